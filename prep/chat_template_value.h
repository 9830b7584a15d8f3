// The values a chat template computes with (Python's, as jinja2 sees them),
// the text helpers they need, and the one error type of the interpreter:
// internal to prep/chat_template*.cpp (chat_template.h is the contract).
#pragma once

#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace strata::chat_template_detail {

struct RenderError {
  std::string message;
};

// Throws the one-line RenderError "chat template line N: what" (line
// breaks in `what` shown as \n and \r).
[[noreturn]] void fail(int line, const std::string& what);

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

// json.dumps(x, ensure_ascii=False, indent=indent, separators=..., sort_keys=...).
struct JsonFormat {
  std::optional<std::string> indent;  // none: one line
  std::string item_separator, key_separator;
  bool sort_keys = false;
};

// Code points of UTF-8 text; a byte that does not start a valid sequence
// stands for itself (as U+FFFD would lose it).
std::u32string decode_utf8(std::string_view text);

void append_utf8(std::string& out, char32_t cp);

std::string encode_utf8(std::u32string_view text);

// Python's str.isspace(), which strip(), split() and trim use.
bool is_python_space(char32_t c);

std::u32string strip_chars(std::u32string_view text, bool left, bool right,
                           const std::u32string* chars);

std::string ascii_lower(std::string text);

std::string ascii_upper(std::string text);

std::string ascii_capitalize(std::string text);

// jinja2's `title` filter: words begin after "-", "(", "{", "[", "<" or
// whitespace (Python's str.title, the method, also after "'" and digits).
std::string jinja_title(const std::string& text);

std::string ascii_title(std::string text);

const char* type_name(const Value& v);

bool truthy(const Value& v);

// Python's str(), which `{{ }}`, `~`, join and `string` apply (undefined: "").
std::string python_str(const Value& v);

void json_dump(std::string& out, const Value& v, const JsonFormat& format, int depth, int line);

// Python's ==, with jinja2's rule that undefined equals only undefined.
bool equal(const Value& a, const Value& b);

// Python's <, for numbers, strings and lists.
bool less(const Value& a, const Value& b, int line);

// The items a for loop, `in`, join and the list filters walk.
List iterate(const Value& v, int line);

bool contains(const Value& container, const Value& item, int line);

// Python's index rule: negative counts from the end; out of range: nullopt.
std::optional<size_t> resolve_index(int64_t index, size_t size);

// Python's slice.indices(): the positions a slice visits.
std::vector<size_t> slice_positions(std::optional<int64_t> start, std::optional<int64_t> stop,
                                    std::optional<int64_t> step, size_t size, int line);

// A JSON value (nlohmann::json or ordered_json, whose key order tojson keeps) as a Value.
Value from_json(const nlohmann::json& j);
Value from_json(const nlohmann::ordered_json& j);

}  // namespace strata::chat_template_detail
