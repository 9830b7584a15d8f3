// The chat-template interpreter: a lexer that applies jinja2's whitespace
// rules, a parser to an AST, and an evaluator over Values built from the JSON
// conversation. chat_template.h states the subset and the target rule.
// This file is the contract's entry points; the interpreter is in five parts:
// chat_template_value (Values and text), chat_template_lexer,
// chat_template_parser, chat_template_renderer and chat_template_builtins.
#include "prep/chat_template.h"

#include <memory>
#include <optional>
#include <string>
#include <utility>

#include "prep/chat_template_lexer.h"
#include "prep/chat_template_parser.h"
#include "prep/chat_template_renderer.h"
#include "prep/chat_template_value.h"

namespace strata {

using chat_template_detail::from_json;
using chat_template_detail::RenderError;
using chat_template_detail::Value;

Result<ChatTemplate> ChatTemplate::parse(std::string source) {
  try {
    auto program = std::make_shared<Program>();
    program->body = chat_template_detail::parse_template_tokens(
        chat_template_detail::tokenize_template(std::move(source)), program->has_generation);
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
  return chat_template_detail::render_values(*program_, from_json(messages), context,
                                             std::move(tools));
}

Result<std::vector<ChatPiece>> ChatTemplate::render(
    const nlohmann::ordered_json& messages, const ChatTemplateContext& context,
    const std::optional<nlohmann::ordered_json>& tools) const {
  std::optional<Value> tool_values;
  if (tools)
    tool_values = from_json(*tools);
  else if (context.tools)
    tool_values = from_json(*context.tools);
  return chat_template_detail::render_values(*program_, from_json(messages), context,
                                             std::move(tool_values));
}

}  // namespace strata
