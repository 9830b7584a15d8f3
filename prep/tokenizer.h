// A BPE tokenizer read from a Hugging Face `tokenizer.json`, giving the ids
// the `tokenizers` library gives for the same text (Tokenizer.encode), and
// the text it gives back for ids (Tokenizer.decode).
//
// What it reads (anything else is refused in one line naming the key and its value):
//  - model: type BPE with vocab and merges (the "a b" string form or the
//    ["a", "b"] array form); ignore_merges (a whole pre-token found in the
//    vocabulary is one token, as Llama 3 sets it); unk_token, fuse_unk and
//    byte_fallback (a character the vocabulary lacks becomes its <0xAB> byte
//    tokens when all exist, else the unk token, runs of them one unk when
//    fuse_unk; without an unk token it is dropped, as `tokenizers` drops it,
//    and dropped_bytes() counts it). No dropout, no subword prefix or suffix.
//    Byte-level vocabularies (a ByteLevel pre-tokenizer) may lack bytes
//    (SmolLM's): those bytes take the unk token.
//  - added_tokens: matched leftmost and longest before anything else, each its
//    own id; normalized=false ones on the raw text, the others by their
//    normalized content on the normalized text between those; lstrip and
//    rstrip take the whitespace beside a match into it; single_word matches
//    only between non-word characters; special ones are left out of decode
//    when asked.
//  - normalizer: NFC, NFD, NFKC, NFKD, Lowercase (through ICU), Strip, Prepend,
//    Replace (String or Regex), or a Sequence of them.
//  - pre_tokenizer: ByteLevel (add_prefix_space, use_regex: GPT-2's pattern),
//    Metaspace (replacement, prepend_scheme always/first/never or the older
//    add_prefix_space, split), Split (String or Regex, any behaviour, invert),
//    Digits, Punctuation, Whitespace, WhitespaceSplit, or a Sequence of them in
//    any order; steps after ByteLevel see its characters, as in `tokenizers`.
//    Patterns run in Oniguruma, the library `tokenizers` uses, so \p{L},
//    (?i:...) and lookaheads mean the same.
//  - post_processor: null, ByteLevel, TemplateProcessing (its `single`
//    template: special tokens around $A, like Llama 3's <|begin_of_text|> or a
//    BOS/EOS pair), or a Sequence of those; truncation and padding must be null.
//  - decoder: ByteLevel, Metaspace, Replace, ByteFallback, Fuse, Strip, or a
//    Sequence of them.
//
// BPE merges the adjacent pair of lowest rank first (the leftmost on ties),
// as `tokenizers` does, with a cache of recent words. A Tokenizer is not
// thread-safe (the cache, the counters); copies are independent.
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
#include "prep/tokenizer_text.h"

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
  // The text of a token as tokenizer.json writes it ("Ġthe", "▁the",
  // "<0x0A>", "<|eot_id|>"), or nothing for an id the tokenizer lacks.
  std::optional<std::string> token_content(uint32_t id) const;
  // The model's unk token, when it has one.
  std::optional<uint32_t> unk_id() const;
  bool is_special(uint32_t id) const;
  // The ids the post-processor puts before and after a single sequence.
  const std::vector<uint32_t>& prefix_tokens() const;
  const std::vector<uint32_t>& suffix_tokens() const;

  // Tokenizer.encode(text, add_special_tokens) of `tokenizers`. `text` must be
  // valid UTF-8 (invalid_utf8_offset says where it is not).
  std::vector<uint32_t> encode(std::string_view text, bool add_special_tokens = true);

  // Calls progress(bytes) about every `every` bytes of a long text with the
  // bytes of it tokenized so far (for a progress line on a large document).
  void set_progress(std::function<void(uint64_t)> progress, uint64_t every = 1 << 20);

  // encode's tokens, each with the bytes [begin, end) of `text` its
  // characters came from (a token made by a normalizer or pre-tokenizer, a
  // prepended "▁", comes from the character beside it; the post-processor's
  // tokens have empty ranges at the ends). Appends to `out`.
  void encode_spans(std::string_view text, bool add_special_tokens, std::vector<TokenSpan>& out);

  // Tokenizer.decode(ids, skip_special_tokens) of `tokenizers`: each id's
  // token through the decoder (ids the tokenizer lacks are left out, as there).
  std::string decode(const std::vector<uint32_t>& ids, bool skip_special_tokens = false) const;

  // Bytes of input that became no token (a character without a vocabulary
  // entry, byte fallback or unk token), counted since the tokenizer was made.
  uint64_t dropped_bytes() const { return dropped_bytes_; }

 private:
  void encode_normalized_gap(const tokenizer_text::AlignedText& gap, std::vector<TokenSpan>& out);
  void encode_piece(const tokenizer_text::AlignedText& piece, std::vector<TokenSpan>& out);
  // The ids and lengths (bytes of the piece) BPE gives a piece.
  const std::vector<std::pair<uint32_t, uint32_t>>& model_tokens(const std::string& piece);

  std::shared_ptr<const TokenizerTables> tables_;
  std::unordered_map<std::string, std::vector<std::pair<uint32_t, uint32_t>>> cache_;
  std::vector<std::pair<uint32_t, uint32_t>> uncached_;  // a long word's tokens
  uint64_t dropped_bytes_ = 0;
  std::function<void(uint64_t)> progress_;
  uint64_t progress_every_ = 0, next_progress_ = 0;
};

// The byte offset of the first invalid UTF-8 sequence in `text`, or nothing.
std::optional<uint64_t> invalid_utf8_offset(std::string_view text);

}  // namespace strata
