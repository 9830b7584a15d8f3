// The step-time model (core/plan/step_model.h): the simulator on hand-made
// DAGs whose step times are worked out by hand in each test, the lane
// executor's order on a real plan, the cost of an operation from its bytes
// and FLOPs, the CUDA units' launches and host waits (gpu_launches.h), and
// hardware profiles (presets, files, one-line errors).
#include "core/plan/step_model.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>

#include "core/engine/lane_executor.h"
#include "core/plan/gpu_launches.h"
#include "core/plan/planner.h"

namespace strata {
namespace {

SimOp op(int lane, double seconds, std::vector<int> deps = {}, uint32_t resources = 0,
         int previous_step_dep = -1) {
  SimOp o;
  o.lane = lane;
  o.seconds = seconds;
  o.deps = std::move(deps);
  o.resources = resources;
  o.previous_step_dep = previous_step_dep;
  return o;
}

constexpr uint32_t kNvme = uint32_t(Resource::nvme);

TEST(StepModel, ASerialChainTakesTheSumOfItsOperations) {
  // 1 + 2 + 3 s on one lane, each after the one before; the next step is
  // handed out when the last is done: 6 s a step, every step.
  const std::vector<SimOp> ops = {op(0, 1), op(0, 2, {0}), op(0, 3, {1})};
  const Simulation sim = simulate_steps(ops, 1, 2, 3);
  for (int s = 0; s < 3; ++s) EXPECT_DOUBLE_EQ(sim.step_seconds(s), 6.0) << s;
  EXPECT_EQ(sim.ops.size(), 9u);
}

TEST(StepModel, TwoLanesOverlapAndTheLongerOneIsTheStep) {
  // 2 s on lane 0 and 3 s on lane 1, independent: both start at 0, and the
  // step is done (and the next handed out) at 3 s.
  const std::vector<SimOp> ops = {op(0, 2), op(1, 3)};
  const Simulation sim = simulate_steps(ops, 2, 1, 2);
  EXPECT_DOUBLE_EQ(sim.step_seconds(0), 3.0);
  EXPECT_DOUBLE_EQ(sim.step_seconds(1), 3.0);
  for (const SimulatedOp& s : sim.ops) {
    if (s.step == 0) {
      EXPECT_DOUBLE_EQ(s.start, 0.0) << s.op;
    }
  }
}

TEST(StepModel, TwoLanesOnOneLinkTakeTurns) {
  // The same two operations holding the one NVMe set: 2 + 3 = 5 s, and the
  // second waited 2 s for the link, not for its lane.
  const std::vector<SimOp> ops = {op(0, 2, {}, kNvme), op(1, 3, {}, kNvme)};
  const Simulation sim = simulate_steps(ops, 2, 1, 2);
  EXPECT_DOUBLE_EQ(sim.step_seconds(0), 5.0);
  double waited = 0;
  for (const SimulatedOp& s : sim.ops)
    if (s.step == 0) waited += s.waited;
  EXPECT_DOUBLE_EQ(waited, 2.0);
}

TEST(StepModel, AComputeWaitsForThePreviousStepsUpdateOfItsParameters) {
  // compute 1 s (lane 0), then its update 2 s (lane 1). The step returns at
  // its compute (the release operation), so step 1 is handed out at 1 s, but
  // its compute reads parameters that step 0's update publishes at 3 s: it runs
  // 3-4, its update 4-6. Step 2 is handed out at 4 s (its predecessor's compute
  // done, step 0 complete at 3), computes 6-7. Steps: 1 s, then 3 s each.
  const std::vector<SimOp> ops = {op(0, 1, {}, 0, 1), op(1, 2, {0})};
  const Simulation sim = simulate_steps(ops, 2, 0, 4);
  EXPECT_DOUBLE_EQ(sim.step_seconds(0), 1.0);
  EXPECT_DOUBLE_EQ(sim.step_seconds(1), 3.0);
  EXPECT_DOUBLE_EQ(sim.step_seconds(2), 3.0);
  // Without the wait across steps the update would overlap the next compute: 1 s a step.
  const std::vector<SimOp> free_ops = {op(0, 1), op(1, 2, {0})};
  const Simulation overlapped = simulate_steps(free_ops, 2, 0, 4);
  EXPECT_DOUBLE_EQ(overlapped.step_seconds(1), 2.0);  // step 0 must be complete (at 3 s)
}

PlanInput tiny_input(int stage, int accumulation, Schedule schedule) {
  PlanInput in;
  Result<ModelConfig> model = load_model_config("tiny");
  EXPECT_TRUE(model.is_ok());
  in.model = *model;
  in.stage = stage;
  in.seq_len = 32;
  in.micro_batch = 2;
  in.grad_accum = accumulation;
  in.schedule = schedule;
  in.activation_home = tiers::Tier::device;
  in.offload_optimizer = OffloadDevice::cpu;
  if (stage == 3) in.offload_param = OffloadDevice::cpu;
  return in;
}

// Stage 3 with the parameters and the optimizer state on NVMe, two micro-batches.
PlanInput nvme_input() {
  PlanInput in = tiny_input(3, 2, Schedule::micro_batch);
  in.offload_param = OffloadDevice::nvme;
  in.offload_optimizer = OffloadDevice::nvme;
  in.nvme_path_known = true;
  return in;
}

// The lane executor and the simulator run each lane's operations of a real
// plan in the same order: plan order, step after step; and every simulated
// operation starts after its dependencies and the update it waits for.
TEST(StepModel, TheSimulatorAndTheLaneExecutorOrderARealPlanAlike) {
  for (Schedule schedule : {Schedule::micro_batch, Schedule::layer}) {
    for (int stage : {1, 3}) {
      Result<TrainingPlan> plan = plan_training(tiny_input(stage, 3, schedule));
      ASSERT_TRUE(plan.is_ok()) << plan.status().message();
      SCOPED_TRACE(testing::Message()
                   << "stage " << stage << " layer-major " << (schedule == Schedule::layer));
      constexpr int kSteps = 3;
      // The executor: each lane's (step, op) in the order it ran them.
      std::mutex mutex;
      std::map<int, std::vector<std::pair<int64_t, int>>> executed;
      {
        LaneExecutor executor(lane_ops(*plan), {});
        std::vector<std::shared_ptr<StepProgress>> steps;
        for (int s = 0; s < kSteps; ++s)
          steps.push_back(executor.start_step(s, [&, s](int, int i) {
            std::lock_guard lock(mutex);
            executed[static_cast<int>(plan->ops[size_t(i)].lane)].push_back({s, i});
            return Status::ok();
          }));
        for (auto& step : steps) ASSERT_TRUE(step->wait_all().is_ok());
      }
      const HardwareProfile hw = *hardware_preset("h100-sxm");
      const std::vector<OpCost> costs = cost_operations(*plan, hw);
      const std::vector<SimOp> graph = step_graph(*plan, costs);
      const Simulation sim = simulate_steps(graph, kLaneCount, exchange_op(*plan), kSteps);
      ASSERT_EQ(sim.ops.size(), kSteps * plan->ops.size());
      std::map<int, std::vector<std::pair<int64_t, int>>> simulated;
      std::map<std::pair<int, int>, SimulatedOp> by_op;
      for (const SimulatedOp& s : sim.ops) {
        simulated[graph[size_t(s.op)].lane].push_back({s.step, s.op});
        by_op[{s.step, s.op}] = s;
      }
      EXPECT_EQ(simulated, executed);
      for (const SimulatedOp& s : sim.ops) {
        for (int d : graph[size_t(s.op)].deps) {
          const SimulatedOp& dep = by_op[std::make_pair(s.step, d)];
          EXPECT_GE(s.start, dep.end);
        }
        const int wait = graph[size_t(s.op)].previous_step_dep;
        if (wait >= 0 && s.step > 0) {
          const SimulatedOp& update = by_op[std::make_pair(s.step - 1, wait)];
          EXPECT_GE(s.start, update.end);
        }
        EXPECT_GE(s.start, sim.step_start[size_t(s.step)]);
      }
    }
  }
}

TEST(StepModel, OperationsCostTheirBytesOverTheirLinkAndTheirFlopsOnTheDevice) {
  Result<TrainingPlan> plan = plan_training(nvme_input());
  ASSERT_TRUE(plan.is_ok()) << plan.status().message();
  HardwareProfile hw;
  hw.name = "by hand";
  hw.matmul_tflops_fp32 = 1;  // 1e12 FLOP/s
  hw.memory_gbps = 1000;
  hw.memcpy_gbps = 1000;
  hw.adamw_mparams_fp32 = 100;                   // 1e8 parameters/s
  hw.nvme = {NvmeDrive{2, 1, 0, std::nullopt}};  // 2 GB/s read, 1 GB/s written, no latency
  const std::vector<OpCost> costs = cost_operations(*plan, hw);
  const std::vector<StepTraffic> traffic = traffic_per_op(*plan);
  bool saw_fetch = false, saw_layer = false;
  for (size_t i = 0; i < plan->ops.size(); ++i) {
    const PlanOp& op = plan->ops[i];
    if (op.kind == OpKind::fetch) {
      saw_fetch = true;
      EXPECT_DOUBLE_EQ(costs[i].seconds, double(traffic[i].nvme_read) / 2e9);
      EXPECT_EQ(costs[i].resources, kNvme);
    }
    if (op.kind == OpKind::forward && op.unit == 1) {
      saw_layer = true;
      EXPECT_NEAR(costs[i].seconds, operation_flops(*plan, op) / 1e12, 1e-12);
      // 2 N per token for the layer's matmuls, and causal attention.
      const ModelConfig& m = plan->layout.config;
      const double N = 2 * 32, T = 32, D = double(m.head_dim);
      EXPECT_DOUBLE_EQ(operation_flops(*plan, op),
                       2 * N * double(m.layer_parameter_count()) +
                           4 * 2 * T * (T + 1) / 2 * double(m.num_attention_heads) * D);
    }
  }
  EXPECT_TRUE(saw_fetch);
  EXPECT_TRUE(saw_layer);
  // The whole account is the plan's.
  const StepTraffic sum = total_traffic(traffic);
  EXPECT_EQ(sum.nvme_read, plan->traffic_per_step.nvme_read);
  EXPECT_EQ(sum.nvme_written, plan->traffic_per_step.nvme_written);
  EXPECT_EQ(sum.intra_node, plan->traffic_per_step.intra_node);
  EXPECT_EQ(sum.inter_node, plan->traffic_per_step.inter_node);
}

// The streamed optimizer reads its next chunk while it updates one and writes
// the last: bound by the drives, its time is their bytes (in turn, or both
// at once at the profile's mixed rate, never faster than either way alone),
// and it shares the cores, working them only its AdamW's time; bound by
// AdamW, it holds them.
TEST(StepModel, AStreamedOptimizerBoundByTheDrivesSharesTheCores) {
  Result<TrainingPlan> plan = plan_training(nvme_input());
  ASSERT_TRUE(plan.is_ok()) << plan.status().message();
  HardwareProfile hw;
  hw.name = "by hand";
  hw.matmul_tflops_fp32 = 1;
  hw.memory_gbps = hw.memcpy_gbps = 1000;
  hw.adamw_mparams_fp32 = 1e6;                   // 1e12 parameters/s: the drives bound it
  hw.nvme = {NvmeDrive{2, 1, 0, std::nullopt}};  // 2 GB/s read, 1 GB/s written, no latency
  const std::vector<StepTraffic> traffic = traffic_per_op(*plan);
  const uint32_t cores = uint32_t(Resource::cores);
  const int cores_index = 1;  // resource_name(1)
  ASSERT_STREQ(resource_name(cores_index), "cores");
  auto check = [&](double mixed_gbps, double adamw_mparams) {
    hw.nvme[0].mixed_gbps = mixed_gbps;
    hw.adamw_mparams_fp32 = adamw_mparams;
    const std::vector<OpCost> costs = cost_operations(*plan, hw);
    int seen = 0;
    for (size_t i = 0; i < plan->ops.size(); ++i) {
      const PlanOp& op = plan->ops[i];
      const StepTraffic& t = traffic[i];
      if (op.kind != OpKind::optimizer || t.nvme_read == 0 || t.nvme_written == 0) continue;
      ++seen;
      const double r = double(t.nvme_read), w = double(t.nvme_written);
      const double update =
          double(plan->units[size_t(op.unit)].optimizer_numel) / (adamw_mparams * 1e6);
      const double io = mixed_gbps > 0 ? std::max({r / 2e9, w / 1e9, (r + w) / (mixed_gbps * 1e9)})
                                       : r / 2e9 + w / 1e9;
      SCOPED_TRACE(fmt::format("op {} mixed {} adamw {}", i, mixed_gbps, adamw_mparams));
      EXPECT_NEAR(costs[i].seconds, std::max(io, update), 1e-15);
      EXPECT_TRUE(costs[i].resources & kNvme);
      if (update < io) {
        EXPECT_FALSE(costs[i].resources & cores);
        EXPECT_NEAR(costs[i].busy_seconds(cores_index), update, 1e-15);
      } else {
        EXPECT_TRUE(costs[i].resources & cores);
        EXPECT_DOUBLE_EQ(costs[i].busy_seconds(cores_index), costs[i].seconds);
      }
    }
    EXPECT_GT(seen, 0);
  };
  check(0, 1e6);     // in turn
  check(2.5, 1e6);   // both at once, 2.5 GB/s together: above either way alone
  check(10, 1e6);    // a mixed rate above the sum: each way's own rate bounds it
  check(2.5, 1e-3);  // 1000 parameters/s: AdamW bounds it and holds the cores
}

TEST(StepModel, ASparseLayerCostsTheExpertsItsTokensRead) {
  // A qwen3_moe shape with a dense layer 0 among sparse ones: each layer's
  // forward counts its own active parameters (the router and k of E experts).
  ModelConfig m = nvme_input().model;
  m.family = ModelFamily::qwen3_moe;
  m.qk_norm = true;
  m.num_experts = 6;
  m.num_experts_per_tok = 2;
  m.moe_intermediate_size = 24;
  m.mlp_only_layers = {0};
  ASSERT_GE(m.num_hidden_layers, 2);
  const int64_t B = 2, T = 32;
  const double N = double(B * T), D = double(m.head_dim);
  const double attention = 4 * double(B) * T * (T + 1) / 2 * double(m.num_attention_heads) * D;
  const double C = double(m.hidden_size);
  EXPECT_DOUBLE_EQ(layer_forward_flops(m, B, T, 0),
                   2 * N * double(m.layer_parameter_count(0)) + attention);
  EXPECT_DOUBLE_EQ(layer_forward_flops(m, B, T, 1),
                   2 * N * double(m.layer_parameter_count(1) - 4 * 3 * C * 24) + attention);
  EXPECT_LT(layer_forward_flops(m, B, T, 1), layer_forward_flops(m, B, T, 0));
  PlanInput in = nvme_input();
  in.model = m;
  Result<TrainingPlan> plan = plan_training(in);
  ASSERT_TRUE(plan.is_ok()) << plan.status().message();
  for (const PlanOp& op : plan->ops) {
    if (op.kind != OpKind::forward || op.unit < 1 || op.unit > 2) continue;
    EXPECT_DOUBLE_EQ(operation_flops(*plan, op),
                     layer_forward_flops(m, in.micro_batch, in.seq_len, op.unit - 1));
  }
}

// A mixture read as routed: 16 experts, top 1, two micro-batches of
// `micro_batch` x `seq_len` tokens, at `world` ranks, its updates deferred
// or not, the optimizer in host memory.
Result<TrainingPlan> routed_plan(int world, bool deferred, int64_t micro_batch = 2,
                                 int64_t seq_len = 32) {
  PlanInput in = nvme_input();
  in.world_size = world;
  in.model.family = ModelFamily::mixtral;
  in.model.num_experts = 16;
  in.model.num_experts_per_tok = 1;
  in.model.moe_intermediate_size = in.model.intermediate_size;
  in.model.layer_pieces = 2;
  in.layer_pieces_auto = false;
  in.offload_optimizer = OffloadDevice::cpu;
  in.expert_update_deferred = deferred;
  in.micro_batch = micro_batch;
  in.seq_len = seq_len;
  return plan_training(in);
}

// A mixture read as routed, its updates deferred: a step predicted with a
// routing costs that routing's bytes (the engine's count, routed_step) and
// AdamW elements. Every expert routed is within the worst case; a
// routing that reaches few experts is cheaper, its NVMe bytes those
// deferred_step_nvme_bytes counts. At two ranks the shares replay (the
// most of either rank's), not the forwards.
TEST(StepModel, ARecordedRoutingCostsItsOwnBytesAndUpdates) {
  for (const int world : {1, 2}) {
    SCOPED_TRACE(std::to_string(world) + " ranks");
    const OpKind replays = world > 1 ? OpKind::share : OpKind::forward;
    Result<TrainingPlan> plan = routed_plan(world, true);
    ASSERT_TRUE(plan.is_ok()) << plan.status().message();
    ASSERT_TRUE(plan->routed_expert_fetch) << plan->expert_fetch_reason;
    ASSERT_TRUE(plan->deferred_expert_updates) << plan->expert_update_reason;
    const HardwareProfile hw = *hardware_preset("h100-sxm/gen4x1");
    StepRouting every(plan->units.size()), none(plan->units.size()), few(plan->units.size());
    for (int u = 0; u < int(plan->units.size()); ++u) {
      if (!routes_expert_reads(*plan, u)) continue;
      every[size_t(u)].assign(size_t(plan->input.grad_accum), std::vector<uint8_t>(16, 1));
      none[size_t(u)].assign(size_t(plan->input.grad_accum), std::vector<uint8_t>(16, 0));
      few[size_t(u)] = none[size_t(u)];
      few[size_t(u)][0][3] = few[size_t(u)][1][3] = 1;  // one expert reached
    }
    const StepPrediction worst = predict_step(*plan, hw);
    // Every expert waiting and then routed to at once: within the worst
    // step (which counts the replays of experts apart: expert_update.h).
    ExpertUpdateLedger ledger(*plan);
    (void)routed_step(*plan, none, ledger, 1);
    const RoutedStep all = routed_step(*plan, every, ledger, 2);
    const StepPrediction routed_all = predict_step(*plan, hw, &all);
    EXPECT_LE(routed_all.traffic.nvme_read, worst.traffic.nvme_read);
    EXPECT_LE(routed_all.traffic.nvme_written, worst.traffic.nvme_written);
    EXPECT_GT(routed_all.traffic.nvme_read, worst.traffic.nvme_read * 8 / 10);
    EXPECT_LE(routed_all.steady_seconds, worst.steady_seconds);
    // Its replays step each expert for the one step it missed.
    int64_t replayed = 0;
    for (size_t i = 0; i < plan->ops.size(); ++i) {
      if (plan->ops[i].kind == replays) {
        replayed += std::max<int64_t>(0, all.adamw_elements[i]);
      } else if (plan->ops[i].kind != OpKind::optimizer) {
        EXPECT_EQ(all.adamw_elements[i], -1) << plan->ops[i].text();
      }
    }
    EXPECT_GT(replayed, 0);
    // Few experts reached, with nothing waiting before: fewer bytes and elements, a shorter step.
    ExpertUpdateLedger fresh(*plan);
    const RoutedStep one = routed_step(*plan, few, fresh, 1);
    ExpertUpdateLedger counted(*plan);
    const WindowBytes bytes = deferred_step_nvme_bytes(*plan, few, counted);
    const StepPrediction sparse = predict_step(*plan, hw, &one);
    EXPECT_EQ(sparse.traffic.nvme_read, bytes.read);
    EXPECT_EQ(sparse.traffic.nvme_written, bytes.written);
    EXPECT_LT(sparse.traffic.nvme_read, worst.traffic.nvme_read);
    EXPECT_LT(sparse.steady_seconds, worst.steady_seconds);
    for (size_t i = 0; i < plan->ops.size(); ++i) {
      const PlanOp& op = plan->ops[i];
      if (op.kind == OpKind::optimizer && defers_expert_updates(*plan, op.unit)) {
        EXPECT_GT(one.adamw_elements[i], 0);
        EXPECT_LT(one.adamw_elements[i], plan->units[size_t(op.unit)].optimizer_numel);
      }
      if (op.kind == replays) {
        EXPECT_LE(one.adamw_elements[i], 0) << "nothing waited: nothing replayed";
      }
    }
  }
}

// An even routing: each token k experts of E, drawn the same way every
// time; the units of one layer share its routing, the others have none.
// One token a micro-batch reaches exactly k experts; many reach them all;
// in between, about E (1 - (1 - k/E)^N), at several ranks with N the
// ranks' tokens together (they join their routings).
TEST(StepModel, AnEvenRoutingReachesWhatTokensDrawnUniformlyReach) {
  for (const int world : {1, 2}) {
    for (const int64_t tokens : {1, 4, 256}) {
      Result<TrainingPlan> plan = routed_plan(world, true, 1, tokens);
      ASSERT_TRUE(plan.is_ok()) << plan.status().message();
      const std::vector<StepRouting> steps = even_routings(*plan, 40);
      ASSERT_EQ(steps.size(), 40u);
      EXPECT_TRUE(even_routings(*plan, 40) == steps);  // the same draws every time
      if (tokens * world < 16) {
        EXPECT_TRUE(even_routings(*plan, 40, 2) != steps);  // another seed, others
      }
      const double N = double(tokens * world);
      double reached = 0, counted = 0;
      for (const StepRouting& routing : steps) {
        ASSERT_EQ(routing.size(), plan->units.size());
        for (int u = 0; u < int(plan->units.size()); ++u) {
          if (!routes_expert_reads(*plan, u)) {
            EXPECT_TRUE(routing[size_t(u)].empty()) << u;
            continue;
          }
          ASSERT_EQ(routing[size_t(u)].size(), size_t(plan->input.grad_accum));
          for (const std::vector<uint8_t>& used : routing[size_t(u)]) {
            ASSERT_EQ(used.size(), 16u);
            const int64_t n = std::count(used.begin(), used.end(), uint8_t{1});
            if (N == 1) {
              EXPECT_EQ(n, 1);
            } else if (N >= 256) {
              EXPECT_EQ(n, 16);
            }
            reached += double(n);
            counted += 1;
          }
        }
      }
      const double expected = 16 * (1 - std::pow(15.0 / 16, N));
      EXPECT_NEAR(reached / counted, expected, 0.05 * expected) << world << " ranks, " << tokens;
    }
  }
}

// The expected step of a mixture read as routed is an even routing's: no
// slower than the worst case the plan counts, and, where few tokens leave
// experts idle and their updates wait, faster; with every expert reached
// every step, the updates deferred or not cost alike. A dense model's is
// predict_step's.
TEST(StepModel, TheExpectedStepOfARoutedMixtureIsAnEvenRoutings) {
  const HardwareProfile hw = *hardware_preset("h100-sxm/gen4x1");
  for (const int world : {1, 2}) {
    SCOPED_TRACE(std::to_string(world) + " ranks");
    Result<TrainingPlan> few = routed_plan(world, true, 1, 2);
    ASSERT_TRUE(few.is_ok()) << few.status().message();
    const StepPrediction worst = predict_step(*few, hw);
    const StepPrediction expected = predict_expected_step(*few, hw);
    EXPECT_LT(expected.traffic.nvme_read, worst.traffic.nvme_read);
    EXPECT_LT(expected.steady_seconds, worst.steady_seconds);
    // It is the median of the drawn steps after the ledger filled.
    const RoutedPrediction drawn =
        predict_routed_steps(*few, hw, even_routings(*few, kEvenRoutingSteps), kEvenRoutingWarmup);
    EXPECT_EQ(drawn.steps, kEvenRoutingSteps - kEvenRoutingWarmup);
    EXPECT_DOUBLE_EQ(expected.steady_seconds, drawn.median.steady_seconds);
    EXPECT_LE(drawn.least, drawn.mean);
    EXPECT_LE(drawn.mean, drawn.most);
    Result<TrainingPlan> many = routed_plan(world, true, 1, 512);
    Result<TrainingPlan> eager = routed_plan(world, false, 1, 512);
    ASSERT_TRUE(many.is_ok() && eager.is_ok());
    EXPECT_LE(predict_expected_step(*many, hw).steady_seconds,
              predict_step(*many, hw).steady_seconds);
    EXPECT_LE(predict_expected_step(*eager, hw).steady_seconds,
              predict_step(*eager, hw).steady_seconds);
  }
  Result<TrainingPlan> dense = plan_training(nvme_input());
  ASSERT_TRUE(dense.is_ok());
  EXPECT_EQ(predict_expected_step(*dense, hw).steady_seconds,
            predict_step(*dense, hw).steady_seconds);
}

TEST(StepModel, APredictionNamesWhatBoundsTheStep) {
  Result<TrainingPlan> plan = plan_training(nvme_input());
  ASSERT_TRUE(plan.is_ok()) << plan.status().message();
  HardwareProfile slow_disk = *hardware_preset("h100-sxm/gen4x1");
  slow_disk.nvme = {NvmeDrive{0.001, 0.001, 100, 1.0}};  // 1 MB/s: the disk bounds everything
  const StepPrediction p = predict_step(*plan, slow_disk);
  EXPECT_GT(p.steady_seconds, 0);
  EXPECT_STREQ(resource_name(p.bound_resource), "nvme");
  EXPECT_TRUE(p.drive_years.has_value());
  const std::string text = format_prediction(p);
  EXPECT_NE(text.find("bound by the"), std::string::npos) << text;
  EXPECT_NE(text.find("SSD wear"), std::string::npos) << text;
  // More drives: faster, never slower.
  const StepPrediction four = predict_step(*plan, *hardware_preset("h100-sxm/gen5x4"));
  const StepPrediction one = predict_step(*plan, *hardware_preset("h100-sxm/gen5x1"));
  EXPECT_LE(four.steady_seconds, one.steady_seconds);
}

// A small mixture on the CUDA backend: 16 experts of 32 rows, top 2, its
// micro-batch of 64 tokens; `groups` groups of experts (1: the MLP piece
// whole), the load-balancing loss in the objective.
Result<TrainingPlan> gpu_mixture_plan(int64_t groups, int64_t tokens = 64) {
  PlanInput in = tiny_input(0, 1, Schedule::micro_batch);
  ModelConfig& m = in.model;
  m.family = ModelFamily::qwen3_moe;
  m.num_experts = 16;
  m.num_experts_per_tok = 2;
  m.moe_intermediate_size = 32;
  m.output_router_logits = true;
  m.router_aux_loss_coef = 0.01;
  m.layer_pieces = 2;
  m.expert_groups = groups;
  in.layer_pieces_auto = in.expert_groups_auto = false;
  in.seq_len = tokens / in.micro_batch;
  in.gpu = true;
  in.precision = Precision::bf16;
  return plan_training(in);
}

TEST(GpuLaunches, AnEvenRoutingReachesWhatOneTokenAndManyTokensReach) {
  ModelConfig m = *load_model_config("tiny");
  m.num_experts = 16;
  m.num_experts_per_tok = 2;
  // One token reaches exactly k experts: a piece of e of the E, k e / E of them.
  EXPECT_DOUBLE_EQ(expected_experts_reached(m, 1, 16), 2.0);
  EXPECT_DOUBLE_EQ(expected_experts_reached(m, 1, 4), 0.5);
  // Two tokens: each expert missed by both with probability (7/8)^2.
  EXPECT_DOUBLE_EQ(expected_experts_reached(m, 2, 16), 16 * (1 - 49.0 / 64));
  // Many tokens reach every expert; a dense model none.
  EXPECT_NEAR(expected_experts_reached(m, 4096, 16), 16.0, 1e-9);
  m.num_experts = 0;
  EXPECT_EQ(expected_experts_reached(m, 4096, 16), 0.0);
}

// The CUDA units wait for the routing once per sparse layer forward, and
// in expert groups once per piece: G + 1 forward, G backward (the router
// piece recomputes its routing without a wait), the load-balancing
// gradient's upload once per micro-batch; the unit before the head keeps
// its forward's routing. The experts' products are the
// same whole or in groups; the groups add their chain's copies.
TEST(GpuLaunches, ASparseLayerWaitsOncePerPieceThatNeedsItsRouting) {
  for (const int64_t groups : {1, 4}) {
    Result<TrainingPlan> plan = gpu_mixture_plan(groups);
    ASSERT_TRUE(plan.is_ok()) << plan.status().message();
    const ModelConfig& m = plan->layout.config;
    const int64_t layers = m.num_hidden_layers;
    std::vector<int> forward_waits(size_t(layers), 0), backward_waits(size_t(layers), 0);
    std::vector<double> forward_kernels(size_t(layers), 0);
    for (const PlanOp& op : plan->ops) {
      const UnitShape& unit = plan->layout.units[size_t(op.unit < 0 ? 0 : op.unit)].unit;
      const GpuLaunches l = gpu_launches(*plan, op);
      if (op.kind != OpKind::forward && op.kind != OpKind::backward) {
        EXPECT_EQ(l.kernels, 0) << op.text();
        EXPECT_EQ(l.waits, 0) << op.text();
        continue;
      }
      EXPECT_GT(l.kernels, 0) << op.text();
      if (unit.kind != UnitKind::decoder_layer) {
        EXPECT_EQ(l.waits, 0) << op.text();
        continue;
      }
      if (unit.piece == LayerPiece::attention) {
        EXPECT_EQ(l.waits, 0) << op.text();
      }
      if (op.kind == OpKind::forward) {
        forward_waits[size_t(unit.layer)] += l.waits;
        if (unit.piece != LayerPiece::attention) forward_kernels[size_t(unit.layer)] += l.kernels;
      } else {
        backward_waits[size_t(unit.layer)] += l.waits;
      }
    }
    const double R = expected_experts_reached(m, plan->tokens_per_micro, 16);
    EXPECT_GT(R, 14.0);  // 64 tokens at top 2 reach nearly all 16
    for (int64_t layer = 0; layer < layers; ++layer) {
      const std::string at = fmt::format("{} groups, layer {}", groups, layer);
      EXPECT_EQ(forward_waits[size_t(layer)], groups == 1 ? 1 : groups + 1) << at;
      // The last layer's backward uploads the load-balancing gradient first,
      // and (its MLP piece the unit before the head) takes its forward's
      // routing without computing it again.
      const bool last = layer == layers - 1;
      EXPECT_EQ(backward_waits[size_t(layer)], (groups == 1 ? (last ? 0 : 1) : groups) + last)
          << at;
      // The MLP's forward: three products per expert reached, and a few more.
      EXPECT_GE(forward_kernels[size_t(layer)], 3 * R + 10) << at;
      EXPECT_LE(forward_kernels[size_t(layer)], 3 * R + 10 + 8 * double(groups)) << at;
    }
  }
}

// The launches cost nothing while the device's FLOPs cover them (a dense
// layer of llama3-8b at 4096 tokens) and set the time where the kernels are
// small (128 experts of 768 rows at 512 tokens: qwen3-30b-a3b's); each wait
// adds host_wait_us. The CPU backend's costs do not depend on them.
TEST(GpuLaunches, LaunchesCostOnlyWhereTheKernelsAreTooSmallToCoverThem) {
  Result<HardwareProfile> h100 = hardware_preset("h100-sxm");
  ASSERT_TRUE(h100.is_ok());
  HardwareProfile free_launches = *h100;
  free_launches.launch_us = free_launches.host_wait_us = 0;
  auto forward_of_layer_1 = [](const TrainingPlan& plan, const HardwareProfile& hw) {
    const std::vector<OpCost> costs = cost_operations(plan, hw);
    for (size_t i = 0; i < plan.ops.size(); ++i)
      if (plan.ops[i].kind == OpKind::forward && plan.ops[i].unit == 2) return costs[i].seconds;
    ADD_FAILURE() << "no forward of layer 1";
    return 0.0;
  };
  for (const char* model : {"llama3-8b", "qwen3-30b-a3b"}) {
    PlanInput in;
    in.model = *load_model_config(model);
    in.precision = Precision::bf16;
    in.gpu = true;
    in.micro_batch = 1;
    in.seq_len = model == std::string("llama3-8b") ? 4096 : 512;
    in.budgets.device_per_rank = 1LL << 40;
    in.budgets.host_per_node = 1LL << 40;
    Result<TrainingPlan> plan = plan_training(in);
    ASSERT_TRUE(plan.is_ok()) << plan.status().message();
    const double with = forward_of_layer_1(*plan, *h100);
    const double without = forward_of_layer_1(*plan, free_launches);
    const PlanOp* forward = nullptr;
    for (const PlanOp& op : plan->ops)
      if (op.kind == OpKind::forward && op.unit == 2) forward = &op;
    ASSERT_NE(forward, nullptr);
    const GpuLaunches l = gpu_launches(*plan, *forward);
    const double flops = operation_flops(*plan, *forward) / h100->matmul_flops(Precision::bf16);
    EXPECT_NEAR(without, flops, 1e-12) << model;
    EXPECT_NEAR(
        with,
        std::max(flops, l.kernels * h100->launch_us * 1e-6) + l.waits * h100->host_wait_us * 1e-6,
        1e-12)
        << model;
    if (model == std::string("llama3-8b")) {
      EXPECT_EQ(l.waits, 0);
      EXPECT_DOUBLE_EQ(with, without);  // the FLOPs cover the launches
    } else {
      EXPECT_EQ(l.waits, 1);
      EXPECT_GT(l.kernels, 3 * 128);
      EXPECT_GT(with, 2 * without);  // launch-bound
    }
  }
  // The CPU backend: the same plan on the CPU costs the same whatever the launches.
  Result<TrainingPlan> cpu = plan_training(nvme_input());
  ASSERT_TRUE(cpu.is_ok());
  HardwareProfile cpu_hw = *h100;
  cpu_hw.gpu = false;
  HardwareProfile cpu_free = cpu_hw;
  cpu_free.launch_us = cpu_free.host_wait_us = 0;
  const std::vector<OpCost> a = cost_operations(*cpu, cpu_hw), b = cost_operations(*cpu, cpu_free);
  for (size_t i = 0; i < a.size(); ++i) EXPECT_EQ(a[i].seconds, b[i].seconds) << i;
}

// Ranks of one process share the CPU's cores at the probe's measured shares,
// the last one's aggregate split further beyond them, evenly without them.
TEST(HardwareProfile, EachRanksShareOfTheCores) {
  HardwareProfile hw;
  hw.cores = 2;
  EXPECT_DOUBLE_EQ(hw.rank_share(1), 1.0);
  EXPECT_DOUBLE_EQ(hw.rank_share(2), 1.0);
  EXPECT_DOUBLE_EQ(hw.rank_share(4), 0.5);
  hw.rank_shares = {1.0, 0.6, 0.36};
  EXPECT_DOUBLE_EQ(hw.rank_share(2), 0.6);
  EXPECT_DOUBLE_EQ(hw.rank_share(3), 0.36);
  EXPECT_DOUBLE_EQ(hw.rank_share(6), 0.36 * 3 / 6);
  // A unit's forward at two ranks takes 1 / 0.6 of its time at one.
  PlanInput in = nvme_input();
  in.world_size = 2;
  in.budgets.ranks_per_node = 2;
  Result<TrainingPlan> two = plan_training(in);
  ASSERT_TRUE(two.is_ok()) << two.status().message();
  hw.matmul_tflops_fp32 = 1;
  hw.layer_forward_gflops = 100;
  const std::vector<OpCost> costs = cost_operations(*two, hw);
  bool saw = false;
  for (size_t i = 0; i < two->ops.size(); ++i) {
    const PlanOp& op = two->ops[i];
    if (op.kind != OpKind::forward || op.unit != 1) continue;
    saw = true;
    EXPECT_NEAR(costs[i].seconds, operation_flops(*two, op) / (100e9 * 0.6), 1e-12);
  }
  EXPECT_TRUE(saw);
}

TEST(HardwareProfile, PresetsAndFilesRoundTripAndBadOnesAreOneLine) {
  for (const std::string& name : hardware_preset_names()) {
    Result<HardwareProfile> p = hardware_preset(name + "/gen5x2");
    ASSERT_TRUE(p.is_ok()) << p.status().message();
    EXPECT_EQ(p->nvme.size(), 2u);
    EXPECT_GT(p->matmul_tflops_bf16, p->matmul_tflops_fp32) << name;
    Result<HardwareProfile> back = parse_hardware_profile(hardware_profile_json(*p), "x.json");
    ASSERT_TRUE(back.is_ok()) << back.status().message();
    EXPECT_EQ(hardware_profile_json(*back), hardware_profile_json(*p));
    EXPECT_EQ(p->nvme_mixed_gbps(), 0.0) << name;  // a preset's drives have no measured mixed rate
  }
  {
    // A probed drive's mixed rate round-trips; the drives' sum is the node's,
    // and unknown where one drive lacks it.
    Result<HardwareProfile> p = parse_hardware_profile(
        R"({"compute": {"matmul_tflops": {"fp32": 1}},
            "nvme": [{"read_gbps": 2, "write_gbps": 1.5, "mixed_gbps": 2.5},
                     {"read_gbps": 2, "write_gbps": 1.5, "mixed_gbps": 3}]})",
        "mixed.json");
    ASSERT_TRUE(p.is_ok()) << p.status().message();
    EXPECT_DOUBLE_EQ(p->nvme_mixed_gbps(), 5.5);
    Result<HardwareProfile> back = parse_hardware_profile(hardware_profile_json(*p), "x.json");
    ASSERT_TRUE(back.is_ok()) << back.status().message();
    EXPECT_DOUBLE_EQ(back->nvme_mixed_gbps(), 5.5);
    p->nvme[1].mixed_gbps = 0;
    EXPECT_EQ(p->nvme_mixed_gbps(), 0.0);
  }
  struct Case {
    std::string text, names;
  };
  const std::vector<Case> bad = {
      {R"({"compute": {"matmul_tflops": {"fp32": -1}}})", "compute.matmul_tflops.fp32"},
      {R"({"compute": {"matmul_tflops": {"fp32": 1}}, "nvme": [{"read_gbps": 1}]})", "nvme[0]"},
      {R"({"compute": {"matmul_tflops": {"fp32": 1}},
           "nvme": [{"read_gbps": 1, "write_gbps": 1, "mixed_gbps": 0}]})",
       "nvme[0].mixed_gbps"},
      {R"({"compute": {"matmul_tflops": {"fp32": 1}}, "netwrok": {}})", "netwrok"},
      {R"({"kind": "tpu", "compute": {"matmul_tflops": {"fp32": 1}}})", "kind"},
      {R"({"name": "no rates"})", "compute.matmul_tflops.fp32"},
      {R"({"compute": )", "profile.json"},
      {R"({"compute": {"matmul_tflops": {"fp32": 1}}, "cpu_units": {"rank_shares": [1, 2]}})",
       "cpu_units.rank_shares"},
      {R"({"compute": {"matmul_tflops": {"fp32": 1}}, "cpu_units": {"rank_shares": []}})",
       "cpu_units.rank_shares"},
      {R"({"kind": "gpu", "compute": {"matmul_tflops": {"fp32": 1}, "launch_us": -4}})",
       "compute.launch_us"},
      {R"({"kind": "gpu", "compute": {"matmul_tflops": {"fp32": 1}, "host_wait_us": "x"}})",
       "compute.host_wait_us"},
  };
  for (const Case& c : bad) {
    Result<HardwareProfile> p = parse_hardware_profile(c.text, "profile.json");
    ASSERT_FALSE(p.is_ok()) << c.text;
    EXPECT_NE(p.status().message().find("profile.json"), std::string::npos) << p.status().message();
    EXPECT_NE(p.status().message().find(c.names), std::string::npos) << p.status().message();
    EXPECT_EQ(p.status().message().find('\n'), std::string::npos) << p.status().message();
  }
  for (const char* name : {"h100", "h100-sxm/gen3x1", "h100-sxm/gen4x0", "h100-sxm/gen4"}) {
    Result<HardwareProfile> p = hardware_preset(name);
    ASSERT_FALSE(p.is_ok()) << name;
    EXPECT_NE(p.status().message().find(name), std::string::npos) << p.status().message();
  }
}

}  // namespace
}  // namespace strata
