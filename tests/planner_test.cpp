// The planner's numbers, each derived by hand in the test from core/README.md's
// bytes per parameter (strata's) and the ZeRO paper's (2 + 2 + 12 bytes).
#include "core/plan/planner.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "core/config/config.h"
#include "core/model/model.h"
#include "core/plan/plan_input.h"
#include "io/base/sizes.h"

namespace strata {
namespace {

// `strata plan --params N`: a plan of model_of_size(N), like any model's.
PlanInput bare(int64_t parameters, int world, int stage, Precision precision) {
  PlanInput in;
  in.model = model_of_size(parameters);
  in.world_size = world;
  in.stage = stage;
  in.precision = precision;
  in.seq_len = 64;
  in.schedule = Schedule::micro_batch;
  return in;
}

// A rank's shard of every unit, each padded to 2048 elements, summed.
int64_t shard_sum(const ModelConfig& model, int world) {
  int64_t sum = 0;
  for (const UnitShape& unit : model_units(model))
    if (unit.numel > 0) sum += ((unit.numel + world - 1) / world + 2047) / 2048 * 2048;
  return sum;
}

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

TEST(Planner, ShardsArePaddedTo4KiBInEveryDtype) {
  EXPECT_EQ(padded_shard_elements(2048, 1), 2048);
  EXPECT_EQ(padded_shard_elements(2049, 1), 4096);
  EXPECT_EQ(padded_shard_elements(10000, 3), 4096);  // ceil(10000 / 3) = 3334 -> 4096
  EXPECT_EQ(padded_shard_elements(1, 8), 2048);
}

TEST(Planner, AModelOfASizeHasAboutThatManyParametersInLlamasProportions) {
  for (int64_t n : {int64_t{125000000}, int64_t{1000000000}, int64_t{7000000000},
                    int64_t{70000000000}, int64_t{175000000000}}) {
    const ModelConfig m = model_of_size(n);
    EXPECT_NEAR(double(m.parameter_count()), double(n), 0.03 * double(n)) << m.name;
    EXPECT_EQ(m.vocab_size, 32000) << m.name;
    const double per_layer = double(m.hidden_size) / double(m.num_hidden_layers);
    EXPECT_GT(per_layer, 32) << m.name;
    EXPECT_LT(per_layer, 512) << m.name;
    EXPECT_EQ(m.hidden_size % m.num_attention_heads, 0) << m.name;
  }
  // Too small for a 32000-token vocabulary: a byte vocabulary.
  EXPECT_EQ(model_of_size(2000000).vocab_size, 256);
}

TEST(Planner, StageZeroOneRankBf16IsEighteenBytesPerPaddedParameter) {
  const PlanInput in = bare(1000000000, 1, 0, Precision::bf16);
  PlanReport plan = *plan_memory(in);
  const int64_t padded = shard_sum(in.model, 1);
  EXPECT_EQ(plan.shard_elements, padded);
  EXPECT_EQ(plan.parameters, in.model.parameter_count());
  EXPECT_EQ(plan.model_states.device, 18 * padded);
  EXPECT_EQ(plan.model_states.host, 0);
  EXPECT_EQ(plan.model_states.nvme, 0);
  EXPECT_EQ(plan.model_states_zero.device, 16 * plan.parameters);  // 2 + 2 + 12 bytes each
}

TEST(Planner, StageThreeDividesEverythingByTheRanks) {
  const PlanInput in = bare(1000000000, 4, 3, Precision::bf16);
  PlanReport plan = *plan_memory(in);
  const int64_t shard = shard_sum(in.model, 4);
  const int64_t n = plan.parameters;
  EXPECT_EQ(plan.shard_elements, shard);
  EXPECT_EQ(plan.model_states.device, 18 * shard);
  EXPECT_EQ(plan.model_states_zero.device, 2 * ceil_div(2 * n, 4) + ceil_div(12 * n, 4));
}

TEST(Planner, FpThirtyTwoWithTheOptimizerOnTheHostKeepsASeparateMaster) {
  PlanInput in = bare(1000000000, 2, 2, Precision::fp32);
  in.offload_optimizer = OffloadDevice::cpu;
  PlanReport plan = *plan_memory(in);
  const int64_t shard = shard_sum(in.model, 2);
  const int64_t n = plan.parameters;
  // Stage 2: parameters whole (both shards) on the device in fp32.
  EXPECT_EQ(plan.model_states.device, 4 * 2 * shard);
  // Gradient shard (fp32), master, m and v on the host: 16 bytes per shard element.
  EXPECT_EQ(plan.model_states.host, 16 * shard);
  // ZeRO: 2N params on the device; grads 2N/2 and optimizer 12N/2 on the host.
  EXPECT_EQ(plan.model_states_zero.device, 2 * n);
  EXPECT_EQ(plan.model_states_zero.host, ceil_div(2 * n, 2) + ceil_div(12 * n, 2));
}

TEST(Planner, FpThirtyTwoWithoutOffloadHasNoSeparateMaster) {
  PlanReport plan = *plan_memory(bare(1000000000, 1, 0, Precision::fp32));
  EXPECT_EQ(plan.model_states.device, 16 * plan.shard_elements);
}

TEST(Planner, EverythingOnNvmeStagesThroughPinnedBuffers) {
  PlanInput in = bare(1000000000, 1, 3, Precision::bf16);
  in.offload_optimizer = OffloadDevice::nvme;
  in.offload_param = OffloadDevice::nvme;
  PlanReport plan = *plan_memory(in);
  const int64_t s = plan.shard_elements;
  EXPECT_EQ(plan.model_states.nvme, 14 * s);  // params 2 + master 4 + m 4 + v 4
  EXPECT_EQ(plan.model_states.host, 4 * s);   // the fp32 gradient shard
  EXPECT_EQ(plan.model_states.device, 0);
  // Staging: the NVMe parameter copies and the streamed optimizer's buffers in host memory.
  EXPECT_GT(plan.host_staging_bytes, 0);
  EXPECT_EQ(plan.total_per_rank.nvme, plan.model_states.nvme);
  // NVMe per step: optimizer state read and written (12 bytes), parameters
  // read by every fetch and written once after the step (2 bytes).
  Result<TrainingPlan> built = build_training_plan(in);
  ASSERT_TRUE(built.is_ok()) << built.status().message();
  int64_t fetched = 0;
  for (const PlanOp& op : built->ops)
    if (op.kind == OpKind::fetch) fetched += op.bytes;
  // Each unit is fetched for its forward and again for its backward, but the
  // head (one pass for both) once: 2 bytes x (2 x shard - the head's shard).
  const int64_t head = built->units.back().shard_numel;
  EXPECT_EQ(fetched, 2 * (2 * s - head));
  EXPECT_EQ(plan.traffic.nvme_read_bytes, 12 * s + fetched);
  EXPECT_EQ(plan.traffic.nvme_write_bytes, 12 * s + 2 * s);
  EXPECT_EQ(plan.traffic.slowest_link, "NVMe");
}

TEST(Planner, FpThirtyTwoOnNvmeStreamsTheParametersAsTheMaster) {
  PlanInput in = bare(1000000000, 1, 3, Precision::fp32);
  in.offload_optimizer = OffloadDevice::nvme;
  in.offload_param = OffloadDevice::nvme;
  in.optimizer_chunk_elements = streamed_chunk_elements(500000);  // rounds down to 488 * 1024
  EXPECT_EQ(in.optimizer_chunk_elements, 488 * 1024);
  PlanReport plan = *plan_memory(in);
  const int64_t s = plan.shard_elements;
  EXPECT_EQ(plan.model_states.nvme, 12 * s);  // params (the master), m, v
  EXPECT_EQ(plan.model_states.host, 4 * s);
  EXPECT_EQ(plan.traffic.nvme_write_bytes, 12 * s);  // the optimizer's write is the parameters'
}

// Traffic has one source: the plan's operations, whichever planner reads it.
TEST(Planner, TrafficIsTheTrainingPlansOwn) {
  for (int stage : {0, 1, 2, 3}) {
    PlanInput in = bare(1000000000, 4, stage, Precision::bf16);
    in.grad_accum = 2;
    if (stage == 3) in.offload_param = OffloadDevice::nvme;
    in.offload_optimizer = stage == 3 ? OffloadDevice::nvme : OffloadDevice::none;
    PlanReport plan = *plan_memory(in);
    Result<TrainingPlan> built = build_training_plan(in);
    ASSERT_TRUE(built.is_ok()) << built.status().message();
    const StepTraffic& t = built->traffic_per_step;
    EXPECT_EQ(plan.traffic.intra_node_bytes, t.intra_node) << stage;
    EXPECT_EQ(plan.traffic.inter_node_bytes, t.inter_node) << stage;
    EXPECT_EQ(plan.traffic.nvme_read_bytes, t.nvme_read) << stage;
    EXPECT_EQ(plan.traffic.nvme_write_bytes, t.nvme_written) << stage;
    EXPECT_EQ(plan.traffic.h2d_bytes, t.h2d) << stage;
    EXPECT_EQ(plan.traffic.d2h_bytes, t.d2h) << stage;
  }
}

TEST(Planner, CollectiveVolumeFollowsTheStage) {
  PlanInput in = bare(1000000000, 4, 3, Precision::bf16);
  in.grad_accum = 2;
  PlanReport plan = *plan_memory(in);
  const int64_t n = plan.parameters;
  Result<TrainingPlan> built = build_training_plan(in);
  ASSERT_TRUE(built.is_ok());
  // Per micro-batch each unit's fp32 gradient is reduce-scattered (3/4 of
  // its padded 4 bytes). Its bf16 parameters are all-gathered (3/4 of 2
  // bytes) once per use, a run of computations that read it: a layer's
  // forward and backward of each micro-batch (2G), the head's one pass (G),
  // and the embedding's forward of one micro-batch with the backward of the
  // one before, which reads no parameters (G + 1).
  const int64_t G = 2;
  int64_t padded = 0;
  for (const UnitPlacement& u : built->units) padded += u.padded_numel;
  const int64_t head = built->units.back().padded_numel;
  const int64_t embedding = built->units.front().padded_numel;
  const int64_t layers = padded - head - embedding;
  const int64_t reduce_scatter = padded * 4 * 3 / 4;
  const int64_t all_gather = (2 * G * layers + G * head + (G + 1) * embedding) * 2 * 3 / 4;
  // The step's exchange: every unit's norm partial and flag and each
  // micro-batch's loss, 8 bytes each, all-gathered (3 other ranks).
  const int64_t exchange = (2 * int64_t(built->units.size()) + G) * 8 * 3;
  EXPECT_EQ(plan.traffic.collective_bytes(), G * reduce_scatter + all_gather + exchange);
  EXPECT_EQ(plan.traffic.collective_bytes_zero, 3 * 2 * n);  // 3 psi, fp16
  in.stage = 1;
  PlanReport stage1 = *plan_memory(in);
  EXPECT_EQ(stage1.traffic.collective_bytes_zero, 2 * 2 * n);  // 2 psi
  in.world_size = 1;
  EXPECT_EQ(plan_memory(in)->traffic.collective_bytes(), 0);
}

TEST(Planner, TinyModelUnitsAndActivationsByHand) {
  ModelConfig tiny = *load_model_config("tiny");  // V 256, H 96, I 160, L 2, 6 heads, 2 KV heads
  PlanInput in;
  in.model = tiny;
  in.precision = Precision::bf16;
  in.micro_batch = 2;
  in.seq_len = 64;
  PlanReport plan = *plan_memory(in);
  const int64_t layer = 96 * 96 + 2 * 96 * 32 + 96 * 96 + 3 * 96 * 160 + 2 * 96;  // 70848
  EXPECT_EQ(plan.parameters, 256 * 96 + 2 * layer + 96 + 256 * 96);
  EXPECT_EQ(plan.units, 4);
  // Padded per unit: 24576 = 12 blocks; 70848 -> 35 blocks; 24672 -> 13 blocks.
  EXPECT_EQ(plan.shard_elements, (12 + 2 * 35 + 13) * 2048);
  // The CPU backend's activations (fp32): the inputs of the three units after the
  // embedding, the activation gradient, the tokens and targets, each on whole pages.
  const int64_t tokens = 2 * 64;
  EXPECT_EQ(plan.saved_activation_bytes,
            3 * tokens * 96 * 4 + tokens * 96 * 4 + round_up<int64_t>(2 * tokens * 4, 4096));
  EXPECT_EQ(plan.activation_working_bytes,
            round_up<int64_t>(UnitWorkspace::bytes_for(tiny, 2, 64), 4096));
  // The whole table is the engine's plan for the same input.
  Result<TrainingPlan> engine_plan = plan_training(in);
  ASSERT_TRUE(engine_plan.is_ok()) << engine_plan.status().message();
  EXPECT_EQ(plan.total_per_rank.device, engine_plan->peak(Tier::device));
  EXPECT_EQ(plan.total_per_rank.host, engine_plan->peak(Tier::host));
  EXPECT_EQ(plan.buffers.size(), engine_plan->buffers.size());
}

TEST(Planner, ABudgetThatOverflowsNamesTheTierAndSuggestsTheSmallestChange) {
  PlanInput in;
  in.model = *load_model_config("llama3-8b");
  in.precision = Precision::bf16;
  in.budgets.device_per_rank = 80LL << 30;
  in.budgets.host_per_node = 1LL << 40;
  PlanReport plan = *plan_with_suggestion(in);
  EXPECT_FALSE(plan.fits);
  EXPECT_FALSE(plan.verdicts[0].fits());  // device: 18 bytes x 8B parameters
  EXPECT_TRUE(plan.verdicts[1].fits());
  EXPECT_EQ(plan.suggestion, "--offload-optimizer cpu");

  in.budgets.host_per_node = 100LL << 30;  // too little host memory for the optimizer state
  PlanReport tight = *plan_with_suggestion(in);
  EXPECT_EQ(tight.suggestion, "--offload-optimizer nvme --nvme-path DIR");

  in.world_size = 8;  // with ranks to shard over, a higher stage is the smallest change
  in.budgets.host_per_node = 1LL << 40;
  PlanReport ranks = *plan_with_suggestion(in);
  EXPECT_EQ(ranks.suggestion, "--stage 1");
}

// When even everything on NVMe leaves the device short, the line names what
// no placement or rank count shrinks: the largest unit's slots and
// gradients, whole on every rank; and what would: groups of experts, on
// either backend.
TEST(Planner, ADeviceTooSmallForOneUnitNamesTheUnit) {
  PlanInput in;
  in.model = *load_model_config("qwen3-235b-a22b");
  in.precision = Precision::bf16;
  in.gpu = true;
  in.stage = 3;
  in.offload_param = OffloadDevice::nvme;
  in.offload_optimizer = OffloadDevice::nvme;
  in.nvme_path_known = true;
  in.budgets.device_per_rank = 24LL << 30;
  in.budgets.host_per_node = 1LL << 40;
  in.budgets.nvme_per_node = 8LL << 40;
  const PlanReport plan = *plan_with_suggestion(in);
  ASSERT_FALSE(plan.fits);
  EXPECT_EQ(plan.suggestion.rfind("none: ", 0), 0u) << plan.suggestion;
  // (the leanest plan has the layers in pieces, said as the flag: the largest is a sparse MLP)
  EXPECT_NE(plan.suggestion.find("micro batch 1 (and --layer-pieces 2"), std::string::npos)
      << plan.suggestion;
  EXPECT_NE(plan.suggestion.find("sized by the largest unit, layers.0.mlp (2.42B parameters)"),
            std::string::npos)
      << plan.suggestion;
  EXPECT_EQ(plan.suggestion.find("more nodes"), std::string::npos) << plan.suggestion;
  // The line names the fewest groups of experts that give the device room,
  // and with them it has; the CPU backend's line names groups too.
  PlanInput shorter = in;
  shorter.seq_len = 256;  // each group keeps its input: short sequences, so that some count fits
  PlanInput on_cpu = shorter;
  on_cpu.gpu = false;
  EXPECT_NE(plan_with_suggestion(on_cpu)->suggestion.find(", or --layer-pieces 2 --expert-groups "),
            std::string::npos);
  const PlanReport grouped = *plan_with_suggestion(shorter);
  ASSERT_FALSE(grouped.fits);
  // (asked for whole layers, it names the pieces the groups need too)
  const std::string named = ", or --layer-pieces 2 --expert-groups ";
  const size_t at = grouped.suggestion.find(named);
  ASSERT_NE(at, std::string::npos) << grouped.suggestion;
  PlanInput cut = shorter;
  cut.stage = 3;
  cut.micro_batch = 1;
  cut.model.layer_pieces = 2;
  cut.model.expert_groups = std::stoll(grouped.suggestion.substr(at + named.size()));
  cut.model.vocab_chunks = vocab_chunks_for_layers(cut);
  EXPECT_GT(cut.model.expert_groups, 1);
  EXPECT_TRUE(plan_memory(cut)->verdicts[0].fits()) << grouped.suggestion;
  // Left to the plan (strata.expert_groups auto, the other cuts auto too),
  // the same count is chosen, and said why.
  PlanInput chosen = shorter;
  chosen.vocab_chunks_auto = chosen.layer_pieces_auto = chosen.expert_groups_auto = true;
  const PlanReport automatic = *plan_memory(chosen);
  EXPECT_TRUE(automatic.fits);
  EXPECT_EQ(automatic.input.model.expert_groups, cut.model.expert_groups);
  EXPECT_EQ(automatic.input.model.layer_pieces, 2);
  EXPECT_EQ(automatic.input.expert_groups_reason.rfind(
                std::to_string(cut.model.expert_groups) + " (auto: the plan does not fit", 0),
            0u)
      << automatic.input.expert_groups_reason;
  PlanInput roomy = chosen;  // with room for one piece, none is cut
  roomy.budgets.device_per_rank = 1LL << 40;
  const PlanReport one = *plan_memory(roomy);
  EXPECT_EQ(one.input.model.expert_groups, 1);
  cut.model.expert_groups -= 1;  // the fewest: one group fewer does not fit
  cut.model.vocab_chunks = vocab_chunks_for_layers(cut);
  if (cut.model.expert_groups > 1) {
    EXPECT_FALSE(plan_memory(cut)->verdicts[0].fits());
  }
  // A dense model asked for in whole layers that fit in pieces, on a GPU:
  // say so (the GPT-3-shaped Llama of 172B at 1 x 4096 tokens on 24 GB, its
  // vocabulary in two chunks, its saved inputs spilled to host memory); with
  // its vocabulary asked for whole too, the pieces come with a vocabulary
  // cut to their size.
  PlanInput dense = in;
  ModelConfig& m = dense.model;
  m = *load_model_config("llama3-8b");
  m.hidden_size = 12288;
  m.intermediate_size = 36864;
  m.num_hidden_layers = 100;
  m.num_attention_heads = 96;
  m.num_key_value_heads = 8;
  m.head_dim = 128;
  m.vocab_size = 128256;
  m.tie_word_embeddings = false;
  m.layer_pieces = 1;
  m.vocab_chunks = 2;
  dense.layer_pieces_auto = false;
  dense.vocab_chunks_auto = false;
  dense.micro_batch = 1;
  dense.seq_len = 4096;
  dense.budgets.host_per_node = 256LL << 30;
  const PlanReport whole = *plan_with_suggestion(dense);
  ASSERT_FALSE(whole.fits);
  EXPECT_EQ(whole.suggestion,
            "--layer-pieces 2 (each layer's attention and MLP as units of their own)");
  m.vocab_chunks = 1;
  const PlanReport whole_vocabulary = *plan_with_suggestion(dense);
  ASSERT_FALSE(whole_vocabulary.fits);
  EXPECT_EQ(whole_vocabulary.suggestion.rfind("--layer-pieces 2 --vocab-chunks 2 (", 0), 0u)
      << whole_vocabulary.suggestion;
  PlanInput cut_both = dense;
  cut_both.model.layer_pieces = 2;
  cut_both.model.vocab_chunks = 2;
  EXPECT_TRUE(plan_memory(cut_both)->fits);
}

TEST(Planner, ShardSizesAreTheModelLayoutsOwn) {
  for (const char* preset : {"tiny", "small", "llama3.2-1b"}) {
    for (int world : {1, 3, 8}) {
      PlanInput in;
      in.model = *load_model_config(preset);
      in.world_size = world;
      in.stage = 3;
      ModelLayout layout = model_layout(in.model, world);
      int64_t shards = 0;
      for (const UnitLayout& unit : layout.units) shards += unit.shard_numel;
      EXPECT_EQ(plan_memory(in)->shard_elements, shards) << preset << " over " << world;
    }
  }
}

TEST(Planner, OffloadingParametersBelowStageThreeIsRefused) {
  PlanInput in = bare(1000, 1, 2, Precision::bf16);
  in.offload_param = OffloadDevice::cpu;
  Status status = validate_plan_input(in);
  ASSERT_FALSE(status.is_ok());
  EXPECT_NE(status.message().find("needs ZeRO stage 3"), std::string::npos);
}

TEST(Planner, ExpertsOnADenseFamilyOrExpertsOfNoRowsAreRefused) {
  PlanInput in = bare(1000, 1, 2, Precision::bf16);
  in.model.num_experts = 4;  // a llama shape with experts: nothing to compute them by
  in.model.num_experts_per_tok = 2;
  Status status = validate_plan_input(in);
  ASSERT_FALSE(status.is_ok());
  EXPECT_NE(status.message().find("num_experts 4 on a dense family (llama)"), std::string::npos)
      << status.message();
  in.model = *load_model_config("mixtral-8x7b");
  EXPECT_TRUE(validate_plan_input(in).is_ok());
  in.model.num_experts_per_tok = 9;
  status = validate_plan_input(in);
  ASSERT_FALSE(status.is_ok());
  EXPECT_NE(status.message().find("1 to num_experts 8 experts per token (got 9)"),
            std::string::npos)
      << status.message();
}

TEST(Planner, JsonHasThePerRankModelStates) {
  PlanReport plan = *plan_memory(bare(1000000000, 1, 0, Precision::bf16));
  nlohmann::ordered_json j = plan_to_json(plan, false);
  EXPECT_EQ(j["per_rank"]["device_bytes"].get<int64_t>(), plan.model_states.device);
  EXPECT_EQ(j["per_rank"]["host_bytes"].get<int64_t>(), 0);
  nlohmann::ordered_json zero = plan_to_json(plan, true);
  EXPECT_EQ(zero["per_rank"]["device_bytes"].get<int64_t>(), 16 * plan.parameters);
}

// Stage 3 with everything on NVMe, CPU backend: a 3-layer model of hidden
// 256 with this vocabulary and MLP.
PlanInput all_on_nvme(const char* name, int64_t vocab, int64_t intermediate) {
  PlanInput in = bare(0, 1, 3, Precision::fp32);
  in.model = ModelConfig();
  in.model.name = name;
  in.model.vocab_size = vocab;
  in.model.hidden_size = 256;
  in.model.intermediate_size = intermediate;
  in.model.num_hidden_layers = 3;
  in.model.num_attention_heads = 4;
  in.model.num_key_value_heads = 2;
  in.model.head_dim = 64;
  in.model.max_position_embeddings = 256;
  in.offload_param = OffloadDevice::nvme;
  in.offload_optimizer = OffloadDevice::nvme;
  in.gradient_home = GradientHome::nvme;
  in.nvme_path_known = true;
  return in;
}

// strata.activation_home auto in the micro-batch order, at one micro-batch:
// the saved inputs stay on the device while they fit, go to the first home
// that fits when they do not (on a GPU host memory, then NVMe), and the
// schedule's reason says where and why; a home given is kept, and one that
// does not fit is told the home that does.
TEST(PlannerSchedule, SavedInputsThatDoNotFitTheDeviceAreSpilledAndSaidSo) {
  PlanInput in = all_on_nvme("long sequences", 512, 512);
  in.model.num_hidden_layers = 8;
  in.model.max_position_embeddings = 4096;
  in.seq_len = 4096;
  in.gpu = true;
  in.precision = Precision::bf16;
  in.schedule = Schedule::auto_choice;
  in.grad_accum = 1;
  const PlanReport roomy = *plan_memory(in);
  ASSERT_TRUE(roomy.fits);
  EXPECT_EQ(roomy.input.activation_home, Tier::device);
  EXPECT_EQ(roomy.schedule.reason,
            "micro_batch: one micro-batch per step, where both orders are the same");
  int64_t saved = 0;
  for (const PlanBuffer& b : roomy.buffers)
    if (b.role == BufferRole::gpu_saved_inputs) saved = b.bytes;
  ASSERT_GT(saved, 0);
  // Room on the device for half the saved inputs: host memory, over PCIe.
  in.budgets.device_per_rank = roomy.total_per_rank.device - saved / 2;
  const PlanReport spilled = *plan_memory(in);
  ASSERT_TRUE(spilled.fits);
  EXPECT_EQ(spilled.input.schedule, Schedule::micro_batch);
  EXPECT_EQ(spilled.input.activation_home, Tier::host);
  EXPECT_EQ(spilled.schedule.reason,
            "micro_batch: one micro-batch per step, where both orders are the same, saved inputs "
            "in host memory (the device has no room for them)");
  Result<TrainingPlan> plan = plan_training(in);
  ASSERT_TRUE(plan.is_ok()) << plan.status().message();
  EXPECT_TRUE(plan->activations_spilled());
  // (two levels stay on the device, the rest in host memory)
  EXPECT_EQ(plan->buffer(BufferRole::gpu_saved_inputs)->copies, 2);
  EXPECT_EQ(plan->buffer(BufferRole::activation_spill)->tier, Tier::host);
  // No host memory to spare for them: NVMe.
  in.budgets.host_per_node = spilled.total_per_rank.host - saved / 2;
  const PlanReport on_nvme = *plan_memory(in);
  ASSERT_TRUE(on_nvme.fits);
  EXPECT_EQ(on_nvme.input.activation_home, Tier::nvme);
  EXPECT_NE(on_nvme.schedule.reason.find(", saved inputs on NVMe (the device has no room"),
            std::string::npos)
      << on_nvme.schedule.reason;
  // Given the device, they do not fit; the plan says which home does.
  in.budgets.host_per_node.reset();
  in.activation_home = Tier::device;
  const PlanReport given = *plan_with_suggestion(in);
  EXPECT_FALSE(given.fits);
  EXPECT_EQ(given.suggestion, "--activation-home host");
  in.activation_home = Tier::host;
  const PlanReport host = *plan_memory(in);
  EXPECT_TRUE(host.fits);
  EXPECT_NE(host.schedule.reason.find(", saved inputs in host memory (given)"), std::string::npos)
      << host.schedule.reason;
}

// The micro-batch order, asked for, plans where the layer-major one cannot
// run (a tied embedding accumulating in GPU memory), with no home given,
// and a given home is named in the reason.
TEST(PlannerSchedule, AGivenMicroBatchOrderPlansWhereLayerMajorCannot) {
  PlanInput in = bare(20'000'000, 1, 0, Precision::bf16);
  in.model.tie_word_embeddings = true;
  in.gpu = true;
  in.grad_accum = 2;
  in.schedule = Schedule::layer;
  Result<TrainingPlan> refused = plan_training(in);
  ASSERT_FALSE(refused.is_ok());
  EXPECT_NE(refused.status().message().find("--schedule micro_batch"), std::string::npos)
      << refused.status().message();
  in.schedule = Schedule::micro_batch;
  std::string reason;
  Result<TrainingPlan> planned = plan_training(in, &reason);
  ASSERT_TRUE(planned.is_ok()) << planned.status().message();
  EXPECT_EQ(reason, "micro_batch (given)");
  Result<PlanReport> report = plan_memory(in);  // strata plan builds both orders
  ASSERT_TRUE(report.is_ok()) << report.status().message();
  EXPECT_EQ(report->input.schedule, Schedule::micro_batch);
  in.activation_home = Tier::host;
  planned = plan_training(in, &reason);
  ASSERT_TRUE(planned.is_ok()) << planned.status().message();
  EXPECT_TRUE(planned->activations_spilled());
  EXPECT_EQ(reason, "micro_batch (given), saved inputs in host memory (given)");
}

// DeepSpeed's activation_checkpointing.cpu_checkpointing asks for the saved
// inputs in host memory, unless strata.activation_home says otherwise.
TEST(PlannerSchedule, CpuCheckpointingMeansTheHostHome) {
  const ModelConfig model = model_of_size(100'000'000);
  auto home = [&](const char* json) {
    Result<TrainConfig> config =
        train_config_from_json(nlohmann::json::parse(json), "test config", {});
    EXPECT_TRUE(config.is_ok()) << config.status().message();
    return plan_input_from_config(*config, model, {.gpu = true}).activation_home;
  };
  EXPECT_EQ(home(R"({"train_micro_batch_size_per_gpu": 1})"), std::nullopt);
  EXPECT_EQ(home(R"({"train_micro_batch_size_per_gpu": 1,
                     "activation_checkpointing": {"cpu_checkpointing": true}})"),
            Tier::host);
  EXPECT_EQ(home(R"({"train_micro_batch_size_per_gpu": 1,
                     "activation_checkpointing": {"cpu_checkpointing": true},
                     "strata": {"activation_home": "device"}})"),
            Tier::device);
}

