// NcclComm (comm/nccl_comm.h): every collective on device and on host buffers,
// fp32 and bf16, against a float64 loop over fresh random inputs:
//  - one rank (WORLD_SIZE=1) in this process, where a GPU exists;
//  - one process per GPU, rendezvous on 127.0.0.1, where several GPUs exist;
//  - two ranks on one GPU are refused with an error on both, not a hang;
//  - without a GPU (CUDA build) or without CUDA, make_nccl_comm is a one-line
//    error, and ranks without a GPU fail together rather than wait.
// Multi-rank cases run the ranks as fresh processes of this test binary (a
// forked CUDA process cannot use CUDA), started by `strata launch`, so that the
// launcher, the rendezvous and NcclComm are tested together: NcclCommWorker.Run
// does one rank's part when STRATA_NCCL_TEST_ROLE is set and is skipped otherwise.
#include "comm/nccl_comm.h"

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "kernels/backend.h"
#include "kernels/cpu/simd.h"
#include "tests/comm_test_support.h"

#if STRATA_HAS_CUDA
#include <cuda_runtime_api.h>
#endif

extern char** environ;

namespace strata::comm {
namespace {

using testing::expect_one_line_error;
using testing::fresh_seed;

int gpu_count() {
  return static_cast<int>(kernels::query_gpus().devices.size());
}

// --- workers: ranks as processes of this binary, started by `strata launch` ----------

// Runs `strata launch -n world -- THIS_BINARY --gtest_filter=NcclCommWorker.Run`
// with the role, a fresh seed and the GPU each rank uses ("local_rank" or an
// index) in the environment; expects every rank to pass (launch exits 0). A
// launch still running after a generous guard is a hang: stopped and reported.
void run_workers(const std::string& role, int world, const std::string& gpu) {
  const uint32_t seed = fresh_seed();
  char self[4096] = {};
  ASSERT_GT(::readlink("/proc/self/exe", self, sizeof(self) - 1), 0);
  std::vector<std::string> variables = {"STRATA_NCCL_TEST_ROLE=" + role,
                                        "STRATA_NCCL_TEST_SEED=" + std::to_string(seed),
                                        "STRATA_NCCL_TEST_GPU=" + gpu};
  for (char** entry = environ; *entry; ++entry) {
    if (std::strncmp(*entry, "STRATA_NCCL_TEST_", 17) != 0) variables.emplace_back(*entry);
  }
  std::vector<char*> envp;
  for (std::string& variable : variables) envp.push_back(variable.data());
  envp.push_back(nullptr);
  std::vector<std::string> arguments = {STRATA_BINARY,
                                        "launch",
                                        "-n",
                                        std::to_string(world),
                                        "--grace-period",
                                        "5",
                                        "--",
                                        self,
                                        "--gtest_filter=NcclCommWorker.Run"};
  std::vector<char*> argv;
  for (std::string& argument : arguments) argv.push_back(argument.data());
  argv.push_back(nullptr);
  pid_t launch = -1;
  ASSERT_EQ(posix_spawn(&launch, STRATA_BINARY, nullptr, nullptr, argv.data(), envp.data()), 0);

  const auto guard = std::chrono::steady_clock::now() + std::chrono::minutes(5);
  int status = 0;
  while (::waitpid(launch, &status, WNOHANG) == 0) {
    if (std::chrono::steady_clock::now() > guard) {
      ::kill(launch, SIGTERM);  // launch stops its ranks
      ::waitpid(launch, &status, 0);
      FAIL() << role << ": the ranks were still running after 5 minutes (a hang); stopped";
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0)
      << role << ": a rank failed (its output and launch's line are above)";
}

// The launch environment a worker was started with.
LaunchEnvironment worker_environment() {
  Result<LaunchEnvironment> env = launch_environment();
  EXPECT_TRUE(env.is_ok()) << env.status().message();
  return env.is_ok() ? *env : LaunchEnvironment{};
}

// --- without a usable GPU -----------------------------------------------------------

TEST(NcclComm, WithoutAGpuOrCudaIsAOneLineError) {
  if (kernels::built_with_cuda() && gpu_count() > 0) GTEST_SKIP() << "a GPU is present";
  Result<std::unique_ptr<NcclComm>> comm = make_nccl_comm(LaunchEnvironment{}, 0);
  if (kernels::built_with_cuda()) {
    expect_one_line_error(comm.status(), {"NcclComm rank 0 of 1", "no usable GPU"});
  } else {
    expect_one_line_error(comm.status(), {"built without CUDA"});
  }
}

TEST(NcclComm, RanksWithoutAGpuFailTogether) {
  if (!kernels::built_with_cuda()) GTEST_SKIP() << "built without CUDA";
  if (gpu_count() > 0) GTEST_SKIP() << "a GPU is present (TwoRanksOnOneGpuAreRefused runs)";
  run_workers("no_gpu", 3, "0");
}

TEST(NcclComm, TwoRanksOnOneGpuAreRefused) {
  if (gpu_count() == 0) GTEST_SKIP() << "no GPU: " << kernels::query_gpus().why_none;
  run_workers("two_on_one_gpu", 2, "0");
}

#if STRATA_HAS_CUDA

// --- buffers and the float64 reference ---------------------------------------------

size_t element_bytes(DataType dtype) {
  return dtype_bytes(dtype);
}

// Random values representable in `dtype` (so that the reference sees what NCCL sees).
std::vector<float> random_values(size_t n, DataType dtype, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> values(n);
  for (float& x : values) {
    x = normal(rng);
    if (dtype == DataType::bf16) x = kernels::cpu::bf16_to_float(kernels::cpu::float_to_bf16(x));
  }
  return values;
}

std::vector<uint8_t> encode(const std::vector<float>& values, DataType dtype) {
  std::vector<uint8_t> bytes(values.size() * element_bytes(dtype));
  for (size_t i = 0; i < values.size(); ++i) {
    if (dtype == DataType::fp32) {
      std::memcpy(bytes.data() + 4 * i, &values[i], 4);
    } else {
      const uint16_t bits = kernels::cpu::float_to_bf16(values[i]);
      std::memcpy(bytes.data() + 2 * i, &bits, 2);
    }
  }
  return bytes;
}

std::vector<float> decode(const std::vector<uint8_t>& bytes, DataType dtype) {
  std::vector<float> values(bytes.size() / element_bytes(dtype));
  for (size_t i = 0; i < values.size(); ++i) {
    if (dtype == DataType::fp32) {
      std::memcpy(&values[i], bytes.data() + 4 * i, 4);
    } else {
      uint16_t bits;
      std::memcpy(&bits, bytes.data() + 2 * i, 2);
      values[i] = kernels::cpu::bf16_to_float(bits);
    }
  }
  return values;
}

// A buffer of `bytes` in device memory or in (pageable) host memory.
class Buffer {
 public:
  Buffer(size_t bytes, bool on_device) : bytes_(bytes), on_device_(on_device) {
    if (on_device_) {
      EXPECT_EQ(cudaMalloc(&device_, bytes_), cudaSuccess);
    } else {
      host_.resize(bytes_);
    }
  }
  ~Buffer() {
    if (device_) cudaFree(device_);
  }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;

  void* get() { return on_device_ ? device_ : host_.data(); }
  void write(const std::vector<uint8_t>& bytes) {
    ASSERT_EQ(bytes.size(), bytes_);
    if (on_device_) {
      ASSERT_EQ(cudaMemcpy(device_, bytes.data(), bytes_, cudaMemcpyHostToDevice), cudaSuccess);
    } else {
      host_ = bytes;
    }
  }
  std::vector<uint8_t> read() const {
    if (!on_device_) return host_;
    std::vector<uint8_t> bytes(bytes_);
    EXPECT_EQ(cudaMemcpy(bytes.data(), device_, bytes_, cudaMemcpyDeviceToHost), cudaSuccess);
    return bytes;
  }

 private:
  size_t bytes_;
  bool on_device_;
  void* device_ = nullptr;
  std::vector<uint8_t> host_;
};

double relative_error(const std::vector<float>& got, const std::vector<double>& want) {
  double diff = 0.0, norm = 0.0;
  for (size_t i = 0; i < want.size(); ++i) {
    diff += (got[i] - want[i]) * (got[i] - want[i]);
    norm += want[i] * want[i];
  }
  return std::sqrt(diff) / std::max(std::sqrt(norm), 1e-300);
}

void expect_ok(const Status& status, const std::string& what) {
  EXPECT_TRUE(status.is_ok()) << what << ": " << status.message();
}

// A sum of W values rounded at most W times to `dtype`: per-tensor bound.
double tolerance(DataType dtype, int world) {
  return world * (dtype == DataType::fp32 ? std::ldexp(1.0, -23) : std::ldexp(1.0, -8));
}

const char* dtype_label(DataType dtype) {
  return dtype == DataType::fp32 ? "fp32" : "bf16";
}

// Where the send and recv buffers live.
struct Placement {
  bool send_on_device;
  bool recv_on_device;
  const char* label;
};
const Placement kPlacements[] = {{true, true, "device"},
                                 {false, false, "host"},
                                 {false, true, "host->device"},
                                 {true, false, "device->host"}};

// Every collective through `comm`, checked on this rank against a float64 loop
// over every rank's inputs (each rank's inputs come from `seed` and its rank).
void check_collectives(Communicator& comm, uint32_t seed) {
  const int world = comm.world_size();
  const int rank = comm.rank();
  std::mt19937 sizes(seed);
  for (DataType dtype : {DataType::fp32, DataType::bf16}) {
    for (const Placement& placement : kPlacements) {
      const size_t count = std::uniform_int_distribution<size_t>(1, 5000)(sizes);
      const size_t bytes = count * element_bytes(dtype);
      const std::string what =
          fmt::format("{} {} count {} rank {}", dtype_label(dtype), placement.label, count, rank);
      auto input_of = [&](int r, size_t n, int op) {
        return random_values(n, dtype, seed * 31u + static_cast<uint32_t>(r * 8 + op) + count);
      };

      {  // all_gather
        Buffer send(bytes, placement.send_on_device), recv(bytes * world, placement.recv_on_device);
        send.write(encode(input_of(rank, count, 0), dtype));
        expect_ok(comm.all_gather(send.get(), recv.get(), count, dtype), what);
        std::vector<double> want;
        for (int r = 0; r < world; ++r) {
          for (float x : input_of(r, count, 0)) want.push_back(x);
        }
        EXPECT_EQ(relative_error(decode(recv.read(), dtype), want), 0.0) << "all_gather " << what;
      }
      {  // reduce_scatter
        Buffer send(bytes * world, placement.send_on_device), recv(bytes, placement.recv_on_device);
        send.write(encode(input_of(rank, count * world, 1), dtype));
        expect_ok(comm.reduce_scatter(send.get(), recv.get(), count, dtype), what);
        std::vector<double> want(count, 0.0);
        for (int r = 0; r < world; ++r) {
          const std::vector<float> input = input_of(r, count * world, 1);
          for (size_t i = 0; i < count; ++i) want[i] += input[rank * count + i];
        }
        EXPECT_LE(relative_error(decode(recv.read(), dtype), want), tolerance(dtype, world))
            << "reduce_scatter " << what;
      }
      {  // all_reduce, out of place and in place
        Buffer send(bytes, placement.send_on_device), recv(bytes, placement.recv_on_device);
        send.write(encode(input_of(rank, count, 2), dtype));
        expect_ok(comm.all_reduce(send.get(), recv.get(), count, dtype), what);
        std::vector<double> want(count, 0.0);
        for (int r = 0; r < world; ++r) {
          const std::vector<float> input = input_of(r, count, 2);
          for (size_t i = 0; i < count; ++i) want[i] += input[i];
        }
        EXPECT_LE(relative_error(decode(recv.read(), dtype), want), tolerance(dtype, world))
            << "all_reduce " << what;
        expect_ok(comm.all_reduce(send.get(), send.get(), count, dtype), what);
        EXPECT_LE(relative_error(decode(send.read(), dtype), want), tolerance(dtype, world))
            << "all_reduce in place " << what;
      }
      {  // broadcast from the last rank
        const int root = world - 1;
        Buffer buffer(bytes, placement.send_on_device);
        buffer.write(encode(input_of(rank, count, 3), dtype));
        expect_ok(comm.broadcast(buffer.get(), count, dtype, root), what);
        const std::vector<float> input = input_of(root, count, 3);
        EXPECT_EQ(relative_error(decode(buffer.read(), dtype),
                                 std::vector<double>(input.begin(), input.end())),
                  0.0)
            << "broadcast " << what;
      }
      expect_ok(comm.barrier(), what);
    }
  }
}

// --- one rank in this process ---------------------------------------------------

class NcclCommOneRank : public ::testing::Test {
 protected:
  void SetUp() override {
    const kernels::GpuQuery query = kernels::query_gpus();
    if (query.devices.empty()) GTEST_SKIP() << "no GPU: " << query.why_none;
    Result<std::unique_ptr<NcclComm>> made = make_nccl_comm(LaunchEnvironment{}, 0);
    ASSERT_TRUE(made.is_ok()) << made.status().message();
    comm_ = std::move(made.value());
  }
  std::unique_ptr<NcclComm> comm_;
};

TEST_F(NcclCommOneRank, EveryCollectiveOnDeviceAndHostBuffers) {
  EXPECT_EQ(comm_->rank(), 0);
  EXPECT_EQ(comm_->world_size(), 1);
  EXPECT_EQ(comm_->gpu_index(), 0);
  check_collectives(*comm_, fresh_seed());
}

TEST_F(NcclCommOneRank, AsyncCallsRunOnTheCallersStream) {
  const uint32_t seed = fresh_seed();
  const size_t count = 1000 + seed % 1000;
  const std::vector<float> input = random_values(count, DataType::fp32, seed);
  Buffer send(count * 4, true), recv(count * 4, true);
  send.write(encode(input, DataType::fp32));
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreate(&stream), cudaSuccess);
  expect_ok(comm_->all_reduce_async(send.get(), recv.get(), count, DataType::fp32, stream),
            "async");
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  EXPECT_EQ(relative_error(decode(recv.read(), DataType::fp32),
                           std::vector<double>(input.begin(), input.end())),
            0.0);
  // Host buffers are refused by the async calls.
  std::vector<float> host(count);
  expect_one_line_error(
      comm_->all_reduce_async(host.data(), recv.get(), count, DataType::fp32, stream),
      {"all_reduce_async of", "fp32", "host memory"});
  cudaStreamDestroy(stream);
}

TEST_F(NcclCommOneRank, StagesHostBuffersThroughTheBuffersItIsGiven) {
  const uint32_t seed = fresh_seed();
  const size_t limit = 5000 * 4;  // check_collectives' largest call at one rank
  Buffer send(limit, true), recv(limit, true);
  send.write(std::vector<uint8_t>(limit, 0xA5));
  comm_->use_staging(send.get(), recv.get(), limit);
  // A host all-reduce passes through the given send buffer.
  const size_t count = 100 + seed % 900;
  const std::vector<float> input = random_values(count, DataType::fp32, seed);
  std::vector<uint8_t> host = encode(input, DataType::fp32);
  expect_ok(comm_->all_reduce(host.data(), host.data(), count, DataType::fp32), "staged");
  const std::vector<uint8_t> staged = send.read();
  EXPECT_TRUE(std::equal(host.begin(), host.end(), staged.begin()))
      << "the given buffer was not used";
  check_collectives(*comm_, seed);
  // Buffers too small for a call: the communicator allocates its own for it.
  Buffer small_send(64, true), small_recv(64, true);
  comm_->use_staging(small_send.get(), small_recv.get(), 64);
  check_collectives(*comm_, seed + 1);
  // Back to memory of its own.
  comm_->use_staging(nullptr, nullptr, 0);
  check_collectives(*comm_, seed + 2);
}

TEST_F(NcclCommOneRank, ArgumentErrorsNameTheCollective) {
  std::vector<float> host(16);
  expect_one_line_error(comm_->broadcast(host.data(), 16, DataType::bf16, 1),
                        {"broadcast of 16 bf16 elements", "root 1"});
  expect_one_line_error(comm_->all_reduce(nullptr, host.data(), 16, DataType::fp32),
                        {"all_reduce of 16 fp32 elements", "send buffer is null"});
}

#endif  // STRATA_HAS_CUDA

// --- several processes --------------------------------------------------------------

TEST(NcclComm, OneProcessPerGpu) {
  const int gpus = gpu_count();
  if (gpus < 2) GTEST_SKIP() << "needs two GPUs, found " << gpus;
  run_workers("collectives", std::min(gpus, 8), "local_rank");
}

// One rank's part of the cases above, in a process run_workers started.
TEST(NcclCommWorker, Run) {
  const char* role_value = std::getenv("STRATA_NCCL_TEST_ROLE");
  if (!role_value) GTEST_SKIP() << "runs as a rank of a multi-process test";
  const std::string role = role_value;
  const uint32_t seed = static_cast<uint32_t>(std::stoul(std::getenv("STRATA_NCCL_TEST_SEED")));
  const LaunchEnvironment env = worker_environment();
  const std::string gpu_value = std::getenv("STRATA_NCCL_TEST_GPU");
  const int gpu = gpu_value == "local_rank" ? env.local_rank : std::stoi(gpu_value);
  NcclCommOptions options;
  options.rendezvous_timeout = std::chrono::seconds(60);
  Result<std::unique_ptr<NcclComm>> comm = make_nccl_comm(env, gpu, options);
  if (role == "no_gpu") {
    // Every rank fails, with its own reason or the first rank's.
    expect_one_line_error(comm.status(), {"NcclComm rank", "no usable GPU"});
  } else if (role == "two_on_one_gpu") {
    expect_one_line_error(comm.status(),
                          {"ranks 0 and 1 both use GPU", "one GPU per process", "LOCAL_RANK"});
  } else if (role == "collectives") {
#if STRATA_HAS_CUDA
    ASSERT_TRUE(comm.is_ok()) << comm.status().message();
    EXPECT_EQ((*comm)->rank(), env.rank);
    EXPECT_EQ((*comm)->world_size(), env.world_size);
    check_collectives(**comm, seed);
#endif
  } else {
    FAIL() << "unknown role " << role;
  }
  (void)seed;
}

}  // namespace
}  // namespace strata::comm
