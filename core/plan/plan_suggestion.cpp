// The smallest change that fits (plan_with_suggestion, core/plan/planner.h):
// one change of the given plan input at a time, in the order a user would
// pay for it, and when none fits, what even the leanest layout needs and
// what sets the device's share.
#include <fmt/format.h>

#include <algorithm>
#include <functional>

#include "core/plan/planner.h"
#include "io/base/sizes.h"

namespace strata {

// The end of the "none" line when the device is short even with
// everything on NVMe: what sets its need and what would shrink it.
static std::string device_short_line(const PlanInput& input, const PlanInput& leanest,
                                     const PlanReport& lean) {
  // More ranks shard the state, not a gathered unit: the device's working
  // set is the largest unit's, whole on every rank (the leanest plan has the
  // layers in pieces already). A mixture: the fewest groups of experts that fit.
  const int64_t groups_fit = input.model.is_moe() ? expert_groups_that_fit(leanest) : 0;
  const bool dense = input.model.sparse_layer_count() < input.model.num_hidden_layers;
  const int64_t parts_fit = dense && groups_fit == 0 ? mlp_parts_that_fit(leanest) : 0;
  const auto [both_groups, both_parts] =
      dense && input.model.is_moe() && groups_fit == 0 && parts_fit == 0
          ? groups_and_parts_that_fit(leanest)
          : std::pair<int64_t, int64_t>{0, 0};
  const char* pieces =
      input.model.layer_pieces < 2 && !input.layer_pieces_auto ? "--layer-pieces 2 " : "";
  const std::string smaller =
      both_groups > 0 ? fmt::format(
                            ", or {}--expert-groups {} --mlp-parts {} (each sparse layer's experts "
                            "and each dense layer's MLP in that many pieces: the device has room)",
                            pieces, both_groups, both_parts)
      : groups_fit > 0 ? fmt::format(
                             ", or {}--expert-groups {} (each sparse layer's experts in that many "
                             "pieces: the device has room)",
                             pieces, groups_fit)
      : parts_fit > 0
          ? fmt::format(
                ", or {}--mlp-parts {} (each dense layer's MLP in that many parts along its "
                "intermediate dimension: the device has room)",
                pieces, parts_fit)
          : "";
  return fmt::format(
      "{} of the device's need is its parameter slots and unit gradients, sized by the largest "
      "unit, {} ({:.2f}B parameters), whole on every rank at any rank count: a device with more "
      "memory{}",
      format_bytes(double(lean.device_staging_bytes)), lean.largest_unit,
      double(lean.largest_unit_elements) / 1e9, smaller);
}

// The leanest layout of `input`: stage 3, everything on NVMe, micro batch
// 1, the layers in pieces and the vocabulary cut to a piece's size; the
// saved inputs in the first home that fits.
static PlanInput leanest_layout(const PlanInput& input) {
  PlanInput leanest = input;
  leanest.stage = 3;
  leanest.offload_optimizer = OffloadDevice::nvme;
  leanest.offload_param = OffloadDevice::nvme;
  leanest.micro_batch = 1;
  leanest.model.layer_pieces = 2;
  leanest.layer_pieces_auto = false;
  leanest.model.vocab_chunks =
      std::max(leanest.model.vocab_chunks, vocab_chunks_for_layers(leanest));
  leanest.vocab_chunks_auto = false;
  leanest.expert_groups_auto = false;
  leanest.mlp_parts_auto = false;
  leanest.activation_home.reset();
  return leanest;
}

Result<PlanReport> plan_with_suggestion(const PlanInput& input) {
  Result<PlanReport> planned = plan_memory(input);
  if (!planned || planned->fits) return planned;
  PlanReport& plan = *planned;

  struct Candidate {
    std::string description;
    std::function<void(PlanInput&)> apply;
  };
  std::vector<Candidate> candidates;
  const std::string nvme_hint = input.nvme_path_known ? "" : " --nvme-path DIR";
  // The saved inputs, in the home asked for, may be what does not fit: in
  // another home, or (the layer-major order's) not kept at all.
  if (input.activation_home) {
    for (Tier home : {Tier::host, Tier::nvme}) {
      if (home == *input.activation_home) continue;
      candidates.push_back({fmt::format("--activation-home {}{}", tier_name(home),
                                        home == Tier::nvme ? nvme_hint : ""),
                            [home](PlanInput& p) { p.activation_home = home; }});
    }
  }
  if (plan.schedule.schedule == Schedule::layer && input.grad_accum > 1)
    candidates.push_back({"--schedule micro_batch (the layer-major activations do not fit)",
                          [](PlanInput& p) { p.schedule = Schedule::micro_batch; }});
  // The embedding and the head cut to a layer's size, where they are larger.
  if (const int64_t chunks = vocab_chunks_for_layers(input);
      chunks > 1 && input.model.vocab_chunks == 1 && !input.vocab_chunks_auto)
    candidates.push_back({fmt::format("--vocab-chunks {} (the embedding and the head cut to a "
                                      "layer's size)",
                                      chunks),
                          [chunks](PlanInput& p) { p.model.vocab_chunks = chunks; }});
  // Each layer's attention and MLP fetched on their own, where a whole layer
  // does not fit (either backend), with the vocabulary cut to a piece's size
  // where a given cut leaves the embedding or the head larger than one.
  if (input.model.layer_pieces == 1 && !input.layer_pieces_auto) {
    PlanInput cut = input;
    cut.model.layer_pieces = 2;
    const int64_t chunks = input.vocab_chunks_auto ? 0 : vocab_chunks_for_layers(cut);
    const bool more_chunks = chunks > input.model.vocab_chunks;
    candidates.push_back(
        {more_chunks ? fmt::format("--layer-pieces 2 --vocab-chunks {} (each layer's attention and "
                                   "MLP as units of their own, the embedding and the head cut to "
                                   "a piece's size)",
                                   chunks)
                     : "--layer-pieces 2 (each layer's attention and MLP as units of their own)",
         [chunks, more_chunks](PlanInput& p) {
           p.model.layer_pieces = 2;
           if (more_chunks) p.model.vocab_chunks = chunks;
         }});
  }
  if (input.world_size > 1) {
    for (int stage = input.stage + 1; stage <= 3; ++stage) {
      candidates.push_back(
          {fmt::format("--stage {}", stage), [stage](PlanInput& p) { p.stage = stage; }});
    }
  }
  if (input.offload_optimizer == OffloadDevice::none) {
    candidates.push_back({"--offload-optimizer cpu",
                          [](PlanInput& p) { p.offload_optimizer = OffloadDevice::cpu; }});
  }
  if (input.offload_param == OffloadDevice::none) {
    candidates.push_back(
        {"--stage 3 --offload-optimizer cpu --offload-param cpu", [](PlanInput& p) {
           p.stage = 3;
           p.offload_optimizer = OffloadDevice::cpu;
           p.offload_param = OffloadDevice::cpu;
         }});
  }
  if (input.offload_optimizer != OffloadDevice::nvme) {
    candidates.push_back({"--offload-optimizer nvme" + nvme_hint, [](PlanInput& p) {
                            p.offload_optimizer = OffloadDevice::nvme;
                            p.budgets.nvme_per_node.reset();
                          }});
    candidates.push_back(
        {"--stage 3 --offload-optimizer nvme --offload-param cpu" + nvme_hint, [](PlanInput& p) {
           p.stage = 3;
           p.offload_optimizer = OffloadDevice::nvme;
           p.offload_param = OffloadDevice::cpu;
         }});
  }
  if (input.offload_param != OffloadDevice::nvme) {
    candidates.push_back(
        {"--stage 3 --offload-optimizer nvme --offload-param nvme" + nvme_hint, [](PlanInput& p) {
           p.stage = 3;
           p.offload_optimizer = OffloadDevice::nvme;
           p.offload_param = OffloadDevice::nvme;
         }});
  }
  if (input.micro_batch > 1) {
    candidates.push_back(
        {"--micro-batch 1 (raise --grad-accum to keep the global batch)", [](PlanInput& p) {
           p.grad_accum *= p.micro_batch;
           p.micro_batch = 1;
         }});
  }
  // More ranks; where the ranks per node are known, in more nodes of as many
  // (each with its own host memory and NVMe).
  const int per_node = input.budgets.ranks_per_node;
  for (int ranks = input.world_size * 2; ranks <= 1024; ranks *= 2) {
    const std::string nodes =
        per_node > 0 ? fmt::format(", {} nodes of {} ranks", ranks / per_node, per_node) : "";
    candidates.push_back(
        {fmt::format("--world-size {} (at ZeRO stage 3{})", ranks, nodes), [ranks](PlanInput& p) {
           p.world_size = ranks;
           p.stage = 3;
         }});
  }
  for (const Candidate& candidate : candidates) {
    PlanInput changed = input;
    candidate.apply(changed);
    // An NVMe directory that was not given has no known free space: judge the rest.
    if (!input.nvme_path_known) changed.budgets.nvme_per_node.reset();
    if (!validate_plan_input(changed).is_ok()) continue;
    Result<PlanReport> alternative = plan_memory(changed);
    if (alternative && alternative->fits) {
      plan.suggestion = candidate.description;
      return planned;
    }
  }
  // Nothing fits: say what the leanest layout still needs on this node.
  const PlanInput leanest = leanest_layout(input);
  Result<PlanReport> lean_plan = plan_memory(leanest);
  if (!lean_plan) return lean_plan.status();
  const PlanReport& lean = *lean_plan;
  // The cuts the leanest layout takes that the input asked otherwise.
  std::string cuts;
  if (input.model.layer_pieces < 2 && !input.layer_pieces_auto) cuts += " --layer-pieces 2";
  if (leanest.model.vocab_chunks > input.model.vocab_chunks && !input.vocab_chunks_auto)
    cuts += fmt::format(" --vocab-chunks {}", leanest.model.vocab_chunks);
  plan.suggestion = fmt::format(
      "none: even ZeRO stage 3 with everything on NVMe and micro batch 1{} needs {} device per "
      "rank, {} host and {} NVMe on the node; ",
      cuts.empty() ? "" : " (and" + cuts + ")", format_bytes(double(lean.verdicts[0].need)),
      format_bytes(double(lean.verdicts[1].need)), format_bytes(double(lean.verdicts[2].need)));
  if (lean.verdicts[0].fits()) {
    plan.suggestion += "add memory or disk, or spread the ranks over more nodes";
    return planned;
  }
  plan.suggestion += device_short_line(input, leanest, lean);
  return planned;
}

}  // namespace strata
