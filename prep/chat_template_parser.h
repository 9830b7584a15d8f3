// The chat-template parser: tokens to the tree the renderer walks (the
// subset chat_template.h lists; anything else refused naming its line), and
// ChatTemplate::Program, a parsed template. Internal to prep/chat_template*.cpp.
#pragma once

#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "prep/chat_template.h"
#include "prep/chat_template_lexer.h"
#include "prep/chat_template_value.h"

namespace strata::chat_template_detail {

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

// The filters and tests the renderer implements.
const std::set<std::string, std::less<>>& known_filters();
const std::set<std::string, std::less<>>& known_tests();

// The template's tree; has_generation says whether it has {% generation %} blocks.
Body parse_template_tokens(std::vector<Token> tokens, bool& has_generation);

}  // namespace strata::chat_template_detail

namespace strata {

struct ChatTemplate::Program {
  chat_template_detail::Body body;
  bool has_generation = false;
  // The assistant header (chat_template.h) by (bos_token, eos_token): two
  // renders of a probe conversation, done once per pair of tokens.
  mutable std::mutex header_mutex;
  mutable std::map<std::pair<std::string, std::string>, std::string> headers;
};

}  // namespace strata
