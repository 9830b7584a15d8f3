// Routed expert fetch (core/plan/expert_fetch.h): a mixture with its
// parameters on NVMe at stage 3, the layers in pieces, reads a sparse
// layer's experts only when its micro-batches' tokens reach them (at
// several ranks, any rank's tokens), whether its MLP piece is whole or cut
// into groups of experts. At several ranks the ranks join their routings:
// the bits of reading every expert, through the emulated GPU's data paths
// too, and each rank reads its shard's part of what the plan counts.
// Training gives the bits of reading every expert, in both schedules, fp32
// and bf16; the NVMe bytes each step reads are what the plan counts for that
// step's routing, below its worst case and below what a dense model with as
// many MLP parameters reads; the plan says why it routes or not.
#include <gtest/gtest.h>

#include <algorithm>
#include <tuple>

#include "core/plan/expert_fetch.h"
#include "engine_test_support.h"
#include "io/base/sizes.h"
#include "io/fault_injection.h"

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
// experts, and the computations it serves then read none. Worst case: the
// fetch reads the whole unit, merged (a block the rest and an expert share
// read once); counted apart (each expert's blocks and the rest's, a shared
// block in each: the bound on a routing that reads them at different
// operations), at least that.
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
    const std::vector<uint8_t> every(size_t(plan.layout.config.num_experts), 1);
    int64_t merged = 0, apart = 0;
    for (const tiers::ByteRange& r : fetch_ranges(plan, fetch.unit, every, alignment))
      merged += int64_t(r.bytes);
    for (const tiers::ByteRange& r : fetch_ranges(plan, fetch.unit, every, alignment, true))
      apart += int64_t(r.bytes);
    EXPECT_EQ(merged, whole) << label << ": " << fetch.text();
    EXPECT_EQ(fetch.bytes + experts[size_t(i)], apart) << label << ": " << fetch.text();
    EXPECT_GE(apart, whole) << label << ": " << fetch.text();
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
    // Every expert routed counts no more than the worst case; nor does a
    // routing that spreads each unit's experts over its micro-batches (expert
    // e to micro-batch e mod G; tests/engine_expert_groups_test.cpp shows a
    // routing that counts more than every expert's).
    StepRouting every = r.steps[0].routing, spread = every;
    for (auto& unit : every)
      for (auto& micro : unit) std::fill(micro.begin(), micro.end(), uint8_t{1});
    for (auto& unit : spread)
      for (size_t m = 0; m < unit.size(); ++m)
        for (size_t e = 0; e < unit[m].size(); ++e) unit[m][e] = e % unit.size() == m;
    EXPECT_LE(routed_parameter_reads(r.plan, every), worst);
    EXPECT_LE(routed_parameter_reads(r.plan, spread), worst);
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

// Several ranks: each forward of a routed unit has a route and a share, and
// nothing else does; a routed gather sends less than the whole shard.
void expect_routes_and_shares(const TrainingPlan& plan, const std::string& label) {
  const int W = plan.input.world_size;
  int forwards = 0, routes = 0, shares = 0;
  for (int i = 0; i < int(plan.ops.size()); ++i) {
    const PlanOp& op = plan.ops[size_t(i)];
    routes += op.kind == OpKind::route;
    shares += op.kind == OpKind::share;
    if (op.kind != OpKind::forward || !routes_expert_reads(plan, op.unit)) continue;
    ++forwards;
    int share = -1;
    for (int d : op.deps)
      if (plan.ops[size_t(d)].kind == OpKind::share) share = d;
    ASSERT_GE(share, 0) << label << ": " << op.text();
    const PlanOp& s = plan.ops[size_t(share)];
    EXPECT_EQ(s.unit, op.unit) << label;
    EXPECT_EQ(s.micro, op.micro) << label;
    EXPECT_EQ(plan.ops[size_t(s.deps[0])].kind, OpKind::route) << label;
    // No gather for a later computation comes before the share on its lane.
    for (int g = 0; g < share; ++g) {
      if (plan.ops[size_t(g)].kind != OpKind::gather) continue;
      int first = int(plan.ops.size());
      for (int k = g + 1; k < int(plan.ops.size()) && first == int(plan.ops.size()); ++k) {
        const OpKind kind = plan.ops[size_t(k)].kind;
        const std::vector<int>& deps = plan.ops[size_t(k)].deps;
        if ((kind == OpKind::forward || kind == OpKind::backward) &&
            std::find(deps.begin(), deps.end(), g) != deps.end())
          first = k;
      }
      EXPECT_LE(first, i) << label << ": " << plan.ops[size_t(g)].text() << " before " << s.text();
    }
  }
  EXPECT_EQ(forwards > 0, plan.routed_expert_fetch) << label;
  EXPECT_EQ(routes, W > 1 ? forwards : 0) << label;
  EXPECT_EQ(shares, W > 1 ? forwards : 0) << label;
}

