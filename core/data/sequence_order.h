// The order in which training reads the sequences of a token file.
//
// Training consumes sequences by global position: position i is the i-th
// sequence read since the run began, counted over every rank and micro-batch
// (the engine's running sequence offset, which checkpoints store). Row b of
// micro-batch m on rank r of a step that starts at offset o reads position
// o + (m*W + r)*B + b (batch_position), so a step reads positions
// [o, o + G*W*B) however the world size, micro-batch and accumulation split
// its global batch.
//
// A SequenceOrder maps a position to one of the file's S whole sequences:
//  - sequential (the default): i mod S, the file's order, pass after pass;
//  - shuffled(seed): permutation_e(i mod S), e = i / S being the pass over
//    the data. permutation_e is a bijection on [0, S) and a function of
//    (seed, e, S) only, so every world size and batch split, and a run resumed
//    at any offset, read the same sequences at the same positions; each pass
//    draws a new permutation.
//
// The permutation is the swap-or-not shuffle (Hoang, Morris and Rogaway,
// 2012): each of 90 rounds draws a pivot p in [0, S) and pairs every index x
// with (p - x) mod S; a coin drawn for the pair decides whether the two swap.
// Every round is an involution, so the whole is a bijection on [0, S) for
// any S, with no table and no rounding of S up: O(1) memory, no set-up at the
// start of a pass or a resume however many sequences the file holds (a
// Fisher-Yates table would hold S entries in every process and cost a pass
// over them at every epoch and resume), about half a microsecond per
// sequence. Ethereum's consensus specification shuffles with the same
// algorithm and round count for the same reason, one index at a time, with
// SHA-256 coins; here pivots and coins come from splitmix64, defined in the
// .cpp with its constants, so every build and standard library draws the same
// order. A pseudorandom permutation, not a uniform draw among all S! orders:
// ample for the order of training data, not meant for cryptography.
//
// Values; thread-safe.
#pragma once

#include <cstdint>
#include <string>

namespace strata {

struct StrataConfig;

// Sequence that `index` (< sequences) maps to in pass `pass` of the shuffled
// order with `seed`: permutation_pass(index), a bijection on [0, sequences).
int64_t shuffled_sequence(uint64_t seed, uint64_t pass, int64_t index, int64_t sequences);

// The global position that row b of micro-batch `micro` on `rank` reads, in a
// step starting at `offset`: offset + (micro * world + rank) * B + b.
int64_t batch_position(int64_t offset, int64_t micro, int64_t rank, int64_t world, int64_t B,
                       int64_t b);

class SequenceOrder {
 public:
  SequenceOrder() = default;  // sequential
  static SequenceOrder shuffled(uint64_t seed);
  // strata.shuffle and strata.shuffle_seed; the seed defaults to the run's.
  static SequenceOrder from_config(const StrataConfig& config, uint64_t run_seed);

  bool is_shuffled() const { return shuffled_; }
  uint64_t seed() const { return seed_; }  // 0 when sequential
  // The sequence read at global position `position` (>= 0) of a file of
  // `sequences` (>= 1) whole sequences.
  int64_t sequence(int64_t position, int64_t sequences) const;
  // "in sequential order" or "shuffled with seed N", for messages.
  std::string describe() const;

  bool operator==(const SequenceOrder&) const = default;

 private:
  bool shuffled_ = false;
  uint64_t seed_ = 0;
};

}  // namespace strata
