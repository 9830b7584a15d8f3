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

#include "prep/chat_template_builtins.h"

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

  // Filters take their subject and arguments evaluated (chat_template_builtins.h).
  Value eval_filter(const Expr& e) {
    const Value subject = eval(*e.args[0]);
    return apply_filter(e.name, subject, evaluate_args(e, 1), evaluate_kwargs(e), e.line);
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
