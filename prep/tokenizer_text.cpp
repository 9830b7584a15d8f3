#include "prep/tokenizer_text.h"

#include <fmt/format.h>
// Oniguruma would otherwise define UChar, which ICU declares too.
#define ONIG_ESCAPE_UCHAR_COLLISION
#include <oniguruma.h>

#include <algorithm>
#include <mutex>

namespace strata::tokenizer_text {

std::optional<uint32_t> next_code_point(std::string_view text, size_t& i) {
  const auto byte = [&](size_t k) { return static_cast<unsigned char>(text[k]); };
  const unsigned char lead = byte(i);
  if (lead < 0x80) {
    ++i;
    return lead;
  }
  int length = 0;
  uint32_t cp = 0;
  if ((lead & 0xE0) == 0xC0) {
    length = 2;
    cp = lead & 0x1F;
  } else if ((lead & 0xF0) == 0xE0) {
    length = 3;
    cp = lead & 0x0F;
  } else if ((lead & 0xF8) == 0xF0) {
    length = 4;
    cp = lead & 0x07;
  } else {
    return std::nullopt;
  }
  if (i + length > text.size()) return std::nullopt;
  for (int k = 1; k < length; ++k) {
    if ((byte(i + k) & 0xC0) != 0x80) return std::nullopt;
    cp = (cp << 6) | (byte(i + k) & 0x3F);
  }
  static constexpr uint32_t kMinimum[5] = {0, 0, 0x80, 0x800, 0x10000};
  if (cp < kMinimum[length] || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return std::nullopt;
  i += length;
  return cp;
}

size_t utf8_length_at(std::string_view text, size_t i) {
  const unsigned char lead = static_cast<unsigned char>(text[i]);
  const size_t length = lead < 0x80 ? 1 : (lead & 0xE0) == 0xC0 ? 2 : (lead & 0xF0) == 0xE0 ? 3 : 4;
  return std::min(length, text.size() - i);
}

void append_utf8(std::string& out, uint32_t cp) {
  if (cp < 0x80) {
    out.push_back(char(cp));
  } else if (cp < 0x800) {
    out.push_back(char(0xC0 | (cp >> 6)));
    out.push_back(char(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out.push_back(char(0xE0 | (cp >> 12)));
    out.push_back(char(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(char(0x80 | (cp & 0x3F)));
  } else {
    out.push_back(char(0xF0 | (cp >> 18)));
    out.push_back(char(0x80 | ((cp >> 12) & 0x3F)));
    out.push_back(char(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(char(0x80 | (cp & 0x3F)));
  }
}

bool is_whitespace(uint32_t cp) {
  if (cp <= 0x20) return cp == 0x20 || (cp >= 0x09 && cp <= 0x0D);
  if (cp < 0x85) return false;
  return cp == 0x85 || cp == 0xA0 || cp == 0x1680 || (cp >= 0x2000 && cp <= 0x200A) ||
         cp == 0x2028 || cp == 0x2029 || cp == 0x202F || cp == 0x205F || cp == 0x3000;
}

std::string lossy_utf8(std::string_view bytes) {
  const auto byte = [&](size_t k) { return static_cast<unsigned char>(bytes[k]); };
  std::string out;
  out.reserve(bytes.size());
  size_t i = 0;
  while (i < bytes.size()) {
    const unsigned char lead = byte(i);
    if (lead < 0x80) {
      out.push_back(char(lead));
      ++i;
      continue;
    }
    // The length a lead byte announces and the range its second byte must be in
    // (Unicode's table of well-formed sequences).
    size_t length = 0;
    unsigned char low = 0x80, high = 0xBF;
    if (lead >= 0xC2 && lead <= 0xDF) {
      length = 2;
    } else if (lead >= 0xE0 && lead <= 0xEF) {
      length = 3;
      if (lead == 0xE0) low = 0xA0;
      if (lead == 0xED) high = 0x9F;
    } else if (lead >= 0xF0 && lead <= 0xF4) {
      length = 4;
      if (lead == 0xF0) low = 0x90;
      if (lead == 0xF4) high = 0x8F;
    }
    size_t valid = 1;  // bytes of the sequence seen to be well formed
    if (length > 0 && i + 1 < bytes.size() && byte(i + 1) >= low && byte(i + 1) <= high) {
      valid = 2;
      while (valid < length && i + valid < bytes.size() && (byte(i + valid) & 0xC0) == 0x80)
        ++valid;
    }
    if (length > 0 && valid == length) {
      out.append(bytes.substr(i, length));
    } else {
      out += "\xEF\xBF\xBD";  // U+FFFD for the maximal invalid subsequence
    }
    i += valid;
  }
  return out;
}

AlignedText AlignedText::slice(size_t from, size_t to) const {
  AlignedText out;
  out.text = text.substr(from, to - from);
  out.base = base;
  if (identity()) {
    out.base = base + from;
  } else {
    out.begin.assign(begin.begin() + std::ptrdiff_t(from), begin.begin() + std::ptrdiff_t(to));
    out.end.assign(end.begin() + std::ptrdiff_t(from), end.begin() + std::ptrdiff_t(to));
  }
  return out;
}

namespace {

uint32_t relative_begin(const AlignedText& text, size_t i) {
  return text.identity() ? uint32_t(i) : text.begin[i];
}
uint32_t relative_end(const AlignedText& text, size_t i) {
  return text.identity() ? uint32_t(i + 1) : text.end[i];
}

}  // namespace

Result<std::shared_ptr<const Regex>> Regex::compile(const std::string& source) {
  static std::once_flag initialised;
  std::call_once(initialised, [] {
    OnigEncoding encodings[1] = {ONIG_ENCODING_UTF8};
    onig_initialize(encodings, 1);
  });
  std::shared_ptr<Regex> regex(new Regex());
  OnigErrorInfo info;
  OnigRegex compiled = nullptr;
  const auto* begin = reinterpret_cast<const OnigUChar*>(source.data());
  const int r = onig_new(&compiled, begin, begin + source.size(), ONIG_OPTION_NONE,
                         ONIG_ENCODING_UTF8, ONIG_SYNTAX_DEFAULT, &info);
  if (r != ONIG_NORMAL) {
    OnigUChar message[ONIG_MAX_ERROR_MESSAGE_LEN];
    onig_error_code_to_str(message, r, &info);
    return Status::error(fmt::format("the pattern /{}/ does not compile: {}", source,
                                     reinterpret_cast<const char*>(message)));
  }
  regex->regex_ = compiled;
  return std::shared_ptr<const Regex>(std::move(regex));
}

Regex::~Regex() {
  if (regex_ != nullptr) onig_free(static_cast<OnigRegex>(regex_));
}

std::vector<Match> Regex::find_matches(std::string_view text) const {
  // The matches as the `onig` crate's find_iter yields them: an empty match
  // right where the previous match ended is skipped by moving one character on.
  std::vector<Match> out;
  OnigRegion* region = onig_region_new();
  const auto* str = reinterpret_cast<const OnigUChar*>(text.data());
  const OnigUChar* end = str + text.size();
  size_t search_from = 0, previous = 0;
  std::optional<size_t> last_match_end;
  while (search_from <= text.size()) {
    const int r = onig_search(static_cast<OnigRegex>(regex_), str, end, str + search_from, end,
                              region, ONIG_OPTION_NONE);
    if (r < 0) break;  // ONIG_MISMATCH (or an error, which a compiled pattern does not raise)
    const size_t match_begin = size_t(region->beg[0]), match_end = size_t(region->end[0]);
    if (match_begin == match_end && last_match_end == match_end) {
      search_from += search_from < text.size() ? utf8_length_at(text, search_from) : 1;
      continue;
    }
    if (match_begin > previous) out.push_back({previous, match_begin, false});
    out.push_back({match_begin, match_end, true});
    previous = match_end;
    search_from = match_end;
    last_match_end = match_end;
  }
  if (previous < text.size()) out.push_back({previous, text.size(), false});
  onig_region_free(region, 1);
  return out;
}

std::vector<Match> find_literal(std::string_view text, std::string_view literal) {
  std::vector<Match> out;
  if (literal.empty()) {
    if (!text.empty()) out.push_back({0, text.size(), false});
    return out;
  }
  size_t previous = 0;
  for (size_t at = text.find(literal); at != std::string_view::npos;
       at = text.find(literal, at + literal.size())) {
    if (at > previous) out.push_back({previous, at, false});
    out.push_back({at, at + literal.size(), true});
    previous = at + literal.size();
  }
  if (previous < text.size()) out.push_back({previous, text.size(), false});
  return out;
}

std::vector<Match> find_characters(std::string_view text,
                                   const std::function<bool(uint32_t)>& is_match) {
  std::vector<Match> out;
  size_t previous = 0, i = 0;
  while (i < text.size()) {
    const size_t at = i;
    const std::optional<uint32_t> cp = next_code_point(text, i);
    if (!cp) {
      i = at + 1;  // callers pass valid UTF-8; a stray byte matches nothing
      continue;
    }
    if (is_match(*cp)) {
      if (at > previous) out.push_back({previous, at, false});
      out.push_back({at, i, true});
      previous = i;
    }
  }
  if (previous < text.size()) out.push_back({previous, text.size(), false});
  return out;
}

std::optional<SplitBehavior> split_behavior_named(std::string_view name) {
  if (name == "Removed") return SplitBehavior::removed;
  if (name == "Isolated") return SplitBehavior::isolated;
  if (name == "MergedWithPrevious") return SplitBehavior::merged_with_previous;
  if (name == "MergedWithNext") return SplitBehavior::merged_with_next;
  if (name == "Contiguous") return SplitBehavior::contiguous;
  return std::nullopt;
}

void split_text(const AlignedText& text, std::vector<Match> matches, SplitBehavior behavior,
                bool invert, std::vector<AlignedText>& out) {
  if (invert)
    for (Match& m : matches) m.is_match = !m.is_match;
  struct Piece {
    size_t begin, end;
    bool keep;
  };
  std::vector<Piece> pieces;
  pieces.reserve(matches.size());
  bool previous_match = false;
  switch (behavior) {
    case SplitBehavior::isolated:
      for (const Match& m : matches) pieces.push_back({m.begin, m.end, true});
      break;
    case SplitBehavior::removed:
      for (const Match& m : matches) pieces.push_back({m.begin, m.end, !m.is_match});
      break;
    case SplitBehavior::contiguous:
      for (const Match& m : matches) {
        if (m.is_match == previous_match && !pieces.empty())
          pieces.back().end = m.end;
        else
          pieces.push_back({m.begin, m.end, true});
        previous_match = m.is_match;
      }
      break;
    case SplitBehavior::merged_with_previous:
      for (const Match& m : matches) {
        if (m.is_match && !previous_match && !pieces.empty())
          pieces.back().end = m.end;
        else
          pieces.push_back({m.begin, m.end, true});
        previous_match = m.is_match;
      }
      break;
    case SplitBehavior::merged_with_next:
      for (auto m = matches.rbegin(); m != matches.rend(); ++m) {
        if (m->is_match && !previous_match && !pieces.empty())
          pieces.back().begin = m->begin;
        else
          pieces.push_back({m->begin, m->end, true});
        previous_match = m->is_match;
      }
      std::reverse(pieces.begin(), pieces.end());
      break;
  }
  for (const Piece& piece : pieces)
    if (piece.keep && piece.end > piece.begin) out.push_back(text.slice(piece.begin, piece.end));
}

AlignedText replace_matches(const AlignedText& text, const std::vector<Match>& matches,
                            std::string_view content) {
  if (std::none_of(matches.begin(), matches.end(), [](const Match& m) { return m.is_match; }))
    return text;
  std::vector<TextEdit> edits;
  std::string output;
  output.reserve(text.text.size());
  for (const Match& m : matches) {
    if (!m.is_match) {
      output.append(text.text, m.begin, m.end - m.begin);
      continue;
    }
    const size_t at = output.size();
    output.append(content);
    edits.push_back({m.begin, m.end, at, output.size()});
  }
  return apply_edits(text, std::move(output), edits);
}

AlignedText prepend(const AlignedText& text, std::string_view prefix) {
  if (text.text.empty() || prefix.empty()) return text;
  std::string output;
  output.reserve(prefix.size() + text.text.size());
  output.append(prefix);
  output.append(text.text);
  return apply_edits(text, std::move(output), {{0, 0, 0, prefix.size()}});
}

AlignedText strip_whitespace(const AlignedText& text, bool left, bool right) {
  const std::string& s = text.text;
  size_t begin = 0, end = s.size();
  if (left) {
    size_t i = 0;
    while (i < s.size()) {
      const size_t at = i;
      std::optional<uint32_t> cp = next_code_point(s, i);
      if (!cp || !is_whitespace(*cp)) {
        begin = at;
        break;
      }
      begin = i;
    }
  }
  if (right) {
    while (end > begin) {
      size_t at = end - 1;
      while (at > begin && (static_cast<unsigned char>(s[at]) & 0xC0) == 0x80) --at;
      size_t i = at;
      std::optional<uint32_t> cp = next_code_point(s, i);
      if (!cp || !is_whitespace(*cp)) break;
      end = at;
    }
  }
  if (begin == 0 && end == s.size()) return text;
  return text.slice(begin, end);
}

AlignedText apply_edits(const AlignedText& text, std::string output,
                        const std::vector<TextEdit>& edits) {
  AlignedText out;
  out.base = text.base;
  out.begin.reserve(output.size());
  out.end.reserve(output.size());
  size_t source = 0;
  auto copy_through = [&](size_t until) {
    for (; source < until; ++source) {
      out.begin.push_back(relative_begin(text, source));
      out.end.push_back(relative_end(text, source));
    }
  };
  for (const TextEdit& edit : edits) {
    copy_through(edit.source_begin);
    // A rewritten stretch's bytes all come from the whole stretch; an
    // insertion's from the byte it is put before (or the last one, at the end).
    uint32_t from = 0, to = 0;
    if (edit.source_end > edit.source_begin) {
      from = relative_begin(text, edit.source_begin);
      to = relative_end(text, edit.source_end - 1);
    } else if (!text.text.empty()) {
      const size_t beside = std::min(edit.source_begin, text.text.size() - 1);
      from = relative_begin(text, beside);
      to = relative_end(text, beside);
    }
    out.begin.insert(out.begin.end(), edit.output_end - edit.output_begin, from);
    out.end.insert(out.end.end(), edit.output_end - edit.output_begin, to);
    source = edit.source_end;
  }
  copy_through(text.text.size());
  out.text = std::move(output);
  return out;
}

}  // namespace strata::tokenizer_text
