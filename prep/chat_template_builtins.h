// What a chat template's expressions call on values: comparisons and
// arithmetic, attribute and item access, the string and dict methods, the
// tests and the filters strata implements (chat_template.h lists them), each
// as Python and jinja2 compute it. Pure functions of their values; a
// RenderError names the template line of anything outside them. Internal to
// prep/chat_template*.cpp.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "prep/chat_template_value.h"

namespace strata::chat_template_detail {

using Kwargs = std::vector<std::pair<std::string, Value>>;

// Python's a op b for ==, !=, <, <=, >, >= (jinja2's undefined rules).
bool compare(const std::string& op, const Value& a, const Value& b, int line);

// a op b for + - * / // % ** and ~ (string concatenation).
Value eval_binary(const std::string& op, const Value& a, const Value& b, int line);

// object.name (a field, or a method bound to the object) and object[key].
Value get_attribute(const Value& object, const std::string& name, int line);
Value get_item(const Value& object, const Value& key, int line);

// self.name(args, kwargs): the string and dict methods.
Value call_method(const Value& self, const std::string& name, const std::vector<Value>& args,
                  const Kwargs& kwargs, int line);

// `v is name(args)`.
bool eval_test(const std::string& name, const Value& v, const std::vector<Value>& args, int line);

// `subject | name(args, kwargs)`.
Value apply_filter(const std::string& name, const Value& subject, const std::vector<Value>& args,
                   const Kwargs& kwargs, int line);

}  // namespace strata::chat_template_detail
