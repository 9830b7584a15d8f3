// The chat-template interpreter's values and text helpers (chat_template_value.h).
#include "prep/chat_template_value.h"

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <map>
#include <mutex>
#include <set>
#include <stdexcept>
#include <string_view>
#include <unordered_map>

namespace strata::chat_template_detail {
// ---------------------------------------------------------------- text

// Code points of UTF-8 text; a byte that does not start a valid sequence
// stands for itself (as U+FFFD would lose it).
std::u32string decode_utf8(std::string_view text) {
  std::u32string out;
  out.reserve(text.size());
  size_t i = 0;
  while (i < text.size()) {
    unsigned char c = static_cast<unsigned char>(text[i]);
    size_t extra = c < 0x80 ? 0 : (c >> 5) == 6 ? 1 : (c >> 4) == 14 ? 2 : (c >> 3) == 30 ? 3 : 9;
    char32_t cp = extra == 0 ? c : (c & (0x3f >> extra));
    bool valid = extra <= 3 && i + extra < text.size();
    for (size_t k = 1; valid && k <= extra; ++k) {
      unsigned char next = static_cast<unsigned char>(text[i + k]);
      if ((next & 0xc0) != 0x80) valid = false;
      cp = (cp << 6) | (next & 0x3f);
    }
    if (!valid) {
      out.push_back(c);
      ++i;
      continue;
    }
    out.push_back(cp);
    i += extra + 1;
  }
  return out;
}

void append_utf8(std::string& out, char32_t cp) {
  if (cp < 0x80) {
    out.push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out.push_back(static_cast<char>(0xc0 | (cp >> 6)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3f)));
  } else if (cp < 0x10000) {
    out.push_back(static_cast<char>(0xe0 | (cp >> 12)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3f)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3f)));
  } else {
    out.push_back(static_cast<char>(0xf0 | (cp >> 18)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3f)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3f)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3f)));
  }
}

std::string encode_utf8(std::u32string_view text) {
  std::string out;
  out.reserve(text.size());
  for (char32_t cp : text) append_utf8(out, cp);
  return out;
}

// Python's str.isspace(), which strip(), split() and trim use.
bool is_python_space(char32_t c) {
  return (c >= 0x09 && c <= 0x0d) || (c >= 0x1c && c <= 0x20) || c == 0x85 || c == 0xa0 ||
         c == 0x1680 || (c >= 0x2000 && c <= 0x200a) || c == 0x2028 || c == 0x2029 || c == 0x202f ||
         c == 0x205f || c == 0x3000;
}

std::u32string strip_chars(std::u32string_view text, bool left, bool right,
                           const std::u32string* chars) {
  auto strip = [&](char32_t c) {
    return chars ? chars->find(c) != std::u32string::npos : is_python_space(c);
  };
  size_t begin = 0, end = text.size();
  if (left)
    while (begin < end && strip(text[begin])) ++begin;
  if (right)
    while (end > begin && strip(text[end - 1])) --end;
  return std::u32string(text.substr(begin, end - begin));
}

std::string ascii_lower(std::string text) {
  for (char& c : text)
    if (c >= 'A' && c <= 'Z') c = static_cast<char>(c - 'A' + 'a');
  return text;
}
std::string ascii_upper(std::string text) {
  for (char& c : text)
    if (c >= 'a' && c <= 'z') c = static_cast<char>(c - 'a' + 'A');
  return text;
}
static bool ascii_letter(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z');
}
std::string ascii_capitalize(std::string text) {
  text = ascii_lower(std::move(text));
  if (!text.empty() && text[0] >= 'a' && text[0] <= 'z') text[0] = static_cast<char>(text[0] - 32);
  return text;
}
// jinja2's `title` filter: words begin after "-", "(", "{", "[", "<" or
// whitespace (Python's str.title, the method, also after "'" and digits).
std::string jinja_title(const std::string& text) {
  std::string out;
  bool word_start = true;
  for (char c : text) {
    bool separator = c == '-' || c == '(' || c == '{' || c == '[' || c == '<' ||
                     std::isspace(static_cast<unsigned char>(c));
    if (separator) {
      out.push_back(c);
      word_start = true;
    } else {
      out += word_start ? ascii_upper(std::string(1, c)) : ascii_lower(std::string(1, c));
      word_start = false;
    }
  }
  return out;
}