// strata.vocab_chunks auto: whole units unless the embedding and the head
// are what keeps the plan from fitting and cutting them to a layer's size
// makes it fit; a given count is kept, and a plan that does not fit whole is
// told the count that fits.
TEST(PlannerVocabChunks, AutoCutsOnlyWhereThatIsWhatFits) {
  PlanInput in = all_on_nvme("wide vocabulary", 32000, 512);
  // The embedding (8.2M) and the head (8.2M + the norm) against a layer's 0.8M: 11 chunks.
  const int64_t chunks = vocab_chunks_for_layers(in);
  const int64_t layer = in.model.layer_parameter_count(0);
  EXPECT_EQ(chunks, ceil_div(32000 * 256 + 256, layer));
  for (int64_t k = 0; k < chunks; ++k)
    EXPECT_LE(in.model.vocab_chunk_begin(k + 1) - in.model.vocab_chunk_begin(k) + 1, layer);

  Result<PlanReport> whole = plan_memory(in);
  PlanInput cut_in = in;
  cut_in.model.vocab_chunks = chunks;
  Result<PlanReport> cut = plan_memory(cut_in);
  ASSERT_TRUE(whole.is_ok() && cut.is_ok());
  const int64_t whole_device = whole->total_per_rank.device, cut_device = cut->total_per_rank.device;
  ASSERT_LT(cut_device, whole_device / 2);

  in.vocab_chunks_auto = true;
  in.budgets.device_per_rank = (whole_device + cut_device) / 2;  // only the cut fits
  Result<TrainingPlan> chosen = plan_training(in);
  ASSERT_TRUE(chosen.is_ok()) << chosen.status().message();
  EXPECT_EQ(chosen->layout.config.vocab_chunks, chunks);
  EXPECT_EQ(chosen->units.size(), size_t(2 * chunks + 3));
  EXPECT_NE(chosen->input.vocab_chunks_reason.find("auto"), std::string::npos);
  Result<PlanReport> report = plan_memory(in);
  ASSERT_TRUE(report.is_ok());
  EXPECT_TRUE(report->fits);
  EXPECT_EQ(report->input.model.vocab_chunks, chunks);

  in.budgets.device_per_rank = whole_device;  // whole units fit: kept whole
  chosen = plan_training(in);
  ASSERT_TRUE(chosen.is_ok());
  EXPECT_EQ(chosen->layout.config.vocab_chunks, 1);
  EXPECT_EQ(chosen->input.vocab_chunks_reason, "1 (auto: whole units fit the budgets)");

  in.budgets.device_per_rank = cut_device / 2;  // nothing fits: kept whole
  chosen = plan_training(in);
  ASSERT_TRUE(chosen.is_ok());
  EXPECT_EQ(chosen->layout.config.vocab_chunks, 1);

  PlanInput tied = in;  // a tied head cannot be cut
  tied.model.tie_word_embeddings = true;
  tied.budgets.device_per_rank = (whole_device + cut_device) / 2;
  EXPECT_EQ(vocab_chunks_for_layers(tied), 1);

  PlanInput given = in;  // a count given is kept, and the suggestion names the one that fits
  given.vocab_chunks_auto = false;
  given.budgets.device_per_rank = (whole_device + cut_device) / 2;
  Result<PlanReport> suggested = plan_with_suggestion(given);
  ASSERT_TRUE(suggested.is_ok());
  EXPECT_FALSE(suggested->fits);
  EXPECT_EQ(suggested->input.model.vocab_chunks, 1);
  EXPECT_EQ(suggested->suggestion.rfind(fmt::format("--vocab-chunks {} ", chunks), 0), 0u)
      << suggested->suggestion;
}

