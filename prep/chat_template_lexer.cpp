// The chat-template lexer (chat_template_lexer.h).
#include "prep/chat_template_lexer.h"

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

#include "prep/chat_template_value.h"

namespace strata::chat_template_detail {

int64_t parse_integer(const std::string& digits, int line) {
  int64_t v = 0;
  auto result = std::from_chars(digits.data(), digits.data() + digits.size(), v);
  if (result.ec != std::errc() || result.ptr != digits.data() + digits.size())
    fail(line, "integer " + digits + " is out of range");
  return v;
}

namespace {

// Python's unicode-escape decoding of a string literal's body, as jinja2 does.
std::string unescape(std::string_view body, int line) {
  std::string out;
  for (size_t k = 0; k < body.size(); ++k) {
    char c = body[k];
    if (c != '\\' || k + 1 == body.size()) {
      out.push_back(c);
      continue;
    }
    char e = body[++k];
    switch (e) {
      case 'n':
        out.push_back('\n');
        break;
      case 't':
        out.push_back('\t');
        break;
      case 'r':
        out.push_back('\r');
        break;
      case '\\':
        out.push_back('\\');
        break;
      case '\'':
        out.push_back('\'');
        break;
      case '"':
        out.push_back('"');
        break;
      case 'a':
        out.push_back('\a');
        break;
      case 'b':
        out.push_back('\b');
        break;
      case 'f':
        out.push_back('\f');
        break;
      case 'v':
        out.push_back('\v');
        break;
      case '\n':
        break;  // a line continuation
      case 'x':
      case 'u':
      case 'U': {
        size_t digits = e == 'x' ? 2 : e == 'u' ? 4 : 8;
        if (k + digits >= body.size())
          fail(line, "truncated \\" + std::string(1, e) + " escape in a string literal");
        std::string hex(body.substr(k + 1, digits));
        for (char h : hex)
          if (!std::isxdigit(static_cast<unsigned char>(h)))
            fail(line, "malformed \\" + std::string(1, e) + " escape in a string literal");
        unsigned long code = std::stoul(hex, nullptr, 16);
        if (code > 0x10ffff) fail(line, "\\U escape beyond U+10FFFF in a string literal");
        append_utf8(out, static_cast<char32_t>(code));
        k += digits;
        break;
      }
      default:
        if (e >= '0' && e <= '7') {
          unsigned value = 0;
          size_t count = 0;
          while (count < 3 && k < body.size() && body[k] >= '0' && body[k] <= '7') {
            value = value * 8 + static_cast<unsigned>(body[k] - '0');
            ++k;
            ++count;
          }
          --k;
          append_utf8(out, value);
        } else {
          out.push_back('\\');  // Python keeps an unknown escape as written
          out.push_back(e);
        }
    }
  }
  return out;
}

class Lexer {
 public:
  explicit Lexer(std::string source) : source_(std::move(source)) {
    // jinja2 reads "\r\n" and "\r" as "\n" and drops one trailing newline.
    std::string normalized;
    normalized.reserve(source_.size());
    for (size_t k = 0; k < source_.size(); ++k) {
      if (source_[k] == '\r') {
        normalized.push_back('\n');
        if (k + 1 < source_.size() && source_[k + 1] == '\n') ++k;
      } else {
        normalized.push_back(source_[k]);
      }
    }
    if (!normalized.empty() && normalized.back() == '\n') normalized.pop_back();
    source_ = std::move(normalized);
  }

  std::vector<Token> tokenize() {
    std::vector<Token> tokens;
    size_t pos = 0;
    bool line_starting = true;
    while (pos < source_.size()) {
      size_t open = find_open(pos);
      std::string text =
          source_.substr(pos, (open == std::string::npos ? source_.size() : open) - pos);
      if (open == std::string::npos) {
        if (!text.empty()) tokens.push_back({Tok::data, text, line_at(pos)});
        break;
      }
      char kind = source_[open + 1];  // '{', '%' or '#'
      size_t after = open + 2;
      char sign = after < source_.size() && (source_[after] == '-' || source_[after] == '+')
                      ? source_[after]
                      : 0;
      if (sign) ++after;
      if (sign == '-') {
        std::u32string wide = decode_utf8(text);
        text = encode_utf8(strip_chars(wide, false, true, nullptr));
      } else if (sign != '+' && kind != '{') {
        // lstrip_blocks: a block or comment alone on its line loses the indent.
        size_t line_begin = text.rfind('\n');
        line_begin = line_begin == std::string::npos ? 0 : line_begin + 1;
        if (line_begin > 0 || line_starting) {
          bool blank = std::all_of(text.begin() + static_cast<long>(line_begin), text.end(),
                                   [](char c) { return c == ' ' || c == '\t'; });
          if (blank) text.resize(line_begin);
        }
      }
      if (!text.empty()) tokens.push_back({Tok::data, text, line_at(pos)});
      int line = line_at(open);
      if (kind == '#') {
        pos = lex_comment(after, line, line_starting);
        continue;
      }
      tokens.push_back({kind == '{' ? Tok::variable_begin : Tok::block_begin, "", line});
      pos = lex_tag(after, kind == '{', tokens, line_starting);
    }
    tokens.push_back({Tok::end, "", line_at(source_.size())});
    return tokens;
  }

 private:
  size_t find_open(size_t pos) const {
    while (true) {
      size_t k = source_.find('{', pos);
      if (k == std::string::npos || k + 1 >= source_.size()) return std::string::npos;
      char next = source_[k + 1];
      if (next == '{' || next == '%' || next == '#') return k;
      pos = k + 1;
    }
  }

