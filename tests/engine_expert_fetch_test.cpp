// Routed expert fetch (core/plan/expert_fetch.h): a mixture with its
// parameters on NVMe at stage 3, one rank, the layers in pieces, reads a
// sparse layer's experts only when its micro-batches' tokens reach them,
// whether its MLP piece is whole or cut into groups of experts.
// Training gives the bits of reading every expert, in both schedules, fp32
// and bf16; the NVMe bytes each step reads are what the plan counts for that
// step's routing, below its worst case and below what a dense model with as
// many MLP parameters reads; the plan says why it routes or not.
#include <gtest/gtest.h>

#include <algorithm>

#include "core/plan/expert_fetch.h"
#include "engine_test_support.h"
#include "io/base/sizes.h"

namespace strata {
namespace {

using testing::EngineOutcome;
using testing::EngineRun;

class EngineExpertFetch : public testing::EngineRunsTest {
 protected:
  EngineExpertFetch() : EngineRunsTest("engine_expert_fetch") {}
};

// 16 experts of 64, top 1, four tokens a micro-batch: each micro-batch
// reaches at most 4 of a layer's 16 experts. The optimizer in host memory,
// so every NVMe read is a parameter's.
EngineRun routed_run(const std::string& schedule, const std::string& precision) {
  EngineRun run = testing::routed_moe_run(schedule, precision);
  run.offload_optimizer = "cpu";
  run.grad_accum = 3;
  run.steps = 3;
  return run;
}

// How many (unit, micro-batch, expert) triples a step's routing leaves out.
int64_t unrouted(const StepRouting& routing) {
  int64_t left = 0;
  for (const auto& unit : routing)
    for (const auto& micro : unit)
      for (uint8_t used : micro) left += used == 0;
  return left;
}

// Reads ahead: every backward's fetch depends on its forwards and reads their
// experts, and the computations it serves then read none (worst case: the
// fetch reads the whole unit, a block shared by the rest and an expert once).
void expect_backwards_read_ahead(const TrainingPlan& plan, const std::string& label) {
  const std::vector<int64_t> experts = routed_expert_reads_per_op(plan, nullptr);
  const uint64_t alignment = plan.input.nvme_alignment;
  int ahead = 0;
  for (int i = 0; i < int(plan.ops.size()); ++i) {
    const PlanOp& fetch = plan.ops[size_t(i)];
    const std::vector<int> micros = micros_read_ahead(plan, i);
    if (micros.empty()) continue;
    ++ahead;
    const int64_t whole = round_up(plan.units[size_t(fetch.unit)].param_numel * plan.compute_bytes,
                                   int64_t(alignment));
    EXPECT_EQ(fetch.bytes + experts[size_t(i)], whole) << label << ": " << fetch.text();
    std::vector<uint8_t> none(size_t(plan.layout.config.num_experts), 0);
    std::vector<tiers::ByteRange> rest = fetch_ranges(plan, fetch.unit, none, alignment);
    int64_t rest_bytes = 0;
    for (const tiers::ByteRange& r : rest) rest_bytes += int64_t(r.bytes);
    EXPECT_EQ(rest_bytes, fetch.bytes) << label;
    // The computations of its gather: backwards of those micro-batches, reading nothing.
    for (int c = i + 1; c < int(plan.ops.size()); ++c) {
      const PlanOp& op = plan.ops[size_t(c)];
      if (op.kind != OpKind::gather ||
          std::find(op.deps.begin(), op.deps.end(), i) == op.deps.end())
        continue;
      int served = 0;
      for (int k = c + 1; k < int(plan.ops.size()); ++k) {
        const PlanOp& compute = plan.ops[size_t(k)];
        if (std::find(compute.deps.begin(), compute.deps.end(), c) == compute.deps.end() ||
            (compute.kind != OpKind::forward && compute.kind != OpKind::backward))
          continue;
        ++served;
        EXPECT_EQ(compute.kind, OpKind::backward) << label << ": " << compute.text();
        EXPECT_NE(std::find(micros.begin(), micros.end(), compute.micro), micros.end()) << label;
        EXPECT_EQ(experts[size_t(k)], 0) << label << ": " << compute.text();
      }
      EXPECT_EQ(served, int(micros.size())) << label << ": " << fetch.text();
    }
    for (int d : fetch.deps) EXPECT_LT(d, i) << label;
  }
  // Every backward's fetch reads ahead, and every routed gather waits for its fetch.
  int backward_fetches = 0;
  for (int i = 0; i < int(plan.ops.size()); ++i) {
    const PlanOp& op = plan.ops[size_t(i)];
    if (op.kind != OpKind::gather || !routes_expert_reads(plan, op.unit)) continue;
    int fetches = 0;
    for (int d : op.deps) fetches += plan.ops[size_t(d)].kind == OpKind::fetch;
    EXPECT_EQ(fetches, 1) << label << ": " << op.text();
    for (const PlanOp& compute : plan.ops)
      if (compute.kind == OpKind::backward &&
          std::find(compute.deps.begin(), compute.deps.end(), i) != compute.deps.end()) {
        ++backward_fetches;
        break;
      }
  }
  EXPECT_EQ(ahead, backward_fetches) << label;
  EXPECT_GT(ahead, 0) << label << ": no fetch reads ahead, the test shows nothing";
}

TEST_F(EngineExpertFetch, RoutedReadsGiveTheBitsOfReadingEveryExpert) {
  for (const char* schedule : {"micro_batch", "layer"}) {
    for (auto [precision, groups] :
         {std::pair{"fp32", 1}, std::pair{"bf16", 1}, std::pair{"fp32", 4}, std::pair{"bf16", 4}}) {
      EngineRun routed = routed_run(schedule, precision);
      routed.expert_groups = groups;  // pieces of 4 experts read as their router piece routed
      EngineRun all = routed;
      all.expert_fetch = "all";
      const EngineOutcome a = train(all), r = train(routed);
      ASSERT_EQ(r.steps.size(), 3u) << routed.label();
      ASSERT_EQ(a.steps.size(), 3u) << all.label();
      EXPECT_FALSE(a.plan.routed_expert_fetch) << all.label();
      EXPECT_TRUE(r.plan.routed_expert_fetch) << routed.label();
      EXPECT_TRUE(a.steps[0].routing.empty());
      ASSERT_FALSE(r.steps[0].routing.empty());
      EXPECT_GT(unrouted(r.steps[0].routing), 0) << "every expert reached: the test shows nothing";
      testing::expect_identical(r, a, routed.label() + " vs " + all.label());
    }
  }
}

TEST_F(EngineExpertFetch, NvmeReadsAreWhatThePlanCountsForTheStepsRouting) {
  for (auto [schedule, groups] : {std::pair{"micro_batch", 1}, std::pair{"layer", 1},
                                  std::pair{"micro_batch", 4}, std::pair{"layer", 4}}) {
    EngineRun routed = routed_run(schedule, "bf16");
    routed.expert_groups = groups;
    EngineRun all = routed;
    all.expert_fetch = "all";
    // A dense model with the experts' MLP parameters (less the routers').
    EngineRun dense = all;
    dense.moe = false;
    dense.expert_groups = 1;
    dense.experts = dense.experts_per_token = 0;
    dense.intermediate = routed.experts * routed.intermediate;
    const EngineOutcome r = train(routed), a = train(all), d = train(dense);
    ASSERT_EQ(r.steps.size(), 3u) << routed.label();
    ASSERT_EQ(a.steps.size(), 3u) << all.label();
    ASSERT_EQ(d.steps.size(), 3u) << dense.label();
    const int64_t worst = r.plan.traffic_per_step.nvme_read;
    EXPECT_GE(worst, a.plan.traffic_per_step.nvme_read);  // whole blocks around each expert
    expect_backwards_read_ahead(r.plan, schedule);
    for (size_t s = 0; s < r.steps.size(); ++s) {
      const StepResult& step = r.steps[s];
      const int64_t counted = routed_parameter_reads(r.plan, step.routing);
      EXPECT_EQ(int64_t(step.nvme_read_bytes), counted) << schedule << " step " << s;
      EXPECT_LT(counted, worst) << schedule << " step " << s;
      EXPECT_EQ(int64_t(a.steps[s].nvme_read_bytes), a.plan.traffic_per_step.nvme_read)
          << schedule << " step " << s;
      EXPECT_LT(step.nvme_read_bytes, d.steps[s].nvme_read_bytes) << schedule << " step " << s;
    }
    // Every expert routed counts the worst case.
    StepRouting every = r.steps[0].routing;
    for (auto& unit : every)
      for (auto& micro : unit) std::fill(micro.begin(), micro.end(), uint8_t{1});
    EXPECT_EQ(routed_parameter_reads(r.plan, every), worst);
    EXPECT_EQ(worst_parameter_reads(r.plan), worst);
    // As the metrics file records it and `strata plan --routing` reads it back.
    std::vector<StepRouting> recorded;
    for (const StepResult& step : r.steps) {
      const nlohmann::json record =
          nlohmann::json::parse(routing_to_json(r.plan, step.routing).dump());
      Result<StepRouting> back = routing_from_json(r.plan, record, "record");
      ASSERT_TRUE(back.is_ok()) << back.status().message();
      EXPECT_EQ(*back, step.routing);
      recorded.push_back(std::move(*back));
    }
    const RecordedReads reads = recorded_parameter_reads(r.plan, recorded);
    EXPECT_EQ(reads.steps, 3);
    EXPECT_EQ(reads.worst, worst);
    EXPECT_EQ(reads.least, int64_t(std::min({r.steps[0].nvme_read_bytes, r.steps[1].nvme_read_bytes,
                                             r.steps[2].nvme_read_bytes})));
    if (groups > 1) {  // a record of groups against the whole MLP pieces' plan, and back
      const nlohmann::json record =
          nlohmann::json::parse(routing_to_json(r.plan, r.steps[0].routing).dump());
      EngineRun whole = routed;
      whole.expert_groups = 1;
      const TrainingPlan whole_plan = train(whole).plan;
      for (const auto& [plan, from] :
           {std::pair{&whole_plan, record},
            std::pair{
                &r.plan,
                nlohmann::json::parse(
                    routing_to_json(whole_plan, StepRouting(whole_plan.units.size())).dump())}}) {
        Result<StepRouting> other = routing_from_json(*plan, from, "record");
        ASSERT_FALSE(other.is_ok());
        EXPECT_NE(other.status().message().find("the --expert-groups of the run"),
                  std::string::npos)
            << other.status().message();
      }
    }
    nlohmann::json wrong =
        nlohmann::json::parse(routing_to_json(r.plan, r.steps[0].routing).dump());
    wrong.begin()->at(0) = "01";
    Result<StepRouting> refused = routing_from_json(r.plan, wrong, "record");
    ASSERT_FALSE(refused.is_ok());
    EXPECT_NE(refused.status().message().find("not a string of 16 '0' and '1'"), std::string::npos)
        << refused.status().message();
  }
}

TEST_F(EngineExpertFetch, ThePlanSaysWhyItReadsEveryExpert) {
  auto reason = [](EngineRun run) {
    Result<TrainConfig> config = testing::engine_config(run, "nvme-dir");
    EXPECT_TRUE(config.is_ok()) << config.status().message();
    PlanInput in;
    in.model = testing::small_moe_model();
    in.model.layer_pieces = run.layer_pieces;
    in.stage = run.stage;
    in.world_size = run.world;
    in.offload_param = run.offload_param == "nvme" ? OffloadDevice::nvme : OffloadDevice::cpu;
    in.expert_fetch_all = run.expert_fetch == "all";
    EXPECT_EQ(config->strata.expert_fetch_all, in.expert_fetch_all);
    std::string why;
    const bool routes = plan_routes_expert_reads(in, state_homes(in), why);
    return std::pair{routes, why};
  };
  EngineRun run = routed_run("layer", "bf16");
  EXPECT_TRUE(reason(run).first) << reason(run).second;
  EXPECT_NE(reason(run).second.find("routed:"), std::string::npos) << reason(run).second;
  run.layer_pieces = 1;
  EXPECT_NE(reason(run).second.find("--layer-pieces 2"), std::string::npos);
  run.layer_pieces = 2;
  run.offload_param = "cpu";
  EXPECT_NE(reason(run).second.find("not on NVMe"), std::string::npos);
  run.offload_param = "nvme";
  run.world = 2;
  EXPECT_NE(reason(run).second.find("one rank"), std::string::npos);
  run.world = 1;
  run.expert_fetch = "all";
  EXPECT_NE(reason(run).second.find("strata.expert_fetch all"), std::string::npos);
  EXPECT_FALSE(reason(run).first);
}

}  // namespace
}  // namespace strata
