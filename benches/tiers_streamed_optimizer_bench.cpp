// The streamed AdamW step over NVMe-resident state against the same step in memory.
//
//   tiers_streamed_optimizer_bench [google benchmark flags]
//   environment: STRATA_BENCH_PATH        NVMe directory (default: the temp directory)
//                STRATA_BENCH_STATE_GIB   master + m + v, in GiB (default 9)
//                STRATA_BENCH_BLOCK_SIZE  I/O request size in bytes (default 1 MiB)
//                STRATA_BENCH_QUEUE_DEPTH requests in flight (default 16)
//                STRATA_BENCH_BUFFERS     host buffers (default 5)
//                STRATA_BENCH_CHUNK       elements per chunk (default 2^22: 48 MiB a buffer)
//
// StreamedStep: master, m and v of every unit live in one striped O_DIRECT
// swap file; one step reads and writes all of them (24 bytes per parameter)
// through STRATA_BENCH_BUFFERS pinned buffers of chunk * 12 bytes. One untimed
// step first writes every block, so reads then come from the drive and not
// from unwritten extents. InMemoryStep: the same units, the same kernel, the
// state in ordinary memory. Both take the bf16 gradient from one chunk-sized
// buffer reused for every unit and write the bf16 copy to another (in
// training they come from / go to the device unit by unit), so host memory is
// the buffers. Counters: state bytes, bytes moved, GB/s, seconds the pass
// waited for reads / write-backs, and the process's peak resident memory.
// benches/tiers_streamed_optimizer.py runs both beside fio's floor.
#include <benchmark/benchmark.h>
#include <sys/resource.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "core/optimizer/optimizer.h"
#include "core/optimizer/streamed_optimizer.h"
#include "io/aligned_buffer.h"
#include "kernels/cpu/gemm.h"

namespace {

using strata::kernels::cpu::ElementType;

uint64_t env_number(const char* name, uint64_t fallback) {
  const char* value = std::getenv(name);
  return value ? std::strtoull(value, nullptr, 10) : fallback;
}

struct Shape {
  int64_t chunk = int64_t(env_number("STRATA_BENCH_CHUNK", uint64_t{1} << 22));
  uint64_t state_bytes = env_number("STRATA_BENCH_STATE_GIB", 9) << 30;
  int units() const { return int(state_bytes / (uint64_t(chunk) * 12)); }
  uint64_t total_state_bytes() const { return uint64_t(units()) * uint64_t(chunk) * 12; }
};

double peak_rss_bytes() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  return double(usage.ru_maxrss) * 1024.0;
}

// A bf16 gradient of `n` small values (bit patterns of bf16 numbers near 1e-3).
std::vector<uint16_t> make_gradient(int64_t n) {
  std::vector<uint16_t> grad(n);
  for (int64_t i = 0; i < n; ++i) grad[i] = uint16_t(0x3a80 + (i * 2654435761u >> 24) % 64);
  return grad;
}

strata::Optimizer make_optimizer() {
  strata::OptimizerOptions options;
  options.adamw.lr = 1e-4;
  options.adamw.weight_decay = 0.01;
  options.skip_nonfinite_steps = false;
  return *strata::Optimizer::create(options);
}

