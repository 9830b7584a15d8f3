#include "core/plan/planner.h"

#include <fmt/format.h>
#include <sys/statvfs.h>

#include <algorithm>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <sstream>

#include "io/base/sizes.h"

namespace strata {
namespace {

// "on NVMe", "in host memory".
std::string kept_where(Tier home) {
  return home == Tier::nvme ? "on NVMe" : fmt::format("in {} memory", tier_name(home));
}

int64_t ceil_div(int64_t a, int64_t b) {
  return (a + b - 1) / b;
}

struct Sizes {
  int64_t parameters = 0;
  int64_t shard = 0;
  int64_t padded = 0;
  int64_t largest_unit = 0;  // padded elements
  std::string largest_name;  // the first unit of that size
  int units = 0;
};

Sizes compute_sizes(const PlanInput& in) {
  Sizes s;
  for (const UnitShape& unit : model_units(in.model)) {
    if (unit.numel <= 0) continue;
    const int64_t shard = padded_shard_elements(unit.numel, in.world_size);
    s.parameters += unit.numel;
    s.shard += shard;
    s.padded += shard * in.world_size;
    if (shard * in.world_size > s.largest_unit) {
      s.largest_unit = shard * in.world_size;
      s.largest_name = unit.name;
    }
    ++s.units;
  }
  return s;
}

}  // namespace

int64_t padded_shard_elements(int64_t numel, int world_size) {
  int64_t per_rank = ceil_div(numel, world_size);
  return ceil_div(per_rank, kShardAlignElements) * kShardAlignElements;
}

int64_t& TierBytes::at(Tier tier) {
  return tier == Tier::device ? device : tier == Tier::host ? host : nvme;
}
int64_t TierBytes::at(Tier tier) const {
  return tier == Tier::device ? device : tier == Tier::host ? host : nvme;
}

Result<TrainingPlan> plan_training(const PlanInput& given, std::string* schedule_reason) {
  Result<PlanInput> chosen = resolve_unit_cuts(given);
  if (!chosen) return chosen.status();
  const PlanInput& input = *chosen;
  PlanInput resolved = input;
  if (input.schedule == Schedule::auto_choice || !input.activation_home) {
    Result<ScheduleChoice> choice = choose_schedule(input);
    if (!choice) return choice.status();
    resolved.schedule = choice->schedule;
    resolved.activation_home = choice->activation_home;
    if (schedule_reason) *schedule_reason = choice->reason;
  } else if (schedule_reason) {
    *schedule_reason = fmt::format("{} (given)", schedule_name(input.schedule));
    if (*input.activation_home != Tier::device)
      *schedule_reason +=
          fmt::format(", saved inputs {} (given)", kept_where(*input.activation_home));
  }
  return build_training_plan(resolved);
}

namespace {

// The links' times at the given bandwidths, and the slowest. Each rank has
// its own share of both collective links (LinkBandwidths).
void time_links(const PlanInput& in, Traffic& t) {
  t.intra_node_seconds = t.intra_node_bytes / in.links.intra_node;
  t.inter_node_seconds = t.inter_node_bytes / in.links.inter_node;
  t.h2d_seconds = t.h2d_bytes / in.links.pcie;
  t.d2h_seconds = t.d2h_bytes / in.links.pcie;
  // Every rank on the node shares the NVMe drives.
  t.nvme_seconds = double(t.nvme_read_bytes + t.nvme_write_bytes) *
                   double(in.budgets.node_ranks(in.world_size)) / in.links.nvme;
  double slowest = 0;
  t.slowest_link.clear();
  for (auto [seconds, name] : {std::pair{t.intra_node_seconds, "intra-node"},
                               std::pair{t.inter_node_seconds, "inter-node"},
                               std::pair{std::max(t.h2d_seconds, t.d2h_seconds), "PCIe"},
                               std::pair{t.nvme_seconds, "NVMe"}}) {
    if (seconds > slowest) {
      slowest = seconds;
      t.slowest_link = name;
    }
  }
}

double slowest_seconds(const Traffic& t) {
  return std::max(
      {t.intra_node_seconds, t.inter_node_seconds, t.h2d_seconds, t.d2h_seconds, t.nvme_seconds});
}

// The bytes each link moves per step and rank: the training plan's operations
// (core/plan/training_plan.h); the ZeRO paper's count beside them.
Traffic plan_traffic(const PlanInput& in, const TrainingPlan& plan, const Sizes& sizes) {
  Traffic t;
  const StepTraffic& s = plan.traffic_per_step;
  t.intra_node_bytes = s.intra_node;
  t.inter_node_bytes = s.inter_node;
  t.h2d_bytes = s.h2d;
  t.d2h_bytes = s.d2h;
  t.nvme_read_bytes = s.nvme_read;
  t.nvme_write_bytes = s.nvme_written;
  if (in.world_size > 1) t.collective_bytes_zero = (in.stage == 3 ? 3 : 2) * 2 * sizes.parameters;
  time_links(in, t);
  return t;
}

// Which summary line of `strata plan` a buffer of the plan belongs to.
enum class BufferKind { state, activation, working_set, staging };

BufferKind buffer_kind(BufferRole role) {
  if (state_shard_kind(role) || role == BufferRole::int8_scales) return BufferKind::state;
  switch (role) {
    case BufferRole::saved_inputs:
    case BufferRole::activation_gradient:
    case BufferRole::head_logits:
    case BufferRole::expert_chain:
    case BufferRole::tokens_and_targets:
    case BufferRole::gpu_saved_inputs:
    case BufferRole::gpu_activation_gradient:
    case BufferRole::gpu_tokens_and_targets:
    case BufferRole::gpu_token_losses:
    case BufferRole::gpu_head_logits:
    case BufferRole::gpu_expert_chain:
    case BufferRole::activation_spill:
      return BufferKind::activation;
    case BufferRole::unit_working_set:
    case BufferRole::gpu_unit_working_set:
    case BufferRole::gpu_matmul_workspace:
      return BufferKind::working_set;
    default:
      return BufferKind::staging;
  }
}

}  // namespace

PlanReport training_plan_report(const PlanInput& in, TrainingPlan built) {
  PlanReport plan;
  plan.input = in;
  const Sizes sizes = compute_sizes(in);
  plan.parameters = sizes.parameters;
  plan.shard_elements = sizes.shard;
  plan.padded_elements = sizes.padded;
  plan.largest_unit_elements = sizes.largest_unit;
  plan.largest_unit = sizes.largest_name;
  plan.units = sizes.units;

  const int w = in.world_size;
  const int node_ranks = in.budgets.node_ranks(w);

  // strata's bytes: the training plan's buffers, as the ranks allocate them.
  plan.buffers = std::move(built.buffers);
  const StateHomes homes = built.homes;
  plan.gradient_home_reason = built.gradient_home_reason;
  plan.expert_fetch_reason = built.expert_fetch_reason;
  plan.expert_update_reason = built.expert_update_reason;
  plan.traffic = plan_traffic(in, built, sizes);
  plan.homes = homes;
  for (const PlanBuffer& b : plan.buffers) {
    plan.total_per_rank.at(b.tier) += b.bytes;
    switch (buffer_kind(b.role)) {
      case BufferKind::state:
        plan.states.push_back({b.name, b.tier, b.bytes});
        plan.model_states.at(b.tier) += b.bytes;
        break;
      case BufferKind::activation:
        plan.saved_activation_bytes += b.bytes;
        break;
      case BufferKind::working_set:
        plan.activation_working_bytes += b.bytes;
        break;
      case BufferKind::staging:
        (b.tier == Tier::device ? plan.device_staging_bytes : plan.host_staging_bytes) += b.bytes;
        break;
    }
  }

  // The ZeRO paper: 2 + 2 + 12 bytes per (unpadded) parameter, divided by the
  // world size where the stage shards it.
  const int64_t n = sizes.parameters;
  auto shard_if = [&](bool sharded, int64_t bytes) { return sharded ? ceil_div(bytes, w) : bytes; };
  plan.states_zero.push_back({"parameters (fp16)", homes.param, shard_if(in.stage == 3, 2 * n)});
  plan.states_zero.push_back({"gradients (fp16)", homes.grad, shard_if(in.stage >= 2, 2 * n)});
  plan.states_zero.push_back(
      {"optimizer states (fp32 master, m, v)", homes.optimizer, shard_if(in.stage >= 1, 12 * n)});
  for (const StateLine& line : plan.states_zero) plan.model_states_zero.at(line.tier) += line.bytes;

  // Budgets: the device per rank; host and NVMe for the ranks on the node.
  const PlanBudgets& budgets = in.budgets;
  plan.verdicts = {
      {Tier::device, plan.total_per_rank.device, budgets.device_per_rank, budgets.device_source},
      {Tier::host, plan.total_per_rank.host * node_ranks, budgets.host_per_node,
       budgets.host_source},
      {Tier::nvme, plan.total_per_rank.nvme * node_ranks, budgets.nvme_per_node,
       budgets.nvme_source},
  };
  plan.fits = std::all_of(plan.verdicts.begin(), plan.verdicts.end(),
                          [](const TierVerdict& v) { return v.fits(); });
  return plan;
}

namespace {

// plan_memory for an input whose schedule and activation home are resolved.
Result<PlanReport> plan_memory_fixed(const PlanInput& in) {
  Result<TrainingPlan> built = build_training_plan(in);
  if (!built) return built.status();
  return training_plan_report(in, std::move(*built));
}

// One schedule's option: its plan with the first activation home that fits
// (device, host, then NVMe where a path is known), or the device's when none
// does. Either order spills its saved inputs out of the device when their
// home is NVMe, or host memory on a GPU (TrainingPlan::activations_spilled);
// only the layer-major order keeps more than one micro-batch's.
Result<std::pair<ScheduleOption, PlanReport>> schedule_option(const PlanInput& in,
                                                              Schedule schedule) {
  const bool nvme_known = in.nvme_path_known || in.offload_param == OffloadDevice::nvme ||
                          in.offload_optimizer == OffloadDevice::nvme;
  std::vector<Tier> homes;
  if (in.activation_home)
    homes = {*in.activation_home};
  else if (nvme_known)
    homes = {Tier::device, Tier::host, Tier::nvme};
  else
    homes = {Tier::device, Tier::host};
  std::optional<std::pair<ScheduleOption, PlanReport>> first;
  for (Tier home : homes) {
    PlanInput fixed = in;
    fixed.schedule = schedule;
    fixed.activation_home = home;
    Result<PlanReport> planned = plan_memory_fixed(fixed);
    if (!planned) return planned.status();
    ScheduleOption option;
    option.schedule = schedule;
    option.activation_home = home;
    option.fits = planned->fits;
    option.traffic = planned->traffic;
    option.slowest_seconds = slowest_seconds(planned->traffic);
    for (const PlanBuffer& b : planned->buffers)
      if (buffer_kind(b.role) == BufferKind::activation) option.activations.at(b.tier) += b.bytes;
    std::pair<ScheduleOption, PlanReport> result{option, std::move(*planned)};
    if (option.fits) return result;
    if (!first) first = std::move(result);
  }
  return std::move(*first);
}

// "2.00 GiB over NVMe"
std::string slowest_bytes(const Traffic& t) {
  if (t.slowest_link == "intra-node")
    return fmt::format("{} over the intra-node link", format_bytes(double(t.intra_node_bytes)));
  if (t.slowest_link == "inter-node")
    return fmt::format("{} over the inter-node link", format_bytes(double(t.inter_node_bytes)));
  if (t.slowest_link == "PCIe")
    return fmt::format("{} over PCIe", format_bytes(double(std::max(t.h2d_bytes, t.d2h_bytes))));
  if (t.slowest_link == "NVMe")
    return fmt::format("{} through NVMe",
                       format_bytes(double(t.nvme_read_bytes + t.nvme_write_bytes)));
  return "nothing";
}

// The choice among the options (micro-batch first), and why. With
// `every_option` false a given schedule is the only option built (a run's
// plan needs no other); `strata plan` shows both.
Result<std::pair<ScheduleChoice, PlanReport>> resolve(const PlanInput& in, bool every_option) {
  const std::vector<Schedule> schedules =
      every_option || in.schedule == Schedule::auto_choice
          ? std::vector<Schedule>{Schedule::micro_batch, Schedule::layer}
          : std::vector<Schedule>{in.schedule};
  ScheduleChoice choice;
  std::vector<PlanReport> plans;
  std::string unavailable;  // why the layer-major order cannot run here
  for (Schedule s : schedules) {
    auto option = schedule_option(in, s);
    if (!option) {
      // Unless it was asked for, the layer-major order not running here is
      // only a reason to take the other.
      if (s == Schedule::layer && in.schedule != Schedule::layer) {
        unavailable = option.status().message();
        continue;
      }
      return option.status();
    }
    choice.options.push_back(option->first);
    plans.push_back(std::move(option->second));
  }
  size_t pick = 0;
  bool home_said = false;  // the reason names where the saved inputs are
  if (in.schedule != Schedule::auto_choice) {
    pick = in.schedule == Schedule::layer && plans.size() > 1 ? 1 : 0;
    choice.reason = fmt::format("{} (given)", schedule_name(in.schedule));
    if (choice.options[pick].schedule == Schedule::layer && in.grad_accum > 1) {
      choice.reason +=
          fmt::format(", saved inputs {}", kept_where(choice.options[pick].activation_home));
      home_said = true;
    }
  } else if (!unavailable.empty()) {
    choice.reason = "micro_batch: " + unavailable;
  } else if (plans.size() < 2 || in.grad_accum == 1) {
    choice.reason = "micro_batch: one micro-batch per step, where both orders are the same";
  } else {
    const ScheduleOption& micro = choice.options[0];
    const ScheduleOption& layer = choice.options[1];
    const int64_t kept = layer.activations.total() - micro.activations.total();
    if (!layer.fits && micro.fits) {
      choice.reason = fmt::format(
          "micro_batch: the layer-major order keeps {} more activations for {} micro-batches, "
          "which do not fit",
          format_bytes(double(kept)), in.grad_accum);
    } else if (layer.fits && !micro.fits) {
      pick = 1;
      choice.reason = fmt::format("layer: the micro-batch order does not fit (saved inputs {})",
                                  kept_where(layer.activation_home));
      home_said = true;
    } else if (layer.slowest_seconds < micro.slowest_seconds) {
      pick = 1;
      home_said = true;
      choice.reason = fmt::format(
          "layer: it moves {} per step where the micro-batch order moves {}, for {} more "
          "activations{}",
          slowest_bytes(layer.traffic), slowest_bytes(micro.traffic), format_bytes(double(kept)),
          layer.activation_home == Tier::device
              ? " in device memory"
              : fmt::format(" ({} of them {})",
                            format_bytes(double(layer.activations.at(layer.activation_home))),
                            kept_where(layer.activation_home)));
    } else {
      choice.reason =
          micro.slowest_seconds == 0
              ? "micro_batch: no link carries parameters, so the layer-major order would save "
                "nothing"
              : fmt::format(
                    "micro_batch: the layer-major order moves as much ({}) and keeps {} "
                    "more activations",
                    slowest_bytes(layer.traffic), format_bytes(double(kept)));
    }
  }
  // Saved inputs out of the device in the order chosen (spilled, or kept in
  // host memory on the CPU backend): said, as what the plan costs.
  if (!home_said && choice.options[pick].activation_home != Tier::device)
    choice.reason +=
        fmt::format(", saved inputs {} ({})", kept_where(choice.options[pick].activation_home),
                    in.activation_home ? "given" : "the device has no room for them");
  choice.schedule = choice.options[pick].schedule;
  choice.activation_home = choice.options[pick].activation_home;
  PlanReport plan = std::move(plans[pick]);
  return std::pair{std::move(choice), std::move(plan)};
}

}  // namespace

Result<ScheduleChoice> choose_schedule(const PlanInput& input) {
  auto resolved = resolve(input, false);
  if (!resolved) return resolved.status();
  return std::move(resolved->first);
}

Result<PlanReport> plan_memory(const PlanInput& given) {
  Result<UnitCutsChoice> chosen = choose_unit_cuts(given);
  if (!chosen) return chosen.status();
  if (chosen->report) return std::move(*chosen->report);
  const PlanInput& input = chosen->input;
  auto resolved = resolve(input, true);
  if (!resolved) return resolved.status();
  PlanReport plan = std::move(resolved->second);
  plan.schedule = std::move(resolved->first);
  return plan;
}

std::optional<int64_t> detect_host_available_bytes() {
  std::ifstream meminfo("/proc/meminfo");
  std::string key;
  int64_t value = 0;
  std::string unit;
  while (meminfo >> key >> value >> unit) {
    if (key == "MemAvailable:") return value * 1024;
  }
  return std::nullopt;
}

std::optional<int64_t> detect_free_bytes(const std::vector<std::string>& directories) {
  if (directories.empty()) return std::nullopt;
  // Striped evenly: the fullest directory bounds what the stripe set can hold.
  std::optional<int64_t> smallest;
  for (const std::string& dir : directories) {
    struct statvfs fs {};
    if (statvfs(dir.c_str(), &fs) != 0) return std::nullopt;
    int64_t free_bytes = static_cast<int64_t>(fs.f_bavail) * static_cast<int64_t>(fs.f_frsize);
    smallest = smallest ? std::min(*smallest, free_bytes) : free_bytes;
  }
  return *smallest * static_cast<int64_t>(directories.size());
}

namespace {

std::string cell(int64_t bytes) {
  return bytes == 0 ? "-" : format_bytes(static_cast<double>(bytes));
}

// Bytes per model parameter, "-" for none.
std::string per_parameter(int64_t bytes, int64_t parameters) {
  if (bytes == 0 || parameters <= 0) return "-";
  return fmt::format("{:.2f}", double(bytes) / double(parameters));
}

void row(std::ostringstream& out, const std::string& label, const TierBytes& bytes) {
  out << fmt::format("  {:<56}{:>14}{:>14}{:>14}\n", label, cell(bytes.device), cell(bytes.host),
                     cell(bytes.nvme));
}

}  // namespace

// The traffic section of format_plan_table: each link's bytes per step and
// rank, its time, and the slowest.
static void format_traffic(std::ostringstream& out, const PlanReport& plan,
                           const std::string& everyone) {
  const PlanInput& in = plan.input;
  const int nodes = in.budgets.nodes(in.world_size);
  const int node_ranks = in.budgets.node_ranks(in.world_size);
  const Traffic& t = plan.traffic;
  auto link = [&](const char* label, int64_t bytes, double bandwidth, double seconds) {
    if (bytes == 0) {
      out << fmt::format("  {:<17}none\n", label);
    } else {
      out << fmt::format("  {:<17}{:>12} at {}/s: {} ({} B per parameter, {})\n", label,
                         format_bytes(double(bytes)), format_bytes(bandwidth),
                         format_seconds(seconds),
                         per_parameter(bytes * in.world_size, plan.parameters), everyone);
    }
  };
  if (nodes > 1) {
    // Each collective reduces (or gathers) within the node, then across the nodes.
    out << fmt::format(
        "\ntraffic per step and rank (collectives within each node of {} ranks, "
        "then across the {} nodes)\n",
        node_ranks, nodes);
    out << fmt::format("  collectives      {:>12} in all (ZeRO paper's count: {})\n",
                       format_bytes(double(t.collective_bytes())),
                       format_bytes(double(t.collective_bytes_zero)));
    link("intra-node", t.intra_node_bytes, in.links.intra_node, t.intra_node_seconds);
    link("inter-node", t.inter_node_bytes, in.links.inter_node, t.inter_node_seconds);
  } else if (in.world_size > 1) {
    out << "\ntraffic per step and rank\n";
    out << fmt::format("  collectives      {:>12} at {}/s: {} (ZeRO paper's count: {})\n",
                       format_bytes(double(t.collective_bytes())),
                       format_bytes(in.links.intra_node), format_seconds(t.intra_node_seconds),
                       format_bytes(double(t.collective_bytes_zero)));
  } else {
    out << "\ntraffic per step and rank\n";
    out << "  collectives      none (one rank)\n";
  }
  link("PCIe host->dev", t.h2d_bytes, in.links.pcie, t.h2d_seconds);
  link("PCIe dev->host", t.d2h_bytes, in.links.pcie, t.d2h_seconds);
  if (t.nvme_read_bytes + t.nvme_write_bytes == 0) {
    out << "  NVMe             none\n";
  } else {
    out << fmt::format(
        "  NVMe read/write  {:>12} / {} at {}/s shared by the node: {} ({} / {} B per "
        "parameter, {})\n",
        format_bytes(double(t.nvme_read_bytes)), format_bytes(double(t.nvme_write_bytes)),
        format_bytes(in.links.nvme), format_seconds(t.nvme_seconds),
        per_parameter(t.nvme_read_bytes * in.world_size, plan.parameters),
        per_parameter(t.nvme_write_bytes * in.world_size, plan.parameters), everyone);
  }
  if (!t.slowest_link.empty())
    out << fmt::format("  slowest link: {} ({} per step)\n", t.slowest_link,
                       format_seconds(slowest_seconds(t)));
}

std::string format_plan_table(const PlanReport& plan, bool zero_accounting) {
  const PlanInput& in = plan.input;
  std::ostringstream out;
  std::string model = fmt::format("{} ({} parameters, {} units)", in.model.name,
                                  format_count(static_cast<double>(plan.parameters)), plan.units);
  out << fmt::format("strata plan: {}\n", model);
  const int nodes = in.budgets.nodes(in.world_size);
  const int node_ranks = in.budgets.node_ranks(in.world_size);
  // Bytes per parameter are over every rank: the node's with one node.
  const std::string everyone = nodes > 1 ? fmt::format("{} nodes", nodes) : "node";
  const std::string world =
      nodes > 1 ? fmt::format("{} ({} nodes x {} ranks)", in.world_size, nodes, node_ranks)
                : std::to_string(in.world_size);
  out << fmt::format("  world size {}, ZeRO stage {}, {}; offload optimizer {}, params {}\n", world,
                     in.stage, precision_name(in.precision),
                     offload_device_name(in.offload_optimizer),
                     offload_device_name(in.offload_param));
  out << fmt::format("  Adam m and v in {}; {}\n", optimizer_state_dtype_name(in.optimizer_state),
                     plan.gradient_home_reason);
  out << fmt::format("  micro batch {} x sequence {}, gradient accumulation {}; {}\n",
                     in.micro_batch, in.seq_len, in.grad_accum,
                     in.gpu ? "CUDA backend (the device is a GPU)"
                            : "CPU backend (host memory stands in for the device)");
  if (in.model.vocab_chunks > 1 || !in.vocab_chunks_reason.empty())
    out << fmt::format("  vocabulary chunks: {}\n", vocabulary_chunks_line(in));
  if (in.model.layer_pieces > 1 || !in.layer_pieces_reason.empty())
    out << fmt::format("  layer pieces: {}\n", layer_pieces_line(in));
  if (in.model.expert_groups > 1 || !in.expert_groups_reason.empty())
    out << fmt::format("  expert groups: {}\n", expert_groups_line(in));
  if (in.model.mlp_parts > 1 || !in.mlp_parts_reason.empty())
    out << fmt::format("  MLP parts: {}\n", mlp_parts_line(in));
  if (!plan.expert_fetch_reason.empty())
    out << fmt::format("  expert fetch: {}\n", plan.expert_fetch_reason);
  if (!plan.expert_update_reason.empty())
    out << fmt::format("  expert update: {}\n", plan.expert_update_reason);
  out << fmt::format("\nper rank ({} accounting){:>{}}{:>14}{:>14}\n",
                     zero_accounting ? "ZeRO paper's 2+2+12 bytes" : "strata's", "device",
                     zero_accounting ? 26 : 40, "host", "nvme");
  for (const StateLine& line : zero_accounting ? plan.states_zero : plan.states) {
    TierBytes bytes;
    bytes.at(line.tier) = line.bytes;
    row(out, line.name, bytes);
  }
  const TierBytes& states = zero_accounting ? plan.model_states_zero : plan.model_states;
  row(out, "model states", states);
  if (!zero_accounting && plan.parameters > 0) {
    // What each kind of state costs per parameter over the ranks, and where.
    std::string parts;
    for (const StateLine& line : plan.states)
      parts += fmt::format("{}{} {} ({})", parts.empty() ? "" : ", ", line.name,
                           per_parameter(line.bytes * in.world_size, plan.parameters),
                           tier_name(line.tier));
    out << fmt::format("  model states per parameter ({}, bytes): {} = {}\n", everyone, parts,
                       per_parameter(states.total() * in.world_size, plan.parameters));
  }
  // The rest of the training plan's buffers, as a rank allocates them.
  for (const PlanBuffer& b : plan.buffers) {
    if (buffer_kind(b.role) == BufferKind::state) continue;
    TierBytes bytes;
    bytes.at(b.tier) = b.bytes;
    row(out, b.name, bytes);
  }
  row(out, "total per rank (strata)", plan.total_per_rank);
  auto times = [&](int ranks) {
    return TierBytes{plan.total_per_rank.device * ranks, plan.total_per_rank.host * ranks,
                     plan.total_per_rank.nvme * ranks};
  };
  if (node_ranks > 1) row(out, fmt::format("node total ({} ranks)", node_ranks), times(node_ranks));
  if (nodes > 1)
    row(out, fmt::format("all {} nodes ({} ranks)", nodes, in.world_size), times(in.world_size));
  // What each choice costs, whatever the model's size: bytes per parameter over the ranks.
  const TierBytes all = times(in.world_size);
  out << fmt::format(
      "  {:<56}{:>14}{:>14}{:>14}\n", fmt::format("bytes per parameter ({})", everyone),
      per_parameter(all.device, plan.parameters), per_parameter(all.host, plan.parameters),
      per_parameter(all.nvme, plan.parameters));

  out << "\nbudget\n";
  for (const TierVerdict& v : plan.verdicts) {
    if (v.need == 0 && !v.budget) continue;
    std::string scope = v.tier == Tier::device ? "per rank" : "per node";
    if (!v.budget) {
      out << fmt::format("  {:<7} needs {} ({}); no budget known ({})\n", tier_name(v.tier),
                         format_bytes(double(v.need)), scope,
                         v.tier == Tier::device ? "give --device-mem-limit"
                         : v.tier == Tier::host ? "give --host-mem-limit"
                                                : "give --nvme-path");
      continue;
    }
    std::string verdict = v.fits() ? "fits"
                                   : fmt::format("DOES NOT FIT: over by {}",
                                                 format_bytes(double(v.need - *v.budget)));
    out << fmt::format("  {:<7} needs {} of {} ({}, {}): {}\n", tier_name(v.tier),
                       format_bytes(double(v.need)), format_bytes(double(*v.budget)), scope,
                       v.budget_source, verdict);
  }
  out << (plan.fits ? "  verdict: fits\n"
                    : fmt::format("  verdict: does not fit; smallest change that fits: {}\n",
                                  plan.suggestion));

  format_traffic(out, plan, everyone);

  // The schedules side by side: what each moves per step and keeps for the backward.
  const ScheduleChoice& choice = plan.schedule;
  out << fmt::format("\nschedule: {}\n", choice.reason);
  if (choice.options.size() > 1) {
    out << fmt::format("  {:<12}{:>12}{:>12}{:>12}{:>12}{:>12}{:>14}{:>12}{:>12}  {}\n", "per step",
                       "collectives", "PCIe h2d", "PCIe d2h", "NVMe read", "NVMe write",
                       "act. device", "act. host", "act. NVMe", "fits");
    for (const ScheduleOption& o : choice.options) {
      out << fmt::format("  {:<12}{:>12}{:>12}{:>12}{:>12}{:>12}{:>14}{:>12}{:>12}  {}\n",
                         schedule_name(o.schedule), cell(o.traffic.collective_bytes()),
                         cell(o.traffic.h2d_bytes), cell(o.traffic.d2h_bytes),
                         cell(o.traffic.nvme_read_bytes), cell(o.traffic.nvme_write_bytes),
                         cell(o.activations.device), cell(o.activations.host),
                         cell(o.activations.nvme), o.fits ? "yes" : "no");
    }
  }
  return out.str();
}

nlohmann::ordered_json plan_to_json(const PlanReport& plan, bool zero_accounting) {
  using json = nlohmann::ordered_json;
  const PlanInput& in = plan.input;
  auto tiers = [](const TierBytes& b) {
    return json{{"device_bytes", b.device}, {"host_bytes", b.host}, {"nvme_bytes", b.nvme}};
  };
  auto lines = [](const std::vector<StateLine>& states) {
    json out = json::array();
    for (const StateLine& s : states)
      out.push_back({{"name", s.name}, {"tier", tier_name(s.tier)}, {"bytes", s.bytes}});
    return out;
  };
  json j;
  j["model"] = in.model.name;
  j["parameters"] = plan.parameters;
  j["units"] = plan.units;
  j["vocab_chunks"] = {{"chunks", in.model.vocab_chunks},
                       {"reason", vocabulary_chunks_line(in)}};
  j["layer_pieces"] = {{"pieces", in.model.layer_pieces}, {"reason", layer_pieces_line(in)}};
  if (in.model.is_moe())
    j["expert_groups"] = {{"groups", in.model.expert_groups}, {"reason", expert_groups_line(in)}};
  if (in.model.sparse_layer_count() < in.model.num_hidden_layers)
    j["mlp_parts"] = {{"parts", in.model.mlp_parts}, {"reason", mlp_parts_line(in)}};
  j["world_size"] = in.world_size;
  j["nodes"] = in.budgets.nodes(in.world_size);
  j["ranks_per_node"] = in.budgets.node_ranks(in.world_size);
  j["stage"] = in.stage;
  j["precision"] = precision_name(in.precision);
  j["offload_optimizer"] = offload_device_name(in.offload_optimizer);
  j["offload_param"] = offload_device_name(in.offload_param);
  j["micro_batch"] = in.micro_batch;
  j["seq_len"] = in.seq_len;
  j["grad_accum"] = in.grad_accum;
  j["optimizer_state_dtype"] = optimizer_state_dtype_name(in.optimizer_state);
  j["gradient_home"] = tier_name(plan.homes.grad);
  j["gradient_bf16"] = plan.homes.grad_bf16;
  j["gradient_home_reason"] = plan.gradient_home_reason;
  if (!plan.expert_fetch_reason.empty()) j["expert_fetch"] = plan.expert_fetch_reason;
  if (!plan.expert_update_reason.empty()) j["expert_update"] = plan.expert_update_reason;
  j["accounting"] = zero_accounting ? "zero" : "strata";
  j["per_rank"] = tiers(zero_accounting ? plan.model_states_zero : plan.model_states);
  j["per_rank"]["states"] = lines(zero_accounting ? plan.states_zero : plan.states);
  j["per_rank_strata"] = tiers(plan.model_states);
  j["per_rank_zero"] = tiers(plan.model_states_zero);
  j["shard_elements"] = plan.shard_elements;
  j["backend"] = in.gpu ? "cuda" : "cpu";
  json buffers = json::array();
  for (const PlanBuffer& b : plan.buffers)
    buffers.push_back({{"name", b.name},
                       {"role", buffer_role_name(b.role)},
                       {"tier", tier_name(b.tier)},
                       {"bytes", b.bytes}});
  j["buffers"] = buffers;
  j["activations"] = {{"saved_bytes", plan.saved_activation_bytes},
                      {"working_bytes", plan.activation_working_bytes}};
  j["staging"] = {{"device_bytes", plan.device_staging_bytes},
                  {"host_bytes", plan.host_staging_bytes}};
  j["total_per_rank"] = tiers(plan.total_per_rank);
  // The node's bytes per model parameter: memory per tier, and traffic per link per step.
  const int64_t w = in.world_size;
  auto per = [&](int64_t bytes) {
    return plan.parameters > 0 ? double(bytes * w) / double(plan.parameters) : 0.0;
  };
  j["bytes_per_parameter"] = {{"device", per(plan.total_per_rank.device)},
                              {"host", per(plan.total_per_rank.host)},
                              {"nvme", per(plan.total_per_rank.nvme)},
                              {"collectives_per_step", per(plan.traffic.collective_bytes())},
                              {"intra_node_per_step", per(plan.traffic.intra_node_bytes)},
                              {"inter_node_per_step", per(plan.traffic.inter_node_bytes)},
                              {"pcie_h2d_per_step", per(plan.traffic.h2d_bytes)},
                              {"pcie_d2h_per_step", per(plan.traffic.d2h_bytes)},
                              {"nvme_read_per_step", per(plan.traffic.nvme_read_bytes)},
                              {"nvme_write_per_step", per(plan.traffic.nvme_write_bytes)}};
  json verdicts = json::array();
  for (const TierVerdict& v : plan.verdicts) {
    verdicts.push_back({{"tier", tier_name(v.tier)},
                        {"need_bytes", v.need},
                        {"budget_bytes", v.budget ? json(*v.budget) : json(nullptr)},
                        {"budget_source", v.budget ? json(v.budget_source) : json(nullptr)},
                        {"fits", v.fits()}});
  }
  j["budgets"] = verdicts;
  j["fits"] = plan.fits;
  j["suggestion"] = plan.fits ? json(nullptr) : json(plan.suggestion);
  json options = json::array();
  for (const ScheduleOption& o : plan.schedule.options)
    options.push_back({{"schedule", schedule_name(o.schedule)},
                       {"activation_home", tier_name(o.activation_home)},
                       {"fits", o.fits},
                       {"collective_bytes", o.traffic.collective_bytes()},
                       {"intra_node_bytes", o.traffic.intra_node_bytes},
                       {"inter_node_bytes", o.traffic.inter_node_bytes},
                       {"h2d_bytes", o.traffic.h2d_bytes},
                       {"d2h_bytes", o.traffic.d2h_bytes},
                       {"nvme_read_bytes", o.traffic.nvme_read_bytes},
                       {"nvme_write_bytes", o.traffic.nvme_write_bytes},
                       {"activation_bytes", tiers(o.activations)},
                       {"slowest_seconds", o.slowest_seconds}});
  j["schedule"] = {{"chosen", schedule_name(plan.schedule.schedule)},
                   {"activation_home", tier_name(plan.schedule.activation_home)},
                   {"reason", plan.schedule.reason},
                   {"options", options}};
  const Traffic& t = plan.traffic;
  j["traffic"] = {{"collective_bytes", t.collective_bytes()},
                  {"collective_bytes_zero", t.collective_bytes_zero},
                  {"intra_node_bytes", t.intra_node_bytes},
                  {"intra_node_seconds", t.intra_node_seconds},
                  {"inter_node_bytes", t.inter_node_bytes},
                  {"inter_node_seconds", t.inter_node_seconds},
                  {"h2d_bytes", t.h2d_bytes},
                  {"d2h_bytes", t.d2h_bytes},
                  {"h2d_seconds", t.h2d_seconds},
                  {"d2h_seconds", t.d2h_seconds},
                  {"nvme_read_bytes", t.nvme_read_bytes},
                  {"nvme_write_bytes", t.nvme_write_bytes},
                  {"nvme_seconds", t.nvme_seconds},
                  {"intra_node_bandwidth", in.links.intra_node},
                  {"inter_node_bandwidth", in.links.inter_node},
                  {"pcie_bandwidth", in.links.pcie},
                  {"nvme_bandwidth", in.links.nvme},
                  {"slowest_link", t.slowest_link.empty() ? json(nullptr) : json(t.slowest_link)},
                  {"slowest_seconds", slowest_seconds(t)}};
  return j;
}

}  // namespace strata
