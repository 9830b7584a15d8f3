// The chat-template interpreter: a lexer that applies jinja2's whitespace
// rules, a parser to an AST, and an evaluator over Values built from the JSON
// conversation. chat_template.h states the subset and the target rule.
#include "prep/chat_template.h"

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

namespace strata {
namespace {

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
bool ascii_letter(char c) {
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

struct RenderError {
  std::string message;
};

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

struct Value;
using List = std::vector<Value>;
using Dict = std::vector<std::pair<std::string, Value>>;  // in insertion order, as Python's

struct Value {
  enum Kind { undefined, none, boolean, integer, floating, string, list, dict, ns, callable };
  Kind kind = undefined;
  bool b = false;
  int64_t i = 0;
  double f = 0;
  std::string s;                      // string; the name of a callable
  std::shared_ptr<const List> items;  // list
  std::shared_ptr<Dict> fields;       // dict (shared, never changed after creation) and namespace
  std::shared_ptr<Value> self;        // a bound method's object
  int message = -1;                   // this value is messages[message] of the conversation
  bool tuple = false;                 // a list that Python would hold as a tuple (its repr)

  static Value make_none() { return with_kind(none); }
  static Value make_bool(bool v) {
    Value out = with_kind(boolean);
    out.b = v;
    return out;
  }
  static Value make_int(int64_t v) {
    Value out = with_kind(integer);
    out.i = v;
    return out;
  }
  static Value make_float(double v) {
    Value out = with_kind(floating);
    out.f = v;
    return out;
  }
  static Value make_string(std::string v) {
    Value out = with_kind(string);
    out.s = std::move(v);
    return out;
  }
  static Value make_list(List v) {
    Value out = with_kind(list);
    out.items = std::make_shared<const List>(std::move(v));
    return out;
  }
  static Value make_dict(Dict v) {
    Value out = with_kind(dict);
    out.fields = std::make_shared<Dict>(std::move(v));
    return out;
  }
  static Value make_callable(std::string name, std::shared_ptr<Value> self = nullptr) {
    Value out = with_kind(callable);
    out.s = std::move(name);
    out.self = std::move(self);
    return out;
  }
  static Value with_kind(Kind kind) {
    Value out;
    out.kind = kind;
    return out;
  }

  bool is_number() const { return kind == boolean || kind == integer || kind == floating; }
  double as_double() const {
    return kind == floating ? f : kind == integer ? static_cast<double>(i) : (b ? 1.0 : 0.0);
  }
  int64_t as_int() const { return kind == integer ? i : (b ? 1 : 0); }
  const Value* find(std::string_view key) const {
    if (!fields) return nullptr;
    for (const auto& [name, value] : *fields)
      if (name == key) return &value;
    return nullptr;
  }
};

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
Value from_json(const Json& j) {
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
      for (const auto& item : j) items.push_back(from_json(item));
      return Value::make_list(std::move(items));
    }
    case nlohmann::json::value_t::object: {
      Dict fields;
      fields.reserve(j.size());
      for (auto it = j.begin(); it != j.end(); ++it) fields.emplace_back(it.key(), from_json(*it));
      return Value::make_dict(std::move(fields));
    }
    default:
      return Value::make_none();  // binary and discarded values do not come from JSON text
  }
}

// Python's repr(float): the shortest digits that read back, in fixed notation
// for exponents -4..15 and with ".0" when integral, else d.ddde+XX.
std::string python_float(double x) {
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
bool python_unprintable(char32_t c) {
  return c < 0x20 || c == 0x7f || (c >= 0x80 && c <= 0xa0) || c == 0xad || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200f) || (c >= 0x2028 && c <= 0x202f) ||
         (c >= 0x205f && c <= 0x2064) || c == 0x3000 || c == 0xfeff;
}

std::string python_repr_string(const std::string& text) {
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

std::string python_repr(const Value& v) {
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

// json.dumps(x, ensure_ascii=False, indent=indent, separators=..., sort_keys=...).
struct JsonFormat {
  std::optional<std::string> indent;  // none: one line
  std::string item_separator, key_separator;
  bool sort_keys = false;
};

void json_string(std::string& out, const std::string& text) {
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

// ---------------------------------------------------------------- lexer

int64_t parse_integer(const std::string& digits, int line) {
  int64_t v = 0;
  auto result = std::from_chars(digits.data(), digits.data() + digits.size(), v);
  if (result.ec != std::errc() || result.ptr != digits.data() + digits.size())
    fail(line, "integer " + digits + " is out of range");
  return v;
}

enum class Tok {
  data,
  variable_begin,
  variable_end,
  block_begin,
  block_end,
  name,
  string,
  integer,
  floating,
  op,
  end
};

struct Token {
  Tok type;
  std::string text;  // data; a name; a string's value; an operator; a number's digits
  int line;
};

// Python's unicode-escape decoding of a string literal's body, as jinja2 does.
std::string unescape(std::string_view body, int line) {
  std::string out;
  for (size_t k = 0; k < body.size(); ++k) {
    char c = body[k];
    if (c != '\\' || k + 1 == body.size()) {
      out.push_back(c);
      continue;
    }
    char e = body[++k];
    switch (e) {
      case 'n':
        out.push_back('\n');
        break;
      case 't':
        out.push_back('\t');
        break;
      case 'r':
        out.push_back('\r');
        break;
      case '\\':
        out.push_back('\\');
        break;
      case '\'':
        out.push_back('\'');
        break;
      case '"':
        out.push_back('"');
        break;
      case 'a':
        out.push_back('\a');
        break;
      case 'b':
        out.push_back('\b');
        break;
      case 'f':
        out.push_back('\f');
        break;
      case 'v':
        out.push_back('\v');
        break;
      case '\n':
        break;  // a line continuation
      case 'x':
      case 'u':
      case 'U': {
        size_t digits = e == 'x' ? 2 : e == 'u' ? 4 : 8;
        if (k + digits >= body.size())
          fail(line, "truncated \\" + std::string(1, e) + " escape in a string literal");
        std::string hex(body.substr(k + 1, digits));
        for (char h : hex)
          if (!std::isxdigit(static_cast<unsigned char>(h)))
            fail(line, "malformed \\" + std::string(1, e) + " escape in a string literal");
        unsigned long code = std::stoul(hex, nullptr, 16);
        if (code > 0x10ffff) fail(line, "\\U escape beyond U+10FFFF in a string literal");
        append_utf8(out, static_cast<char32_t>(code));
        k += digits;
        break;
      }
      default:
        if (e >= '0' && e <= '7') {
          unsigned value = 0;
          size_t count = 0;
          while (count < 3 && k < body.size() && body[k] >= '0' && body[k] <= '7') {
            value = value * 8 + static_cast<unsigned>(body[k] - '0');
            ++k;
            ++count;
          }
          --k;
          append_utf8(out, value);
        } else {
          out.push_back('\\');  // Python keeps an unknown escape as written
          out.push_back(e);
        }
    }
  }
  return out;
}

class Lexer {
 public:
  explicit Lexer(std::string source) : source_(std::move(source)) {
    // jinja2 reads "\r\n" and "\r" as "\n" and drops one trailing newline.
    std::string normalized;
    normalized.reserve(source_.size());
    for (size_t k = 0; k < source_.size(); ++k) {
      if (source_[k] == '\r') {
        normalized.push_back('\n');
        if (k + 1 < source_.size() && source_[k + 1] == '\n') ++k;
      } else {
        normalized.push_back(source_[k]);
      }
    }
    if (!normalized.empty() && normalized.back() == '\n') normalized.pop_back();
    source_ = std::move(normalized);
  }

  std::vector<Token> tokenize() {
    std::vector<Token> tokens;
    size_t pos = 0;
    bool line_starting = true;
    while (pos < source_.size()) {
      size_t open = find_open(pos);
      std::string text =
          source_.substr(pos, (open == std::string::npos ? source_.size() : open) - pos);
      if (open == std::string::npos) {
        if (!text.empty()) tokens.push_back({Tok::data, text, line_at(pos)});
        break;
      }
      char kind = source_[open + 1];  // '{', '%' or '#'
      size_t after = open + 2;
      char sign = after < source_.size() && (source_[after] == '-' || source_[after] == '+')
                      ? source_[after]
                      : 0;
      if (sign) ++after;
      if (sign == '-') {
        std::u32string wide = decode_utf8(text);
        text = encode_utf8(strip_chars(wide, false, true, nullptr));
      } else if (sign != '+' && kind != '{') {
        // lstrip_blocks: a block or comment alone on its line loses the indent.
        size_t line_begin = text.rfind('\n');
        line_begin = line_begin == std::string::npos ? 0 : line_begin + 1;
        if (line_begin > 0 || line_starting) {
          bool blank = std::all_of(text.begin() + static_cast<long>(line_begin), text.end(),
                                   [](char c) { return c == ' ' || c == '\t'; });
          if (blank) text.resize(line_begin);
        }
      }
      if (!text.empty()) tokens.push_back({Tok::data, text, line_at(pos)});
      int line = line_at(open);
      if (kind == '#') {
        pos = lex_comment(after, line, line_starting);
        continue;
      }
      tokens.push_back({kind == '{' ? Tok::variable_begin : Tok::block_begin, "", line});
      pos = lex_tag(after, kind == '{', tokens, line_starting);
    }
    tokens.push_back({Tok::end, "", line_at(source_.size())});
    return tokens;
  }

 private:
  size_t find_open(size_t pos) const {
    while (true) {
      size_t k = source_.find('{', pos);
      if (k == std::string::npos || k + 1 >= source_.size()) return std::string::npos;
      char next = source_[k + 1];
      if (next == '{' || next == '%' || next == '#') return k;
      pos = k + 1;
    }
  }

  int line_at(size_t pos) {
    while (counted_ < pos && counted_ < source_.size()) {
      if (source_[counted_] == '\n') ++lines_;
      ++counted_;
    }
    return lines_;
  }

  // After a closing `-%}`, `-}}` or `-#}`: all whitespace goes; after `%}` or
  // `#}` (trim_blocks): one newline.
  size_t skip_after_close(size_t pos, bool strip_all, bool trim_newline, bool& line_starting) {
    size_t start = pos;
    if (strip_all) {
      while (pos < source_.size()) {
        std::u32string next = decode_utf8(std::string_view(source_).substr(pos, 4));
        if (!is_python_space(next[0])) break;
        pos += encode_utf8(next.substr(0, 1)).size();
      }
    } else if (trim_newline && pos < source_.size() && source_[pos] == '\n') {
      ++pos;
    }
    line_starting = pos > start && source_[pos - 1] == '\n';
    return pos;
  }

  size_t lex_comment(size_t pos, int line, bool& line_starting) {
    size_t close = source_.find("#}", pos);
    if (close == std::string::npos) fail(line, "comment {# is never closed with #}");
    char sign = close > pos && (source_[close - 1] == '-' || source_[close - 1] == '+')
                    ? source_[close - 1]
                    : 0;
    return skip_after_close(close + 2, sign == '-', sign == 0, line_starting);
  }

  size_t lex_tag(size_t pos, bool variable, std::vector<Token>& tokens, bool& line_starting) {
    const std::string close = variable ? "}}" : "%}";
    int depth = 0;
    int open_line = line_at(pos);
    while (true) {
      while (pos < source_.size() && std::isspace(static_cast<unsigned char>(source_[pos]))) ++pos;
      if (pos >= source_.size())
        fail(open_line, std::string(variable ? "{{" : "{%") + " is never closed with " + close);
      int line = line_at(pos);
      if (depth == 0) {
        if (source_.compare(pos, 3, "-" + close) == 0) {
          tokens.push_back({variable ? Tok::variable_end : Tok::block_end, "", line});
          return skip_after_close(pos + 3, true, false, line_starting);
        }
        if (!variable && source_.compare(pos, 3, "+" + close) == 0) {
          tokens.push_back({Tok::block_end, "", line});
          line_starting = false;
          return pos + 3;
        }
        if (source_.compare(pos, 2, close) == 0) {
          tokens.push_back({variable ? Tok::variable_end : Tok::block_end, "", line});
          return skip_after_close(pos + 2, false, !variable, line_starting);
        }
      }
      char c = source_[pos];
      if (std::isalpha(static_cast<unsigned char>(c)) || c == '_') {
        size_t end = pos;
        while (end < source_.size() &&
               (std::isalnum(static_cast<unsigned char>(source_[end])) || source_[end] == '_'))
          ++end;
        tokens.push_back({Tok::name, source_.substr(pos, end - pos), line});
        pos = end;
      } else if (std::isdigit(static_cast<unsigned char>(c))) {
        size_t end = pos;
        bool is_float = false;
        auto digits = [&] {
          while (end < source_.size() &&
                 (std::isdigit(static_cast<unsigned char>(source_[end])) || source_[end] == '_'))
            ++end;
        };
        digits();
        bool after_dot =
            !tokens.empty() && tokens.back().type == Tok::op && tokens.back().text == ".";
        if (!after_dot && end + 1 < source_.size() && source_[end] == '.' &&
            std::isdigit(static_cast<unsigned char>(source_[end + 1]))) {
          is_float = true;
          ++end;
          digits();
        }
        if (!after_dot && end < source_.size() && (source_[end] == 'e' || source_[end] == 'E')) {
          size_t exp = end + 1;
          if (exp < source_.size() && (source_[exp] == '+' || source_[exp] == '-')) ++exp;
          if (exp < source_.size() && std::isdigit(static_cast<unsigned char>(source_[exp]))) {
            is_float = true;
            end = exp;
            digits();
          }
        }
        std::string number;
        for (size_t k = pos; k < end; ++k)
          if (source_[k] != '_') number.push_back(source_[k]);
        tokens.push_back({is_float ? Tok::floating : Tok::integer, number, line});
        pos = end;
      } else if (c == '\'' || c == '"') {
        size_t end = pos + 1;
        while (end < source_.size() && source_[end] != c) {
          if (source_[end] == '\\') ++end;
          ++end;
        }
        if (end >= source_.size()) fail(line, "string literal is never closed");
        tokens.push_back({Tok::string,
                          unescape(std::string_view(source_).substr(pos + 1, end - pos - 1), line),
                          line});
        pos = end + 1;
      } else {
        static const char* const kOperators[] = {"//", "**", "==", "!=", "<=", ">=", "+", "-", "*",
                                                 "/",  "%",  "~",  "<",  ">",  "=",  "(", ")", "[",
                                                 "]",  "{",  "}",  ",",  ".",  ":",  "|", ";"};
        const char* found = nullptr;
        for (const char* op : kOperators) {
          if (source_.compare(pos, std::strlen(op), op) == 0) {
            found = op;
            break;
          }
        }
        if (!found) fail(line, std::string("unexpected character '") + c + "' in a tag");
        std::string op = found;
        if (op == "(" || op == "[" || op == "{") ++depth;
        if ((op == ")" || op == "]" || op == "}") && depth > 0) --depth;
        tokens.push_back({Tok::op, op, line});
        pos += op.size();
      }
    }
  }

  std::string source_;
  size_t counted_ = 0;
  int lines_ = 1;
};

// ---------------------------------------------------------------- AST

struct Expr;
using ExprPtr = std::shared_ptr<const Expr>;

struct Expr {
  enum Kind {
    literal,
    variable,
    getattr,    // args[0].name
    getitem,    // args[0][args[1]]
    slice,      // args[0][args[1]:args[2]:args[3]] (null: omitted)
    call,       // args[0](args[1..], kwargs)
    filter,     // args[0] | name(args[1..], kwargs)
    test,       // args[0] is [not] name(args[1..])
    unary,      // op args[0]: "not", "-", "+"
    binary,     // args[0] op args[1]: + - * / // % ** ~
    compare,    // args[0] ops[0] args[1] ops[1] args[2] ...
    logic_and,  // args[0] and args[1]
    logic_or,
    condition,  // args[1] if args[0] else args[2] (null: undefined)
    list_literal,
    dict_literal  // keys and values alternate in args
  };
  Kind kind;
  int line = 0;
  Value value;       // literal
  std::string name;  // name, getattr, filter, test, unary/binary op
  std::vector<ExprPtr> args;
  std::vector<std::pair<std::string, ExprPtr>> kwargs;
  std::vector<std::string> ops;  // compare
  bool negated = false;          // test
};

struct Node;
using NodePtr = std::shared_ptr<const Node>;
using Body = std::vector<NodePtr>;

struct Node {
  enum Kind { data, output, if_, for_, set, set_attribute, break_, continue_, generation };
  Kind kind;
  int line = 0;
  std::string text;                                // text
  ExprPtr expr;                                    // output; set's value; for's iterable
  std::vector<std::pair<ExprPtr, Body>> branches;  // if/elif (else: null condition)
  std::vector<std::string> targets;                // for's names; set's name
  std::string attribute;                           // set_attribute: targets[0].attribute
  ExprPtr condition;                               // for's `if`
  Body body, else_body;                            // for, generation
};

const std::set<std::string, std::less<>>& known_filters() {
  static const std::set<std::string, std::less<>> names = {
      "abs",    "capitalize", "count",      "d",       "default", "first",  "float",
      "int",    "items",      "join",       "last",    "length",  "list",   "lower",
      "map",    "reject",     "rejectattr", "replace", "reverse", "select", "selectattr",
      "string", "title",      "tojson",     "trim",    "upper"};
  return names;
}

const std::set<std::string, std::less<>>& known_tests() {
  static const std::set<std::string, std::less<>> names = {
      "boolean", "callable", "defined",  "divisibleby", "eq",   "equalto",   "even",
      "false",   "float",    "ge",       "gt",          "in",   "integer",   "iterable",
      "le",      "lower",    "lt",       "mapping",     "ne",   "none",      "number",
      "odd",     "sameas",   "sequence", "string",      "true", "undefined", "upper",
      "==",      "!=",       "<",        "<=",          ">",    ">="};
  return names;
}

class Parser {
 public:
  explicit Parser(std::vector<Token> tokens) : tokens_(std::move(tokens)) {}

  Body parse_template(bool& has_generation) {
    Body body = parse_body({});
    has_generation = has_generation_;
    return body;
  }

 private:
  const Token& current() const { return tokens_[pos_]; }
  const Token& peek(size_t ahead = 1) const {
    return tokens_[std::min(pos_ + ahead, tokens_.size() - 1)];
  }
  Token next() { return tokens_[pos_ < tokens_.size() - 1 ? pos_++ : pos_]; }
  bool at_op(std::string_view op) const {
    return current().type == Tok::op && current().text == op;
  }
  bool at_name(std::string_view name) const {
    return current().type == Tok::name && current().text == name;
  }
  void expect_op(std::string_view op, std::string_view where) {
    if (!at_op(op))
      fail(current().line, "expected '" + std::string(op) + "' " + std::string(where) + ", found " +
                               describe(current()));
    next();
  }
  std::string expect_name(std::string_view where) {
    if (current().type != Tok::name)
      fail(current().line,
           "expected a name " + std::string(where) + ", found " + describe(current()));
    return next().text;
  }
  void expect_block_end(std::string_view tag) {
    if (current().type != Tok::block_end)
      fail(current().line,
           "expected the end of the '" + std::string(tag) + "' tag, found " + describe(current()));
    next();
  }
  static std::string describe(const Token& token) {
    switch (token.type) {
      case Tok::block_end:
        return "'%}'";
      case Tok::variable_end:
        return "'}}'";
      case Tok::end:
        return "the end of the template";
      case Tok::data:
        return "text";
      case Tok::string:
        return "a string";
      case Tok::integer:
      case Tok::floating:
        return "'" + token.text + "'";
      default:
        return "'" + token.text + "'";
    }
  }

  // Statements until a block tag named in `ends` (left unconsumed after its name).
  Body parse_body(const std::vector<std::string>& ends) {
    Nesting nesting(*this, current().line);
    Body body;
    while (true) {
      const Token& token = current();
      if (token.type == Tok::end) {
        if (!ends.empty())
          fail(token.line,
               "the template ends inside a block; expected '{% " + ends.back() + " %}'");
        return body;
      }
      if (token.type == Tok::data) {
        auto node = std::make_shared<Node>();
        node->kind = Node::data;
        node->line = token.line;
        node->text = token.text;
        body.push_back(node);
        next();
        continue;
      }
      if (token.type == Tok::variable_begin) {
        next();
        auto node = std::make_shared<Node>();
        node->kind = Node::output;
        node->line = token.line;
        node->expr = parse_expression();
        if (current().type != Tok::variable_end)
          fail(current().line,
               "expected '}}' to close the expression, found " + describe(current()));
        next();
        body.push_back(node);
        continue;
      }
      // a block tag
      int line = token.line;
      next();
      if (current().type != Tok::name) fail(line, "a '{%' tag without a statement name");
      std::string tag = current().text;
      if (std::find(ends.begin(), ends.end(), tag) != ends.end()) return body;
      next();
      if (tag == "if") {
        body.push_back(parse_if(line));
      } else if (tag == "for") {
        body.push_back(parse_for(line));
      } else if (tag == "set") {
        body.push_back(parse_set(line));
      } else if (tag == "break" || tag == "continue") {
        if (loop_depth_ == 0) fail(line, "'" + tag + "' outside a for loop");
        auto node = std::make_shared<Node>();
        node->kind = tag == "break" ? Node::break_ : Node::continue_;
        node->line = line;
        expect_block_end(tag);
        body.push_back(node);
      } else if (tag == "generation") {
        expect_block_end(tag);
        has_generation_ = true;
        auto node = std::make_shared<Node>();
        node->kind = Node::generation;
        node->line = line;
        node->body = parse_body({"endgeneration"});
        next();
        expect_block_end("endgeneration");
        body.push_back(node);
      } else if (tag == "elif" || tag == "else" || tag.rfind("end", 0) == 0) {
        fail(line, "unexpected '{% " + tag + " %}'" +
                       (ends.empty() ? std::string() : "; expected '{% " + ends.back() + " %}'"));
      } else {
        fail(line, "unsupported tag '{% " + tag +
                       " %}': strata renders the part of Jinja2 that chat templates use "
                       "(prep/chat_template.h lists it)");
      }
    }
  }

  NodePtr parse_if(int line) {
    auto node = std::make_shared<Node>();
    node->kind = Node::if_;
    node->line = line;
    ExprPtr condition = parse_expression();
    expect_block_end("if");
    while (true) {
      Body branch = parse_body({"elif", "else", "endif"});
      node->branches.emplace_back(condition, std::move(branch));
      std::string tag = next().text;
      if (tag == "elif") {
        condition = parse_expression();
        expect_block_end("elif");
      } else if (tag == "else") {
        expect_block_end("else");
        Body else_branch = parse_body({"endif"});
        next();
        expect_block_end("endif");
        node->branches.emplace_back(nullptr, std::move(else_branch));
        return node;
      } else {
        expect_block_end("endif");
        return node;
      }
    }
  }

  NodePtr parse_for(int line) {
    auto node = std::make_shared<Node>();
    node->kind = Node::for_;
    node->line = line;
    bool parenthesized = at_op("(");
    if (parenthesized) next();
    node->targets.push_back(expect_name("after 'for'"));
    while (at_op(",")) {
      next();
      node->targets.push_back(expect_name("in the for loop's targets"));
    }
    if (parenthesized) expect_op(")", "after the for loop's targets");
    if (!at_name("in"))
      fail(current().line, "expected 'in' in the for loop, found " + describe(current()));
    next();
    node->expr = parse_or();
    if (at_name("if")) {
      next();
      node->condition = parse_expression();
    }
    if (at_name("recursive")) fail(current().line, "unsupported: recursive for loops");
    expect_block_end("for");
    ++loop_depth_;
    node->body = parse_body({"else", "endfor"});
    --loop_depth_;
    if (next().text == "else") {
      expect_block_end("else");
      node->else_body = parse_body({"endfor"});
      next();
    }
    expect_block_end("endfor");
    return node;
  }

  NodePtr parse_set(int line) {
    auto node = std::make_shared<Node>();
    node->line = line;
    std::string target = expect_name("after 'set'");
    if (at_op(".")) {
      next();
      node->kind = Node::set_attribute;
      node->targets.push_back(target);
      node->attribute = expect_name("after '.' in the set target");
    } else {
      node->kind = Node::set;
      node->targets.push_back(target);
    }
    if (at_op(",")) fail(line, "unsupported: set with several targets");
    if (current().type == Tok::block_end)
      fail(line, "unsupported: '{% set " + target + " %}...{% endset %}' blocks");
    expect_op("=", "in the set tag");
    node->expr = parse_expression();
    expect_block_end("set");
    return node;
  }

  ExprPtr make(Expr::Kind kind, int line, std::vector<ExprPtr> args = {}, std::string name = {}) {
    auto e = std::make_shared<Expr>();
    e->kind = kind;
    e->line = line;
    e->args = std::move(args);
    e->name = std::move(name);
    return e;
  }

  ExprPtr parse_expression() {
    int line = current().line;
    Nesting nesting(*this, line);
    ExprPtr expr = parse_or();
    while (at_name("if")) {
      next();
      ExprPtr condition = parse_or();
      ExprPtr otherwise;
      if (at_name("else")) {
        next();
        otherwise = parse_expression();
      }
      expr = make(Expr::condition, line, {condition, expr, otherwise});
    }
    return expr;
  }

  ExprPtr parse_or() {
    ExprPtr left = parse_and();
    while (at_name("or")) {
      int line = next().line;
      left = make(Expr::logic_or, line, {left, parse_and()});
    }
    return left;
  }

  ExprPtr parse_and() {
    ExprPtr left = parse_not();
    while (at_name("and")) {
      int line = next().line;
      left = make(Expr::logic_and, line, {left, parse_not()});
    }
    return left;
  }

  ExprPtr parse_not() {
    if (at_name("not")) {
      int line = next().line;
      Nesting nesting(*this, line);
      return make(Expr::unary, line, {parse_not()}, "not");
    }
    return parse_compare();
  }

  ExprPtr parse_compare() {
    int line = current().line;
    ExprPtr first = parse_math1();
    std::vector<ExprPtr> operands{first};
    std::vector<std::string> ops;
    while (true) {
      if (current().type == Tok::op &&
          (current().text == "==" || current().text == "!=" || current().text == "<" ||
           current().text == ">" || current().text == "<=" || current().text == ">=")) {
        ops.push_back(next().text);
      } else if (at_name("in")) {
        next();
        ops.push_back("in");
      } else if (at_name("not") && peek().type == Tok::name && peek().text == "in") {
        next();
        next();
        ops.push_back("not in");
      } else {
        break;
      }
      operands.push_back(parse_math1());
    }
    if (ops.empty()) return first;
    auto e = std::make_shared<Expr>();
    e->kind = Expr::compare;
    e->line = line;
    e->args = std::move(operands);
    e->ops = std::move(ops);
    return e;
  }

  ExprPtr parse_math1() {
    ExprPtr left = parse_concat();
    while (at_op("+") || at_op("-")) {
      Token op = next();
      left = make(Expr::binary, op.line, {left, parse_concat()}, op.text);
    }
    return left;
  }

  ExprPtr parse_concat() {
    ExprPtr left = parse_math2();
    while (at_op("~")) {
      Token op = next();
      left = make(Expr::binary, op.line, {left, parse_math2()}, "~");
    }
    return left;
  }

  ExprPtr parse_math2() {
    ExprPtr left = parse_pow();
    while (at_op("*") || at_op("/") || at_op("//") || at_op("%")) {
      Token op = next();
      left = make(Expr::binary, op.line, {left, parse_pow()}, op.text);
    }
    return left;
  }

  ExprPtr parse_pow() {
    ExprPtr left = parse_unary(true);
    while (at_op("**")) {
      Token op = next();
      left = make(Expr::binary, op.line, {left, parse_unary(true)}, "**");
    }
    return left;
  }

  ExprPtr parse_unary(bool with_filter) {
    ExprPtr node;
    if (at_op("-") || at_op("+")) {
      Token op = next();
      Nesting nesting(*this, op.line);
      node = make(Expr::unary, op.line, {parse_unary(false)}, op.text);
    } else {
      node = parse_primary();
    }
    node = parse_postfix(node);
    if (with_filter) node = parse_filter_expr(node);
    return node;
  }

  ExprPtr parse_primary() {
    const Token token = current();
    switch (token.type) {
      case Tok::name: {
        next();
        if (token.text == "true" || token.text == "True")
          return literal(Value::make_bool(true), token.line);
        if (token.text == "false" || token.text == "False")
          return literal(Value::make_bool(false), token.line);
        if (token.text == "none" || token.text == "None")
          return literal(Value::make_none(), token.line);
        return make(Expr::variable, token.line, {}, token.text);
      }
      case Tok::string: {
        std::string text;
        while (current().type == Tok::string) text += next().text;  // adjacent literals join
        return literal(Value::make_string(text), token.line);
      }
      case Tok::integer: {
        next();
        return literal(Value::make_int(parse_integer(token.text, token.line)), token.line);
      }
      case Tok::floating: {
        next();
        return literal(Value::make_float(std::strtod(token.text.c_str(), nullptr)), token.line);
      }
      case Tok::op: {
        if (token.text == "(") {
          next();
          if (at_op(")")) {
            next();
            return make(Expr::list_literal, token.line, {}, "tuple");
          }
          ExprPtr inner = parse_expression();
          if (!at_op(",")) {
            expect_op(")", "to close '('");
            return inner;
          }
          std::vector<ExprPtr> items{inner};  // a tuple: a list that prints as Python's tuple
          while (at_op(",")) {
            next();
            if (at_op(")")) break;
            items.push_back(parse_expression());
          }
          expect_op(")", "to close the tuple");
          return make(Expr::list_literal, token.line, std::move(items), "tuple");
        }
        if (token.text == "[") {
          next();
          std::vector<ExprPtr> items;
          while (!at_op("]")) {
            if (!items.empty()) {
              expect_op(",", "between list items");
              if (at_op("]")) break;
            }
            items.push_back(parse_expression());
          }
          next();
          return make(Expr::list_literal, token.line, std::move(items));
        }
        if (token.text == "{") {
          next();
          std::vector<ExprPtr> items;
          while (!at_op("}")) {
            if (!items.empty()) {
              expect_op(",", "between dict items");
              if (at_op("}")) break;
            }
            items.push_back(parse_expression());
            expect_op(":", "after a dict key");
            items.push_back(parse_expression());
          }
          next();
          return make(Expr::dict_literal, token.line, std::move(items));
        }
        break;
      }
      default:
        break;
    }
    fail(token.line, "expected an expression, found " + describe(token));
  }

  ExprPtr literal(Value value, int line) {
    auto e = std::make_shared<Expr>();
    e->kind = Expr::literal;
    e->line = line;
    e->value = std::move(value);
    return e;
  }

  ExprPtr parse_postfix(ExprPtr node) {
    while (true) {
      if (at_op(".")) {
        int line = next().line;
        if (current().type == Tok::integer) {
          ExprPtr index = literal(Value::make_int(parse_integer(next().text, line)), line);
          node = make(Expr::getitem, line, {node, index});
        } else {
          node = make(Expr::getattr, line, {node}, expect_name("after '.'"));
        }
      } else if (at_op("[")) {
        int line = next().line;
        node = parse_subscript(node, line);
      } else if (at_op("(")) {
        node = parse_call(node);
      } else {
        return node;
      }
    }
  }

  ExprPtr parse_subscript(ExprPtr node, int line) {
    ExprPtr parts[3];
    int part = 0;
    bool is_slice = false;
    while (!at_op("]")) {
      if (at_op(":")) {
        next();
        is_slice = true;
        if (++part > 2) fail(line, "a slice has at most two ':'");
        continue;
      }
      if (parts[part])
        fail(line, "expected ':' or ']' in the subscript, found " + describe(current()));
      parts[part] = parse_expression();
      if (at_op(",")) fail(line, "unsupported: subscripts with ','");
    }
    next();
    if (!is_slice) {
      if (!parts[0]) fail(line, "empty subscript []");
      return make(Expr::getitem, line, {node, parts[0]});
    }
    return make(Expr::slice, line, {node, parts[0], parts[1], parts[2]});
  }

  void parse_call_arguments(std::shared_ptr<Expr>& call) {
    expect_op("(", "to open the arguments");
    bool first = true;
    while (!at_op(")")) {
      if (!first) {
        expect_op(",", "between arguments");
        if (at_op(")")) break;
      }
      first = false;
      if (current().type == Tok::name && peek().type == Tok::op && peek().text == "=") {
        std::string key = next().text;
        next();
        call->kwargs.emplace_back(key, parse_expression());
      } else {
        if (at_op("*") || at_op("**"))
          fail(current().line, "unsupported: *args and **kwargs in calls");
        if (!call->kwargs.empty())
          fail(current().line, "a positional argument follows a keyword argument");
        call->args.push_back(parse_expression());
      }
    }
    next();
  }

  ExprPtr parse_call(ExprPtr callee) {
    auto call = std::make_shared<Expr>();
    call->kind = Expr::call;
    call->line = current().line;
    call->args.push_back(callee);
    parse_call_arguments(call);
    return call;
  }

  ExprPtr parse_filter_expr(ExprPtr node) {
    while (true) {
      if (at_op("|")) {
        int line = next().line;
        std::string name = expect_name("after '|'");
        if (!known_filters().count(name))
          fail(line, "unsupported filter '" + name +
                         "' (prep/chat_template.h lists the filters strata implements)");
        auto filter = std::make_shared<Expr>();
        filter->kind = Expr::filter;
        filter->line = line;
        filter->name = name;
        filter->args.push_back(node);
        if (at_op("(")) parse_call_arguments(filter);
        node = filter;
      } else if (at_name("is")) {
        int line = next().line;
        auto test = std::make_shared<Expr>();
        test->kind = Expr::test;
        test->line = line;
        if (at_name("not")) {
          next();
          test->negated = true;
        }
        test->name = expect_name("after 'is'");
        if (!known_tests().count(test->name))
          fail(line, "unsupported test '" + test->name +
                         "' (prep/chat_template.h lists the tests strata implements)");
        test->args.push_back(node);
        if (at_op("(")) {
          parse_call_arguments(test);
        } else if ((current().type == Tok::name || current().type == Tok::string ||
                    current().type == Tok::integer || current().type == Tok::floating ||
                    at_op("(") || at_op("[") || at_op("{")) &&
                   !at_name("else") && !at_name("or") && !at_name("and")) {
          if (at_name("is")) fail(line, "tests cannot be chained with 'is'");
          test->args.push_back(parse_postfix(parse_primary()));
        }
        node = test;
      } else if (at_op("(")) {
        node = parse_call(node);
      } else {
        return node;
      }
    }
  }

  // Bounds the parser's recursion (and so the evaluator's): a template nested
  // deeper than any chat template is refused instead of overflowing the stack.
  struct Nesting {
    Nesting(Parser& parser, int line) : parser_(parser) {
      if (++parser_.nesting_ > 200) fail(line, "expressions or blocks nested more than 200 deep");
    }
    ~Nesting() { --parser_.nesting_; }
    Parser& parser_;
  };

  std::vector<Token> tokens_;
  size_t pos_ = 0;
  int nesting_ = 0;
  int loop_depth_ = 0;
  bool has_generation_ = false;
};

}  // namespace

struct ChatTemplate::Program {
  Body body;
  bool has_generation = false;
  // The assistant header (chat_template.h) by (bos_token, eos_token): two
  // renders of a probe conversation, done once per pair of tokens.
  mutable std::mutex header_mutex;
  mutable std::map<std::pair<std::string, std::string>, std::string> headers;
};

namespace {

// ---------------------------------------------------------------- evaluation

enum class Flow { normal, break_, continue_ };

// Rendered text and, per byte, whether it is a target.
struct Output {
  std::string text;
  std::vector<uint8_t> target;
  void append(const std::string& piece, bool is_target) {
    text += piece;
    target.insert(target.end(), piece.size(), is_target ? 1 : 0);
  }
};

class Renderer {
 public:
  Renderer(const ChatTemplate::Program& program, Output& out, bool mark_targets,
           std::string assistant_header)
      : program_(program),
        out_(out),
        mark_targets_(mark_targets && !program.has_generation),
        assistant_header_(std::move(assistant_header)) {}

  void run(std::unordered_map<std::string, Value> globals) {
    scopes_.push_back(std::move(globals));
    scopes_.emplace_back();
    exec_body(program_.body);
  }

  bool saw_assistant_iteration() const { return saw_assistant_iteration_; }

 private:
  Flow exec_body(const Body& body) {
    for (const NodePtr& node : body) {
      Flow flow = exec(*node);
      if (flow != Flow::normal) return flow;
    }
    return Flow::normal;
  }

  void emit(const std::string& text) { out_.append(text, generation_depth_ > 0); }

  Flow exec(const Node& node) {
    switch (node.kind) {
      case Node::data:
        emit(node.text);
        return Flow::normal;
      case Node::output:
        emit(python_str(eval(*node.expr)));
        return Flow::normal;
      case Node::if_:
        for (const auto& [condition, body] : node.branches)
          if (!condition || truthy(eval(*condition))) return exec_body(body);
        return Flow::normal;
      case Node::for_:
        exec_for(node);
        return Flow::normal;
      case Node::set:
        scopes_.back()[node.targets[0]] = eval(*node.expr);
        return Flow::normal;
      case Node::set_attribute: {
        Value* target = lookup(node.targets[0]);
        if (!target || target->kind != Value::ns)
          fail(node.line, "cannot assign attribute '" + node.attribute + "' of '" +
                              node.targets[0] + "': only a namespace() takes attributes");
        Value value = eval(*node.expr);
        for (auto& [key, field] : *target->fields) {
          if (key == node.attribute) {
            field = std::move(value);
            return Flow::normal;
          }
        }
        target->fields->emplace_back(node.attribute, std::move(value));
        return Flow::normal;
      }
      case Node::break_:
        return Flow::break_;
      case Node::continue_:
        return Flow::continue_;
      case Node::generation: {
        ++generation_depth_;
        Flow flow = exec_body(node.body);
        --generation_depth_;
        return flow;
      }
    }
    return Flow::normal;
  }

  void bind_targets(const Node& node, const Value& item,
                    std::unordered_map<std::string, Value>& scope) {
    if (node.targets.size() == 1) {
      scope[node.targets[0]] = item;
      return;
    }
    List parts = item.kind == Value::list ? *item.items : iterate(item, node.line);
    if (parts.size() != node.targets.size())
      fail(node.line, "cannot unpack " + std::to_string(parts.size()) + " values into " +
                          std::to_string(node.targets.size()) + " loop targets");
    for (size_t k = 0; k < parts.size(); ++k) scope[node.targets[k]] = parts[k];
  }

  void exec_for(const Node& node) {
    List all = iterate(eval(*node.expr), node.line);
    List items;
    if (node.condition) {
      for (const Value& item : all) {
        scopes_.emplace_back();
        bind_targets(node, item, scopes_.back());
        bool keep = truthy(eval(*node.condition));
        scopes_.pop_back();
        if (keep) items.push_back(item);
      }
    } else {
      items = std::move(all);
    }
    if (items.empty()) {
      exec_body(node.else_body);
      return;
    }
    const int64_t length = static_cast<int64_t>(items.size());
    for (int64_t k = 0; k < length; ++k) {
      const Value& item = items[static_cast<size_t>(k)];
      scopes_.emplace_back();
      auto& scope = scopes_.back();
      bind_targets(node, item, scope);
      Dict loop;
      loop.emplace_back("index", Value::make_int(k + 1));
      loop.emplace_back("index0", Value::make_int(k));
      loop.emplace_back("revindex", Value::make_int(length - k));
      loop.emplace_back("revindex0", Value::make_int(length - k - 1));
      loop.emplace_back("first", Value::make_bool(k == 0));
      loop.emplace_back("last", Value::make_bool(k == length - 1));
      loop.emplace_back("length", Value::make_int(length));
      loop.emplace_back("depth", Value::make_int(1));
      loop.emplace_back("depth0", Value::make_int(0));
      loop.emplace_back("previtem", k > 0 ? items[static_cast<size_t>(k - 1)] : Value());
      loop.emplace_back("nextitem", k + 1 < length ? items[static_cast<size_t>(k + 1)] : Value());
      scope["loop"] = Value::make_dict(std::move(loop));

      bool assistant = item.message >= 0 && item.kind == Value::dict && [&] {
        const Value* role = item.find("role");
        return role && role->kind == Value::string && role->s == "assistant";
      }();
      if (assistant) saw_assistant_iteration_ = true;
      size_t start = out_.text.size();
      Flow flow = exec_body(node.body);
      if (assistant && mark_targets_) mark_assistant_turn(start);
      scopes_.pop_back();
      if (flow == Flow::break_) break;
    }
  }

  // The rule of chat_template.h: from the end of the assistant header through
  // the end of the iteration's output, less trailing whitespace.
  void mark_assistant_turn(size_t start) {
    std::string_view turn = std::string_view(out_.text).substr(start);
    size_t header = 0;
    if (!assistant_header_.empty()) {
      if (turn.substr(0, assistant_header_.size()) == assistant_header_) {
        header = assistant_header_.size();
      } else {
        size_t found = turn.find(assistant_header_);
        if (found != std::string_view::npos) header = found + assistant_header_.size();
      }
    }
    std::u32string tail = decode_utf8(turn.substr(header));
    size_t keep = tail.size();
    while (keep > 0 && is_python_space(tail[keep - 1])) --keep;
    size_t end = start + header + encode_utf8(std::u32string_view(tail).substr(0, keep)).size();
    for (size_t k = start + header; k < end; ++k) out_.target[k] = 1;
  }

  Value* lookup(const std::string& name) {
    for (auto it = scopes_.rbegin(); it != scopes_.rend(); ++it) {
      auto found = it->find(name);
      if (found != it->end()) return &found->second;
    }
    return nullptr;
  }

  Value eval(const Expr& e) {
    switch (e.kind) {
      case Expr::literal:
        return e.value;
      case Expr::variable: {
        if (Value* found = lookup(e.name)) return *found;
        if (e.name == "range" || e.name == "namespace" || e.name == "raise_exception" ||
            e.name == "dict")
          return Value::make_callable(e.name);
        return Value();
      }
      case Expr::getattr:
        return get_attribute(eval(*e.args[0]), e.name, e.line);
      case Expr::getitem:
        return get_item(eval(*e.args[0]), eval(*e.args[1]), e.line);
      case Expr::slice:
        return eval_slice(e);
      case Expr::call:
        return eval_call(e);
      case Expr::filter:
        return eval_filter(e);
      case Expr::test: {
        bool result = eval_test(e.name, eval(*e.args[0]), evaluate_args(e, 1), e.line);
        return Value::make_bool(e.negated ? !result : result);
      }
      case Expr::unary: {
        Value operand = eval(*e.args[0]);
        if (e.name == "not") return Value::make_bool(!truthy(operand));
        if (operand.kind == Value::undefined)
          fail(e.line, "undefined value in unary '" + e.name + "'");
        if (!operand.is_number())
          fail(e.line, std::string("bad operand type for unary ") + e.name + ": '" +
                           type_name(operand) + "'");
        if (e.name == "+")
          return operand.kind == Value::boolean ? Value::make_int(operand.as_int()) : operand;
        if (operand.kind == Value::floating) return Value::make_float(-operand.f);
        if (operand.as_int() == INT64_MIN) fail(e.line, "integer overflow in unary '-'");
        return Value::make_int(-operand.as_int());
      }
      case Expr::binary:
        return eval_binary(e.name, eval(*e.args[0]), eval(*e.args[1]), e.line);
      case Expr::compare: {
        Value left = eval(*e.args[0]);
        for (size_t k = 0; k < e.ops.size(); ++k) {
          Value right = eval(*e.args[k + 1]);
          if (!compare(e.ops[k], left, right, e.line)) return Value::make_bool(false);
          left = std::move(right);
        }
        return Value::make_bool(true);
      }
      case Expr::logic_and: {
        Value left = eval(*e.args[0]);
        return truthy(left) ? eval(*e.args[1]) : left;
      }
      case Expr::logic_or: {
        Value left = eval(*e.args[0]);
        return truthy(left) ? left : eval(*e.args[1]);
      }
      case Expr::condition:
        if (truthy(eval(*e.args[0]))) return eval(*e.args[1]);
        return e.args[2] ? eval(*e.args[2]) : Value();
      case Expr::list_literal: {
        List items;
        for (const ExprPtr& item : e.args) items.push_back(eval(*item));
        Value list = Value::make_list(std::move(items));
        list.tuple = e.name == "tuple";
        return list;
      }
      case Expr::dict_literal: {
        Dict fields;
        for (size_t k = 0; k + 1 < e.args.size(); k += 2) {
          Value key = eval(*e.args[k]);
          if (key.kind != Value::string) fail(e.line, "dict literal keys must be strings");
          Value value = eval(*e.args[k + 1]);
          bool replaced = false;
          for (auto& [name, field] : fields)
            if (name == key.s) {
              field = value;
              replaced = true;
            }
          if (!replaced) fields.emplace_back(key.s, std::move(value));
        }
        return Value::make_dict(std::move(fields));
      }
    }
    return Value();
  }

  bool compare(const std::string& op, const Value& a, const Value& b, int line) {
    if (op == "==") return equal(a, b);
    if (op == "!=") return !equal(a, b);
    if (op == "in") return contains(b, a, line);
    if (op == "not in") return !contains(b, a, line);
    if (a.kind == Value::undefined || b.kind == Value::undefined)
      fail(line, "undefined value in comparison '" + op + "'");
    if (op == "<") return less(a, b, line);
    if (op == ">") return less(b, a, line);
    if (op == "<=") return !less(b, a, line);
    return !less(a, b, line);  // >=
  }

  Value eval_binary(const std::string& op, const Value& a, const Value& b, int line) {
    if (op == "~") return Value::make_string(python_str(a) + python_str(b));
    if (a.kind == Value::undefined || b.kind == Value::undefined)
      fail(line,
           "undefined value in '" + op + "' (a variable or key the template expects is missing)");
    auto unsupported = [&]() -> Value {
      fail(line, "unsupported operand types for " + op + ": '" + type_name(a) + "' and '" +
                     type_name(b) + "'");
    };
    if (op == "+") {
      if (a.kind == Value::string && b.kind == Value::string) return Value::make_string(a.s + b.s);
      if (a.kind == Value::list && b.kind == Value::list) {
        List items = *a.items;
        items.insert(items.end(), b.items->begin(), b.items->end());
        return Value::make_list(std::move(items));
      }
    }
    if (op == "*" && (a.kind == Value::string || a.kind == Value::list) &&
        (b.kind == Value::integer || b.kind == Value::boolean)) {
      int64_t times = std::max<int64_t>(0, b.as_int());
      size_t unit = a.kind == Value::string ? a.s.size() : a.items->size();
      if (unit > 0 && times > static_cast<int64_t>((size_t{1} << 26) / unit))
        fail(line, "'*' would build more than 64 Mi characters or items");
      if (a.kind == Value::string) {
        std::string text;
        for (int64_t k = 0; k < times; ++k) text += a.s;
        return Value::make_string(std::move(text));
      }
      List items;
      for (int64_t k = 0; k < times; ++k)
        items.insert(items.end(), a.items->begin(), a.items->end());
      return Value::make_list(std::move(items));
    }
    if (!a.is_number() || !b.is_number()) return unsupported();
    bool floating = a.kind == Value::floating || b.kind == Value::floating;
    if (op == "/") {
      if (b.as_double() == 0) fail(line, "division by zero");
      return Value::make_float(a.as_double() / b.as_double());
    }
    if (op == "**") {
      if (!floating && b.as_int() >= 0) {
        int64_t base = a.as_int(), result = 1;
        if (base == 0 || base == 1) return Value::make_int(b.as_int() == 0 ? 1 : base);
        if (base == -1) return Value::make_int(b.as_int() % 2 ? -1 : 1);
        for (int64_t k = 0; k < b.as_int(); ++k)
          if (__builtin_mul_overflow(result, base, &result))
            fail(line, "integer overflow in '**' (strata's integers are 64-bit)");
        return Value::make_int(result);
      }
      return Value::make_float(std::pow(a.as_double(), b.as_double()));
    }
    if (floating) {
      double x = a.as_double(), y = b.as_double();
      if (op == "+") return Value::make_float(x + y);
      if (op == "-") return Value::make_float(x - y);
      if (op == "*") return Value::make_float(x * y);
      if (y == 0) fail(line, "division by zero");
      double quotient = std::floor(x / y);
      if (op == "//") return Value::make_float(quotient);
      double remainder = std::fmod(x, y);
      if (remainder != 0 && ((remainder < 0) != (y < 0))) remainder += y;
      return Value::make_float(remainder);
    }
    int64_t x = a.as_int(), y = b.as_int(), result = 0;
    bool overflow = op == "+"   ? __builtin_add_overflow(x, y, &result)
                    : op == "-" ? __builtin_sub_overflow(x, y, &result)
                    : op == "*" ? __builtin_mul_overflow(x, y, &result)
                                : false;
    if (overflow) fail(line, "integer overflow in '" + op + "' (strata's integers are 64-bit)");
    if (op == "+" || op == "-" || op == "*") return Value::make_int(result);
    if (y == 0) fail(line, "integer division or modulo by zero");
    int64_t quotient = x / y;
    if ((x % y != 0) && ((x < 0) != (y < 0))) --quotient;
    if (op == "//") return Value::make_int(quotient);
    return Value::make_int(x - quotient * y);  // %
  }

  Value get_attribute(const Value& object, const std::string& name, int line) {
    switch (object.kind) {
      case Value::undefined:
        fail(line,
             "'" + name +
                 "' of an undefined value (a variable or key the template expects is missing)");
      case Value::dict:
        if (name == "items" || name == "keys" || name == "values" || name == "get")
          return Value::make_callable(name, std::make_shared<Value>(object));
        if (const Value* found = object.find(name)) return *found;
        return Value();
      case Value::ns:
        if (const Value* found = object.find(name)) return *found;
        return Value();
      case Value::string: {
        static const std::set<std::string, std::less<>> methods = {
            "strip", "lstrip", "rstrip", "split",      "startswith", "endswith",
            "lower", "upper",  "title",  "capitalize", "replace"};
        if (methods.count(name)) return Value::make_callable(name, std::make_shared<Value>(object));
        return Value();
      }
      default:
        return Value();
    }
  }

  Value get_item(const Value& object, const Value& key, int line) {
    switch (object.kind) {
      case Value::undefined:
        fail(line,
             "subscript of an undefined value (a variable or key the template expects is missing)");
      case Value::dict:
      case Value::ns:
        if (key.kind == Value::string) {
          if (const Value* found = object.find(key.s)) return *found;
          return object.kind == Value::dict ? get_attribute(object, key.s, line) : Value();
        }
        return Value();
      case Value::list:
        if (key.kind == Value::integer || key.kind == Value::boolean) {
          auto index = resolve_index(key.as_int(), object.items->size());
          return index ? (*object.items)[*index] : Value();
        }
        return Value();
      case Value::string:
        if (key.kind == Value::integer || key.kind == Value::boolean) {
          std::u32string wide = decode_utf8(object.s);
          auto index = resolve_index(key.as_int(), wide.size());
          return index ? Value::make_string(encode_utf8(wide.substr(*index, 1))) : Value();
        }
        return get_attribute(object, key.kind == Value::string ? key.s : "", line);
      default:
        return Value();
    }
  }

  std::optional<int64_t> slice_bound(const ExprPtr& expr, int line) {
    if (!expr) return std::nullopt;
    Value v = eval(*expr);
    if (v.kind == Value::none) return std::nullopt;
    if (v.kind != Value::integer && v.kind != Value::boolean)
      fail(line, "slice indices must be integers or none");
    return v.as_int();
  }

  Value eval_slice(const Expr& e) {
    Value object = eval(*e.args[0]);
    auto start = slice_bound(e.args[1], e.line);
    auto stop = slice_bound(e.args[2], e.line);
    auto step = slice_bound(e.args[3], e.line);
    if (object.kind == Value::list) {
      List items;
      for (size_t k : slice_positions(start, stop, step, object.items->size(), e.line))
        items.push_back((*object.items)[k]);
      return Value::make_list(std::move(items));
    }
    if (object.kind == Value::string) {
      std::u32string wide = decode_utf8(object.s), part;
      for (size_t k : slice_positions(start, stop, step, wide.size(), e.line))
        part.push_back(wide[k]);
      return Value::make_string(encode_utf8(part));
    }
    if (object.kind == Value::undefined)
      fail(e.line,
           "slice of an undefined value (a variable or key the template expects is missing)");
    fail(e.line, std::string("'") + type_name(object) + "' object is not subscriptable");
  }

  std::vector<Value> evaluate_args(const Expr& e, size_t first) {
    std::vector<Value> args;
    for (size_t k = first; k < e.args.size(); ++k) args.push_back(eval(*e.args[k]));
    return args;
  }

  // A filter's or method's argument by position or keyword.
  static const Value* argument(const std::vector<Value>& args,
                               const std::vector<std::pair<std::string, Value>>& kwargs,
                               size_t position, std::string_view keyword) {
    if (position < args.size()) return &args[position];
    for (const auto& [key, value] : kwargs)
      if (key == keyword) return &value;
    return nullptr;
  }

  std::vector<std::pair<std::string, Value>> evaluate_kwargs(const Expr& e) {
    std::vector<std::pair<std::string, Value>> kwargs;
    for (const auto& [key, expr] : e.kwargs) kwargs.emplace_back(key, eval(*expr));
    return kwargs;
  }

  Value eval_call(const Expr& e) {
    Value callee = eval(*e.args[0]);
    std::vector<Value> args = evaluate_args(e, 1);
    auto kwargs = evaluate_kwargs(e);
    if (callee.kind != Value::callable) {
      std::string what = e.args[0]->kind == Expr::variable  ? "'" + e.args[0]->name + "'"
                         : e.args[0]->kind == Expr::getattr ? "'" + e.args[0]->name + "'"
                                                            : "the expression";
      fail(e.line, what + " is " +
                       (callee.kind == Value::undefined ? "undefined" : "not callable") +
                       " (strata's templates may call range, namespace, raise_exception, dict and "
                       "the string and dict methods prep/chat_template.h lists)");
    }
    const std::string& name = callee.s;
    if (!callee.self) {
      if (name == "raise_exception") {
        std::string message = args.empty() ? std::string() : python_str(args[0]);
        fail(e.line, "the template refused the conversation: " + message);
      }
      if (name == "namespace" || name == "dict") {
        Dict fields;
        for (const Value& arg : args) {
          if (arg.kind != Value::dict) fail(e.line, name + "() takes keyword arguments or a dict");
          for (const auto& field : *arg.fields) fields.push_back(field);
        }
        for (auto& [key, value] : kwargs) fields.emplace_back(key, value);
        Value out = Value::make_dict(std::move(fields));
        if (name == "namespace") out.kind = Value::ns;
        return out;
      }
      if (name == "range") {
        if (args.empty() || args.size() > 3) fail(e.line, "range() takes 1 to 3 integers");
        for (const Value& arg : args)
          if (arg.kind != Value::integer && arg.kind != Value::boolean)
            fail(e.line, "range() takes integers");
        int64_t start = args.size() > 1 ? args[0].as_int() : 0;
        int64_t stop = args.size() > 1 ? args[1].as_int() : args[0].as_int();
        int64_t step = args.size() > 2 ? args[2].as_int() : 1;
        if (step == 0) fail(e.line, "range() step must not be zero");
        List items;
        for (int64_t k = start; step > 0 ? k < stop : k > stop; k += step) {
          items.push_back(Value::make_int(k));
          if (items.size() > 100000) fail(e.line, "range() of more than 100000 items");
        }
        return Value::make_list(std::move(items));
      }
    }
    return call_method(*callee.self, name, args, kwargs, e.line);
  }

  Value call_method(const Value& self, const std::string& name, const std::vector<Value>& args,
                    const std::vector<std::pair<std::string, Value>>& kwargs, int line) {
    if (self.kind == Value::dict) {
      if (name == "items") {
        List pairs;
        for (const auto& [key, value] : *self.fields) {
          pairs.push_back(Value::make_list({Value::make_string(key), value}));
          pairs.back().tuple = true;
        }
        return Value::make_list(std::move(pairs));
      }
      if (name == "keys") return Value::make_list(iterate(self, line));
      if (name == "values") {
        List values;
        for (const auto& field : *self.fields) values.push_back(field.second);
        return Value::make_list(std::move(values));
      }
      // get
      if (args.empty()) fail(line, "get() takes a key");
      if (args[0].kind == Value::string)
        if (const Value* found = self.find(args[0].s)) return *found;
      return args.size() > 1 ? args[1] : Value::make_none();
    }
    // string methods
    auto string_argument = [&](size_t position,
                               std::string_view keyword) -> std::optional<std::string> {
      const Value* v = argument(args, kwargs, position, keyword);
      if (!v || v->kind == Value::none) return std::nullopt;
      if (v->kind != Value::string) fail(line, name + "() takes a string argument");
      return v->s;
    };
    if (name == "strip" || name == "lstrip" || name == "rstrip") {
      auto chars = string_argument(0, "chars");
      std::u32string wide_chars = chars ? decode_utf8(*chars) : std::u32string();
      return Value::make_string(encode_utf8(strip_chars(
          decode_utf8(self.s), name != "rstrip", name != "lstrip", chars ? &wide_chars : nullptr)));
    }
    if (name == "startswith" || name == "endswith") {
      const Value* affix = argument(args, kwargs, 0, "prefix");
      if (!affix) fail(line, name + "() takes a string");
      List candidates = affix->kind == Value::list ? *affix->items : List{*affix};
      for (const Value& candidate : candidates) {
        if (candidate.kind != Value::string) fail(line, name + "() takes a string");
        const std::string& s = self.s;
        const std::string& c = candidate.s;
        if (c.size() <= s.size() &&
            (name == "startswith" ? s.compare(0, c.size(), c) == 0
                                  : s.compare(s.size() - c.size(), c.size(), c) == 0))
          return Value::make_bool(true);
      }
      return Value::make_bool(false);
    }
    if (name == "split") {
      auto separator = string_argument(0, "sep");
      const Value* max_value = argument(args, kwargs, 1, "maxsplit");
      int64_t maxsplit = max_value && max_value->kind == Value::integer ? max_value->i : -1;
      List parts;
      if (separator) {
        if (separator->empty()) fail(line, "split(): empty separator");
        size_t pos = 0;
        int64_t splits = 0;
        while (maxsplit < 0 || splits < maxsplit) {
          size_t found = self.s.find(*separator, pos);
          if (found == std::string::npos) break;
          parts.push_back(Value::make_string(self.s.substr(pos, found - pos)));
          pos = found + separator->size();
          ++splits;
        }
        parts.push_back(Value::make_string(self.s.substr(pos)));
      } else {
        std::u32string wide = decode_utf8(self.s);
        size_t k = 0;
        int64_t splits = 0;
        while (k < wide.size()) {
          while (k < wide.size() && is_python_space(wide[k])) ++k;
          if (k == wide.size()) break;
          if (maxsplit >= 0 && splits == maxsplit) {
            std::u32string rest =
                strip_chars(std::u32string_view(wide).substr(k), false, true, nullptr);
            parts.push_back(Value::make_string(encode_utf8(rest)));
            break;
          }
          size_t end = k;
          while (end < wide.size() && !is_python_space(wide[end])) ++end;
          parts.push_back(Value::make_string(encode_utf8(wide.substr(k, end - k))));
          ++splits;
          k = end;
        }
      }
      return Value::make_list(std::move(parts));
    }
    if (name == "lower") return Value::make_string(ascii_lower(self.s));
    if (name == "upper") return Value::make_string(ascii_upper(self.s));
    if (name == "title") return Value::make_string(ascii_title(self.s));
    if (name == "capitalize") return Value::make_string(ascii_capitalize(self.s));
    // replace
    auto old_text = string_argument(0, "old");
    auto new_text = string_argument(1, "new");
    if (!old_text || !new_text) fail(line, "replace() takes two strings");
    const Value* count_value = argument(args, kwargs, 2, "count");
    int64_t count = count_value && count_value->kind == Value::integer ? count_value->i : -1;
    return Value::make_string(replace_text(self.s, *old_text, *new_text, count));
  }

  static std::string replace_text(const std::string& text, const std::string& old_text,
                                  const std::string& new_text, int64_t count) {
    std::string out;
    if (old_text.empty()) {
      std::u32string wide = decode_utf8(text);
      int64_t done = 0;
      for (size_t k = 0; k <= wide.size(); ++k) {
        if (count < 0 || done < count) {
          out += new_text;
          ++done;
        }
        if (k < wide.size()) append_utf8(out, wide[k]);
      }
      return out;
    }
    size_t pos = 0;
    int64_t done = 0;
    while (count < 0 || done < count) {
      size_t found = text.find(old_text, pos);
      if (found == std::string::npos) break;
      out += text.substr(pos, found - pos) + new_text;
      pos = found + old_text.size();
      ++done;
    }
    return out + text.substr(pos);
  }

  // jinja2's attribute lookup for selectattr/map: item first, dotted paths.
  Value attribute_path(const Value& object, const std::string& path, int line) {
    Value current = object;
    size_t pos = 0;
    while (true) {
      size_t dot = path.find('.', pos);
      std::string part = path.substr(pos, dot == std::string::npos ? std::string::npos : dot - pos);
      if (current.kind == Value::undefined) return current;
      bool numeric = !part.empty() && std::all_of(part.begin(), part.end(), ::isdigit);
      current = numeric ? get_item(current, Value::make_int(parse_integer(part, line)), line)
                        : get_item(current, Value::make_string(part), line);
      if (dot == std::string::npos) return current;
      pos = dot + 1;
    }
  }

  Value eval_filter(const Expr& e) {
    Value subject = eval(*e.args[0]);
    std::vector<Value> args = evaluate_args(e, 1);
    auto kwargs = evaluate_kwargs(e);
    const std::string& name = e.name;
    const int line = e.line;
    // jinja2's soft_str: the filters that take text take str() of anything.
    auto need_string = [&](const char*) { return python_str(subject); };
    if (name == "trim") {
      auto chars = argument(args, kwargs, 0, "chars");
      std::u32string wide_chars =
          chars && chars->kind == Value::string ? decode_utf8(chars->s) : std::u32string();
      return Value::make_string(
          encode_utf8(strip_chars(decode_utf8(need_string("trim")), true, true,
                                  chars && chars->kind == Value::string ? &wide_chars : nullptr)));
    }
    if (name == "tojson") {
      JsonFormat format;
      const Value* indent = argument(args, kwargs, 0, "indent");
      if (indent && indent->kind != Value::none) {
        if (indent->kind == Value::integer)
          format.indent = std::string(static_cast<size_t>(std::max<int64_t>(0, indent->i)), ' ');
        else if (indent->kind == Value::string)
          format.indent = indent->s;
        else
          fail(line, "tojson: indent must be an integer or a string");
      }
      format.item_separator = format.indent ? "," : ", ";
      format.key_separator = ": ";
      for (const auto& [key, value] : kwargs) {
        if (key == "indent" || key == "ensure_ascii") continue;
        if (key == "sort_keys") {
          format.sort_keys = truthy(value);
        } else if (key == "separators") {
          if (value.kind != Value::list || value.items->size() != 2 ||
              (*value.items)[0].kind != Value::string || (*value.items)[1].kind != Value::string)
            fail(line, "tojson: separators must be two strings");
          format.item_separator = (*value.items)[0].s;
          format.key_separator = (*value.items)[1].s;
        } else {
          fail(line, "tojson: unsupported argument '" + key + "'");
        }
      }
      for (const auto& [key, value] : kwargs)
        if (key == "ensure_ascii" && truthy(value))
          fail(line, "tojson: ensure_ascii=true is not supported");
      std::string out;
      json_dump(out, subject, format, 0, line);
      return Value::make_string(std::move(out));
    }
    if (name == "length" || name == "count") {
      switch (subject.kind) {
        case Value::undefined:
          return Value::make_int(0);
        case Value::string:
          return Value::make_int(static_cast<int64_t>(decode_utf8(subject.s).size()));
        case Value::list:
          return Value::make_int(static_cast<int64_t>(subject.items->size()));
        case Value::dict:
          return Value::make_int(static_cast<int64_t>(subject.fields->size()));
        default:
          fail(line, std::string("object of type '") + type_name(subject) + "' has no len()");
      }
    }
    if (name == "lower") return Value::make_string(ascii_lower(need_string("lower")));
    if (name == "upper") return Value::make_string(ascii_upper(need_string("upper")));
    if (name == "capitalize")
      return Value::make_string(ascii_capitalize(need_string("capitalize")));
    if (name == "title") return Value::make_string(jinja_title(need_string("title")));
    if (name == "string") return Value::make_string(python_str(subject));
    if (name == "default" || name == "d") {
      const Value* fallback = argument(args, kwargs, 0, "default_value");
      const Value* boolean = argument(args, kwargs, 1, "boolean");
      bool use_fallback =
          subject.kind == Value::undefined || (boolean && truthy(*boolean) && !truthy(subject));
      if (use_fallback) return fallback ? *fallback : Value::make_string("");
      return subject;
    }
    if (name == "first" || name == "last") {
      List items = iterate(subject, line);
      if (items.empty()) return Value();
      return name == "first" ? items.front() : items.back();
    }
    if (name == "join") {
      const Value* separator = argument(args, kwargs, 0, "d");
      const Value* attribute = argument(args, kwargs, 1, "attribute");
      std::string out;
      bool first = true;
      for (const Value& item : iterate(subject, line)) {
        if (!first) out += separator ? python_str(*separator) : "";
        first = false;
        out += python_str(attribute ? attribute_path(item, python_str(*attribute), line) : item);
      }
      return Value::make_string(std::move(out));
    }
    if (name == "replace") {
      const Value* old_text = argument(args, kwargs, 0, "old");
      const Value* new_text = argument(args, kwargs, 1, "new");
      const Value* count = argument(args, kwargs, 2, "count");
      if (!old_text || !new_text) fail(line, "replace takes two strings");
      return Value::make_string(
          replace_text(need_string("replace"), python_str(*old_text), python_str(*new_text),
                       count && count->kind == Value::integer ? count->i : -1));
    }
    if (name == "items") {
      if (subject.kind == Value::undefined) return Value::make_list({});
      if (subject.kind != Value::dict) fail(line, "items: can only get item pairs from a mapping");
      return call_method(subject, "items", {}, {}, line);
    }
    if (name == "list") return Value::make_list(iterate(subject, line));
    if (name == "reverse") {
      if (subject.kind == Value::string) {
        std::u32string wide = decode_utf8(subject.s);
        std::reverse(wide.begin(), wide.end());
        return Value::make_string(encode_utf8(wide));
      }
      List items = iterate(subject, line);
      std::reverse(items.begin(), items.end());
      return Value::make_list(std::move(items));
    }
    if (name == "abs") {
      if (subject.kind == Value::floating) return Value::make_float(std::fabs(subject.f));
      if (subject.is_number()) return Value::make_int(std::llabs(subject.as_int()));
      fail(line, std::string("bad operand type for abs(): '") + type_name(subject) + "'");
    }
    if (name == "int" || name == "float") {
      const Value* fallback = argument(args, kwargs, 0, "default");
      Value result;
      if (subject.is_number()) {
        result = name == "int" ? Value::make_int(subject.kind == Value::floating
                                                     ? static_cast<int64_t>(subject.f)
                                                     : subject.as_int())
                               : Value::make_float(subject.as_double());
      } else if (subject.kind == Value::string) {
        std::u32string trimmed = strip_chars(decode_utf8(subject.s), true, true, nullptr);
        std::string text = encode_utf8(trimmed);
        char* end = nullptr;
        if (name == "int") {  // int(text), else int(float(text)), as jinja2
          long long v = std::strtoll(text.c_str(), &end, 10);
          if (!text.empty() && end && *end == '\0') {
            result = Value::make_int(v);
          } else {
            double d = std::strtod(text.c_str(), &end);
            if (!text.empty() && end && *end == '\0' && std::isfinite(d) && std::fabs(d) < 9e18)
              result = Value::make_int(static_cast<int64_t>(d));
          }
        } else {
          double v = std::strtod(text.c_str(), &end);
          if (!text.empty() && end && *end == '\0') result = Value::make_float(v);
        }
      }
      if (result.kind != Value::undefined) return result;
      if (fallback) return *fallback;
      return name == "int" ? Value::make_int(0) : Value::make_float(0.0);
    }
    if (name == "select" || name == "reject" || name == "selectattr" || name == "rejectattr") {
      bool by_attribute = name == "selectattr" || name == "rejectattr";
      bool keep_matching = name == "select" || name == "selectattr";
      size_t next_arg = 0;
      std::string attribute;
      if (by_attribute) {
        if (args.empty() || args[0].kind != Value::string)
          fail(line, name + " takes an attribute name");
        attribute = args[0].s;
        next_arg = 1;
      }
      std::optional<std::string> test;
      if (next_arg < args.size()) {
        if (args[next_arg].kind != Value::string)
          fail(line, name + ": the test is named by a string");
        test = args[next_arg].s;
        if (!known_tests().count(*test)) fail(line, name + ": unsupported test '" + *test + "'");
        ++next_arg;
      }
      std::vector<Value> test_args(args.begin() + static_cast<long>(next_arg), args.end());
      List kept;
      for (const Value& item : iterate(subject, line)) {
        Value probe = by_attribute ? attribute_path(item, attribute, line) : item;
        bool matches = test ? eval_test(*test, probe, test_args, line) : truthy(probe);
        if (matches == keep_matching) kept.push_back(item);
      }
      return Value::make_list(std::move(kept));
    }
    if (name == "map") {
      List mapped;
      const Value* attribute = nullptr;
      for (const auto& [key, value] : kwargs)
        if (key == "attribute") attribute = &value;
      if (attribute) {
        const Value* fallback = nullptr;
        for (const auto& [key, value] : kwargs)
          if (key == "default") fallback = &value;
        for (const Value& item : iterate(subject, line)) {
          Value v = attribute_path(item, python_str(*attribute), line);
          mapped.push_back(v.kind == Value::undefined && fallback ? *fallback : v);
        }
        return Value::make_list(std::move(mapped));
      }
      if (args.empty() || args[0].kind != Value::string)
        fail(line, "map takes attribute= or the name of a filter");
      std::string filter_name = args[0].s;
      if (!known_filters().count(filter_name) || filter_name == "map")
        fail(line, "map: unsupported filter '" + filter_name + "'");
      for (const Value& item : iterate(subject, line)) {
        auto call = std::make_shared<Expr>();
        call->kind = Expr::filter;
        call->line = line;
        call->name = filter_name;
        auto item_literal = std::make_shared<Expr>();
        item_literal->kind = Expr::literal;
        item_literal->value = item;
        call->args.push_back(item_literal);
        for (size_t k = 1; k < args.size(); ++k) {
          auto arg = std::make_shared<Expr>();
          arg->kind = Expr::literal;
          arg->value = args[k];
          call->args.push_back(arg);
        }
        mapped.push_back(eval_filter(*call));
      }
      return Value::make_list(std::move(mapped));
    }
    fail(line, "unsupported filter '" + name + "'");
  }

  bool eval_test(const std::string& name, const Value& v, const std::vector<Value>& args,
                 int line) {
    auto need_arg = [&]() -> const Value& {
      if (args.empty()) fail(line, "test '" + name + "' takes an argument");
      return args[0];
    };
    if (name == "defined") return v.kind != Value::undefined;
    if (name == "undefined") return v.kind == Value::undefined;
    if (name == "none") return v.kind == Value::none;
    if (name == "string") return v.kind == Value::string;
    if (name == "number") return v.is_number();
    if (name == "integer") return v.kind == Value::integer;
    if (name == "float") return v.kind == Value::floating;
    if (name == "boolean") return v.kind == Value::boolean;
    if (name == "true") return v.kind == Value::boolean && v.b;
    if (name == "false") return v.kind == Value::boolean && !v.b;
    if (name == "mapping") return v.kind == Value::dict;
    if (name == "sequence")
      return v.kind == Value::string || v.kind == Value::list || v.kind == Value::dict;
    if (name == "iterable")
      return v.kind == Value::string || v.kind == Value::list || v.kind == Value::dict ||
             v.kind == Value::undefined;
    if (name == "callable") return v.kind == Value::callable;
    if (name == "lower")
      return v.kind == Value::string && ascii_lower(v.s) == v.s && ascii_upper(v.s) != v.s;
    if (name == "upper")
      return v.kind == Value::string && ascii_upper(v.s) == v.s && ascii_lower(v.s) != v.s;
    if (name == "odd" || name == "even") {
      if (!v.is_number() || v.kind == Value::floating)
        fail(line, "test '" + name + "' takes an integer");
      bool odd = (v.as_int() % 2) != 0;
      return name == "odd" ? odd : !odd;
    }
    if (name == "divisibleby") {
      const Value& d = need_arg();
      if (!v.is_number() || !d.is_number() || d.as_double() == 0)
        fail(line, "test 'divisibleby' takes non-zero numbers");
      return std::fmod(v.as_double(), d.as_double()) == 0;
    }
    if (name == "eq" || name == "equalto" || name == "==") return equal(v, need_arg());
    if (name == "ne" || name == "!=") return !equal(v, need_arg());
    if (name == "lt" || name == "<") return compare("<", v, need_arg(), line);
    if (name == "le" || name == "<=") return compare("<=", v, need_arg(), line);
    if (name == "gt" || name == ">") return compare(">", v, need_arg(), line);
    if (name == "ge" || name == ">=") return compare(">=", v, need_arg(), line);
    if (name == "in") return contains(need_arg(), v, line);
    if (name == "sameas") {
      const Value& other = need_arg();
      if (v.kind != other.kind) return false;
      if (v.kind == Value::none || v.kind == Value::undefined) return true;
      if (v.kind == Value::boolean) return v.b == other.b;
      if (v.kind == Value::list) return v.items == other.items;
      if (v.kind == Value::dict || v.kind == Value::ns) return v.fields == other.fields;
      return false;
    }
    fail(line, "unsupported test '" + name + "'");
  }

  const ChatTemplate::Program& program_;
  Output& out_;
  bool mark_targets_;
  std::string assistant_header_;
  std::vector<std::unordered_map<std::string, Value>> scopes_;
  int generation_depth_ = 0;
  bool saw_assistant_iteration_ = false;
};

std::unordered_map<std::string, Value> make_globals(Value messages,
                                                    const ChatTemplateContext& context,
                                                    std::optional<Value> tools) {
  std::unordered_map<std::string, Value> globals;
  globals["messages"] = std::move(messages);
  globals["bos_token"] = Value::make_string(context.bos_token);
  globals["eos_token"] = Value::make_string(context.eos_token);
  globals["add_generation_prompt"] = Value::make_bool(context.add_generation_prompt);
  // transformers passes tools=None and documents=None when there are none.
  globals["tools"] = tools ? std::move(*tools) : Value::make_none();
  globals["documents"] = Value::make_none();
  return globals;
}

// The text add_generation_prompt adds to a one-message conversation: the
// assistant header of chat_template.h's rule ("" when there is none).
std::string assistant_header(const ChatTemplate::Program& program,
                             const ChatTemplateContext& context) {
  Dict probe_message;
  probe_message.emplace_back("role", Value::make_string("user"));
  probe_message.emplace_back("content", Value::make_string("Hi"));
  Value probe = Value::make_dict(std::move(probe_message));
  probe.message = 0;
  Value messages = Value::make_list({probe});
  std::string rendered[2];
  for (int with_prompt = 0; with_prompt < 2; ++with_prompt) {
    ChatTemplateContext probe_context = context;
    probe_context.add_generation_prompt = with_prompt == 1;
    Output out;
    Renderer renderer(program, out, false, "");
    try {
      renderer.run(make_globals(messages, probe_context, std::nullopt));
    } catch (const RenderError&) {
      return "";
    }
    rendered[with_prompt] = std::move(out.text);
  }
  if (rendered[1].compare(0, rendered[0].size(), rendered[0]) != 0) return "";
  return rendered[1].substr(rendered[0].size());
}

Result<std::vector<ChatPiece>> render_values(const ChatTemplate::Program& program, Value messages,
                                             const ChatTemplateContext& context,
                                             std::optional<Value> tools) {
  if (messages.kind != Value::list)
    return Status::error("chat template: `messages` must be a JSON array of message objects");
  bool has_assistant = false;
  List tagged;
  for (size_t k = 0; k < messages.items->size(); ++k) {
    Value message = (*messages.items)[k];
    if (message.kind != Value::dict)
      return Status::error("chat template: message " + std::to_string(k) +
                           " is not a JSON object with \"role\" and \"content\"");
    const Value* role = message.find("role");
    if (role && role->kind == Value::string && role->s == "assistant") has_assistant = true;
    message.message = static_cast<int>(k);
    tagged.push_back(std::move(message));
  }
  Value tagged_messages = Value::make_list(std::move(tagged));
  Output out;
  try {
    std::string header;
    if (!program.has_generation) {
      std::lock_guard<std::mutex> lock(program.header_mutex);
      auto key = std::make_pair(context.bos_token, context.eos_token);
      auto found = program.headers.find(key);
      if (found == program.headers.end())
        found = program.headers.emplace(key, assistant_header(program, context)).first;
      header = found->second;
    }
    Renderer renderer(program, out, true, header);
    renderer.run(make_globals(tagged_messages, context, std::move(tools)));
    if (has_assistant && !program.has_generation && !renderer.saw_assistant_iteration())
      return Status::error(
          "chat template: no for loop iterated over the conversation's assistant messages, so "
          "no text can be attributed to them; wrap the assistant text in "
          "{% generation %}...{% endgeneration %}");
  } catch (const RenderError& error) {
    return Status::error(error.message);
  } catch (const std::exception& error) {
    return Status::error(std::string("chat template: cannot render: ") + error.what());
  }
  std::vector<ChatPiece> pieces;
  for (size_t k = 0; k < out.text.size();) {
    size_t end = k;
    while (end < out.text.size() && out.target[end] == out.target[k]) ++end;
    pieces.push_back({out.text.substr(k, end - k), out.target[k] != 0});
    k = end;
  }
  return pieces;
}

}  // namespace

Result<ChatTemplate> ChatTemplate::parse(std::string source) {
  try {
    Lexer lexer(std::move(source));
    Parser parser(lexer.tokenize());
    auto program = std::make_shared<Program>();
    program->body = parser.parse_template(program->has_generation);
    return ChatTemplate(std::move(program));
  } catch (const RenderError& error) {
    return Status::error(error.message);
  } catch (const std::exception& error) {
    return Status::error(std::string("chat template: cannot parse: ") + error.what());
  }
}

Result<std::vector<ChatPiece>> ChatTemplate::render(const nlohmann::json& messages,
                                                    const ChatTemplateContext& context) const {
  std::optional<Value> tools;
  if (context.tools) tools = from_json(*context.tools);
  return render_values(*program_, from_json(messages), context, std::move(tools));
}

Result<std::vector<ChatPiece>> ChatTemplate::render(
    const nlohmann::ordered_json& messages, const ChatTemplateContext& context,
    const std::optional<nlohmann::ordered_json>& tools) const {
  std::optional<Value> tool_values;
  if (tools)
    tool_values = from_json(*tools);
  else if (context.tools)
    tool_values = from_json(*context.tools);
  return render_values(*program_, from_json(messages), context, std::move(tool_values));
}

}  // namespace strata
