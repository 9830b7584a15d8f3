// The chat-template renderer (chat_template_renderer.h): an evaluator over
// Values that writes the output and marks, byte by byte, what is a target.
#include "prep/chat_template_renderer.h"

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

}  // namespace

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

}  // namespace strata::chat_template_detail
