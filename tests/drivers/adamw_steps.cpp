// Runs the optimizer driver for a few steps on data written by tests/adamw_ref.py.
//
//   adamw_steps DIR
//
// Reads DIR/config.json (tensor shapes, steps, gradient and copy types, AdamW,
// clipping, scheduler and fp16 options), DIR/params.bin (fp32, all tensors
// concatenated) and DIR/grads_<k>.bin (step k's gradients in the gradient
// type, k = 0..steps-1). Writes DIR/out_master.bin, out_exp_avg.bin,
// out_exp_avg_sq.bin, out_copy.bin (when there is a copy) and out_log.json
// (one StepDecision per step). Exits 1 with a message on any error.
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iterator>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <string>
#include <vector>

#include "core/optimizer/optimizer.h"

namespace {

using strata::kernels::cpu::ElementType;

std::vector<char> read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("cannot read " + path);
  return std::vector<char>(std::istreambuf_iterator<char>(in), {});
}

void write_bytes(const std::string& path, const void* data, size_t bytes) {
  std::ofstream out(path, std::ios::binary);
  out.write(static_cast<const char*>(data), static_cast<std::streamsize>(bytes));
  if (!out) throw std::runtime_error("cannot write " + path);
}

ElementType element_type(const std::string& name) {
  if (name == "fp32") return ElementType::f32;
  if (name == "bf16") return ElementType::bf16;
  if (name == "fp16") return ElementType::f16;
  throw std::runtime_error("unknown element type " + name);
}

template <typename T>
T value_or(const nlohmann::json& object, const char* key, T fallback) {
  return object.contains(key) ? object.at(key).get<T>() : fallback;
}

strata::OptimizerOptions options_from(const nlohmann::json& config) {
  strata::OptimizerOptions o;
  const nlohmann::json& a = config.at("adamw");
  o.adamw.lr = a.at("lr");
  o.adamw.beta1 = a.at("beta1");
  o.adamw.beta2 = a.at("beta2");
  o.adamw.eps = a.at("eps");
  o.adamw.weight_decay = a.at("weight_decay");
  o.adamw.adam_w_mode = value_or(a, "adam_w_mode", true);
  o.gradient_clipping = value_or(config, "gradient_clipping", 0.0);
  if (config.contains("scheduler")) {
    const nlohmann::json& s = config.at("scheduler");
    auto type = strata::parse_lr_schedule_type(s.at("type").get<std::string>());
    if (!type) throw std::runtime_error(type.status().message());
    o.lr_schedule.type = *type;
    auto warmup = strata::parse_warmup_type(value_or<std::string>(s, "warmup_type", "log"));
    if (!warmup) throw std::runtime_error(warmup.status().message());
    o.lr_schedule.warmup_type = *warmup;
    o.lr_schedule.warmup_min_lr = value_or(s, "warmup_min_lr", 0.0);
    if (s.contains("warmup_max_lr"))
      o.lr_schedule.warmup_max_lr = s.at("warmup_max_lr").get<double>();
    o.lr_schedule.warmup_num_steps = value_or<int64_t>(s, "warmup_num_steps", 1000);
    o.lr_schedule.total_num_steps = value_or<int64_t>(s, "total_num_steps", 0);
    o.lr_schedule.warmup_min_ratio = value_or(s, "warmup_min_ratio", 0.0);
    o.lr_schedule.cos_min_ratio = value_or(s, "cos_min_ratio", 0.0001);
  }
  if (config.contains("fp16")) {
    const nlohmann::json& f = config.at("fp16");
    o.loss_scaler.enabled = value_or(f, "enabled", false);
    o.loss_scaler.initial_scale_power = value_or(f, "initial_scale_power", 16);
    o.loss_scaler.hysteresis = value_or(f, "hysteresis", 2);
    o.loss_scaler.loss_scale_window = value_or<int64_t>(f, "loss_scale_window", 1000);
  }
  return o;
}

int run(const std::string& dir) {
  std::ifstream config_file(dir + "/config.json");
  const nlohmann::json config = nlohmann::json::parse(config_file);
  const ElementType grad_type = element_type(config.at("grad_type"));
  const std::string copy_name = config.at("copy_type");
  const int steps = config.at("steps");

  std::vector<strata::ShardSegment> segments;
  int64_t numel = 0;
  for (const auto& tensor : config.at("tensors")) {
    const std::vector<int64_t> shape = tensor.at("shape");
    int64_t count = 1;
    for (int64_t d : shape) count *= d;
    segments.push_back({numel, numel + count, strata::param_group_for_shape(shape)});
    numel += count;
  }
  const std::vector<char> params = read_bytes(dir + "/params.bin");
  if (static_cast<int64_t>(params.size()) != numel * 4) throw std::runtime_error("params.bin size");
  std::vector<float> master(numel), exp_avg(numel, 0.0f), exp_avg_sq(numel, 0.0f);
  std::memcpy(master.data(), params.data(), params.size());
  std::vector<uint16_t> copy(numel, 0);

  strata::Result<strata::Optimizer> created = strata::Optimizer::create(options_from(config));
  if (!created) throw std::runtime_error(created.status().message());
  strata::Optimizer& optimizer = created.value();

  nlohmann::json log = nlohmann::json::array();
  for (int k = 0; k < steps; ++k) {
    const std::vector<char> grad = read_bytes(dir + "/grads_" + std::to_string(k) + ".bin");
    if (static_cast<int64_t>(grad.size()) !=
        numel * static_cast<int64_t>(strata::kernels::cpu::element_size(grad_type))) {
      throw std::runtime_error("grads size at step " + std::to_string(k));
    }
    const double loss_scale = optimizer.loss_scale();
    auto norm = strata::kernels::cpu::grad_norm_squared(grad.data(), grad_type, numel);
    if (!norm) throw std::runtime_error(norm.status().message());
    auto plan = optimizer.begin_step(*norm);
    if (!plan) throw std::runtime_error(plan.status().message());
    strata::kernels::cpu::AdamWShard shard;
    shard.numel = numel;
    shard.master = master.data();
    shard.exp_avg = exp_avg.data();
    shard.exp_avg_sq = exp_avg_sq.data();
    shard.grad = grad.data();
    shard.grad_type = grad_type;
    if (copy_name != "none") {
      shard.copy = copy.data();
      shard.copy_type = element_type(copy_name);
    }
    shard.segments = segments;
    if (strata::Status status = optimizer.update_shard(*plan, shard); !status) {
      throw std::runtime_error(status.message());
    }
    log.push_back({{"apply", plan->apply},
                   {"overflow", plan->overflow},
                   {"step", plan->step},
                   {"lr", plan->lr},
                   {"grad_norm", plan->apply ? plan->grad_norm : 0.0},
                   {"clip_coef", plan->clip_coef},
                   {"loss_scale", loss_scale}});
  }
  write_bytes(dir + "/out_master.bin", master.data(), master.size() * 4);
  write_bytes(dir + "/out_exp_avg.bin", exp_avg.data(), exp_avg.size() * 4);
  write_bytes(dir + "/out_exp_avg_sq.bin", exp_avg_sq.data(), exp_avg_sq.size() * 4);
  if (copy_name != "none") write_bytes(dir + "/out_copy.bin", copy.data(), copy.size() * 2);
  std::ofstream(dir + "/out_log.json") << log.dump(1);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: adamw_steps DIR\n");
    return 2;
  }
  try {
    return run(argv[1]);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "adamw_steps: %s\n", e.what());
    return 1;
  }
}
