// A model whose training state is at least 4x the host budget and 8x the
// device budget trains in a child process whose peak resident memory (VmHWM),
// less what was resident when it started (the program and the libraries the
// loader mapped: a CUDA build loads cuBLAS, about 150 MiB resident, whether or
// not it computes on a GPU), stays under the host budget plus the device
// budget (host memory stands in for the device on the CPU backend) plus a
// fixed overhead of kOverheadBytes: thread stacks, BLAS and TBB scratch, and
// one unit's fp32 parameters while the model is initialised.
#include <gtest/gtest.h>
#include <spawn.h>
#include <sys/wait.h>

#include <fstream>
#include <nlohmann/json.hpp>

#include "engine_test_support.h"

extern char** environ;

namespace strata {
namespace {

constexpr int64_t kOverheadBytes = int64_t{64} << 20;  // measured: about 16 MiB over the budgets

ModelConfig deep_narrow_model() {
  ModelConfig c;
  c.vocab_size = 512;
  c.hidden_size = 256;
  c.intermediate_size = 768;
  c.num_hidden_layers = 24;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.head_dim = 64;
  c.max_position_embeddings = 256;
  c.rope_theta = 10000.0;
  return c;
}

int run_child(const std::vector<std::string>& args) {
  std::vector<char*> argv;
  for (const std::string& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  pid_t pid = 0;
  if (posix_spawn(&pid, argv[0], nullptr, nullptr, argv.data(), environ) != 0) return -1;
  int status = 0;
  if (waitpid(pid, &status, 0) != pid) return -1;
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

TEST(EngineMemory, TrainsAStateFourTimesTheHostBudgetWithinIt) {
  io::testing::TemporaryDirectory dir;
  if (std::string why = dir.why_unusable(); !why.empty()) GTEST_SKIP() << why;
  const uint64_t seed = tiers::testing::fresh_seed("engine_memory");
  const ModelConfig model = deep_narrow_model();

  nlohmann::json ds = {
      {"train_micro_batch_size_per_gpu", 1},
      {"gradient_accumulation_steps", 2},
      {"gradient_clipping", 1.0},
      {"bf16", {{"enabled", true}}},
      {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", 1e-3}}}}},
      {"zero_optimization",
       {{"stage", 3},
        {"sub_group_size", 65536},
        {"offload_param", {{"device", "nvme"}, {"nvme_path", dir.path()}, {"buffer_count", 1}}},
        {"offload_optimizer",
         {{"device", "nvme"}, {"nvme_path", dir.path()}, {"buffer_count", 2}}}}},
      {"aio", {{"block_size", 262144}, {"queue_depth", 8}}},
      {"strata", {{"seq_len", 32}}}};
  // Budgets from the plan itself: what it needs, rounded up to a MiB.
  Result<TrainConfig> config = train_config_from_json(ds, "memory test", {});
  ASSERT_TRUE(config.is_ok()) << config.status().message();
  Result<TrainingPlan> plan = plan_training(plan_input_from_config(*config, model));
  ASSERT_TRUE(plan.is_ok()) << plan.status().message();
  const int64_t mib = 1 << 20;
  const int64_t device_budget = (plan->peak(tiers::Tier::device) + mib) / mib * mib;
  const int64_t host_budget = (plan->peak(tiers::Tier::host) + mib) / mib * mib;
  int64_t state = 0;
  for (const PlanBuffer& b : plan->buffers) {
    if (b.name.rfind("parameters (", 0) == 0 || b.name == "gradients (fp32)" ||
        b.name == "fp32 master" || b.name == "Adam m" || b.name == "Adam v")
      state += b.bytes;
  }
  std::printf(
      "training state %.1f MiB, host budget %.1f MiB (%.2fx), device budget %.1f MiB (%.2fx)\n",
      double(state) / mib, double(host_budget) / mib, double(state) / host_budget,
      double(device_budget) / mib, double(state) / device_budget);
  ASSERT_GE(state, 4 * host_budget);
  ASSERT_GE(state, 8 * device_budget);

  const std::string model_path = dir.path() + "/config.json";
  std::ofstream(model_path) << model_config_to_json(model).dump();
  const std::string config_path = dir.path() + "/ds.json";
  std::ofstream(config_path) << ds.dump();
  const std::vector<int32_t> tokens = testing::random_tokens(8192, model.vocab_size, seed);
  std::vector<uint16_t> narrow(tokens.begin(), tokens.end());
  const std::string data_path = dir.path() + "/tokens.bin";
  std::ofstream(data_path, std::ios::binary)
      .write(reinterpret_cast<const char*>(narrow.data()), std::streamsize(narrow.size() * 2));
  const std::string report_path = dir.path() + "/report.json";

  const int status =
      run_child({std::string(STRATA_TEST_DRIVERS) + "/engine_train", "--model", model_path,
                 "--config", config_path, "--data", data_path, "--steps", "2", "--device-budget",
                 std::to_string(device_budget), "--host-budget", std::to_string(host_budget),
                 "--report", report_path, "--seed", std::to_string(seed)});
  ASSERT_EQ(status, 0);
  nlohmann::json report = nlohmann::json::parse(std::ifstream(report_path));
  const int64_t startup = report["startup_resident_bytes"];
  const int64_t hwm = int64_t(report["vm_hwm_bytes"]) - startup;
  std::printf(
      "VmHWM %.1f MiB above the %.1f MiB resident at start; limit %.1f MiB (host + device "
      "budgets + %.0f MiB overhead)\n",
      double(hwm) / mib, double(startup) / mib,
      double(host_budget + device_budget + kOverheadBytes) / mib, double(kOverheadBytes) / mib);
  ASSERT_GT(startup, 0);
  EXPECT_LT(hwm, host_budget + device_budget + kOverheadBytes);
  EXPECT_GT(int64_t(report["nvme_read_bytes"]), state / 2);
  for (const char* tier : {"device", "host"})
    EXPECT_LE(int64_t(report["tiers"][tier]["peak_bytes_per_rank"]),
              int64_t(report["tiers"][tier]["plan_peak_bytes_per_rank"]))
        << tier;
}

}  // namespace
}  // namespace strata