  int line_at(size_t pos) {
    while (counted_ < pos && counted_ < source_.size()) {
      if (source_[counted_] == '\n') ++lines_;
      ++counted_;
    }
    return lines_;
  }

  // After a closing `-%}`, `-}}` or `-#}`: all whitespace goes; after `%}` or
  // `#}` (trim_blocks): one newline.
  size_t skip_after_close(size_t pos, bool strip_all, bool trim_newline, bool& line_starting) {
    size_t start = pos;
    if (strip_all) {
      while (pos < source_.size()) {
        std::u32string next = decode_utf8(std::string_view(source_).substr(pos, 4));
        if (!is_python_space(next[0])) break;
        pos += encode_utf8(next.substr(0, 1)).size();
      }
    } else if (trim_newline && pos < source_.size() && source_[pos] == '\n') {
      ++pos;
    }
    line_starting = pos > start && source_[pos - 1] == '\n';
    return pos;
  }

  size_t lex_comment(size_t pos, int line, bool& line_starting) {
    size_t close = source_.find("#}", pos);
    if (close == std::string::npos) fail(line, "comment {# is never closed with #}");
    char sign = close > pos && (source_[close - 1] == '-' || source_[close - 1] == '+')
                    ? source_[close - 1]
                    : 0;
    return skip_after_close(close + 2, sign == '-', sign == 0, line_starting);
  }

  size_t lex_tag(size_t pos, bool variable, std::vector<Token>& tokens, bool& line_starting) {
    const std::string close = variable ? "}}" : "%}";
    int depth = 0;
    int open_line = line_at(pos);
    while (true) {
      while (pos < source_.size() && std::isspace(static_cast<unsigned char>(source_[pos]))) ++pos;
      if (pos >= source_.size())
        fail(open_line, std::string(variable ? "{{" : "{%") + " is never closed with " + close);
      int line = line_at(pos);
      if (depth == 0) {
        if (source_.compare(pos, 3, "-" + close) == 0) {
          tokens.push_back({variable ? Tok::variable_end : Tok::block_end, "", line});
          return skip_after_close(pos + 3, true, false, line_starting);
        }
        if (!variable && source_.compare(pos, 3, "+" + close) == 0) {
          tokens.push_back({Tok::block_end, "", line});
          line_starting = false;
          return pos + 3;
        }
        if (source_.compare(pos, 2, close) == 0) {
          tokens.push_back({variable ? Tok::variable_end : Tok::block_end, "", line});
          return skip_after_close(pos + 2, false, !variable, line_starting);
        }
      }
      char c = source_[pos];
      if (std::isalpha(static_cast<unsigned char>(c)) || c == '_') {
        size_t end = pos;
        while (end < source_.size() &&
               (std::isalnum(static_cast<unsigned char>(source_[end])) || source_[end] == '_'))
          ++end;
        tokens.push_back({Tok::name, source_.substr(pos, end - pos), line});
        pos = end;
      } else if (std::isdigit(static_cast<unsigned char>(c))) {
        size_t end = pos;
        bool is_float = false;
        auto digits = [&] {
          while (end < source_.size() &&
                 (std::isdigit(static_cast<unsigned char>(source_[end])) || source_[end] == '_'))
            ++end;
        };
        digits();
        bool after_dot =
            !tokens.empty() && tokens.back().type == Tok::op && tokens.back().text == ".";
        if (!after_dot && end + 1 < source_.size() && source_[end] == '.' &&
            std::isdigit(static_cast<unsigned char>(source_[end + 1]))) {
          is_float = true;
          ++end;
          digits();
        }
        if (!after_dot && end < source_.size() && (source_[end] == 'e' || source_[end] == 'E')) {
          size_t exp = end + 1;
          if (exp < source_.size() && (source_[exp] == '+' || source_[exp] == '-')) ++exp;
          if (exp < source_.size() && std::isdigit(static_cast<unsigned char>(source_[exp]))) {
            is_float = true;
            end = exp;
            digits();
          }
        }
        std::string number;
        for (size_t k = pos; k < end; ++k)
          if (source_[k] != '_') number.push_back(source_[k]);
        tokens.push_back({is_float ? Tok::floating : Tok::integer, number, line});
        pos = end;
      } else if (c == '\'' || c == '"') {
        size_t end = pos + 1;
        while (end < source_.size() && source_[end] != c) {
          if (source_[end] == '\\') ++end;
          ++end;
        }
        if (end >= source_.size()) fail(line, "string literal is never closed");
        tokens.push_back({Tok::string,
                          unescape(std::string_view(source_).substr(pos + 1, end - pos - 1), line),
                          line});
        pos = end + 1;
      } else {
        static const char* const kOperators[] = {"//", "**", "==", "!=", "<=", ">=", "+", "-", "*",
                                                 "/",  "%",  "~",  "<",  ">",  "=",  "(", ")", "[",
                                                 "]",  "{",  "}",  ",",  ".",  ":",  "|", ";"};
        const char* found = nullptr;
        for (const char* op : kOperators) {
          if (source_.compare(pos, std::strlen(op), op) == 0) {
            found = op;
            break;
          }
        }
        if (!found) fail(line, std::string("unexpected character '") + c + "' in a tag");
        std::string op = found;
        if (op == "(" || op == "[" || op == "{") ++depth;
        if ((op == ")" || op == "]" || op == "}") && depth > 0) --depth;
        tokens.push_back({Tok::op, op, line});
        pos += op.size();
      }
    }
  }

  std::string source_;
  size_t counted_ = 0;
  int lines_ = 1;
};

}  // namespace

std::vector<Token> tokenize_template(std::string source) {
  Lexer lexer(std::move(source));
  return lexer.tokenize();
}

}  // namespace strata::chat_template_detail