std::string ascii_title(std::string text) {
  bool previous_letter = false;
  for (char& c : text) {
    if (ascii_letter(c)) {
      c = previous_letter ? ascii_lower(std::string(1, c))[0] : ascii_upper(std::string(1, c))[0];
      previous_letter = true;
    } else {
      previous_letter = false;
    }
  }
  return text;
}

// ---------------------------------------------------------------- values

// Errors are one line: text from the template or the conversation (a
// raise_exception message, a quoted name) may hold line breaks, which are
// shown as \n and \r.
[[noreturn]] void fail(int line, const std::string& what) {
  std::string message = "chat template line " + std::to_string(line) + ": ";
  for (char c : what) {
    if (c == '\n')
      message += "\\n";
    else if (c == '\r')
      message += "\\r";
    else
      message.push_back(c);
  }
  throw RenderError{std::move(message)};
}

const char* type_name(const Value& v) {
  switch (v.kind) {
    case Value::undefined:
      return "undefined";
    case Value::none:
      return "NoneType";
    case Value::boolean:
      return "bool";
    case Value::integer:
      return "int";
    case Value::floating:
      return "float";
    case Value::string:
      return "str";
    case Value::list:
      return "list";
    case Value::dict:
      return "dict";
    case Value::ns:
      return "Namespace";
    case Value::callable:
      return "function";
  }
  return "?";
}

bool truthy(const Value& v) {
  switch (v.kind) {
    case Value::undefined:
    case Value::none:
      return false;
    case Value::boolean:
      return v.b;
    case Value::integer:
      return v.i != 0;
    case Value::floating:
      return v.f != 0;
    case Value::string:
      return !v.s.empty();
    case Value::list:
      return !v.items->empty();
    case Value::dict:
      return !v.fields->empty();
    default:
      return true;
  }
}

template <typename Json>
Value value_of_json(const Json& j) {
  switch (j.type()) {
    case nlohmann::json::value_t::null:
      return Value::make_none();
    case nlohmann::json::value_t::boolean:
      return Value::make_bool(j.template get<bool>());
    case nlohmann::json::value_t::number_integer:
      return Value::make_int(j.template get<int64_t>());
    case nlohmann::json::value_t::number_unsigned: {
      uint64_t u = j.template get<uint64_t>();
      if (u <= static_cast<uint64_t>(INT64_MAX)) return Value::make_int(static_cast<int64_t>(u));
      return Value::make_float(static_cast<double>(u));
    }
    case nlohmann::json::value_t::number_float:
      return Value::make_float(j.template get<double>());
    case nlohmann::json::value_t::string:
      return Value::make_string(j.template get<std::string>());
    case nlohmann::json::value_t::array: {
      List items;
      items.reserve(j.size());
      for (const auto& item : j) items.push_back(value_of_json(item));
      return Value::make_list(std::move(items));
    }
    case nlohmann::json::value_t::object: {
      Dict fields;
      fields.reserve(j.size());
      for (auto it = j.begin(); it != j.end(); ++it)
        fields.emplace_back(it.key(), value_of_json(*it));
      return Value::make_dict(std::move(fields));
    }
    default:
      return Value::make_none();  // binary and discarded values do not come from JSON text
  }
}