TEST_F(EngineExpertFetch, AtSeveralRanksTheRanksShareTheirRoutings) {
  for (int world : {2, 3}) {
    for (auto [schedule, precision, groups] :
         {std::tuple{"micro_batch", "bf16", 1}, std::tuple{"layer", "bf16", 4},
          std::tuple{"layer", "fp32", 1}, std::tuple{"micro_batch", "fp32", 4}}) {
      EngineRun routed = routed_run(schedule, precision);
      routed.world = world;
      routed.expert_groups = groups;
      EngineRun all = routed;
      all.expert_fetch = "all";
      const std::string label = routed.label();
      const EngineOutcome r = train(routed), a = train(all);
      ASSERT_EQ(r.steps.size(), 3u) << label;
      ASSERT_EQ(a.steps.size(), 3u) << all.label();
      ASSERT_TRUE(r.plan.routed_expert_fetch) << label << ": " << r.plan.expert_fetch_reason;
      EXPECT_FALSE(r.plan.deferred_expert_updates) << label;
      expect_routes_and_shares(r.plan, label);
      expect_routes_and_shares(a.plan, all.label());  // none: not routed
      ASSERT_FALSE(r.steps[0].routing.empty());
      EXPECT_GT(unrouted(r.steps[0].routing), 0) << "every expert reached: the test shows nothing";
      testing::expect_identical(r, a, label + " vs " + all.label());
      if (groups == 1) {  // the GPU's data paths (emulated): the CPU backend's bits and routing
        EngineRun gpu = routed;
        gpu.emulate_gpu = true;
        const EngineOutcome g = train(gpu);
        ASSERT_TRUE(g.plan.input.gpu && g.plan.routed_expert_fetch) << gpu.label();
        testing::expect_identical(g, r, gpu.label() + " vs the CPU backend");
        for (size_t s = 0; s < g.steps.size(); ++s) {
          EXPECT_EQ(g.steps[s].routing, r.steps[s].routing) << gpu.label();
          EXPECT_EQ(g.steps[s].nvme_read_bytes, r.steps[s].nvme_read_bytes) << gpu.label();
        }
      }
      // Each rank reads its shard's part of what the joined routing reaches.
      ASSERT_EQ(r.rank_nvme_read.size(), size_t(world)) << label;
      for (int rank = 0; rank < world; ++rank) {
        int64_t of_rank = 0;
        for (const StepResult& step : r.steps)
          of_rank += routed_parameter_reads(r.plan, step.routing, rank);
        EXPECT_EQ(int64_t(r.rank_nvme_read[size_t(rank)]), of_rank) << label << " rank " << rank;
      }
      for (size_t s = 0; s < r.steps.size(); ++s) {
        const StepResult& step = r.steps[s];
        // Every rank reads its shard's part of what the joined routing reaches.
        int64_t counted = 0;
        for (int rank = 0; rank < world; ++rank) {
          const int64_t of_rank = routed_parameter_reads(r.plan, step.routing, rank);
          EXPECT_LE(of_rank, r.plan.traffic_per_step.nvme_read) << label << " rank " << rank;
          EXPECT_LE(of_rank, routed_parameter_reads(r.plan, step.routing)) << label;
          counted += of_rank;
        }
        EXPECT_EQ(int64_t(step.nvme_read_bytes), counted) << label << " step " << s;
        EXPECT_LT(step.nvme_read_bytes, a.steps[s].nvme_read_bytes) << label << " step " << s;
        // The gathers send what was read, the shares what was routed: less
        // than every expert's shard, within the plan's worst case.
        EXPECT_LT(step.network_bytes, a.steps[s].network_bytes) << label << " step " << s;
        EXPECT_LE(step.network_bytes,
                  uint64_t(r.plan.traffic_per_step.collective()) * uint64_t(world))
            << label << " step " << s;
        EXPECT_EQ(a.steps[s].network_bytes,
                  uint64_t(a.plan.traffic_per_step.collective()) * uint64_t(world))
            << all.label() << " step " << s;
      }
    }
  }
}

