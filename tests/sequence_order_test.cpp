// The order sequences are read in (core/data/sequence_order.h): the shuffled
// order is a bijection on the file's sequences for every size, a new one each
// pass, a function of (seed, pass, size) only, the same for every world size
// and batch split; the sequential order is the file's.
#include "core/data/sequence_order.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <random>
#include <set>
#include <vector>

#include "core/config/config.h"

namespace strata {
namespace {

uint64_t fresh_seed() {
  static const uint64_t seed = [] {
    uint64_t drawn = (uint64_t(std::random_device{}()) << 32) ^ std::random_device{}();
    if (const char* given = std::getenv("STRATA_TEST_SEED"))
      drawn = std::strtoull(given, nullptr, 10);
    std::printf("seed %llu (rerun with STRATA_TEST_SEED=%llu)\n", (unsigned long long)drawn,
                (unsigned long long)drawn);
    return drawn;
  }();
  return seed;
}

// Pass `pass` of the shuffled order over `sequences`, as a list.
std::vector<int64_t> permutation(uint64_t seed, uint64_t pass, int64_t sequences) {
  std::vector<int64_t> out(static_cast<size_t>(sequences));
  for (int64_t i = 0; i < sequences; ++i)
    out[size_t(i)] = shuffled_sequence(seed, pass, i, sequences);
  return out;
}

bool is_bijection(const std::vector<int64_t>& p) {
  std::vector<bool> seen(p.size(), false);
  for (int64_t j : p) {
    if (j < 0 || j >= int64_t(p.size()) || seen[size_t(j)]) return false;
    seen[size_t(j)] = true;
  }
  return true;
}

TEST(SequenceOrder, EveryPassIsABijectionForEverySize) {
  std::mt19937_64 random(fresh_seed());
  std::vector<int64_t> sizes = {1,  2,   3,   4,   5,    7,    8,     13,     64,
                                97, 255, 256, 257, 1000, 4096, 65537, 1000003};
  for (int k = 0; k < 20; ++k) sizes.push_back(int64_t(random() % 5000) + 1);
  for (int64_t sequences : sizes) {
    const uint64_t seed = random();
    for (uint64_t pass : {uint64_t{0}, uint64_t{1}, random() % 1000000}) {
      EXPECT_TRUE(is_bijection(permutation(seed, pass, sequences)))
          << sequences << " sequences, seed " << seed << ", pass " << pass;
    }
  }
}

TEST(SequenceOrder, HugeFilesStayInRangeWithoutCollisions) {
  // Too many sequences to enumerate: a sample lands in range, on distinct
  // sequences, and the arithmetic near 2^63 does not overflow.
  std::mt19937_64 random(fresh_seed() + 1);
  for (int64_t sequences : {int64_t{1} << 40, (int64_t{1} << 62) + 3, INT64_MAX}) {
    const uint64_t seed = random();
    std::set<int64_t> seen;
    for (int k = 0; k < 2000; ++k) {
      const int64_t index = int64_t(random() % uint64_t(sequences));
      const int64_t j = shuffled_sequence(seed, 5, index, sequences);
      ASSERT_GE(j, 0) << sequences;
      ASSERT_LT(j, sequences) << sequences;
      seen.insert(j);
    }
    EXPECT_GT(seen.size(), 1990u) << sequences;
  }
}

TEST(SequenceOrder, TheSameSeedPassAndSizeGiveTheSameOrderInEveryBuild) {
  // Fixed values: a checkpoint resumed by another build or on another
  // machine must continue the same order. A change here breaks resumes.
  EXPECT_EQ(permutation(1234, 0, 10), (std::vector<int64_t>{1, 2, 9, 6, 5, 3, 7, 8, 4, 0}));
  EXPECT_EQ(permutation(1234, 1, 10), (std::vector<int64_t>{2, 4, 0, 8, 7, 9, 5, 3, 6, 1}));
  EXPECT_EQ(shuffled_sequence(1234, 7, 0, 1000000000000), 748795905220);
  EXPECT_EQ(shuffled_sequence(1234, 7, 999999999999, 1000000000000), 367704695877);
  const uint64_t seed = fresh_seed();
  EXPECT_EQ(permutation(seed, 3, 5000), permutation(seed, 3, 5000));
}

TEST(SequenceOrder, EachPassAndEachSeedDrawsAnotherOrder) {
  const uint64_t seed = fresh_seed() + 2;
  const int64_t sequences = 1000;
  std::vector<int64_t> identity(sequences);
  for (int64_t i = 0; i < sequences; ++i) identity[size_t(i)] = i;
  std::set<std::vector<int64_t>> orders;
  for (uint64_t pass = 0; pass < 10; ++pass) {
    std::vector<int64_t> p = permutation(seed, pass, sequences);
    EXPECT_NE(p, identity) << "pass " << pass;
    // No order keeps much of the file's: at most a few sequences stay in place.
    int64_t fixed = 0;
    for (int64_t i = 0; i < sequences; ++i) fixed += p[size_t(i)] == i;
    EXPECT_LT(fixed, 10) << "pass " << pass;
    orders.insert(std::move(p));
  }
  EXPECT_EQ(orders.size(), 10u);
  EXPECT_NE(permutation(seed, 0, sequences), permutation(seed + 1, 0, sequences));
}

TEST(SequenceOrder, NoSequenceFavoursAPosition) {
  // Over many seeds, each of the S sequences lands at each of the S positions
  // about equally often: chi-squared over the S x S table, (S-1)^2 degrees of
  // freedom (mean 25, standard deviation 7 for S = 6); an identity, a
  // rotation or a coin that never swaps lands far above the bound.
  std::mt19937_64 random(fresh_seed() + 3);
  const int64_t S = 6, draws = 60000;
  std::vector<double> counts(size_t(S * S), 0.0);
  for (int64_t d = 0; d < draws; ++d) {
    const uint64_t seed = random();
    for (int64_t i = 0; i < S; ++i) counts[size_t(i * S + shuffled_sequence(seed, 0, i, S))] += 1;
  }
  const double expected = double(draws) / double(S);
  double chi2 = 0;
  for (double c : counts) chi2 += (c - expected) * (c - expected) / expected;
  EXPECT_LT(chi2, 25.0 + 10 * 7.1) << "chi-squared " << chi2;
}

TEST(SequenceOrder, PositionsRunOnAcrossPasses) {
  // Position i reads permutation_{i / S}(i mod S): each pass reads every
  // sequence once, whatever offset a step starts at.
  const SequenceOrder order = SequenceOrder::shuffled(fresh_seed() + 4);
  const int64_t S = 29;
  for (int64_t pass = 0; pass < 4; ++pass) {
    std::vector<int64_t> read;
    for (int64_t i = pass * S; i < (pass + 1) * S; ++i) {
      read.push_back(order.sequence(i, S));
      EXPECT_EQ(read.back(), shuffled_sequence(order.seed(), uint64_t(pass), i - pass * S, S));
    }
    EXPECT_TRUE(is_bijection(read)) << "pass " << pass;
  }
}

TEST(SequenceOrder, TheSequentialOrderIsTheFilesPassAfterPass) {
  const SequenceOrder order;
  EXPECT_FALSE(order.is_shuffled());
  for (int64_t i = 0; i < 100; ++i) EXPECT_EQ(order.sequence(i, 7), i % 7);
  EXPECT_EQ(order.describe(), "in sequential order");
  EXPECT_EQ(SequenceOrder::shuffled(9).describe(), "shuffled with seed 9");
}

TEST(SequenceOrder, EveryWorldSizeAndBatchSplitReadsTheSameGlobalSlice) {
  // A step of 12 sequences split over ranks, micro-batches and rows in every
  // way: the positions its rows read are [offset, offset + 12), each once, so
  // the sequences are those of the one-rank run, pass boundaries included.
  const SequenceOrder order = SequenceOrder::shuffled(fresh_seed() + 5);
  const int64_t S = 29, global = 12;
  struct Split {
    int64_t world, accumulation, micro_batch;
  };
  const Split splits[] = {{1, 1, 12}, {1, 3, 4}, {2, 2, 3}, {3, 4, 1},
                          {4, 1, 3},  {6, 2, 1}, {12, 1, 1}};
  for (int64_t step = 0; step < 6; ++step) {
    const int64_t offset = step * global;
    std::multiset<int64_t> expected;
    for (int64_t i = offset; i < offset + global; ++i) expected.insert(order.sequence(i, S));
    for (const Split& split : splits) {
      ASSERT_EQ(split.world * split.accumulation * split.micro_batch, global);
      std::map<int64_t, int> positions;
      std::multiset<int64_t> read;
      for (int64_t m = 0; m < split.accumulation; ++m)
        for (int64_t r = 0; r < split.world; ++r)
          for (int64_t b = 0; b < split.micro_batch; ++b) {
            ++positions[batch_position(offset, m, r, split.world, split.micro_batch, b)];
            read.insert(
                order.sequence(batch_position(offset, m, r, split.world, split.micro_batch, b), S));
          }
      EXPECT_EQ(int64_t(positions.size()), global) << "world " << split.world;
      EXPECT_EQ(positions.begin()->first, offset);
      EXPECT_EQ(positions.rbegin()->first, offset + global - 1);
      EXPECT_EQ(read, expected) << "step " << step << ", world " << split.world << ", accumulation "
                                << split.accumulation << ", micro-batch " << split.micro_batch;
    }
  }
}

TEST(SequenceOrder, FromTheConfigWithTheRunsSeedUnlessOneIsGiven) {
  StrataConfig config;
  EXPECT_EQ(SequenceOrder::from_config(config, 5), SequenceOrder());
  config.shuffle_seed = 9;
  EXPECT_EQ(SequenceOrder::from_config(config, 5), SequenceOrder());  // shuffle is off
  config.shuffle = true;
  EXPECT_EQ(SequenceOrder::from_config(config, 5), SequenceOrder::shuffled(9));
  config.shuffle_seed.reset();
  EXPECT_EQ(SequenceOrder::from_config(config, 5), SequenceOrder::shuffled(5));
}

}  // namespace
}  // namespace strata
