// The builtins of chat templates (chat_template_builtins.h).
#include "prep/chat_template_builtins.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>

#include "prep/chat_template_parser.h"

namespace strata::chat_template_detail {
namespace {

// A filter's or method's argument by position or keyword.
const Value* argument(const std::vector<Value>& args,
                      const std::vector<std::pair<std::string, Value>>& kwargs, size_t position,
                      std::string_view keyword) {
  if (position < args.size()) return &args[position];
  for (const auto& [key, value] : kwargs)
    if (key == keyword) return &value;
  return nullptr;
}

std::string replace_text(const std::string& text, const std::string& old_text,
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

}  // namespace

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
    for (int64_t k = 0; k < times; ++k) items.insert(items.end(), a.items->begin(), a.items->end());
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
      fail(line, "'" + name +
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

bool eval_test(const std::string& name, const Value& v, const std::vector<Value>& args, int line) {
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

namespace {

// tojson(indent=, sort_keys=, separators=), as jinja2's htmlsafe_json_dumps without the escaping.
Value tojson_filter(const Value& subject, const std::vector<Value>& args, const Kwargs& kwargs,
                    int line) {
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

// int(default=) and float(default=): Python's conversions, jinja2's fallbacks.
Value number_filter(const std::string& name, const Value& subject, const std::vector<Value>& args,
                    const Kwargs& kwargs) {
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

// select, reject, selectattr, rejectattr: the items a test (or truth) keeps.
Value select_filter(const std::string& name, const Value& subject, const std::vector<Value>& args,
                    int line) {
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

// map(attribute=, default=) or map('filter', args...).
Value map_filter(const Value& subject, const std::vector<Value>& args, const Kwargs& kwargs,
                 int line) {
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
  const std::vector<Value> rest(args.begin() + 1, args.end());
  for (const Value& item : iterate(subject, line))
    mapped.push_back(apply_filter(filter_name, item, rest, {}, line));
  return Value::make_list(std::move(mapped));
}

}  // namespace

Value apply_filter(const std::string& name, const Value& subject, const std::vector<Value>& args,
                   const Kwargs& kwargs, int line) {
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
  if (name == "tojson") return tojson_filter(subject, args, kwargs, line);
  if (name == "int" || name == "float") return number_filter(name, subject, args, kwargs);
  if (name == "select" || name == "reject" || name == "selectattr" || name == "rejectattr")
    return select_filter(name, subject, args, line);
  if (name == "map") return map_filter(subject, args, kwargs, line);
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
  if (name == "capitalize") return Value::make_string(ascii_capitalize(need_string("capitalize")));
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
    return Value::make_string(replace_text(need_string("replace"), python_str(*old_text),
                                           python_str(*new_text),
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
  fail(line, "unsupported filter '" + name + "'");
}

}  // namespace strata::chat_template_detail
