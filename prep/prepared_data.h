// What `strata prepare-data` makes: documents turned into token ids and a
// loss mask, written as a token file that TokenFile reads and a mask file
// next to it that `strata train` picks up.
//
// Files: `<name>.bin` is an llm.c shard (a 256-int32 header, then the tokens):
// uint16 tokens (magic 20240520, version 1) when every id of the vocabulary
// fits, else uint32 (magic 20240801, version 7), as llm.c writes Llama 3's.
// `<name>.mask` (loss_mask_path) holds one byte per token: 1 when the token
// counts as a target (predicting it is in the loss), 0 when not.
//
// Chat: a rendered conversation arrives as pieces of text, each a target or
// not. Tokenizing piece by piece would differ from tokenizing the text (BPE
// and the pre-tokenizer's regex join characters across piece boundaries: a
// space or newline before a word, a digit run), so the whole text is
// tokenized once and each token's bytes are looked up among the pieces: a
// token is a target when any of its bytes comes from a target piece (the
// model has to produce that token to produce the assistant's text). The
// normalizer (NFC) runs on each piece before they are joined, so a piece
// boundary never moves; it differs from normalizing the whole text only where
// a combining mark starts a piece.
//
// A TokenStream is a plain value; not thread-safe.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "io/base/status.h"
#include "prep/tokenizer.h"

namespace strata {

// The tokens of one output file (train or validation) and their mask.
struct TokenStream {
  std::vector<uint32_t> tokens;
  std::vector<uint8_t> mask;  // (tokens.size()): 1 target, 0 not
  int64_t documents = 0;
  int64_t targets() const;
};

struct MarkedText {
  std::string text;
  bool target = false;
};

// Appends the tokens of the concatenated pieces (no post-processor tokens) and
// their mask by the rule above.
void append_marked_text(Tokenizer& tokenizer, const std::vector<MarkedText>& pieces,
                        TokenStream& out);

// 2 when ids below `vocab_size` fit in uint16, else 4.
int token_width(int64_t vocab_size);

// One output file: the stream and where it goes.
struct TokenOutput {
  const TokenStream* stream = nullptr;
  std::string path;  // <name>.bin; the mask goes to loss_mask_path(path)
};

// Writes every output's token file and mask into temporary files, then renames
// them all into place: an error before the renames leaves every target as it
// was. Refuses a stream of fewer than 2 tokens or more than llm.c's int32 count.
Status write_token_outputs(const std::vector<TokenOutput>& outputs, int token_width);

}  // namespace strata
