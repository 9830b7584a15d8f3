#include "core/data/sequence_order.h"

#include <fmt/format.h>

#include <algorithm>

#include "core/config/config.h"

namespace strata {
namespace {

// splitmix64 (Steele, Lea and Flood, "Fast splittable pseudorandom number
// generators", 2014), with the constants of Vigna's reference splitmix64.c:
// the state advances by the golden-ratio increment and each output is this
// mix of the state.
constexpr uint64_t kSplitmixIncrement = 0x9e3779b97f4a7c15ull;

constexpr uint64_t splitmix64_mix(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// Output n (from 0) of splitmix64 started in `state`.
constexpr uint64_t splitmix64_output(uint64_t state, uint64_t n) {
  return splitmix64_mix(state + (n + 1) * kSplitmixIncrement);
}

constexpr int kSwapOrNotRounds = 90;

}  // namespace

int64_t shuffled_sequence(uint64_t seed, uint64_t pass, int64_t index, int64_t sequences) {
  if (sequences <= 1) return 0;
  const uint64_t n = uint64_t(sequences);
  // The pass's key is output `pass` of a stream started from the seed; round
  // r's pivot and coin key are outputs 2r and 2r + 1 of a stream started from it.
  const uint64_t pass_key = splitmix64_output(splitmix64_mix(seed), pass);
  uint64_t x = uint64_t(index);
  for (int r = 0; r < kSwapOrNotRounds; ++r) {
    // A 64-bit draw scaled to [0, n) (multiply and keep the high half): off
    // uniform by at most n / 2^64, and the same on every machine.
    const uint64_t pivot =
        uint64_t((unsigned __int128)splitmix64_output(pass_key, 2 * uint64_t(r)) * n >> 64);
    const uint64_t partner = pivot >= x ? pivot - x : pivot + n - x;
    // Both members of a pair toss the same coin (keyed by the larger), so the round is an
    // involution.
    const uint64_t coin =
        splitmix64_mix(splitmix64_output(pass_key, 2 * uint64_t(r) + 1) ^ std::max(x, partner));
    if (coin >> 63) x = partner;
  }
  return int64_t(x);
}

int64_t batch_position(int64_t offset, int64_t micro, int64_t rank, int64_t world, int64_t B,
                       int64_t b) {
  return offset + (micro * world + rank) * B + b;
}

SequenceOrder SequenceOrder::shuffled(uint64_t seed) {
  SequenceOrder order;
  order.shuffled_ = true;
  order.seed_ = seed;
  return order;
}

SequenceOrder SequenceOrder::from_config(const StrataConfig& config, uint64_t run_seed) {
  if (!config.shuffle) return SequenceOrder();
  return shuffled(config.shuffle_seed.value_or(run_seed));
}

int64_t SequenceOrder::sequence(int64_t position, int64_t sequences) const {
  if (!shuffled_) return position % sequences;
  return shuffled_sequence(seed_, uint64_t(position / sequences), position % sequences, sequences);
}

std::string SequenceOrder::describe() const {
  return shuffled_ ? fmt::format("shuffled with seed {}", seed_)
                   : std::string("in sequential order");
}

}  // namespace strata