// strata.layer_pieces auto: whole layers unless they are what keeps the plan
// from fitting and each layer's attention and MLP as units of their own
// make it fit; a given count is kept and told the one that fits; the CUDA
// backend chooses by its own plan the same way.
TEST(PlannerLayerPieces, AutoCutsLayersOnlyWhereThatIsWhatFits) {
  PlanInput in = all_on_nvme("wide layers", 512, 2048);
  Result<PlanReport> whole = plan_memory(in);
  PlanInput cut_in = in;
  cut_in.model.layer_pieces = 2;
  Result<PlanReport> cut = plan_memory(cut_in);
  ASSERT_TRUE(whole.is_ok() && cut.is_ok());
  EXPECT_EQ(cut->units, whole->units + 3);
  const int64_t whole_device = whole->total_per_rank.device,
                cut_device = cut->total_per_rank.device;
  // A layer's MLP is 1.57M of its 1.77M parameters: its slots shrink by a ninth, less the
  // saved input each layer's MLP adds.
  ASSERT_LT(cut_device, whole_device * 95 / 100);

  in.layer_pieces_auto = true;
  in.budgets.device_per_rank = (whole_device + cut_device) / 2;  // only the pieces fit
  Result<TrainingPlan> chosen = plan_training(in);
  ASSERT_TRUE(chosen.is_ok()) << chosen.status().message();
  EXPECT_EQ(chosen->layout.config.layer_pieces, 2);
  EXPECT_EQ(chosen->units.size(), size_t(1 + 2 * 3 + 1));
  EXPECT_EQ(chosen->layout.units[2].unit.name, "layers.0.mlp");
  EXPECT_NE(chosen->input.layer_pieces_reason.find("2 (auto:"), std::string::npos);
  Result<PlanReport> report = plan_memory(in);
  ASSERT_TRUE(report.is_ok());
  EXPECT_TRUE(report->fits);
  EXPECT_EQ(report->input.model.layer_pieces, 2);
  EXPECT_NE(format_plan_table(*report, false).find("  layer pieces: 2 (auto:"), std::string::npos);
  EXPECT_EQ(plan_to_json(*report, false)["layer_pieces"]["pieces"].get<int64_t>(), 2);

  in.budgets.device_per_rank = whole_device;  // whole layers fit: kept whole
  chosen = plan_training(in);
  ASSERT_TRUE(chosen.is_ok());
  EXPECT_EQ(chosen->layout.config.layer_pieces, 1);
  EXPECT_EQ(chosen->input.layer_pieces_reason, "1 (auto: whole layers fit the budgets)");

  in.budgets.device_per_rank = cut_device / 2;  // nothing fits: kept whole
  chosen = plan_training(in);
  ASSERT_TRUE(chosen.is_ok());
  EXPECT_EQ(chosen->layout.config.layer_pieces, 1);

  // The CUDA backend cuts its layers too, by its own device accounting.
  PlanInput gpu = in;
  gpu.gpu = true;
  gpu.layer_pieces_auto = false;
  PlanInput gpu_cut = gpu;
  gpu_cut.model.layer_pieces = 2;
  Result<PlanReport> gpu_whole = plan_memory(gpu), gpu_pieces = plan_memory(gpu_cut);
  ASSERT_TRUE(gpu_whole.is_ok() && gpu_pieces.is_ok());
  ASSERT_LT(gpu_pieces->total_per_rank.device, gpu_whole->total_per_rank.device);
  gpu.layer_pieces_auto = true;
  gpu.budgets.device_per_rank =
      (gpu_whole->total_per_rank.device + gpu_pieces->total_per_rank.device) / 2;
  Result<PlanInput> resolved = resolve_unit_cuts(gpu);
  ASSERT_TRUE(resolved.is_ok());
  EXPECT_EQ(resolved->model.layer_pieces, 2);
  EXPECT_NE(resolved->layer_pieces_reason.find("2 (auto:"), std::string::npos)
      << resolved->layer_pieces_reason;

  PlanInput given = in;  // a count given is kept, and the suggestion names the one that fits
  given.layer_pieces_auto = false;
  given.budgets.device_per_rank = (whole_device + cut_device) / 2;
  Result<PlanReport> suggested = plan_with_suggestion(given);
  ASSERT_TRUE(suggested.is_ok());
  EXPECT_FALSE(suggested->fits);
  EXPECT_EQ(suggested->input.model.layer_pieces, 1);
  EXPECT_EQ(suggested->suggestion.rfind("--layer-pieces 2 ", 0), 0u) << suggested->suggestion;
}

}  // namespace
}  // namespace strata