// With the collectives on the compute lane (overlap_comm false) the shares
// and gathers run between the computations, in plan order: the same bits.
TEST_F(EngineExpertFetch, AtSeveralRanksWithoutOverlapTheSharesRunOnTheComputeLane) {
  for (int world : {2, 3}) {
    for (const char* schedule : {"micro_batch", "layer"}) {
      EngineRun routed = routed_run(schedule, "bf16");
      routed.world = world;
      routed.overlap_comm = false;
      EngineRun all = routed;
      all.expert_fetch = "all";
      all.overlap_comm = true;
      const EngineOutcome r = train(routed), a = train(all);
      ASSERT_EQ(r.steps.size(), 3u) << routed.label();
      for (const PlanOp& op : r.plan.ops) {
        if (op.kind == OpKind::share || op.kind == OpKind::gather) {
          EXPECT_EQ(op.lane, Lane::compute) << routed.label() << ": " << op.text();
        }
      }
      expect_routes_and_shares(r.plan, routed.label());
      testing::expect_identical(r, a, routed.label() + " vs " + all.label());
    }
  }
}

// A read that fails at one rank fails the step, and no rank waits forever:
// the shares after the failure (collectives, which still run) send the same
// pieces on every rank, since what a gather loaded follows from the joined
// routing whatever failed. Every third read of the second step is failed in
// turn (which rank's it is depends on the lanes' timing).
TEST_F(EngineExpertFetch, AFailedReadAtOneRankFailsTheStepWithoutAHang) {
  EngineRun run = routed_run("micro_batch", "bf16");
  run.world = 2;
  run.steps = 1;
  auto counter = std::make_shared<io::FaultInjector>();
  run.fault_injector = counter;
  ASSERT_EQ(train(run).steps.size(), 1u);
  const uint64_t reads = counter->calls(io::RingOp::kRead);  // set-up and one step
  ASSERT_GT(reads, 0u);
  run.steps = 2;
  int failed = 0;
  for (uint64_t n = reads + 1; n <= 2 * reads; n += 3) {
    auto injector = std::make_shared<io::FaultInjector>();
    io::Fault fault;
    fault.op = io::RingOp::kRead;
    fault.nth_call = n;
    fault.error_number = EIO;
    injector->add(fault);
    run.fault_injector = injector;
    Result<EngineOutcome> outcome = testing::train_engine(run, dir_.path(), tokens_, seed_);
    if (outcome) continue;  // the read came after the last step's
    ++failed;
    EXPECT_NE(outcome.status().message().find("Input/output error"), std::string::npos)
        << "read " << n << ": " << outcome.status().message();
  }
  EXPECT_GT(failed, 0) << "no read of the second step failed: the test shows nothing";
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
  run.world = 2;  // the ranks share their routings
  EXPECT_TRUE(reason(run).first) << reason(run).second;
  EXPECT_NE(reason(run).second.find("joining their routings"), std::string::npos);
  run.world = 1;
  run.expert_fetch = "all";
  EXPECT_NE(reason(run).second.find("strata.expert_fetch all"), std::string::npos);
  EXPECT_FALSE(reason(run).first);
}

}  // namespace
}  // namespace strata
