// Trains with the engine and writes what the reference and memory checks
// compare: per-step losses, gradient norms and learning rates, the final
// weights (a Hugging Face directory, fp32) and the memory the process and the
// tiers used.
//
//   engine_train --model DIR_OR_PRESET --config ds.json --data tokens.bin --steps N
//                [--world W] [--init DIR] [--nvme DIR] [--device-budget 64M]
//                [--host-budget 64M] [--out DIR] [--report report.json] [--seed S]
#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <map>
#include <nlohmann/json.hpp>
#include <string>

#include "core/config/config.h"
#include "core/engine/engine.h"
#include "core/model/model.h"
#include "core/model/model_config.h"
#include "core/data/token_data.h"
#include "io/base/sizes.h"

namespace {

// A line of /proc/self/status ("VmHWM:", "VmRSS:") in bytes.
int64_t status_bytes(const std::string& key) {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind(key, 0) == 0) return std::stoll(line.substr(key.size())) * 1024;
  }
  return -1;
}

}  // namespace

int main(int argc, char** argv) {
  // Resident before any work: the program and the libraries the loader mapped
  // (a CUDA build's cuBLAS among them), which the engine's budgets do not cover.
  const int64_t startup_resident = status_bytes("VmRSS:");
  CLI::App app{"engine_train: the engine on a token file, for reference and memory checks"};
  std::string model_spec, config_path, data_path, init, nvme, out_dir, report_path;
  std::string device_budget = "256M", host_budget = "256M";
  int steps = 3, world = 1;
  uint64_t seed = 1234;
  app.add_option("--model", model_spec)->required();
  app.add_option("--config", config_path)->required();
  app.add_option("--data", data_path)->required();
  app.add_option("--steps", steps);
  app.add_option("--world", world);
  app.add_option("--init", init);
  app.add_option("--nvme", nvme);
  app.add_option("--device-budget", device_budget);
  app.add_option("--host-budget", host_budget);
  app.add_option("--out", out_dir);
  app.add_option("--report", report_path);
  app.add_option("--seed", seed);
  CLI11_PARSE(app, argc, argv);

  auto fail = [](const strata::Status& status) {
    std::fprintf(stderr, "engine_train: %s\n", status.message().c_str());
    return 1;
  };
  strata::Result<strata::ModelConfig> model = strata::load_model_config(model_spec);
  if (!model) return fail(model.status());
  strata::ConfigOverrides overrides;
  overrides.world_size = world;
  strata::Result<strata::TrainConfig> config = strata::load_train_config(config_path, overrides);
  if (!config) return fail(config.status());
  strata::Result<strata::TokenFile> tokens = strata::TokenFile::open(data_path);
  if (!tokens) return fail(tokens.status());
  strata::Result<uint64_t> device = strata::parse_size(device_budget);
  strata::Result<uint64_t> host = strata::parse_size(host_budget);
  if (!device) return fail(device.status());
  if (!host) return fail(host.status());

  auto file = std::make_shared<strata::TokenFile>(std::move(*tokens));
  const int64_t vocab = model->vocab_size;
  strata::EngineOptions options;
  options.model = *model;
  options.config = *config;
  options.total_steps = steps;
  options.budgets.device_per_rank = int64_t(*device);
  options.budgets.host_per_node = int64_t(*host);
  if (!nvme.empty())
    options.nvme_paths = {nvme};
  else
    options.nvme_paths = config->effective_nvme_paths();
  options.seed = seed;
  options.init_checkpoint = init;
  options.pin_host = false;
  options.data = [file, vocab](int64_t offset, int64_t micro, int rank, int world_size, int64_t B,
                               int64_t T, int32_t* inputs, int32_t* targets) {
    return strata::read_micro_batch(*file, offset, micro, rank, world_size, B, T, vocab, inputs,
                                    targets);
  };
  strata::Result<std::unique_ptr<strata::Engine>> engine = strata::Engine::create(options);
  if (!engine) return fail(engine.status());

  nlohmann::ordered_json report;
  report["losses"] = nlohmann::json::array();
  report["grad_norms"] = nlohmann::json::array();
  report["lrs"] = nlohmann::json::array();
  for (int s = 0; s < steps; ++s) {
    strata::Result<strata::StepResult> step = (*engine)->step();
    if (!step) return fail(step.status());
    std::printf("step %d: loss %.6f grad_norm %.4g lr %.3g nvme read %s written %s\n", s + 1,
                step->loss, step->grad_norm, step->lr,
                strata::format_bytes(double(step->nvme_read_bytes)).c_str(),
                strata::format_bytes(double(step->nvme_written_bytes)).c_str());
    report["losses"].push_back(step->loss);
    report["grad_norms"].push_back(step->grad_norm);
    report["lrs"].push_back(step->lr);
  }
  if (strata::Status s = (*engine)->finish(); !s) return fail(s);
  const strata::TrainingPlan& plan = (*engine)->plan();
  // Where the time went: seconds per kind of operation, summed over ranks and steps.
  std::map<std::string, double> seconds;
  for (const strata::OpTiming& t : (*engine)->take_timings())
    seconds[strata::op_kind_name(plan.ops[size_t(t.op)].kind)] += t.end_seconds - t.start_seconds;
  for (const auto& [kind, total] : seconds) {
    std::printf("  %-10s %8.3f s\n", kind.c_str(), total);
    report["op_seconds"][kind] = total;
  }
  for (auto tier :
       {strata::tiers::Tier::device, strata::tiers::Tier::host, strata::tiers::Tier::nvme}) {
    const strata::tiers::TierUsage usage = (*engine)->usage(tier);
    report["tiers"][strata::tiers::tier_name(tier)] = {
        {"peak_bytes_per_rank", usage.peak}, {"plan_peak_bytes_per_rank", plan.peak(tier)}};
  }
  int64_t state = 0;
  for (const strata::PlanBuffer& b : plan.buffers) {
    if (b.name.rfind("parameters (", 0) == 0 || b.name == "gradients (fp32)" ||
        b.name == "fp32 master" || b.name == "Adam m" || b.name == "Adam v")
      state += b.bytes;
  }
  report["training_state_bytes"] = state * world;
  report["device_budget_bytes"] = *device;
  report["host_budget_bytes"] = *host;
  report["nvme_read_bytes"] = (*engine)->nvme_bytes_read();
  report["nvme_written_bytes"] = (*engine)->nvme_bytes_written();
  if (!out_dir.empty()) {
    strata::Result<strata::HostModel> weights = (*engine)->read_model();
    if (!weights) return fail(weights.status());
    if (strata::Status s = strata::save_host_model(*weights, out_dir, strata::DType::f32); !s)
      return fail(s);
  }
  engine->reset();
  report["vm_hwm_bytes"] = status_bytes("VmHWM:");
  report["startup_resident_bytes"] = startup_resident;
  if (!report_path.empty()) {
    std::ofstream out(report_path);
    out << report.dump(2) << "\n";
  }
  return 0;
}
