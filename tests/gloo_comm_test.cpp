// GlooComm: ranks as forked processes talking over 127.0.0.1 through Gloo.
// Every collective gives bitwise LocalComm's result for the same inputs (fp32
// and bf16, W = 2, 3 and 4, in one piece and split into many), is within
// rounding of a float64 sum, and sends the bytes bytes_sent_by counts; ranks
// that disagree, a rank that exits and a rank that stops answering are
// one-line errors on every rank, never a hang.
#include "comm/gloo_comm.h"

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "comm/reduction.h"
#include "tests/comm_test_support.h"

namespace strata::comm {
namespace {

using testing::free_port;
using testing::fresh_seed;
using testing::rank_of;

using Bytes = std::vector<uint8_t>;

// The read end of a pipe that the parent closes once every rank but the last
// has reported (see run_processes): the last rank may wait on it.
int release_fd = -1;

void wait_for_release() {
  char byte;
  while (::read(release_fd, &byte, 1) > 0) {
  }
}

// Forks one process per rank; rank r runs body(r) and its returned report
// comes back. Ranks 0..W-2 report before the last rank is released.
std::vector<std::string> run_processes(int world, const std::function<std::string(int)>& body) {
  int release[2];
  if (::pipe(release) != 0) return {"pipe failed"};
  std::vector<pid_t> children;
  std::vector<int> reports;
  for (int r = 0; r < world; ++r) {
    int report[2];
    if (::pipe(report) != 0) return {"pipe failed"};
    const pid_t pid = ::fork();
    if (pid == 0) {
      ::close(report[0]);
      ::close(release[1]);
      release_fd = release[0];
      ::alarm(300);  // a safety net for a hang; the communicator's own timeouts come first
      const std::string text = body(r);
      size_t written = 0;
      while (written < text.size()) {
        const ssize_t n = ::write(report[1], text.data() + written, text.size() - written);
        if (n <= 0) break;
        written += static_cast<size_t>(n);
      }
      ::_exit(0);
    }
    ::close(report[1]);
    children.push_back(pid);
    reports.push_back(report[0]);
  }
  ::close(release[0]);
  std::vector<std::string> texts(world);
  for (int r = 0; r < world; ++r) {
    if (r == world - 1) ::close(release[1]);
    char buffer[4096];
    ssize_t n;
    while ((n = ::read(reports[r], buffer, sizeof(buffer))) > 0) texts[r].append(buffer, n);
    ::close(reports[r]);
    int status = 0;
    ::waitpid(children[r], &status, 0);
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
      texts[r] += fmt::format("[rank {} did not exit cleanly: status {}]", r, status);
    }
  }
  return texts;
}

// `count` random normal values as `dtype` elements.
Bytes random_elements(std::mt19937& rng, size_t count, DataType dtype) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  Bytes out(count * dtype_bytes(dtype));
  for (size_t i = 0; i < count; ++i) {
    const float x = normal(rng);
    if (dtype == DataType::fp32) {
      std::memcpy(out.data() + 4 * i, &x, 4);
    } else {
      const uint16_t b = float_to_bf16(x);
      std::memcpy(out.data() + 2 * i, &b, 2);
    }
  }
  return out;
}

double element(const Bytes& buffer, size_t index, DataType dtype) {
  if (dtype == DataType::fp32) {
    float x;
    std::memcpy(&x, buffer.data() + 4 * index, 4);
    return x;
  }
  uint16_t b;
  std::memcpy(&b, buffer.data() + 2 * index, 2);
  return bf16_to_float(b);
}

// One rank's inputs to, and results of, the sequence of collectives in run_sequence.
struct RankData {
  Bytes gather_send, scatter_send, reduce_send, in_place, broadcast_last, broadcast_first;
  Bytes gathered, scattered, reduced;
};

// Runs every collective once on `comm` over `data` (results in place).
Status run_sequence(Communicator& comm, RankData& data, size_t count, DataType dtype) {
  const size_t bytes = count * dtype_bytes(dtype);
  const int world = comm.world_size();
  data.gathered.assign(world * bytes, 0xab);
  data.scattered.assign(bytes, 0xab);
  data.reduced.assign(bytes, 0xab);
  Status status = comm.all_gather(data.gather_send.data(), data.gathered.data(), count, dtype);
  if (status.is_ok()) {
    status = comm.reduce_scatter(data.scatter_send.data(), data.scattered.data(), count, dtype);
  }
  if (status.is_ok()) {
    status = comm.all_reduce(data.reduce_send.data(), data.reduced.data(), count, dtype);
  }
  if (status.is_ok()) {
    status = comm.all_reduce(data.in_place.data(), data.in_place.data(), count, dtype);
  }
  if (status.is_ok()) status = comm.barrier();
  if (status.is_ok()) {
    status = comm.broadcast(data.broadcast_last.data(), count, dtype, world - 1);
  }
  if (status.is_ok()) status = comm.broadcast(data.broadcast_first.data(), count, dtype, 0);
  if (status.is_ok()) status = comm.all_reduce(nullptr, nullptr, 0, dtype);  // empty is fine
  return status;
}

