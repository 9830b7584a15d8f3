// Bootstrap (comm/bootstrap.h): the launch environment from torchrun, SLURM and
// Open MPI variables, its one-line errors, and the TCP rendezvous on 127.0.0.1
// between threads and between forked processes: blobs arrive intact, a rank
// that never comes or a port in use is an error naming the address and port.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "comm/bootstrap.h"
#include "tests/comm_test_support.h"

namespace strata::comm {
namespace {

using testing::expect_one_line_error;
using testing::free_port;
using testing::fresh_seed;
using testing::rank_of;

using Variables = std::map<std::string, std::string>;
using std::chrono::milliseconds;

// --- the launch environment ---------------------------------------------------

TEST(LaunchEnvironment, NoVariablesMeansOneRankNotLaunched) {
  Result<LaunchEnvironment> env = launch_environment_from({{"HOME", "/somewhere"}});
  ASSERT_TRUE(env.is_ok()) << env.status().message();
  EXPECT_EQ(env->rank, 0);
  EXPECT_EQ(env->world_size, 1);
  EXPECT_EQ(env->local_rank, 0);
  EXPECT_FALSE(env->launched());
}

TEST(LaunchEnvironment, TorchrunVariables) {
  std::mt19937 rng(fresh_seed());
  const int world = std::uniform_int_distribution<int>(2, 64)(rng);
  const int rank = std::uniform_int_distribution<int>(0, world - 1)(rng);
  const int local_world = std::uniform_int_distribution<int>(1, world)(rng);
  const int local_rank = std::uniform_int_distribution<int>(0, local_world - 1)(rng);
  const int port = std::uniform_int_distribution<int>(1, 65535)(rng);
  Result<LaunchEnvironment> env = launch_environment_from({
      {"RANK", std::to_string(rank)},
      {"WORLD_SIZE", std::to_string(world)},
      {"LOCAL_RANK", std::to_string(local_rank)},
      {"LOCAL_WORLD_SIZE", std::to_string(local_world)},
      {"MASTER_ADDR", "node-a"},
      {"MASTER_PORT", std::to_string(port)},
      {"SLURM_PROCID", "99"},  // torchrun's variables win over SLURM's
  });
  ASSERT_TRUE(env.is_ok()) << env.status().message();
  EXPECT_EQ(env->source, "torchrun");
  EXPECT_EQ(env->rank, rank);
  EXPECT_EQ(env->world_size, world);
  EXPECT_EQ(env->local_rank, local_rank);
  EXPECT_EQ(env->local_world_size, local_world);
  EXPECT_EQ(env->master_addr, "node-a");
  EXPECT_EQ(env->master_port, port);
  EXPECT_TRUE(env->launched());
}

TEST(LaunchEnvironment, WorldSizeOneNeedsNoMaster) {
  Result<LaunchEnvironment> env = launch_environment_from({{"WORLD_SIZE", "1"}});
  ASSERT_TRUE(env.is_ok()) << env.status().message();
  EXPECT_EQ(env->rank, 0);
  EXPECT_EQ(env->world_size, 1);
  EXPECT_TRUE(env->master_addr.empty());
}

Variables torchrun(int rank, int world) {
  return {{"RANK", std::to_string(rank)},
          {"WORLD_SIZE", std::to_string(world)},
          {"LOCAL_RANK", std::to_string(rank)},
          {"MASTER_ADDR", "127.0.0.1"},
          {"MASTER_PORT", "29500"}};
}

TEST(LaunchEnvironment, MalformedValuesNameTheVariableAndValue) {
  Variables bad = torchrun(1, 4);
  bad["RANK"] = "one";
  expect_one_line_error(launch_environment_from(bad).status(), {"RANK='one'", "whole number"});

  bad = torchrun(1, 4);
  bad["RANK"] = "4";
  expect_one_line_error(launch_environment_from(bad).status(), {"RANK=4", "0..3"});

  bad = torchrun(1, 4);
  bad["WORLD_SIZE"] = "0";
  expect_one_line_error(launch_environment_from(bad).status(), {"WORLD_SIZE=0"});

  bad = torchrun(1, 4);
  bad["MASTER_PORT"] = "70000";
  expect_one_line_error(launch_environment_from(bad).status(),
                        {"MASTER_PORT=70000", "free TCP port"});

  bad = torchrun(1, 4);
  bad["MASTER_PORT"] = "29500x";
  expect_one_line_error(launch_environment_from(bad).status(), {"MASTER_PORT='29500x'"});

  bad = torchrun(1, 4);
  bad["LOCAL_WORLD_SIZE"] = "2";
  bad["LOCAL_RANK"] = "2";
  expect_one_line_error(launch_environment_from(bad).status(), {"LOCAL_RANK=2"});
}

TEST(LaunchEnvironment, MissingVariablesSayWhatToSet) {
  Variables missing = torchrun(1, 4);
  missing.erase("MASTER_ADDR");
  expect_one_line_error(launch_environment_from(missing).status(),
                        {"MASTER_ADDR is not set", "WORLD_SIZE=4", "rank 0's host"});

  missing = torchrun(1, 4);
  missing.erase("MASTER_PORT");
  expect_one_line_error(launch_environment_from(missing).status(), {"MASTER_PORT is not set"});

  missing = torchrun(1, 4);
  missing.erase("WORLD_SIZE");
  expect_one_line_error(launch_environment_from(missing).status(), {"RANK=1", "WORLD_SIZE is not"});

  missing = torchrun(1, 4);
  missing.erase("LOCAL_RANK");
  expect_one_line_error(launch_environment_from(missing).status(), {"LOCAL_RANK is not"});
}

TEST(LaunchEnvironment, SlurmVariables) {
  std::mt19937 rng(fresh_seed());
  const int per_node = std::uniform_int_distribution<int>(1, 8)(rng);
  const int nodes = std::uniform_int_distribution<int>(2, 8)(rng);
  const int world = per_node * nodes;
  const int rank = std::uniform_int_distribution<int>(0, world - 1)(rng);
  const int job = std::uniform_int_distribution<int>(1, 1 << 30)(rng);
  Variables slurm = {{"SLURM_PROCID", std::to_string(rank)},
                     {"SLURM_NTASKS", std::to_string(world)},
                     {"SLURM_LOCALID", std::to_string(rank % per_node)},
                     {"SLURM_NTASKS_PER_NODE", std::to_string(per_node)},
                     {"SLURM_JOB_ID", std::to_string(job)},
                     {"SLURM_JOB_NODELIST", "gpu[007-010,012],login3"}};
  Result<LaunchEnvironment> env = launch_environment_from(slurm);
  ASSERT_TRUE(env.is_ok()) << env.status().message();
  EXPECT_EQ(env->source, "slurm");
  EXPECT_EQ(env->rank, rank);
  EXPECT_EQ(env->world_size, world);
  EXPECT_EQ(env->local_rank, rank % per_node);
  EXPECT_EQ(env->local_world_size, per_node);
  EXPECT_EQ(env->master_addr, "gpu007");
  EXPECT_EQ(env->master_port, 15000 + job % 20000);

  // MASTER_ADDR / MASTER_PORT override; a per-node count like "4(x2)" is unknown.
  slurm["MASTER_ADDR"] = "head";
  slurm["MASTER_PORT"] = "4242";
  slurm["SLURM_NTASKS_PER_NODE"] = fmt::format("{}(x{})", per_node, nodes);
  env = launch_environment_from(slurm);
  ASSERT_TRUE(env.is_ok()) << env.status().message();
  EXPECT_EQ(env->master_addr, "head");
  EXPECT_EQ(env->master_port, 4242);
  EXPECT_FALSE(env->local_world_size.has_value());

  // A node list this parser does not read asks for MASTER_ADDR.
  slurm.erase("MASTER_ADDR");
  slurm["SLURM_JOB_NODELIST"] = "rack[1-2]-gpu[1-4]";
  expect_one_line_error(launch_environment_from(slurm).status(),
                        {"SLURM_JOB_NODELIST", "rack[1-2]-gpu[1-4]", "MASTER_ADDR"});
}

TEST(LaunchEnvironment, ReadsThisProcesssEnvironment) {
  const char* names[] = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"};
  std::map<std::string, std::optional<std::string>> saved;
  for (const char* name : names) {
    const char* value = std::getenv(name);
    saved[name] = value ? std::optional<std::string>(value) : std::nullopt;
  }
  ::setenv("RANK", "2", 1);
  ::setenv("WORLD_SIZE", "3", 1);
  ::setenv("LOCAL_RANK", "2", 1);
  ::setenv("MASTER_ADDR", "127.0.0.1", 1);
  ::setenv("MASTER_PORT", "1234", 1);
  Result<LaunchEnvironment> env = launch_environment();
  for (const auto& [name, value] : saved) {
    if (value) {
      ::setenv(name.c_str(), value->c_str(), 1);
    } else {
      ::unsetenv(name.c_str());
    }
  }
  ASSERT_TRUE(env.is_ok()) << env.status().message();
  EXPECT_EQ(env->rank, 2);
  EXPECT_EQ(env->world_size, 3);
  EXPECT_EQ(env->master_port, 1234);
}

TEST(LaunchEnvironment, FirstSlurmHost) {
  EXPECT_EQ(first_slurm_host("gpu7").value(), "gpu7");
  EXPECT_EQ(first_slurm_host("gpu7,gpu9").value(), "gpu7");
  EXPECT_EQ(first_slurm_host("n[3-5]").value(), "n3");
  EXPECT_EQ(first_slurm_host("node[0012,0020-0030],other[1-2]").value(), "node0012");
  EXPECT_FALSE(first_slurm_host("").is_ok());
  EXPECT_FALSE(first_slurm_host("[1-2]").is_ok());
  EXPECT_FALSE(first_slurm_host("n[a-b]").is_ok());
  EXPECT_FALSE(first_slurm_host("n[1-2").is_ok());
}

TEST(LaunchEnvironment, OpenMpiVariables) {
  Variables mpi = {{"OMPI_COMM_WORLD_RANK", "3"},       {"OMPI_COMM_WORLD_SIZE", "4"},
                   {"OMPI_COMM_WORLD_LOCAL_RANK", "1"}, {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"},
                   {"MASTER_ADDR", "10.0.0.1"},         {"MASTER_PORT", "29400"}};
  Result<LaunchEnvironment> env = launch_environment_from(mpi);
  ASSERT_TRUE(env.is_ok()) << env.status().message();
  EXPECT_EQ(env->source, "openmpi");
  EXPECT_EQ(env->rank, 3);
  EXPECT_EQ(env->world_size, 4);
  EXPECT_EQ(env->local_rank, 1);
  EXPECT_EQ(env->local_world_size, 2);
  EXPECT_EQ(env->master_addr, "10.0.0.1");
  EXPECT_EQ(env->master_port, 29400);

  mpi.erase("MASTER_ADDR");
  expect_one_line_error(launch_environment_from(mpi).status(), {"MASTER_ADDR", "mpirun -x"});
}

// --- the rendezvous -------------------------------------------------------------

// Rank r's blob for a test seeded with `seed`: random bytes of a random length.
Blob blob_of(uint32_t seed, int rank) {
  std::mt19937 rng(seed * 7919u + static_cast<uint32_t>(rank));
  Blob blob(std::uniform_int_distribution<size_t>(0, 300)(rng));
  for (uint8_t& byte : blob) byte = static_cast<uint8_t>(rng());
  return blob;
}

// Joins as `env` and runs broadcast, all_gather and barrier; returns "" or what went wrong.
std::string exchange_as(const LaunchEnvironment& env, uint32_t seed) {
  Result<std::unique_ptr<Rendezvous>> rendezvous = Rendezvous::join(env, milliseconds(60'000));
  if (!rendezvous) return rendezvous.status().message();
  Rendezvous& rv = **rendezvous;
  if (rv.rank() != env.rank || rv.world_size() != env.world_size) return "wrong rank or world";
  // An ncclUniqueId-sized blob from rank 0.
  Blob id = env.rank == 0 ? blob_of(seed, -1) : Blob(3, 0xee);
  if (env.rank == 0) id.resize(128);
  Blob expected_id = blob_of(seed, -1);
  expected_id.resize(128);
  Status broadcast = rv.broadcast(id);
  if (!broadcast.is_ok()) return broadcast.message();
  if (id != expected_id) return "broadcast delivered other bytes";
  for (int round = 0; round < 3; ++round) {
    Result<std::vector<Blob>> all = rv.all_gather(blob_of(seed + round, env.rank));
    if (!all) return all.status().message();
    if (static_cast<int>(all->size()) != env.world_size) return "all_gather: wrong count";
    for (int r = 0; r < env.world_size; ++r) {
      if ((*all)[r] != blob_of(seed + round, r))
        return fmt::format("all_gather: rank {} differs", r);
    }
    Status barrier = rv.barrier();
    if (!barrier.is_ok()) return barrier.message();
  }
  return "";
}

TEST(Rendezvous, ThreadsExchangeBlobs) {
  const uint32_t seed = fresh_seed();
  std::mt19937 rng(seed);
  const int world = std::uniform_int_distribution<int>(2, 6)(rng);
  const int port = free_port();
  std::vector<std::string> outcomes(world);
  std::vector<std::thread> threads;
  // Start the ranks in reverse: the others must wait for rank 0 to listen.
  for (int r = world - 1; r >= 0; --r) {
    threads.emplace_back([&, r] { outcomes[r] = exchange_as(rank_of(r, world, port), seed); });
  }
  for (auto& thread : threads) thread.join();
  for (int r = 0; r < world; ++r) EXPECT_EQ(outcomes[r], "") << "rank " << r;
}

TEST(Rendezvous, WorldOfOneNeedsNoSocket) {
  LaunchEnvironment env;  // not launched: no MASTER_ADDR / MASTER_PORT
  EXPECT_EQ(exchange_as(env, fresh_seed()), "");
}

TEST(Rendezvous, ForkedProcessesExchangeBlobs) {
  const uint32_t seed = fresh_seed();
  const int world = 3;
  const int port = free_port();
  std::vector<pid_t> children;
  for (int r = 0; r < world; ++r) {
    const pid_t pid = ::fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
      const std::string outcome = exchange_as(rank_of(r, world, port), seed);
      if (!outcome.empty()) std::fprintf(stderr, "rank %d: %s\n", r, outcome.c_str());
      std::fflush(stderr);
      ::_exit(outcome.empty() ? 0 : 1);
    }
    children.push_back(pid);
  }
  for (int r = 0; r < world; ++r) {
    int status = 0;
    ASSERT_EQ(::waitpid(children[r], &status, 0), children[r]);
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "rank " << r;
  }
}

TEST(Rendezvous, ARankThatNeverComesIsATimeoutNamingIt) {
  const int port = free_port();
  const int world = 3;  // rank 2 never starts
  Status rank0, rank1;
  std::thread first(
      [&] { rank0 = Rendezvous::join(rank_of(0, world, port), milliseconds(500)).status(); });
  std::thread second(
      [&] { rank1 = Rendezvous::join(rank_of(1, world, port), milliseconds(20'000)).status(); });
  first.join();
  second.join();
  const std::string where = fmt::format("127.0.0.1:{}", port);
  expect_one_line_error(rank0, {where, "rank 2 of 3 did not connect", "MASTER_PORT"});
  // Rank 1 learns that rank 0 gave up instead of waiting out its own timeout.
  expect_one_line_error(rank1, {where, "rank 0"});
}

TEST(Rendezvous, NoRankZeroIsATimeoutNamingTheAddress) {
  const int port = free_port();
  Status status = Rendezvous::join(rank_of(1, 2, port), milliseconds(300)).status();
  expect_one_line_error(
      status, {fmt::format("127.0.0.1:{}", port), "could not connect", "is rank 0 running"});
}

TEST(Rendezvous, PortInUseIsAClearError) {
  // Hold a port with a listening socket of our own.
  const int holder = ::socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(holder, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  address.sin_port = 0;
  ASSERT_EQ(::bind(holder, reinterpret_cast<sockaddr*>(&address), sizeof(address)), 0);
  ASSERT_EQ(::listen(holder, 1), 0);
  socklen_t length = sizeof(address);
  ASSERT_EQ(::getsockname(holder, reinterpret_cast<sockaddr*>(&address), &length), 0);
  const int port = ntohs(address.sin_port);

  Status status = Rendezvous::join(rank_of(0, 2, port), milliseconds(300)).status();
  expect_one_line_error(
      status, {fmt::format("cannot listen on port {}", port), "choose another MASTER_PORT"});
  ::close(holder);
}

TEST(Rendezvous, DisagreeingWorldSizesFailOnEveryRank) {
  const int port = free_port();
  Status rank0, rank1;
  std::thread first(
      [&] { rank0 = Rendezvous::join(rank_of(0, 2, port), milliseconds(20'000)).status(); });
  std::thread second(
      [&] { rank1 = Rendezvous::join(rank_of(1, 3, port), milliseconds(20'000)).status(); });
  first.join();
  second.join();
  expect_one_line_error(rank0, {"rank 1 has WORLD_SIZE=3 but rank 0 has WORLD_SIZE=2"});
  expect_one_line_error(rank1, {"rank 1 has WORLD_SIZE=3 but rank 0 has WORLD_SIZE=2"});
}

TEST(Rendezvous, TwoProcessesClaimingOneRankFail) {
  const int port = free_port();
  Status rank0, first_one, second_one;
  std::thread zero(
      [&] { rank0 = Rendezvous::join(rank_of(0, 3, port), milliseconds(20'000)).status(); });
  std::thread a(
      [&] { first_one = Rendezvous::join(rank_of(1, 3, port), milliseconds(20'000)).status(); });
  std::thread b(
      [&] { second_one = Rendezvous::join(rank_of(1, 3, port), milliseconds(20'000)).status(); });
  zero.join();
  a.join();
  b.join();
  expect_one_line_error(rank0, {"two processes claim rank 1"});
  expect_one_line_error(first_one, {"two processes claim rank 1"});
  expect_one_line_error(second_one, {"two processes claim rank 1"});
}

TEST(Rendezvous, ARankThatDiesMidwayIsAnErrorNotAHang) {
  const int port = free_port();
  Status gathered;
  std::thread zero([&] {
    auto rendezvous = Rendezvous::join(rank_of(0, 2, port), milliseconds(20'000));
    ASSERT_TRUE(rendezvous.is_ok()) << rendezvous.status().message();
    gathered = (*rendezvous)->all_gather(Blob{1, 2, 3}).status();
  });
  std::thread one([&] {
    auto rendezvous = Rendezvous::join(rank_of(1, 2, port), milliseconds(20'000));
    ASSERT_TRUE(rendezvous.is_ok()) << rendezvous.status().message();
    // Leaves without taking part: its connection closes.
  });
  zero.join();
  one.join();
  expect_one_line_error(gathered, {"rank 1 closed the connection during all_gather"});
}

}  // namespace
}  // namespace strata::comm