// Python's repr(float): the shortest digits that read back, in fixed notation
// for exponents -4..15 and with ".0" when integral, else d.ddde+XX.
static std::string python_float(double x) {
  if (std::isnan(x)) return "nan";
  if (std::isinf(x)) return x > 0 ? "inf" : "-inf";
  if (x == 0) return std::signbit(x) ? "-0.0" : "0.0";
  char buffer[64];
  auto result = std::to_chars(buffer, buffer + sizeof(buffer), x, std::chars_format::scientific);
  std::string sci(buffer, result.ptr);
  bool negative = sci[0] == '-';
  if (negative) sci.erase(0, 1);
  size_t e = sci.find('e');
  std::string mantissa = sci.substr(0, e);
  int exponent = std::stoi(sci.substr(e + 1));
  std::string digits;
  for (char c : mantissa)
    if (c != '.') digits.push_back(c);
  std::string out = negative ? "-" : "";
  if (exponent < -4 || exponent >= 16) {
    out += digits.substr(0, 1);
    if (digits.size() > 1) out += "." + digits.substr(1);
    char exp_text[16];
    std::snprintf(exp_text, sizeof(exp_text), "e%c%02d", exponent < 0 ? '-' : '+',
                  std::abs(exponent));
    return out + exp_text;
  }
  if (exponent < 0) {
    return out + "0." + std::string(static_cast<size_t>(-exponent - 1), '0') + digits;
  }
  size_t point = static_cast<size_t>(exponent) + 1;
  if (digits.size() <= point) return out + digits + std::string(point - digits.size(), '0') + ".0";
  return out + digits.substr(0, point) + "." + digits.substr(point);
}

// Code points Python's repr() escapes besides the ASCII controls: the C1
// controls, the separators and format characters text commonly holds.
static bool python_unprintable(char32_t c) {
  return c < 0x20 || c == 0x7f || (c >= 0x80 && c <= 0xa0) || c == 0xad || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200f) || (c >= 0x2028 && c <= 0x202f) ||
         (c >= 0x205f && c <= 0x2064) || c == 0x3000 || c == 0xfeff;
}

static std::string python_repr_string(const std::string& text) {
  bool has_single = text.find('\'') != std::string::npos;
  bool has_double = text.find('"') != std::string::npos;
  char quote = has_single && !has_double ? '"' : '\'';
  std::string out(1, quote);
  for (char32_t c : decode_utf8(text)) {
    if (c == static_cast<char32_t>(quote) || c == '\\') {
      out.push_back('\\');
      out.push_back(static_cast<char>(c));
    } else if (c == '\n') {
      out += "\\n";
    } else if (c == '\r') {
      out += "\\r";
    } else if (c == '\t') {
      out += "\\t";
    } else if (python_unprintable(c)) {
      char escape[16];
      if (c < 0x100)
        std::snprintf(escape, sizeof(escape), "\\x%02x", static_cast<unsigned>(c));
      else
        std::snprintf(escape, sizeof(escape), "\\u%04x", static_cast<unsigned>(c));
      out += escape;
    } else {
      append_utf8(out, c);
    }
  }
  out.push_back(quote);
  return out;
}

std::string python_str(const Value& v);

static std::string python_repr(const Value& v) {
  switch (v.kind) {
    case Value::string:
      return python_repr_string(v.s);
    case Value::list: {
      std::string out = v.tuple ? "(" : "[";
      for (size_t k = 0; k < v.items->size(); ++k) {
        if (k) out += ", ";
        out += python_repr((*v.items)[k]);
      }
      if (v.tuple && v.items->size() == 1) out += ",";
      return out + (v.tuple ? ")" : "]");
    }
    case Value::dict: {
      std::string out = "{";
      bool first = true;
      for (const auto& [key, value] : *v.fields) {
        if (!first) out += ", ";
        first = false;
        out += python_repr_string(key) + ": " + python_repr(value);
      }
      return out + "}";
    }
    default:
      return python_str(v);
  }
}

// Python's str(), which `{{ }}`, `~`, join and `string` apply (undefined: "").
std::string python_str(const Value& v) {
  switch (v.kind) {
    case Value::undefined:
      return "";
    case Value::none:
      return "None";
    case Value::boolean:
      return v.b ? "True" : "False";
    case Value::integer:
      return std::to_string(v.i);
    case Value::floating:
      return python_float(v.f);
    case Value::string:
      return v.s;
    case Value::list:
    case Value::dict:
      return python_repr(v);
    case Value::ns: {
      std::string out = "<Namespace {";
      bool first = true;
      for (const auto& [key, value] : *v.fields) {
        if (!first) out += ", ";
        first = false;
        out += python_repr_string(key) + ": " + python_repr(value);
      }
      return out + "}>";
    }
    case Value::callable:
      return "<function " + v.s + ">";
  }
  return "";
}

