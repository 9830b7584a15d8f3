// Token files for training, read through mmap, in the order that a
// SequenceOrder (core/data/sequence_order.h) states: by default sequential.
//
// Formats:
//  - nanoGPT: a headerless array of uint16 tokens (train.bin / val.bin).
//  - llm.c shards: a header of 256 int32 (magic, version, token count, ...)
//    then the tokens; magic 20240520 means uint16 tokens, 20240801 uint32.
//  - raw uint32: a headerless array of uint32 tokens; only on request
//    (TokenFormat::raw_uint32), since it cannot be told apart from nanoGPT's.
// `automatic` picks llm.c when the file starts with one of its magics and
// nanoGPT otherwise. A file whose size does not fit its format, an llm.c
// header whose token count disagrees with the file size, or a token outside
// the vocabulary is refused with the file name and the reason: a missing file
// is not_found, a file whose size or header does not fit its format
// corruption, a file too short to train on or a token outside the vocabulary
// invalid_argument, a failed read an I/O error.
//
// Sequence j is tokens [j*T, j*T + T + 1): inputs are the first T, targets
// the last T. A loss mask (one byte per token, 0: that token is not a target)
// lives next to a token file under loss_mask_path's name; `strata train`
// turns the targets it masks into -1, which the loss does not count. A
// TokenFile is immutable once open and safe to read from many threads. It is
// opened, sized and mapped through an io::FileSystem (the kernel's unless one
// is given), which must outlive it.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "core/data/sequence_order.h"
#include "io/base/status.h"
#include "io/file_system.h"

namespace strata {

enum class TokenFormat { automatic, nanogpt_uint16, llmc, raw_uint32 };

// "auto", "nanogpt", "llmc" or "uint32".
Result<TokenFormat> parse_token_format(const std::string& text);
const char* token_format_name(TokenFormat format);

inline constexpr int32_t kLlmcMagicUint16 = 20240520;
inline constexpr int32_t kLlmcMagicUint32 = 20240801;
inline constexpr int64_t kLlmcHeaderInts = 256;

class TokenFile {
 public:
  static Result<TokenFile> open(const std::string& path,
                                TokenFormat format = TokenFormat::automatic,
                                io::FileSystem& file_system = io::FileSystem::real());

  const std::string& path() const { return path_; }
  TokenFormat format() const { return format_; }  // never automatic
  int64_t size() const { return tokens_; }        // tokens in the file
  int bytes_per_token() const { return token_bytes_; }
  uint32_t at(int64_t i) const;
  // Whole sequences of T + 1 tokens: (size - 1) / T.
  int64_t sequence_count(int64_t T) const { return T > 0 && tokens_ > 0 ? (tokens_ - 1) / T : 0; }

  // Sequence j (j < sequence_count(T)): inputs (T) and targets (T). Tokens at
  // or above vocab_size are an error naming the file and the token's position.
  Status read_sequence(int64_t j, int64_t T, int64_t vocab_size, int32_t* inputs,
                       int32_t* targets) const;
  // Tells the kernel the sequences will be read out of order (a shuffled
  // SequenceOrder), so it stops reading ahead for the file's order it was told at open.
  void expect_random_access() const;

 private:
  struct Mapping;
  static Result<std::shared_ptr<Mapping>> map_file(const std::string& path,
                                                   io::FileSystem& file_system);
  std::string path_;
  TokenFormat format_ = TokenFormat::nanogpt_uint16;
  std::shared_ptr<Mapping> mapping_;
  const unsigned char* tokens_begin_ = nullptr;
  int64_t tokens_ = 0;
  int token_bytes_ = 2;
};

// Where the loss mask of a token file lives: the same name with the extension
// .mask ("data/train.bin" -> "data/train.mask"; "train" -> "train.mask").
std::string loss_mask_path(const std::string& token_path);

// The sequence that row b of micro-batch `micro` on rank `rank` reads in
// `order`: order.sequence(batch_position(offset, micro, rank, world, B, b), sequences).
int64_t sequence_index(const SequenceOrder& order, int64_t offset, int64_t micro, int64_t rank,
                       int64_t world, int64_t B, int64_t b, int64_t sequences);
// The same in the sequential order: (offset + (micro * world + rank) * B + b) mod sequences.
int64_t sequence_index(int64_t offset, int64_t micro, int64_t rank, int64_t world, int64_t B,
                       int64_t b, int64_t sequences);

// One micro-batch in `order`: inputs (B, T) and targets (B, T).
Status read_micro_batch(const TokenFile& file, const SequenceOrder& order, int64_t offset,
                        int64_t micro, int64_t rank, int64_t world, int64_t B, int64_t T,
                        int64_t vocab_size, int32_t* inputs, int32_t* targets);
// The same in the sequential order.
Status read_micro_batch(const TokenFile& file, int64_t offset, int64_t micro, int64_t rank,
                        int64_t world, int64_t B, int64_t T, int64_t vocab_size, int32_t* inputs,
                        int32_t* targets);

}  // namespace strata