// Compares the reduce results of `rank` with float64 sums of every rank's inputs.
std::string check_against_float64(const std::vector<RankData>& inputs, const RankData& got,
                                  int rank, size_t count, DataType dtype) {
  const double relative = dtype == DataType::fp32 ? 1e-5 : 1.0 / 128;
  for (size_t i = 0; i < count; ++i) {
    double scatter_exact = 0, scatter_size = 0, reduce_exact = 0, reduce_size = 0;
    for (const RankData& input : inputs) {
      const double s = element(input.scatter_send, rank * count + i, dtype);
      const double r = element(input.reduce_send, i, dtype);
      scatter_exact += s;
      scatter_size += std::fabs(s);
      reduce_exact += r;
      reduce_size += std::fabs(r);
    }
    const double scattered = element(got.scattered, i, dtype);
    const double reduced = element(got.reduced, i, dtype);
    if (std::fabs(scattered - scatter_exact) > relative * (1 + scatter_size)) {
      return fmt::format("rank {}: reduce_scatter element {} is {}, float64 says {}", rank, i,
                         scattered, scatter_exact);
    }
    if (std::fabs(reduced - reduce_exact) > relative * (1 + reduce_size)) {
      return fmt::format("rank {}: all_reduce element {} is {}, float64 says {}", rank, i, reduced,
                         reduce_exact);
    }
  }
  return "";
}

std::string compare(const char* what, int rank, const Bytes& got, const Bytes& expected) {
  if (got == expected) return "";
  size_t at = 0;
  while (at < got.size() && at < expected.size() && got[at] == expected[at]) ++at;
  return fmt::format("rank {}: {} differs from LocalComm's from byte {} (of {})", rank, what, at,
                     expected.size());
}

struct Case {
  int world;
  DataType dtype;
  size_t exchange_bytes;  // small: every collective is split into many exchanges
};

std::string case_name(const ::testing::TestParamInfo<Case>& info) {
  return fmt::format("W{}_{}_{}", info.param.world,
                     info.param.dtype == DataType::fp32 ? "fp32" : "bf16",
                     info.param.exchange_bytes < 4096 ? "split" : "whole");
}

class GlooCommTest : public ::testing::TestWithParam<Case> {};

TEST_P(GlooCommTest, EveryCollectiveIsBitwiseLocalComm) {
  const auto [world, dtype, exchange_bytes] = GetParam();
  std::mt19937 rng(fresh_seed());
  const size_t count = std::uniform_int_distribution<size_t>(1, 3000)(rng);
  std::vector<RankData> inputs(world);
  for (RankData& data : inputs) {
    data.gather_send = random_elements(rng, count, dtype);
    data.scatter_send = random_elements(rng, world * count, dtype);
    data.reduce_send = random_elements(rng, count, dtype);
    data.in_place = random_elements(rng, count, dtype);
    data.broadcast_last = random_elements(rng, count, dtype);
    data.broadcast_first = random_elements(rng, count, dtype);
  }

  // The expected bytes: LocalComm, one thread per rank, on the same inputs.
  std::vector<RankData> expected = inputs;
  {
    auto group = make_local_group(world);
    std::vector<std::thread> threads;
    std::vector<Status> statuses(world);
    for (int r = 0; r < world; ++r) {
      threads.emplace_back(
          [&, r] { statuses[r] = run_sequence(*group[r], expected[r], count, dtype); });
    }
    for (auto& thread : threads) thread.join();
    for (const Status& status : statuses) ASSERT_TRUE(status.is_ok()) << status.message();
  }

  const int port = free_port();
  std::vector<std::string> reports = run_processes(world, [&](int r) -> std::string {
    GlooCommOptions options;
    options.exchange_bytes = exchange_bytes;
    Result<std::unique_ptr<Communicator>> comm = make_gloo_comm(rank_of(r, world, port), options);
    if (!comm) return comm.status().message();
    if ((*comm)->rank() != r || (*comm)->world_size() != world) return "wrong rank or world";
    RankData got = inputs[r];
    Status status = run_sequence(**comm, got, count, dtype);
    if (!status.is_ok()) return status.message();
    std::string report;
    // What went on the wire: the sequence's collectives as bytes_sent_by counts them.
    uint64_t expected_bytes = 0;
    for (auto [kind, root] :
         {std::pair{CollectiveKind::all_gather, 0}, std::pair{CollectiveKind::reduce_scatter, 0},
          std::pair{CollectiveKind::all_reduce, 0}, std::pair{CollectiveKind::all_reduce, 0},
          std::pair{CollectiveKind::broadcast, world - 1},
          std::pair{CollectiveKind::broadcast, 0}}) {
      expected_bytes += bytes_sent_by(kind, count, dtype, world, r, root);
    }
    if ((*comm)->bytes_sent() != expected_bytes) {
      report += fmt::format("rank {} sent {} bytes, bytes_sent_by says {}\n", r,
                            (*comm)->bytes_sent(), expected_bytes);
    }
    for (std::string difference :
         {compare("all_gather", r, got.gathered, expected[r].gathered),
          compare("reduce_scatter", r, got.scattered, expected[r].scattered),
          compare("all_reduce", r, got.reduced, expected[r].reduced),
          compare("all_reduce in place", r, got.in_place, expected[r].in_place),
          compare("broadcast from the last rank", r, got.broadcast_last,
                  expected[r].broadcast_last),
          compare("broadcast from rank 0", r, got.broadcast_first, expected[r].broadcast_first),
          check_against_float64(inputs, got, r, count, dtype)}) {
      if (!difference.empty()) report += difference + "\n";
    }
    return report;
  });
  for (int r = 0; r < world; ++r) EXPECT_EQ(reports[r], "") << "rank " << r;
}

