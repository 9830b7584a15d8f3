// LocalComm: W ranks as threads. Every collective against a scalar loop that
// adds the ranks in order (bitwise) and a float64 sum (within rounding).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <random>
#include <thread>

#include "comm/communicator.h"

namespace strata::comm {
namespace {

// Runs body(rank, communicator) on one thread per rank.
void run_ranks(int world, const std::function<void(int, Communicator&)>& body) {
  auto group = make_local_group(world);
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) threads.emplace_back([&, r] { body(r, *group[r]); });
  for (auto& t : threads) t.join();
}

std::vector<std::vector<float>> random_buffers(int world, size_t count, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<std::vector<float>> buffers(world, std::vector<float>(count));
  for (auto& buffer : buffers) {
    for (float& x : buffer) x = normal(rng);
  }
  return buffers;
}

uint32_t fresh_seed() {
  uint32_t seed = std::random_device{}();
  std::printf("seed %u\n", seed);
  return seed;
}

class LocalCommTest : public ::testing::TestWithParam<int> {};

TEST_P(LocalCommTest, AllGatherPlacesRankRAtROffset) {
  const int world = GetParam();
  const size_t count = 1000 + 37;
  auto send = random_buffers(world, count, fresh_seed());
  std::vector<std::vector<float>> recv(world, std::vector<float>(world * count, -1.0f));
  run_ranks(world, [&](int r, Communicator& comm) {
    ASSERT_TRUE(comm.all_gather(send[r].data(), recv[r].data(), count, DataType::fp32).is_ok());
  });
  for (int r = 0; r < world; ++r) {
    for (int q = 0; q < world; ++q) {
      EXPECT_EQ(std::memcmp(recv[r].data() + q * count, send[q].data(), count * 4), 0) << r << " " << q;
    }
  }
}

TEST_P(LocalCommTest, ReduceScatterSumsInRankOrder) {
  const int world = GetParam();
  const size_t count = 513;
  auto send = random_buffers(world, world * count, fresh_seed());
  std::vector<std::vector<float>> recv(world, std::vector<float>(count));
  run_ranks(world, [&](int r, Communicator& comm) {
    ASSERT_TRUE(comm.reduce_scatter(send[r].data(), recv[r].data(), count, DataType::fp32).is_ok());
  });
  for (int r = 0; r < world; ++r) {
    for (size_t i = 0; i < count; ++i) {
      float ordered = 0.0f;
      double exact = 0.0;
      for (int q = 0; q < world; ++q) {
        ordered += send[q][r * count + i];
        exact += send[q][r * count + i];
      }
      ASSERT_EQ(recv[r][i], ordered) << "rank " << r << " element " << i;
      ASSERT_NEAR(recv[r][i], exact, 1e-5 * (1 + std::fabs(exact)));
    }
  }
}

TEST_P(LocalCommTest, AllReduceInPlaceGivesEveryRankTheSameSum) {
  const int world = GetParam();
  const size_t count = 10007;  // not a multiple of the world size
  auto buffers = random_buffers(world, count, fresh_seed());
  auto original = buffers;
  run_ranks(world, [&](int r, Communicator& comm) {
    ASSERT_TRUE(comm.all_reduce(buffers[r].data(), buffers[r].data(), count, DataType::fp32).is_ok());
  });
  for (size_t i = 0; i < count; ++i) {
    float ordered = 0.0f;
    for (int q = 0; q < world; ++q) ordered += original[q][i];
    for (int r = 0; r < world; ++r) ASSERT_EQ(buffers[r][i], ordered) << r << " " << i;
  }
}

TEST_P(LocalCommTest, Bf16IsSummedInFp32AndRoundedOnce) {
  const int world = GetParam();
  const size_t count = 300;
  auto values = random_buffers(world, count, fresh_seed());
  auto to_bf16 = [](float x) {  // round to nearest even
    uint32_t bits;
    std::memcpy(&bits, &x, 4);
    bits += 0x7fff + ((bits >> 16) & 1);
    return static_cast<uint16_t>(bits >> 16);
  };
  auto to_float = [](uint16_t b) {
    uint32_t bits = uint32_t(b) << 16;
    float x;
    std::memcpy(&x, &bits, 4);
    return x;
  };
  std::vector<std::vector<uint16_t>> send(world, std::vector<uint16_t>(count));
  for (int r = 0; r < world; ++r) {
    for (size_t i = 0; i < count; ++i) send[r][i] = to_bf16(values[r][i]);
  }
  std::vector<std::vector<uint16_t>> recv(world, std::vector<uint16_t>(count));
  run_ranks(world, [&](int r, Communicator& comm) {
    ASSERT_TRUE(comm.all_reduce(send[r].data(), recv[r].data(), count, DataType::bf16).is_ok());
  });
  for (size_t i = 0; i < count; ++i) {
    float sum = 0.0f;
    for (int q = 0; q < world; ++q) sum += to_float(send[q][i]);
    ASSERT_EQ(recv[world - 1][i], to_bf16(sum)) << i;
  }
}

TEST_P(LocalCommTest, BroadcastCopiesTheRootsBuffer) {
  const int world = GetParam();
  const size_t count = 77;
  auto buffers = random_buffers(world, count, fresh_seed());
  const int root = world - 1;
  const std::vector<float> expected = buffers[root];
  run_ranks(world, [&](int r, Communicator& comm) {
    ASSERT_TRUE(comm.broadcast(buffers[r].data(), count, DataType::fp32, root).is_ok());
    ASSERT_TRUE(comm.barrier().is_ok());
  });
  for (int r = 0; r < world; ++r) EXPECT_EQ(buffers[r], expected) << r;
}

TEST_P(LocalCommTest, RepeatedRunsAreBitwiseIdentical) {
  const int world = GetParam();
  const size_t count = 4096;
  auto input = random_buffers(world, count * world, fresh_seed());
  auto run = [&] {
    std::vector<std::vector<float>> recv(world, std::vector<float>(count));
    run_ranks(world, [&](int r, Communicator& comm) {
      for (int repeat = 0; repeat < 3; ++repeat) {
        ASSERT_TRUE(comm.reduce_scatter(input[r].data(), recv[r].data(), count, DataType::fp32).is_ok());
      }
    });
    return recv;
  };
  EXPECT_EQ(run(), run());
}

INSTANTIATE_TEST_SUITE_P(Worlds, LocalCommTest, ::testing::Values(1, 2, 3, 4));

TEST(LocalComm, RanksThatDisagreeAllFailWithTheSameMessage) {
  std::vector<float> a(8, 1.0f), b(16, 1.0f);
  std::vector<std::string> messages(2);
  run_ranks(2, [&](int r, Communicator& comm) {
    std::vector<float> out(32);
    Status s = comm.all_gather(r == 0 ? a.data() : b.data(), out.data(), r == 0 ? 8 : 16, DataType::fp32);
    messages[r] = s.message();
    // The group stays usable after a refused call.
    std::vector<float> one(1, 1.0f), sum(1);
    ASSERT_TRUE(comm.all_reduce(one.data(), sum.data(), 1, DataType::fp32).is_ok());
    EXPECT_EQ(sum[0], 2.0f);
  });
  EXPECT_NE(messages[0].find("ranks disagree"), std::string::npos) << messages[0];
  EXPECT_EQ(messages[0], messages[1]);
}

TEST(LocalComm, BroadcastFromANonRankIsRefused) {
  run_ranks(2, [&](int, Communicator& comm) {
    float x = 0;
    EXPECT_FALSE(comm.broadcast(&x, 1, DataType::fp32, 5).is_ok());
  });
}

}  // namespace
}  // namespace strata::comm
