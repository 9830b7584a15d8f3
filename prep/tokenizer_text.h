// The text layer under prep/tokenizer.h, internal to the room: UTF-8, text
// that remembers where each of its bytes came from, the patterns a
// tokenizer.json names (Oniguruma regexes, literals, character classes), and
// the split behaviours of `tokenizers` (Removed, Isolated, MergedWithPrevious,
// MergedWithNext, Contiguous), each as `tokenizers` defines it.
//
// Offsets: an AlignedText's byte i came from the original text's bytes
// [begin_of(i), end_of(i)): the byte itself where the text was only copied,
// the whole stretch a normalizer rewrote (an NFC composition, a space
// replaced by "▁") where it was changed. Normalizers and pre-tokenizers keep
// that as they change the text, so a token can be traced back to the input's
// characters (the chat loss mask needs it). Text no step has changed holds no
// table: byte i came from base + i.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "io/base/status.h"

namespace strata::tokenizer_text {

// Decodes the code point at text[i], advancing i; nothing on invalid UTF-8.
std::optional<uint32_t> next_code_point(std::string_view text, size_t& i);
// The length of the UTF-8 sequence that starts at text[i] (1 for a stray byte).
size_t utf8_length_at(std::string_view text, size_t i);
void append_utf8(std::string& out, uint32_t code_point);
// Unicode's White_Space property: Rust's char::is_whitespace, which
// `tokenizers` uses for Strip, WhitespaceSplit and the added tokens' lstrip.
bool is_whitespace(uint32_t code_point);
// Rust's String::from_utf8_lossy: each maximal invalid subsequence becomes U+FFFD.
std::string lossy_utf8(std::string_view bytes);

struct AlignedText {
  std::string text;
  // (text.size()) each, offsets from base; both empty: byte i is [base + i, base + i + 1)
  std::vector<uint32_t> begin, end;
  uint64_t base = 0;

  bool identity() const { return begin.empty(); }
  uint64_t begin_of(size_t i) const { return base + (identity() ? i : begin[i]); }
  uint64_t end_of(size_t i) const { return base + (identity() ? i + 1 : end[i]); }
  AlignedText slice(size_t from, size_t to) const;
};

// A pattern's match in a text, or the gap between two matches: `tokenizers`'
// find_matches, which covers the whole text in order.
struct Match {
  size_t begin = 0, end = 0;
  bool is_match = false;
};

// An Oniguruma regex (the library `tokenizers` uses, so \p{L}, (?i:...) and
// lookaheads mean the same), compiled once and shared by a tokenizer's copies;
// searching is thread-safe.
class Regex {
 public:
  static Result<std::shared_ptr<const Regex>> compile(const std::string& source);
  Regex(const Regex&) = delete;
  Regex& operator=(const Regex&) = delete;
  ~Regex();
  // Matches and gaps; an empty match splits nothing.
  std::vector<Match> find_matches(std::string_view text) const;

 private:
  Regex() = default;
  void* regex_ = nullptr;  // OnigRegex, kept out of this header
};

// Each occurrence of `literal`, left to right, not overlapping.
std::vector<Match> find_literal(std::string_view text, std::string_view literal);
// Each character for which `is_match` holds is a match of its own.
std::vector<Match> find_characters(std::string_view text,
                                   const std::function<bool(uint32_t)>& is_match);

enum class SplitBehavior { removed, isolated, merged_with_previous, merged_with_next, contiguous };
std::optional<SplitBehavior> split_behavior_named(std::string_view name);

// `tokenizers`' NormalizedString::split: the pieces the matches cut `text`
// into under `behavior` (inverted first when `invert`), empty pieces left out.
void split_text(const AlignedText& text, std::vector<Match> matches, SplitBehavior behavior,
                bool invert, std::vector<AlignedText>& out);

// Each match replaced by `content`, whose bytes come from the match.
AlignedText replace_matches(const AlignedText& text, const std::vector<Match>& matches,
                            std::string_view content);
// `prefix` before the text, its bytes from the text's first byte (as
// `tokenizers` aligns a prepended string with the first character).
AlignedText prepend(const AlignedText& text, std::string_view prefix);
// Leading and trailing whitespace (is_whitespace) removed.
AlignedText strip_whitespace(const AlignedText& text, bool left, bool right);

// A rewrite of the text as a list of edits: source range [source_begin,
// source_end) of the input became output range [output_begin, output_end).
// Builds the result's origin table from the input's.
struct TextEdit {
  size_t source_begin, source_end, output_begin, output_end;
};
AlignedText apply_edits(const AlignedText& text, std::string output,
                        const std::vector<TextEdit>& edits);

}  // namespace strata::tokenizer_text