INSTANTIATE_TEST_SUITE_P(Worlds, GlooCommTest,
                         ::testing::Values(Case{2, DataType::fp32, size_t(16) << 20},
                                           Case{2, DataType::bf16, size_t(16) << 20},
                                           Case{3, DataType::fp32, size_t(16) << 20},
                                           Case{3, DataType::bf16, size_t(16) << 20},
                                           Case{4, DataType::fp32, size_t(16) << 20},
                                           Case{2, DataType::fp32, 1000},
                                           Case{3, DataType::bf16, 998},
                                           Case{4, DataType::bf16, 998}),
                         case_name);

void expect_one_line(const std::string& message, const std::vector<std::string>& parts) {
  EXPECT_EQ(message.find('\n'), std::string::npos) << message;
  for (const std::string& part : parts) {
    EXPECT_NE(message.find(part), std::string::npos)
        << "'" << part << "' missing from: " << message;
  }
}

TEST(GlooComm, WorldOfOneIsLocalCommOfOne) {
  std::mt19937 rng(fresh_seed());
  const size_t count = 777;
  RankData input;
  for (Bytes* buffer : {&input.gather_send, &input.scatter_send, &input.reduce_send,
                        &input.in_place, &input.broadcast_last, &input.broadcast_first}) {
    *buffer = random_elements(rng, count, DataType::bf16);
  }
  RankData expected = input, got = input;
  auto local = make_local_group(1);
  ASSERT_TRUE(run_sequence(*local[0], expected, count, DataType::bf16).is_ok());
  Result<std::unique_ptr<Communicator>> comm = make_gloo_comm(LaunchEnvironment{});
  ASSERT_TRUE(comm.is_ok()) << comm.status().message();
  ASSERT_TRUE(run_sequence(**comm, got, count, DataType::bf16).is_ok());
  EXPECT_EQ(got.gathered, expected.gathered);
  EXPECT_EQ(got.scattered, expected.scattered);
  EXPECT_EQ(got.reduced, expected.reduced);
  EXPECT_EQ(got.in_place, expected.in_place);
}

TEST(GlooComm, RanksThatDisagreeAllFailWithTheSameMessage) {
  const int world = 3;
  const int port = free_port();
  std::vector<std::string> reports = run_processes(world, [&](int r) -> std::string {
    Result<std::unique_ptr<Communicator>> comm = make_gloo_comm(rank_of(r, world, port));
    if (!comm) return "start-up: " + comm.status().message();
    const size_t count = r == 1 ? 16 : 8;
    std::vector<float> send(count, 1.0f), recv(count);
    Status status = (*comm)->all_reduce(send.data(), recv.data(), count, DataType::fp32);
    if (status.is_ok()) return "a disagreeing all_reduce succeeded";
    // The communicator stays usable after the refusal.
    float one = 1.0f, sum = 0.0f;
    Status after = (*comm)->all_reduce(&one, &sum, 1, DataType::fp32);
    if (!after.is_ok()) return "after the refusal: " + after.message();
    if (sum != world) return fmt::format("after the refusal the sum is {}", sum);
    return status.message();
  });
  for (int r = 0; r < world; ++r) {
    expect_one_line(reports[r],
                    {"all_reduce", "ranks disagree", "rank 0 called all_reduce of 8 fp32 elements",
                     "rank 1 called all_reduce of 16 fp32 elements"});
    EXPECT_EQ(reports[r], reports[0]) << "rank " << r;
  }
}

