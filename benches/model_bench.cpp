// Forward + backward of a whole Llama on the CPU backend (per-unit activation
// checkpointing: every layer is recomputed in its backward).
//
//   model_bench [--model=DIR] [--batch=B] [--seq=T] [--threads=N] [benchmark flags]
//
// DIR is a Hugging Face style directory (config.json + safetensors); without
// it, a ~30M-parameter model (vocab 8192, hidden 512, 8 layers, 8 query / 4
// kv heads) with random weights. benches/model_vs_torch.py runs this next to
// PyTorch on the same weights and threads and prints the ratio.
#include <benchmark/benchmark.h>
#include <fmt/format.h>
#include <tbb/global_control.h>

#include <cstring>
#include <ctime>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "core/checkpoint/safetensors.h"
#include "core/model/model.h"
#include "kernels/cpu/gemm.h"

namespace {

strata::ModelConfig default_config() {
  strata::ModelConfig c;
  c.name = "bench-30m";
  c.vocab_size = 8192;
  c.hidden_size = 512;
  c.intermediate_size = 1376;
  c.num_hidden_layers = 8;
  c.num_attention_heads = 8;
  c.num_key_value_heads = 4;
  c.head_dim = 64;
  c.max_position_embeddings = 2048;
  c.rms_norm_eps = 1e-5;
  c.rope_theta = 10000.0;
  return c;
}

bool take_flag(const char* arg, const char* name, std::string& value) {
  const size_t n = std::strlen(name);
  if (std::strncmp(arg, name, n) != 0 || arg[n] != '=') return false;
  value = arg + n + 1;
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  std::string model_dir, value;
  int64_t B = 1, T = 256;
  int threads = 0;
  std::vector<char*> rest = {argv[0]};
  for (int i = 1; i < argc; ++i) {
    if (take_flag(argv[i], "--model", value)) {
      model_dir = value;
    } else if (take_flag(argv[i], "--batch", value)) {
      B = std::stoll(value);
    } else if (take_flag(argv[i], "--seq", value)) {
      T = std::stoll(value);
    } else if (take_flag(argv[i], "--threads", value)) {
      threads = std::stoi(value);
    } else {
      rest.push_back(argv[i]);
    }
  }
  int rest_count = static_cast<int>(rest.size());
  benchmark::Initialize(&rest_count, rest.data());

  std::unique_ptr<tbb::global_control> thread_limit;
  if (threads > 0) {
    thread_limit = std::make_unique<tbb::global_control>(
        tbb::global_control::max_allowed_parallelism, threads);
  }
  strata::kernels::cpu::set_blas_threads(threads);

  strata::ModelConfig config = default_config();
  if (!model_dir.empty()) {
    strata::Result<strata::ModelConfig> loaded = strata::load_model_config(model_dir);
    if (!loaded.is_ok()) {
      fmt::print(stderr, "model_bench: {}\n", loaded.status().message());
      return 1;
    }
    config = *loaded;
  }
  auto model = std::make_shared<strata::HostModel>(strata::make_host_model(config));
  if (model_dir.empty()) {
    strata::init_host_model(*model, 1);
  } else {
    strata::Result<strata::SafetensorsCheckpoint> ckpt =
        strata::SafetensorsCheckpoint::open(model_dir);
    strata::Status s = ckpt.is_ok() ? strata::load_host_model(*model, *ckpt) : ckpt.status();
    if (!s) {
      fmt::print(stderr, "model_bench: {}\n", s.message());
      return 1;
    }
  }
  auto tokens = std::make_shared<std::vector<int32_t>>(B * T + 1);
  std::mt19937 rng(2);
  for (int32_t& t : *tokens) t = static_cast<int32_t>(rng() % config.vocab_size);
  auto ws = std::make_shared<strata::UnitWorkspace>(config, B, T);

  const std::string name = fmt::format("model_forward_backward/{}/params:{}/B:{}/T:{}", config.name,
                                       config.parameter_count(), B, T);
  benchmark::RegisterBenchmark(
      name.c_str(),
      [=](benchmark::State& state) {
        strata::UnitBatch batch{tokens->data(), tokens->data() + 1, B, T,
                                1.0f / static_cast<float>(B * T)};
        const std::clock_t cpu_start = std::clock();  // every thread of the process
        for (auto _ : state) {
          strata::Result<double> loss = strata::model_forward_backward(*model, batch, *ws);
          benchmark::DoNotOptimize(loss);
        }
        state.counters["process_cpu_s"] = static_cast<double>(std::clock() - cpu_start) /
                                          CLOCKS_PER_SEC / static_cast<double>(state.iterations());
        state.counters["tokens/s"] = benchmark::Counter(
            static_cast<double>(B * T) * state.iterations(), benchmark::Counter::kIsRate);
      })
      ->Unit(benchmark::kMillisecond)
      ->UseRealTime();
  benchmark::AddCustomContext("cpu_kernels", strata::kernels::cpu::describe_cpu_kernels());
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