namespace strata {
namespace {

// bf16 at stage 3 with the parameters and the optimizer on NVMe, 1 x
// `tokens`, `device_gib` for the compute's memory, 256 GiB of host, 16 TiB of NVMe.
void everything_on_nvme(PlanInput& in, int64_t tokens, int64_t device_gib) {
  in.precision = Precision::bf16;
  in.stage = 3;
  in.offload_param = OffloadDevice::nvme;
  in.offload_optimizer = OffloadDevice::nvme;
  in.micro_batch = 1;
  in.seq_len = tokens;
  in.nvme_path_known = true;
  in.budgets.device_per_rank = device_gib << 30;
  in.budgets.host_per_node = 256LL << 30;
  in.budgets.nvme_per_node = 16LL << 40;
}

// A Llama-3.1-405B-shaped dense model on the CPU backend, everything on
// NVMe, 1 x 2048 tokens, a 24 GiB budget for the compute's memory: a
// layer's MLP (2.62B parameters) is more than the budget holds in two
// pieces, and in parts along its intermediate dimension it fits. Given
// whole layers and one MLP piece, the "none" line names the fewest parts
// that give the device room; auto takes that count, and says why.
TEST(Planner, ADenseMlpTooLargeForThePiecesTakesParts) {
  PlanInput in;
  ModelConfig& m = in.model;
  m = *load_model_config("llama3-8b");
  m.hidden_size = 16384;
  m.intermediate_size = 53248;
  m.num_hidden_layers = 126;
  m.num_attention_heads = 128;
  m.num_key_value_heads = 8;
  m.head_dim = 128;
  m.vocab_size = 128256;
  m.tie_word_embeddings = false;
  everything_on_nvme(in, 2048, 24);
  const PlanReport given = *plan_with_suggestion(in);
  ASSERT_FALSE(given.fits);
  const std::string named = ", or --layer-pieces 2 --mlp-parts ";
  const size_t at = given.suggestion.find(named);
  ASSERT_NE(at, std::string::npos) << given.suggestion;
  const int64_t parts = std::stoll(given.suggestion.substr(at + named.size()));
  EXPECT_GT(parts, 1);
  PlanInput chosen = in;
  chosen.vocab_chunks_auto = chosen.layer_pieces_auto = chosen.mlp_parts_auto = true;
  const PlanReport automatic = *plan_memory(chosen);
  EXPECT_TRUE(automatic.fits);
  EXPECT_EQ(automatic.input.model.mlp_parts, parts);
  EXPECT_EQ(automatic.input.model.layer_pieces, 2);
  EXPECT_EQ(automatic.input.mlp_parts_reason.rfind(
                std::to_string(parts) + " (auto: the plan does not fit", 0),
            0u)
      << automatic.input.mlp_parts_reason;
  EXPECT_EQ(automatic.largest_unit.rfind("layers.0.mlp.", 0), 0u) << automatic.largest_unit;
  // One part fewer does not fit.
  PlanInput fewer = automatic.input;
  fewer.model.mlp_parts = parts - 1;
  fewer.model.vocab_chunks = vocab_chunks_for_layers(fewer);
  if (parts - 1 > 1) {
    EXPECT_FALSE(plan_memory(fewer)->fits);
  }
  // The CUDA backend cuts its MLPs too, by its own device accounting.
  PlanInput gpu = chosen;
  gpu.gpu = true;
  const PlanReport on_gpu = *plan_memory(gpu);
  EXPECT_GT(on_gpu.input.model.mlp_parts, 1) << on_gpu.input.mlp_parts_reason;
  EXPECT_EQ(on_gpu.input.mlp_parts_reason.rfind(
                std::to_string(on_gpu.input.model.mlp_parts) + " (auto: the plan does not fit", 0),
            0u)
      << on_gpu.input.mlp_parts_reason;
}

}  // namespace
}  // namespace strata