void StreamedStep(benchmark::State& state) {
  const Shape shape;
  const char* given_path = std::getenv("STRATA_BENCH_PATH");
  const std::string path =
      given_path ? given_path : std::filesystem::temp_directory_path().string();
  const unsigned buffers = unsigned(env_number("STRATA_BENCH_BUFFERS", 5));
  strata::StreamedOptimizerOptions streamed_options{shape.chunk, buffers};

  strata::tiers::TieredStoreOptions options;
  options.host_capacity = strata::StreamedOptimizer::host_buffer_bytes(streamed_options);
  options.nvme_capacity = shape.total_state_bytes();
  options.io.paths = {path};
  options.io.block_size = env_number("STRATA_BENCH_BLOCK_SIZE", 1 << 20);
  options.io.queue_depth = unsigned(env_number("STRATA_BENCH_QUEUE_DEPTH", 16));
  options.use_gpu = false;
  auto store = strata::tiers::TieredStore::open(options);
  if (!store) return state.SkipWithError(store.status().message().c_str());
  for (int unit = 0; unit < shape.units(); ++unit) {
    strata::Status added = strata::StreamedOptimizer::add_unit_state(**store, unit, shape.chunk,
                                                                     strata::tiers::Tier::nvme);
    if (!added) return state.SkipWithError(added.message().c_str());
  }
  auto streamed = strata::StreamedOptimizer::create(**store, streamed_options);
  if (!streamed) return state.SkipWithError(streamed.status().message().c_str());
  std::fprintf(stderr, "%s", (*store)->description().c_str());

  const std::vector<uint16_t> grad = make_gradient(shape.chunk);
  std::vector<uint16_t> copy(shape.chunk);
  std::vector<strata::StreamedOptimizerUnit> units;
  for (int unit = 0; unit < shape.units(); ++unit) {
    strata::StreamedOptimizerUnit streamed;
    streamed.unit = unit;
    streamed.shard.numel = shape.chunk;
    streamed.shard.grad = grad.data();
    streamed.shard.grad_type = ElementType::bf16;
    streamed.shard.copy = copy.data();
    streamed.shard.copy_type = ElementType::bf16;
    units.push_back(streamed);
  }
  strata::Optimizer optimizer = make_optimizer();

  // Untimed: writes every block of the state once.
  strata::Status warm = (*streamed)->step(optimizer, *optimizer.begin_step(std::nullopt), units);
  if (!warm) return state.SkipWithError(warm.message().c_str());

  double read_wait = 0, write_wait = 0, visit = 0;
  uint64_t moved = 0;
  for (auto _ : state) {
    strata::Status status =
        (*streamed)->step(optimizer, *optimizer.begin_step(std::nullopt), units);
    if (!status) return state.SkipWithError(status.message().c_str());
    const strata::tiers::StreamedPassStats& stats = (*streamed)->last_step();
    read_wait += stats.read_wait_seconds;
    write_wait += stats.write_wait_seconds;
    visit += stats.visit_seconds;
    moved += stats.bytes_read + stats.bytes_written;
  }
  const double steps = double(state.iterations());
  state.counters["state_bytes"] = double(shape.total_state_bytes());
  state.counters["moved_bytes_per_step"] = moved / steps;
  state.counters["bytes_per_second"] =
      benchmark::Counter(double(moved), benchmark::Counter::kIsRate);
  state.counters["read_wait_s"] = read_wait / steps;
  state.counters["write_wait_s"] = write_wait / steps;
  state.counters["visit_s"] = visit / steps;
  state.counters["host_buffer_bytes"] = double(options.host_capacity);
  state.counters["peak_rss_bytes"] = peak_rss_bytes();
}

void InMemoryStep(benchmark::State& state) {
  const Shape shape;
  const uint64_t numel = uint64_t(shape.units()) * uint64_t(shape.chunk);
  strata::io::AlignedBuffer master(numel * 4), m(numel * 4), v(numel * 4);
  const std::vector<uint16_t> grad = make_gradient(shape.chunk);
  std::vector<uint16_t> copy(shape.chunk);
  strata::Optimizer optimizer = make_optimizer();
  auto step = [&]() -> strata::Status {
    const strata::StepDecision plan = *optimizer.begin_step(std::nullopt);
    for (int unit = 0; unit < shape.units(); ++unit) {
      const uint64_t begin = uint64_t(unit) * uint64_t(shape.chunk);
      strata::kernels::cpu::AdamWShard shard;
      shard.numel = shape.chunk;
      shard.master = reinterpret_cast<float*>(master.data()) + begin;
      shard.exp_avg = reinterpret_cast<float*>(m.data()) + begin;
      shard.exp_avg_sq = reinterpret_cast<float*>(v.data()) + begin;
      shard.grad = grad.data();
      shard.grad_type = ElementType::bf16;
      shard.copy = copy.data();
      shard.copy_type = ElementType::bf16;
      if (strata::Status status = optimizer.update_shard(plan, shard); !status) return status;
    }
    return strata::Status::ok();
  };
  if (strata::Status warm = step(); !warm) return state.SkipWithError(warm.message().c_str());
  for (auto _ : state) {
    if (strata::Status status = step(); !status)
      return state.SkipWithError(status.message().c_str());
  }
  state.counters["state_bytes"] = double(shape.total_state_bytes());
  state.counters["peak_rss_bytes"] = peak_rss_bytes();
}

BENCHMARK(StreamedStep)->Iterations(2)->UseRealTime()->Unit(benchmark::kSecond);
BENCHMARK(InMemoryStep)->Iterations(2)->UseRealTime()->Unit(benchmark::kSecond);

}  // namespace

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  benchmark::AddCustomContext("cpu_kernels", strata::kernels::cpu::describe_cpu_kernels());
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
