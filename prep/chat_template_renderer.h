// The chat-template renderer: a parsed template run over a conversation, as
// pieces of text that are targets or not (chat_template.h states the rule).
// Internal to prep/chat_template*.cpp.
#pragma once

#include <optional>
#include <vector>

#include "io/base/status.h"
#include "prep/chat_template.h"
#include "prep/chat_template_parser.h"
#include "prep/chat_template_value.h"

namespace strata::chat_template_detail {

// `messages` as a Value (a list of dicts), rendered with `program`.
Result<std::vector<ChatPiece>> render_values(const ChatTemplate::Program& program, Value messages,
                                             const ChatTemplateContext& context,
                                             std::optional<Value> tools);

}  // namespace strata::chat_template_detail
