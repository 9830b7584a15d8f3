// Plans over several nodes: the world as nodes of ranks, collectives that
// reduce within a node and then across nodes, each level's bytes on its own
// link, counted in the plan's one traffic account and costed by the
// step-time model on each link. The byte counts are derived by hand from the
// tiny preset's shapes (core/plan/training_plan.h, StepTraffic).
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "core/plan/hardware_profile.h"
#include "core/plan/planner.h"
#include "core/plan/step_model.h"

namespace strata {
namespace {

// tiny: V 256, H 96, I 160, 2 layers, 6 heads, 2 KV heads of 16.
constexpr int64_t kEmbedding = 256 * 96;                                             // 24576
constexpr int64_t kLayer = 96 * 96 + 2 * 96 * 32 + 96 * 96 + 3 * 96 * 160 + 2 * 96;  // 70848
constexpr int64_t kHead = 96 + 256 * 96;                                             // 24672

// A rank's shard of a unit: ceil(numel / W), padded to 2048 elements (4 KiB of bf16).
int64_t shard(int64_t numel, int world) {
  return ((numel + world - 1) / world + 2047) / 2048 * 2048;
}

// ZeRO stage 3, bf16 parameters, fp32 gradients, one micro-batch.
PlanInput tiny_over(int nodes, int ranks_per_node) {
  PlanInput in;
  in.model = *load_model_config("tiny");
  in.world_size = nodes * ranks_per_node;
  in.budgets.ranks_per_node = ranks_per_node;
  in.stage = 3;
  in.precision = Precision::bf16;
  in.micro_batch = 1;
  in.seq_len = 32;
  in.schedule = Schedule::micro_batch;
  return in;
}

// What one rank's collectives send per shard element, in bytes, over a step:
// every unit's fp32 gradient reduce-scattered once; its bf16 parameters
// all-gathered for each use (a layer's forward and its backward, the head's
// one pass, the embedding's forward and its backward).
// And the step's exchange: an all-gather of each of the 4 units' norm partial
// and flag and the micro-batch's loss sum, 8 bytes each.
int64_t bytes_per_shard_step(int world) {
  const int64_t e = shard(kEmbedding, world), l = shard(kLayer, world), h = shard(kHead, world);
  const int64_t reduce_scatter = 4 * (e + 2 * l + h);
  const int64_t all_gather = 2 * (2 * e + 2 * 2 * l + h);
  const int64_t exchange = (2 * 4 + 1) * 8;
  return reduce_scatter + all_gather + exchange;
}

TEST(PlanNodes, TwoNodesOfTwoRanksSplitEachCollectiveByHand) {
  Result<TrainingPlan> plan = build_training_plan(tiny_over(2, 2));
  ASSERT_TRUE(plan.is_ok()) << plan.status().message();
  // W = 4: shards of 6144, 18432, 8192 elements; P = 4 x 51200 + 2 x 94208 + 72 = 393288.
  const int64_t P = bytes_per_shard_step(4);
  ASSERT_EQ(P, 393288);
  // Within the node: n (g - 1) P = 2 P; across the nodes: (n - 1) P = P.
  EXPECT_EQ(plan->traffic_per_step.intra_node, 786576);
  EXPECT_EQ(plan->traffic_per_step.inter_node, 393288);
  // Together a flat ring's (W - 1) P.
  EXPECT_EQ(plan->traffic_per_step.collective(), 3 * P);
}

TEST(PlanNodes, ThreeNodesOfTwoRanksSplitEachCollectiveByHand) {
  Result<TrainingPlan> plan = build_training_plan(tiny_over(3, 2));
  ASSERT_TRUE(plan.is_ok()) << plan.status().message();
  // W = 6: shards of 4096, 12288, 6144 elements; P = 4 x 34816 + 2 x 63488 + 72 = 266312.
  const int64_t P = bytes_per_shard_step(6);
  ASSERT_EQ(P, 266312);
  EXPECT_EQ(plan->traffic_per_step.intra_node, 3 * 1 * P);  // n (g - 1) P
  EXPECT_EQ(plan->traffic_per_step.inter_node, 2 * P);      // (n - 1) P
  EXPECT_EQ(plan->traffic_per_step.intra_node, 798936);
  EXPECT_EQ(plan->traffic_per_step.inter_node, 532624);
}

TEST(PlanNodes, EachOperationSplitsItsOwnBytes) {
  Result<TrainingPlan> plan = build_training_plan(tiny_over(3, 2));
  ASSERT_TRUE(plan.is_ok()) << plan.status().message();
  const std::vector<StepTraffic> traffic = traffic_per_op(*plan);
  for (size_t i = 0; i < plan->ops.size(); ++i) {
    const PlanOp& op = plan->ops[i];
    if (op.kind != OpKind::gather && op.kind != OpKind::reduce) continue;
    // bytes = 5 s for a shard of s bytes: 3 s within the node, 2 s across.
    EXPECT_EQ(traffic[i].intra_node, op.bytes / 5 * 3) << op_label(*plan, op);
    EXPECT_EQ(traffic[i].inter_node, op.bytes / 5 * 2) << op_label(*plan, op);
  }
}

TEST(PlanNodes, OneNodeKeepsEveryByteOnTheIntraNodeLink) {
  PlanInput whole = tiny_over(1, 4);
  PlanInput unsaid = whole;
  unsaid.budgets.ranks_per_node = 0;  // the whole world on one node
  for (const PlanInput& in : {whole, unsaid}) {
    Result<TrainingPlan> plan = build_training_plan(in);
    ASSERT_TRUE(plan.is_ok()) << plan.status().message();
    EXPECT_EQ(plan->traffic_per_step.intra_node, 3 * bytes_per_shard_step(4));
    EXPECT_EQ(plan->traffic_per_step.inter_node, 0);
  }
  // One rank per node: everything crosses nodes.
  Result<TrainingPlan> spread = build_training_plan(tiny_over(4, 1));
  ASSERT_TRUE(spread.is_ok()) << spread.status().message();
  EXPECT_EQ(spread->traffic_per_step.intra_node, 0);
  EXPECT_EQ(spread->traffic_per_step.inter_node, 3 * bytes_per_shard_step(4));
}

TEST(PlanNodes, AWorldThatIsNotWholeNodesIsRefusedInOneLine) {
  PlanInput in = tiny_over(1, 4);
  in.world_size = 6;
  const Status status = validate_plan_input(in);
  ASSERT_FALSE(status.is_ok());
  EXPECT_NE(status.message().find("world size 6 is not a whole number of nodes of 4 ranks"),
            std::string::npos)
      << status.message();
  EXPECT_EQ(status.message().find('\n'), std::string::npos);
  EXPECT_FALSE(build_training_plan(in).is_ok());
}

TEST(PlanNodes, TheReportTimesEachLinkAndNamesTheSlowest) {
  PlanInput in = tiny_over(2, 2);
  in.links.intra_node = 100e9;
  in.links.inter_node = 1e9;
  PlanReport plan = *plan_memory(in);
  EXPECT_EQ(plan.traffic.intra_node_bytes, 786576);
  EXPECT_EQ(plan.traffic.inter_node_bytes, 393288);
  EXPECT_DOUBLE_EQ(plan.traffic.intra_node_seconds, 786576 / 100e9);
  EXPECT_DOUBLE_EQ(plan.traffic.inter_node_seconds, 393288 / 1e9);
  EXPECT_EQ(plan.traffic.slowest_link, "inter-node");
  in.links.inter_node = 1000e9;
  EXPECT_EQ(plan_memory(in)->traffic.slowest_link, "intra-node");

  const std::string table = format_plan_table(plan, false);
  EXPECT_NE(table.find("world size 4 (2 nodes x 2 ranks)"), std::string::npos) << table;
  EXPECT_NE(table.find("collectives within each node of 2 ranks, then across the 2 nodes"),
            std::string::npos)
      << table;
  EXPECT_NE(table.find("  intra-node "), std::string::npos) << table;
  EXPECT_NE(table.find("  inter-node "), std::string::npos) << table;
  EXPECT_NE(table.find("slowest link: inter-node"), std::string::npos) << table;
  EXPECT_NE(table.find("node total (2 ranks)"), std::string::npos) << table;
  EXPECT_NE(table.find("all 2 nodes (4 ranks)"), std::string::npos) << table;

  const nlohmann::ordered_json j = plan_to_json(plan, false);
  EXPECT_EQ(j["nodes"].get<int>(), 2);
  EXPECT_EQ(j["ranks_per_node"].get<int>(), 2);
  EXPECT_EQ(j["traffic"]["intra_node_bytes"].get<int64_t>(), 786576);
  EXPECT_EQ(j["traffic"]["inter_node_bytes"].get<int64_t>(), 393288);
  EXPECT_EQ(j["traffic"]["collective_bytes"].get<int64_t>(), 786576 + 393288);
  EXPECT_EQ(j["traffic"]["slowest_link"].get<std::string>(), "inter-node");
}

TEST(PlanNodes, HostAndNvmeBudgetsAreEachNodes) {
  PlanInput in = tiny_over(2, 2);
  in.offload_optimizer = OffloadDevice::cpu;
  PlanReport plan = *plan_memory(in);
  // The host verdict is the node's two ranks, not the world's four.
  EXPECT_EQ(plan.verdicts[1].need, 2 * plan.total_per_rank.host);
  in.budgets.host_per_node = 1LL << 30;
  const std::string table = format_plan_table(*plan_memory(in), false);
  EXPECT_NE(table.find("(per node, "), std::string::npos) << table;
}

HardwareProfile two_links() {
  HardwareProfile hw;
  hw.name = "by hand";
  hw.matmul_tflops_fp32 = 1;
  hw.memory_gbps = 1000;
  hw.memcpy_gbps = 1000;
  hw.adamw_mparams_fp32 = 100;
  hw.intra_node_gbps = 100;
  hw.intra_node_latency_us = 10;
  hw.inter_node_gbps = 10;
  hw.inter_node_latency_us = 20;
  return hw;
}

TEST(PlanNodes, TheStepModelCostsEachLevelOnItsOwnLink) {
  Result<TrainingPlan> plan = build_training_plan(tiny_over(3, 2));
  ASSERT_TRUE(plan.is_ok()) << plan.status().message();
  const HardwareProfile hw = two_links();
  const std::vector<OpCost> costs = cost_operations(*plan, hw);
  const std::vector<StepTraffic> traffic = traffic_per_op(*plan);
  const uint32_t both = uint32_t(Resource::intra_node) | uint32_t(Resource::inter_node);
  bool saw = false;
  for (size_t i = 0; i < plan->ops.size(); ++i) {
    if (plan->ops[i].kind != OpKind::reduce) continue;
    saw = true;
    // Within the node: g - 1 = 1 hop; across: n - 1 = 2 hops.
    const double intra = double(traffic[i].intra_node) / 100e9 + 1 * 10e-6;
    const double inter = double(traffic[i].inter_node) / 10e9 + 2 * 20e-6;
    EXPECT_DOUBLE_EQ(costs[i].intra_node_seconds, intra);
    EXPECT_DOUBLE_EQ(costs[i].inter_node_seconds, inter);
    EXPECT_EQ(costs[i].resources & both, both);
    EXPECT_DOUBLE_EQ(costs[i].busy_seconds(3), intra);  // resource_name(3): the intra-node link
    EXPECT_DOUBLE_EQ(costs[i].busy_seconds(6), inter);
  }
  EXPECT_TRUE(saw);
  EXPECT_STREQ(resource_name(3), "intra-node link");
  EXPECT_STREQ(resource_name(6), "inter-node link");
}

TEST(PlanNodes, ASlowNetworkBetweenNodesBoundsThePredictedStep) {
  Result<TrainingPlan> plan = build_training_plan(tiny_over(2, 2));
  ASSERT_TRUE(plan.is_ok()) << plan.status().message();
  HardwareProfile hw = two_links();
  hw.inter_node_gbps = 0.0001;  // 100 kB/s
  const StepPrediction p = predict_step(*plan, hw);
  // The collectives' lane bounds it; of the links, the one between nodes (on
  // the CPU backend a gather holds the cores too, for its whole time).
  EXPECT_EQ(p.bound_lane, Lane::comm);
  EXPECT_GT(p.resource_busy[6], p.resource_busy[3]);
  EXPECT_GT(p.resource_busy[6], p.resource_busy[2]);
  EXPECT_NE(format_prediction(p).find("inter-node "), std::string::npos);
  // A profile without the link (one written for one node) costs nothing for it, and says so.
  hw.inter_node_gbps = 0;
  const StepPrediction unknown = predict_step(*plan, hw);
  EXPECT_TRUE(unknown.inter_node_unknown);
  EXPECT_NE(format_prediction(unknown).find("the profile has no inter-node link"),
            std::string::npos);
}

TEST(PlanNodes, ProfilesCarryTheInterNodeLinkAndOlderOnesStillLoad) {
  const std::string older = R"({"name": "one node", "compute": {"matmul_tflops": {"fp32": 1}},
      "network": {"gbps": 40, "latency_us": 3}})";
  Result<HardwareProfile> p = parse_hardware_profile(older, "old.json");
  ASSERT_TRUE(p.is_ok()) << p.status().message();
  EXPECT_EQ(p->intra_node_gbps, 40);
  EXPECT_EQ(p->inter_node_gbps, 0);  // unknown
  const std::string newer = R"({"compute": {"matmul_tflops": {"fp32": 1}},
      "internode": {"gbps": 50, "latency_us": 7}})";
  p = parse_hardware_profile(newer, "new.json");
  ASSERT_TRUE(p.is_ok()) << p.status().message();
  EXPECT_EQ(p->inter_node_gbps, 50);
  EXPECT_EQ(p->inter_node_latency_us, 7);
  Result<HardwareProfile> bad = parse_hardware_profile(
      R"({"compute": {"matmul_tflops": {"fp32": 1}}, "internode": {"gbps": -1}})", "bad.json");
  ASSERT_FALSE(bad.is_ok());
  EXPECT_NE(bad.status().message().find("internode.gbps"), std::string::npos)
      << bad.status().message();
  // Every GPU preset has both links, and its file form keeps them.
  for (const std::string& name : hardware_preset_names()) {
    const HardwareProfile preset = *hardware_preset(name);
    EXPECT_GT(preset.intra_node_gbps, preset.inter_node_gbps) << name;
    EXPECT_GT(preset.inter_node_gbps, 0) << name;
    const HardwareProfile back = *parse_hardware_profile(hardware_profile_json(preset), name);
    EXPECT_EQ(back.inter_node_gbps, preset.inter_node_gbps) << name;
    EXPECT_EQ(back.inter_node_latency_us, preset.inter_node_latency_us) << name;
  }
}

}  // namespace
}  // namespace strata