TEST(GlooComm, RanksInDifferentCollectivesAllFailWithTheSameMessage) {
  const int world = 2;
  const int port = free_port();
  std::vector<std::string> reports = run_processes(world, [&](int r) -> std::string {
    Result<std::unique_ptr<Communicator>> comm = make_gloo_comm(rank_of(r, world, port));
    if (!comm) return "start-up: " + comm.status().message();
    float x = 1.0f;
    return r == 0 ? (*comm)->barrier().message()
                  : (*comm)->all_reduce(&x, &x, 1, DataType::bf16).message();
  });
  expect_one_line(reports[0], {"ranks disagree", "rank 0 called barrier",
                               "rank 1 called all_reduce of 1 bf16 elements"});
  EXPECT_EQ(reports[1], reports[0]);
}

TEST(GlooComm, BroadcastFromANonRankFailsOnEveryRank) {
  const int world = 2;
  const int port = free_port();
  std::vector<std::string> reports = run_processes(world, [&](int r) -> std::string {
    Result<std::unique_ptr<Communicator>> comm = make_gloo_comm(rank_of(r, world, port));
    if (!comm) return "start-up: " + comm.status().message();
    float x = 1.0f;
    return (*comm)->broadcast(&x, 1, DataType::fp32, 5).message();
  });
  for (int r = 0; r < world; ++r) expect_one_line(reports[r], {"broadcast", "root 5", "0..1"});
}

TEST(GlooComm, ARankThatExitsMakesTheOthersFail) {
  const int world = 3;
  const int port = free_port();
  GlooCommOptions options;
  options.timeout = std::chrono::seconds(20);  // a bound for a hang; the exit is seen at once
  std::vector<std::string> reports = run_processes(world, [&](int r) -> std::string {
    Result<std::unique_ptr<Communicator>> comm = make_gloo_comm(rank_of(r, world, port), options);
    if (!comm) return "start-up: " + comm.status().message();
    // Every pair connected first: a rank that exits while the others still
    // connect to it fails their start-up instead (seen once in 30 runs).
    if (Status s = (*comm)->barrier(); !s) return "first barrier: " + s.message();
    if (r == world - 1) return "";  // exits without taking part: its connection closes
    std::vector<float> buffer(100, 1.0f);
    Status first = (*comm)->all_reduce(buffer.data(), buffer.data(), 100, DataType::fp32);
    Status later = (*comm)->barrier();
    return first.message() + " | " + later.message();
  });
  EXPECT_EQ(reports[world - 1], "");
  for (int r = 0; r < world - 1; ++r) {
    const size_t split = reports[r].find(" | ");
    ASSERT_NE(split, std::string::npos) << reports[r];
    expect_one_line(reports[r].substr(0, split), {"GlooComm all_reduce of 100 fp32 elements",
                                                  "closed the connection", "restart every rank"});
    expect_one_line(reports[r].substr(split + 3), {"barrier", "failed earlier"});
  }
  EXPECT_NE(reports[0].find("rank 2 closed the connection"), std::string::npos) << reports[0];
}

TEST(GlooComm, ARankThatStopsAnsweringIsATimeoutOnEveryRank) {
  const int world = 3;
  const int port = free_port();
  GlooCommOptions options;
  options.timeout = std::chrono::seconds(3);
  std::vector<std::string> reports = run_processes(world, [&](int r) -> std::string {
    Result<std::unique_ptr<Communicator>> comm = make_gloo_comm(rank_of(r, world, port), options);
    if (!comm) return "start-up: " + comm.status().message();
    // The last rank stays connected but calls nothing until the others have
    // given up; then its own call fails too.
    if (r == world - 1) wait_for_release();
    float x = 1.0f;
    return (*comm)->all_reduce(&x, &x, 1, DataType::fp32).message();
  });
  expect_one_line(reports[0], {"all_reduce", "waited 3 s for rank 2", "restart every rank"});
  // Rank 1 waits for rank 2 too (it has rank 0's header): its own timeout.
  expect_one_line(reports[1], {"all_reduce", "rank 2", "restart every rank"});
  // Rank 2 comes when the others have closed their connections.
  expect_one_line(reports[2], {"all_reduce", "closed"});
}

}  // namespace
}  // namespace strata::comm