namespace strata {
namespace {

// A Qwen3-MoE-shaped mixture whose two dense layers' MLPs (805M parameters
// each) and sparse layers' experts (1.6B per layer) are both too large for
// a 16 GiB budget: groups of experts alone leave the dense MLPs whole, and
// MLP parts alone the experts; auto takes both, the fewest groups that fit
// with the dense MLPs cut to a group's size, then the fewest parts, and
// says why in both reasons.
TEST(Planner, AMixtureWithBothMlpsTooLargeTakesGroupsAndParts) {
  PlanInput in;
  ModelConfig& m = in.model;
  m = *load_model_config("qwen3-30b-a3b");
  m.hidden_size = 4096;
  m.intermediate_size = 65536;
  m.moe_intermediate_size = 2048;
  m.num_experts = 64;
  m.num_experts_per_tok = 8;
  m.mlp_only_layers = {0, 1};
  m.num_hidden_layers = 48;
  m.num_attention_heads = 32;
  m.num_key_value_heads = 4;
  m.head_dim = 128;
  m.vocab_size = 151936;
  m.tie_word_embeddings = false;
  everything_on_nvme(in, 1024, 16);
  in.vocab_chunks_auto = in.layer_pieces_auto = true;
  PlanInput groups_only = in, parts_only = in, both = in;
  groups_only.expert_groups_auto = true;
  parts_only.mlp_parts_auto = true;
  both.expert_groups_auto = both.mlp_parts_auto = true;
  EXPECT_FALSE(plan_memory(groups_only)->fits);
  EXPECT_FALSE(plan_memory(parts_only)->fits);
  const PlanReport chosen = *plan_memory(both);
  ASSERT_TRUE(chosen.fits) << chosen.input.expert_groups_reason;
  const int64_t groups = chosen.input.model.expert_groups, parts = chosen.input.model.mlp_parts;
  EXPECT_EQ(groups, 3);  // as README.md says
  EXPECT_EQ(parts, 2);
  EXPECT_EQ(chosen.input.model.layer_pieces, 2);
  EXPECT_EQ(chosen.input.expert_groups_reason.rfind(
                std::to_string(groups) + " (auto: the plan fits the budgets neither", 0),
            0u)
      << chosen.input.expert_groups_reason;
  EXPECT_EQ(chosen.input.mlp_parts_reason.rfind(
                fmt::format("{} (auto: with the experts in {} groups", parts, groups), 0),
            0u)
      << chosen.input.mlp_parts_reason;
  // One part fewer, or one group fewer with any parts up to the most, does not fit.
  auto fits_with = [&](int64_t g, int64_t p) {
    PlanInput cut = chosen.input;
    cut.model.expert_groups = g;
    cut.model.mlp_parts = p;
    cut.model.vocab_chunks = 1;
    cut.model.vocab_chunks = vocab_chunks_for_layers(cut);
    return plan_memory(cut)->fits;
  };
  EXPECT_TRUE(fits_with(groups, parts));
  EXPECT_FALSE(fits_with(groups, parts - 1));
  for (int64_t p = 1; p <= 64; p *= 2) EXPECT_FALSE(fits_with(groups - 1, p)) << p << " parts";
  // Given whole layers and MLPs, the "none" line names both counts.
  PlanInput whole = in;
  whole.layer_pieces_auto = false;
  const PlanReport given = *plan_with_suggestion(whole);
  ASSERT_FALSE(given.fits);
  EXPECT_NE(given.suggestion.find(fmt::format(
                ", or --layer-pieces 2 --expert-groups {} --mlp-parts {} (", groups, parts)),
            std::string::npos)
      << given.suggestion;
}

}  // namespace
}  // namespace strata
