// A byte-level BPE tokenizer read from a Hugging Face `tokenizer.json`, giving
// the ids the `tokenizers` library gives for the same text (Tokenizer.encode).
//
// What it reads (anything else is refused in one line naming the key):
//  - model: type BPE with vocab and merges (the "a b" string form or the
//    ["a", "b"] array form), ignore_merges (true, as Llama 3 sets it: a whole
//    pre-token found in the vocabulary is one token), no dropout, no
//    byte_fallback, no subword prefix or suffix.
//  - added_tokens: matched in the text before anything else, leftmost and
//    longest first, each becoming its own id (special or not); those with
//    normalized=false on the raw text, the others on the normalized text.
//    lstrip, rstrip and single_word must be false.
//  - normalizer: null or NFC (through ICU), alone or in a Sequence.
//  - pre_tokenizer: ByteLevel (add_prefix_space false) with use_regex true
//    (GPT-2's pattern), or a Sequence of Split(Regex, Isolated, invert false)
//    steps and a ByteLevel with use_regex false (Llama 3, Qwen2). Patterns run
//    in Oniguruma, the library `tokenizers` uses, so \p{L}, (?i:...) and
//    lookaheads mean the same.
//  - post_processor: null, ByteLevel, TemplateProcessing (its `single`
//    template: special tokens around $A, like Llama 3's <|begin_of_text|>), or
//    a Sequence of those; truncation and padding must be null.
//
// BPE merges the adjacent pair of lowest rank first (the leftmost on ties),
// as `tokenizers` does, with a cache of recent words. A Tokenizer is not
// thread-safe (the cache); copies are independent.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "io/base/status.h"
#include "io/file_system.h"

namespace strata {

// A token and the bytes [begin, end) of the text it came from.
struct TokenSpan {
  uint32_t id = 0;
  uint64_t begin = 0;
  uint64_t end = 0;
};

struct TokenizerTables;  // tokenizer.cpp: what a tokenizer.json holds, shared by copies

class Tokenizer {
 public:
  // `path` names a tokenizer.json, read through `file_system`. Errors name the
  // file and the key: a missing file is not_found, a malformed one
  // corruption, one asking for what strata does not read invalid_argument.
  static Result<Tokenizer> load(const std::string& path,
                                io::FileSystem& file_system = io::FileSystem::real());
  // `json` is the text of a tokenizer.json; `origin` names it in errors.
  static Result<Tokenizer> parse(std::string_view json, const std::string& origin);

  // Highest id (vocabulary or added token) + 1.
  int64_t vocab_size() const;
  // The id of an added token or a vocabulary entry given as written in
  // tokenizer.json (byte-level characters for the vocabulary: "Ġthe").
  std::optional<uint32_t> token_id(std::string_view content) const;
  // The ids the post-processor puts before and after a single sequence.
  const std::vector<uint32_t>& prefix_tokens() const;
  const std::vector<uint32_t>& suffix_tokens() const;

  // Tokenizer.encode(text, add_special_tokens) of `tokenizers`. `text` must be
  // valid UTF-8 (valid_utf8 says where it is not).
  std::vector<uint32_t> encode(std::string_view text, bool add_special_tokens = true);

  // Calls progress(bytes) about every `every` bytes of a long text with the
  // bytes of it tokenized so far (for a progress line on a large document).
  void set_progress(std::function<void(uint64_t)> progress, uint64_t every = 1 << 20);

  // The normalizer alone (NFC or nothing).
  std::string normalize(std::string_view text) const;
  // The tokens of already normalized text, added tokens included, each with
  // its byte range in `normalized`; no post-processor tokens. Appends to `out`.
  // encode(t, false) equals the ids of encode_normalized(normalize(t)) except
  // where NFC changes an added token's text or joins characters across one.
  void encode_normalized(std::string_view normalized, std::vector<TokenSpan>& out);

 private:
  void encode_added_free(std::string_view text, uint64_t base, std::vector<TokenSpan>& out);
  void encode_word(std::string_view word, uint64_t base, std::vector<TokenSpan>& out);
  void split_on_added(std::string_view text, uint64_t base, bool normalized_pass,
                      std::vector<TokenSpan>& out);

  std::shared_ptr<const TokenizerTables> tables_;
  std::unordered_map<std::string, std::vector<uint32_t>> cache_;  // word bytes -> ids
  std::function<void(uint64_t)> progress_;
  uint64_t progress_every_ = 0, next_progress_ = 0;
};

// The byte offset of the first invalid UTF-8 sequence in `text`, or nothing.
std::optional<uint64_t> invalid_utf8_offset(std::string_view text);

}  // namespace strata
