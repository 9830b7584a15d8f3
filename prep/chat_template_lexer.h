// The chat-template lexer: a template's text as tokens, with jinja2's
// whitespace rules (trim_blocks, lstrip_blocks, `-` markers) applied and its
// line breaks normalized. Internal to prep/chat_template*.cpp.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace strata::chat_template_detail {

enum class Tok {
  data,
  variable_begin,
  variable_end,
  block_begin,
  block_end,
  name,
  string,
  integer,
  floating,
  op,
  end
};

struct Token {
  Tok type;
  std::string text;  // data; a name; a string's value; an operator; a number's digits
  int line;
};

// The template's tokens, ending with Tok::end; a RenderError names the line
// of anything it cannot read.
std::vector<Token> tokenize_template(std::string source);

// A decimal integer literal's value; a RenderError when it is out of range.
int64_t parse_integer(const std::string& digits, int line);

}  // namespace strata::chat_template_detail