static void json_string(std::string& out, const std::string& text) {
  out.push_back('"');
  for (unsigned char c : text) {
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\r':
        out += "\\r";
        break;
      case '\t':
        out += "\\t";
        break;
      case '\b':
        out += "\\b";
        break;
      case '\f':
        out += "\\f";
        break;
      default:
        if (c < 0x20) {
          char escape[8];
          std::snprintf(escape, sizeof(escape), "\\u%04x", c);
          out += escape;
        } else {
          out.push_back(static_cast<char>(c));
        }
    }
  }
  out.push_back('"');
}

void json_dump(std::string& out, const Value& v, const JsonFormat& format, int depth, int line) {
  auto newline = [&](int level) {
    if (!format.indent) return;
    out.push_back('\n');
    for (int k = 0; k < level; ++k) out += *format.indent;
  };
  switch (v.kind) {
    case Value::none:
      out += "null";
      return;
    case Value::boolean:
      out += v.b ? "true" : "false";
      return;
    case Value::integer:
      out += std::to_string(v.i);
      return;
    case Value::floating:
      if (std::isnan(v.f))
        out += "NaN";
      else if (std::isinf(v.f))
        out += v.f > 0 ? "Infinity" : "-Infinity";
      else
        out += python_float(v.f);
      return;
    case Value::string:
      json_string(out, v.s);
      return;
    case Value::list: {
      if (v.items->empty()) {
        out += "[]";
        return;
      }
      out.push_back('[');
      for (size_t k = 0; k < v.items->size(); ++k) {
        if (k) out += format.item_separator;
        newline(depth + 1);
        json_dump(out, (*v.items)[k], format, depth + 1, line);
      }
      newline(depth);
      out.push_back(']');
      return;
    }
    case Value::dict: {
      if (v.fields->empty()) {
        out += "{}";
        return;
      }
      std::vector<const std::pair<std::string, Value>*> entries;
      for (const auto& entry : *v.fields) entries.push_back(&entry);
      if (format.sort_keys)
        std::stable_sort(entries.begin(), entries.end(),
                         [](auto* a, auto* b) { return a->first < b->first; });
      out.push_back('{');
      for (size_t k = 0; k < entries.size(); ++k) {
        if (k) out += format.item_separator;
        newline(depth + 1);
        json_string(out, entries[k]->first);
        out += format.key_separator;
        json_dump(out, entries[k]->second, format, depth + 1, line);
      }
      newline(depth);
      out.push_back('}');
      return;
    }
    default:
      fail(line,
           std::string("tojson: Object of type ") + type_name(v) + " is not JSON serializable");
  }
}

// Python's ==, with jinja2's rule that undefined equals only undefined.
bool equal(const Value& a, const Value& b) {
  if (a.is_number() && b.is_number()) {
    if (a.kind == Value::floating || b.kind == Value::floating)
      return a.as_double() == b.as_double();
    return a.as_int() == b.as_int();
  }
  if (a.kind != b.kind) return false;
  switch (a.kind) {
    case Value::undefined:
    case Value::none:
      return true;
    case Value::string:
      return a.s == b.s;
    case Value::list:
      if (a.items->size() != b.items->size()) return false;
      for (size_t k = 0; k < a.items->size(); ++k)
        if (!equal((*a.items)[k], (*b.items)[k])) return false;
      return true;
    case Value::dict:
      if (a.fields->size() != b.fields->size()) return false;
      for (const auto& [key, value] : *a.fields) {
        const Value* other = b.find(key);
        if (!other || !equal(value, *other)) return false;
      }
      return true;
    case Value::ns:
      return a.fields == b.fields;
    case Value::callable:
      return a.s == b.s;
    default:
      return false;
  }
}

