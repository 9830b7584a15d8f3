// The chat-template parser (chat_template_parser.h).
#include "prep/chat_template_parser.h"

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

namespace {

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

Body parse_template_tokens(std::vector<Token> tokens, bool& has_generation) {
  Parser parser(std::move(tokens));
  return parser.parse_template(has_generation);
}

}  // namespace strata::chat_template_detail
