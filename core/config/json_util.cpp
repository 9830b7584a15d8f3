#include "core/config/json_util.h"

#include <fmt/format.h>

#include <cmath>

namespace strata {
namespace {

const nlohmann::json& empty_object() {
  static const nlohmann::json empty = nlohmann::json::object();
  return empty;
}

// nlohmann's messages start "[json.exception.parse_error.101] parse error at line 3, column 5: ";
// keep only the part after the position, since we print the position ourselves.
std::string parse_error_detail(const std::string& what) {
  size_t colon = what.find(": ");
  if (what.find("parse error") != std::string::npos && colon != std::string::npos) {
    return what.substr(colon + 2);
  }
  return what;
}

}  // namespace

std::string json_excerpt(const nlohmann::json& value) {
  std::string text = value.dump();
  if (text.size() > 40) text = text.substr(0, 37) + "...";
  return text;
}

Result<nlohmann::json> parse_json_text(const std::string& text, const std::string& origin) {
  try {
    return nlohmann::json::parse(text);
  } catch (const nlohmann::json::parse_error& e) {
    // e.byte is the 1-based position just past the offending character.
    size_t byte = e.byte == 0 ? 0 : e.byte - 1;
    if (byte > text.size()) byte = text.size();
    size_t line = 1, column = 1;
    for (size_t i = 0; i < byte; ++i) {
      if (text[i] == '\n') {
        ++line;
        column = 1;
      } else {
        ++column;
      }
    }
    return Status::invalid_argument(fmt::format("{}:{}:{}: malformed JSON: {}", origin, line,
                                                column, parse_error_detail(e.what())));
  }
}

Result<nlohmann::json> read_json_file(const std::string& path, io::FileSystem& file_system) {
  Result<std::string> text = io::read_whole_file(file_system, path);
  if (!text) return text.status();
  return parse_json_text(*text, path);
}

JsonReader::JsonReader(const nlohmann::json& object, std::string origin, std::string path)
    : JsonReader(object, std::move(origin), std::move(path), std::make_shared<Shared>()) {}

JsonReader::JsonReader(const nlohmann::json& object, std::string origin, std::string path,
                       std::shared_ptr<Shared> shared)
    : object_(object.is_object() ? &object : &empty_object()),
      origin_(std::move(origin)),
      path_(std::move(path)),
      shared_(std::move(shared)) {
  shared_->objects.emplace_back(path_, object_);
}

std::string JsonReader::key_path(const std::string& key) const {
  return path_.empty() ? key : path_ + "." + key;
}

bool JsonReader::has(const std::string& key) const {
  auto it = object_->find(key);
  return it != object_->end() && !it->is_null();
}

const nlohmann::json* JsonReader::find(const std::string& key) {
  auto it = object_->find(key);
  if (it == object_->end()) return nullptr;
  shared_->read_keys.insert(key_path(key));
  if (it->is_null()) return nullptr;
  return &*it;
}

void JsonReader::accept(const std::string& key) { find(key); }

void JsonReader::fail(const std::string& key, const std::string& message) {
  if (!shared_->first_error.is_ok()) return;
  shared_->first_error =
      Status::invalid_argument(fmt::format("{}: {}: {}", origin_, key_path(key), message));
}

void JsonReader::type_error(const std::string& key, const std::string& expected,
                            const nlohmann::json& got) {
  fail(key, fmt::format("expected {}, got {}", expected, json_excerpt(got)));
}

Status JsonReader::status() const { return shared_->first_error; }

std::vector<std::string> JsonReader::unread_keys() const {
  std::vector<std::string> unread;
  for (const auto& [path, object] : shared_->objects) {
    for (auto it = object->begin(); it != object->end(); ++it) {
      std::string full = path.empty() ? it.key() : path + "." + it.key();
      if (!shared_->read_keys.count(full)) unread.push_back(full);
    }
  }
  return unread;
}

static bool is_auto(const nlohmann::json& value) {
  return value.is_string() && value.get<std::string>() == "auto";
}

bool JsonReader::optional_int(const std::string& key, int64_t& out, int64_t min, int64_t max) {
  const nlohmann::json* value = find(key);
  if (!value || is_auto(*value)) return false;
  std::string range = max == std::numeric_limits<int64_t>::max()
                          ? (min == std::numeric_limits<int64_t>::min() ? "an integer"
                                                                        : fmt::format("an integer >= {}", min))
                          : fmt::format("an integer in [{}, {}]", min, max);
  int64_t number = 0;
  if (value->is_number_integer()) {
    number = value->get<int64_t>();
  } else if (value->is_number_float()) {
    // DeepSpeed configs write bucket sizes as 5e8; accept floats that are whole numbers.
    double d = value->get<double>();
    if (!std::isfinite(d) || d != std::floor(d) || std::fabs(d) > 9.2e18) {
      type_error(key, range, *value);
      return false;
    }
    number = static_cast<int64_t>(d);
  } else {
    type_error(key, range, *value);
    return false;
  }
  if (number < min || number > max) {
    type_error(key, range, *value);
    return false;
  }
  out = number;
  return true;
}

bool JsonReader::optional_int(const std::string& key, int& out, int min, int max) {
  int64_t wide = out;
  if (!optional_int(key, wide, min, max)) return false;
  out = static_cast<int>(wide);
  return true;
}

bool JsonReader::optional_double(const std::string& key, double& out, double min, double max) {
  const nlohmann::json* value = find(key);
  if (!value || is_auto(*value)) return false;
  std::string range = std::isinf(max) ? (std::isinf(min) ? "a number" : fmt::format("a number >= {}", min))
                                      : fmt::format("a number in [{}, {}]", min, max);
  if (!value->is_number()) {
    type_error(key, range, *value);
    return false;
  }
  double number = value->get<double>();
  if (!(number >= min && number <= max)) {
    type_error(key, range, *value);
    return false;
  }
  out = number;
  return true;
}

bool JsonReader::optional_bool(const std::string& key, bool& out) {
  const nlohmann::json* value = find(key);
  if (!value || is_auto(*value)) return false;
  if (!value->is_boolean()) {
    type_error(key, "true or false", *value);
    return false;
  }
  out = value->get<bool>();
  return true;
}

bool JsonReader::optional_string(const std::string& key, std::string& out) {
  const nlohmann::json* value = find(key);
  if (!value) return false;
  if (!value->is_string()) {
    type_error(key, "a string", *value);
    return false;
  }
  out = value->get<std::string>();
  return true;
}

bool JsonReader::optional_choice(const std::string& key, std::string& out,
                                 const std::vector<std::string>& choices) {
  const nlohmann::json* value = find(key);
  if (!value) return false;
  std::string expected;
  for (const auto& choice : choices) expected += (expected.empty() ? "" : " | ") + choice;
  if (!value->is_string()) {
    type_error(key, "one of " + expected, *value);
    return false;
  }
  std::string text = value->get<std::string>();
  for (const auto& choice : choices) {
    if (text == choice) {
      out = text;
      return true;
    }
  }
  type_error(key, "one of " + expected, *value);
  return false;
}

bool JsonReader::optional_double_pair(const std::string& key, double& first, double& second) {
  const nlohmann::json* value = find(key);
  if (!value || is_auto(*value)) return false;
  if (!value->is_array() || value->size() != 2 || !(*value)[0].is_number() ||
      !(*value)[1].is_number()) {
    type_error(key, "a list of two numbers", *value);
    return false;
  }
  first = (*value)[0].get<double>();
  second = (*value)[1].get<double>();
  return true;
}

bool JsonReader::optional_double_array(const std::string& key, std::vector<double>& out,
                                       double min, double max) {
  const nlohmann::json* value = find(key);
  if (!value || is_auto(*value)) return false;
  bool usable = value->is_array() && !value->empty();
  if (usable)
    for (const nlohmann::json& item : *value)
      usable = usable && item.is_number() && item.get<double>() >= min && item.get<double>() <= max;
  if (!usable) {
    type_error(key, fmt::format("a non-empty list of numbers in [{}, {}]", min, max), *value);
    return false;
  }
  out.clear();
  for (const nlohmann::json& item : *value) out.push_back(item.get<double>());
  return true;
}

void JsonReader::required_int(const std::string& key, int64_t& out, int64_t min) {
  if (!has(key)) {
    accept(key);
    fail(key, "missing; this key is required");
    return;
  }
  optional_int(key, out, min);
}

JsonReader JsonReader::object(const std::string& key) {
  const nlohmann::json* value = find(key);
  if (value && !value->is_object()) {
    type_error(key, "an object", *value);
    value = nullptr;
  }
  return JsonReader(value ? *value : empty_object(), origin_, key_path(key), shared_);
}

}  // namespace strata