// Python's <, for numbers, strings and lists.
bool less(const Value& a, const Value& b, int line) {
  if (a.is_number() && b.is_number()) {
    if (a.kind == Value::floating || b.kind == Value::floating)
      return a.as_double() < b.as_double();
    return a.as_int() < b.as_int();
  }
  if (a.kind == Value::string && b.kind == Value::string) return a.s < b.s;  // code point order
  if (a.kind == Value::list && b.kind == Value::list) {
    size_t n = std::min(a.items->size(), b.items->size());
    for (size_t k = 0; k < n; ++k) {
      if (!equal((*a.items)[k], (*b.items)[k])) return less((*a.items)[k], (*b.items)[k], line);
    }
    return a.items->size() < b.items->size();
  }
  fail(line, std::string("'<' not supported between instances of '") + type_name(a) + "' and '" +
                 type_name(b) + "'");
}

// The items a for loop, `in`, join and the list filters walk.
List iterate(const Value& v, int line) {
  switch (v.kind) {
    case Value::undefined:
      return {};
    case Value::list:
      return *v.items;
    case Value::dict: {
      List keys;
      for (const auto& [key, value] : *v.fields) keys.push_back(Value::make_string(key));
      return keys;
    }
    case Value::string: {
      List chars;
      for (char32_t c : decode_utf8(v.s)) chars.push_back(Value::make_string(encode_utf8({&c, 1})));
      return chars;
    }
    default:
      fail(line, std::string("'") + type_name(v) + "' object is not iterable");
  }
}

bool contains(const Value& container, const Value& item, int line) {
  switch (container.kind) {
    case Value::string:
      if (item.kind != Value::string)
        fail(line,
             std::string("'in <string>' requires string as left operand, not ") + type_name(item));
      return container.s.find(item.s) != std::string::npos;
    case Value::list:
      for (const Value& element : *container.items)
        if (equal(element, item)) return true;
      return false;
    case Value::dict:
      return item.kind == Value::string && container.find(item.s) != nullptr;
    case Value::undefined:
      return false;
    default:
      fail(line, std::string("argument of type '") + type_name(container) + "' is not iterable");
  }
}

// Python's index rule: negative counts from the end; out of range: nullopt.
std::optional<size_t> resolve_index(int64_t index, size_t size) {
  if (index < 0) index += static_cast<int64_t>(size);
  if (index < 0 || index >= static_cast<int64_t>(size)) return std::nullopt;
  return static_cast<size_t>(index);
}

// Python's slice.indices(): the positions a slice visits.
std::vector<size_t> slice_positions(std::optional<int64_t> start, std::optional<int64_t> stop,
                                    std::optional<int64_t> step, size_t size, int line) {
  int64_t n = static_cast<int64_t>(size);
  int64_t st = step.value_or(1);
  if (st == 0) fail(line, "slice step cannot be zero");
  auto clamp = [&](std::optional<int64_t> v, int64_t fallback) {
    if (!v) return fallback;
    int64_t x = *v;
    if (x < 0) {
      x += n;
      if (x < 0) x = st < 0 ? -1 : 0;
    } else if (x >= n) {
      x = st < 0 ? n - 1 : n;
    }
    return x;
  };
  int64_t begin = clamp(start, st < 0 ? n - 1 : 0);
  int64_t end = clamp(stop, st < 0 ? -1 : n);
  std::vector<size_t> out;
  if (st > 0)
    for (int64_t k = begin; k < end; k += st) out.push_back(static_cast<size_t>(k));
  else
    for (int64_t k = begin; k > end; k += st) out.push_back(static_cast<size_t>(k));
  return out;
}

Value from_json(const nlohmann::json& j) {
  return value_of_json(j);
}
Value from_json(const nlohmann::ordered_json& j) {
  return value_of_json(j);
}

}  // namespace strata::chat_template_detail
