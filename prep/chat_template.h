// Chat templates: a conversation rendered to text the way Hugging Face
// `transformers` renders it, and which of that text the model is trained on.
//
// A model directory's chat template is a Jinja2 template (`chat_template` in
// tokenizer_config.json, or chat_template.jinja). `transformers` renders it
// with jinja2's ImmutableSandboxedEnvironment(trim_blocks=True,
// lstrip_blocks=True) and the loopcontrols extension, with `raise_exception`,
// `tojson` (json.dumps(x, ensure_ascii=False, indent=None, separators=None,
// sort_keys=False)) and the variables `messages`, `tools` and `documents` (none
// when not given), `add_generation_prompt`, `bos_token`, `eos_token`. ChatTemplate
// renders that same text, byte for byte, with its own interpreter of the part
// of Jinja2 that chat templates use (tests/chat_template_test.cpp compares it
// with jinja2 on the Llama 3 / 3.1, Qwen2.5, Qwen3, Mistral 7B v0.1 / v0.3
// and ChatML templates):
//  - `{{ }}`, `{% %}`, `{# #}`, whitespace control `-` and `+`, trim_blocks,
//    lstrip_blocks, and jinja2's removal of one trailing newline;
//  - if/elif/else; for (tuple targets, `if` filter, `else`, `loop.index`,
//    `index0`, `revindex`, `revindex0`, `first`, `last`, `length`,
//    `previtem`, `nextitem`), break, continue; set (a name, or `ns.attr` on a
//    `namespace()`); `{% generation %}` (see below);
//  - literals (strings, numbers, true/false/none, lists, tuples, dicts),
//    attribute and item access, slices, calls; `+ - * / // % **`, `~`, comparisons, `in`,
//    `not in`, `and`, `or`, `not`, `x if c else y`;
//  - filters abs, capitalize, count, d, default, first, float, int, items,
//    join, last, length, list, lower, map, reject, rejectattr, replace,
//    reverse, select, selectattr, string, title, tojson, trim, upper;
//  - tests boolean, callable, defined, divisibleby, eq, equalto, even, false,
//    float, ge, gt, in, integer, iterable, le, lower, lt, mapping, ne, none,
//    number, odd, sameas, sequence, string, true, undefined, upper (and
//    "==", "!=", "<", "<=", ">", ">=" as the test names select and reject
//    take);
//  - string methods strip, lstrip, rstrip, split, startswith, endswith,
//    lower, upper, title, capitalize, replace; dict methods items, keys,
//    values, get; globals range, namespace, dict, raise_exception.
// Anything else (macros, call blocks, includes, filter blocks, `set` blocks,
// unknown filters or tests, ...) is refused by parse() in one line naming the
// construct and its line. Python's str() of a list or dict is Python's repr;
// lower/upper/title change ASCII letters only; `strftime_now` is not defined
// (templates that test `strftime_now is defined` take their fixed date).
//
// Which text is a target (the loss mask): a template that wraps text in
// `{% generation %}...{% endgeneration %}` (transformers' assistant-mask tag)
// gets exactly that text as targets. The templates models ship lack the tag,
// so otherwise the rule is:
//   Every iteration of a `for` loop whose item is one of the conversation's
//   messages with role "assistant" (the loop may run over `messages`, a slice
//   of it or a list reversed: the item is recognised, not the expression) is
//   target from the end of the assistant header through the end of the
//   iteration's output, less trailing whitespace. The assistant header is the
//   text the template emits for add_generation_prompt (what a one-message
//   conversation gains when the flag is set, e.g. "<|im_start|>assistant\n",
//   "<|start_header_id|>assistant<|end_header_id|>\n\n"), when the iteration's
//   output starts with it (or holds it: then through its first occurrence);
//   a template without a generation prompt has no header, and a turn that
//   neither starts with nor holds the header is a target as a whole.
// So the reply, its tool calls and the end-of-turn text the template emits
// right after it in the same iteration ("<|eot_id|>", "<|im_end|>", "</s>")
// are targets; the role header before it, the newline after "<|im_end|>" and
// every other message are not. Why this rule: at inference the model is
// given the generation prompt and produces everything after it up to its
// end-of-turn token, so that is what it must learn; the rule reads the
// rendered text, not the template's variables, so it holds for replies,
// tool calls (whose text precedes any value taken from the message, as in
// '{"name": "' + name) and thinking alike, in every template above.
// A conversation with assistant messages none
// of which a loop visited (a template that indexes `messages[i]` in a `range`
// loop) is an error rather than a conversation trained on nothing; add
// generation tags to such a template.
//
// Key order: Python keeps a JSON object's keys in file order, and tojson and
// `items` show it. nlohmann::json sorts keys; the ordered_json overload of
// render keeps them, so callers that read conversations from files should
// parse them as nlohmann::ordered_json and use it.
//
// A ChatTemplate is immutable after parse and safe to render from many
// threads at once.
#pragma once

#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "io/base/status.h"

namespace strata {

struct ChatPiece {
  std::string text;
  bool target = false;  // produced by an assistant message (see the rule above)
};

struct ChatTemplateContext {
  std::string bos_token, eos_token;
  bool add_generation_prompt = false;
  std::optional<nlohmann::json> tools;  // absent: the template sees `tools` as none
};

class ChatTemplate {
 public:
  // Parses a template; refuses what the interpreter does not implement, in one
  // line: "chat template line N: ...".
  static Result<ChatTemplate> parse(std::string source);

  // The rendered conversation as pieces in order; their concatenation is the
  // text jinja2 renders. Adjacent pieces differ in `target`. Errors (a
  // template's raise_exception, an undefined value used in arithmetic, a
  // message that is not an object, ...) are one line naming the template line.
  Result<std::vector<ChatPiece>> render(const nlohmann::json& messages,
                                        const ChatTemplateContext& context) const;
  // The same, keeping the key order of the objects in `messages` and `tools`
  // (context.tools is ignored when `tools` is given).
  Result<std::vector<ChatPiece>> render(
      const nlohmann::ordered_json& messages, const ChatTemplateContext& context,
      const std::optional<nlohmann::ordered_json>& tools = std::nullopt) const;

  struct Program;  // the parsed template (chat_template_parser.h)

 private:
  explicit ChatTemplate(std::shared_ptr<const Program> program) : program_(std::move(program)) {}
  std::shared_ptr<const Program> program_;
};

}  // namespace strata
