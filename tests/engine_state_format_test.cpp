// Compact optimizer state (strata.optimizer_state_dtype bf16 and int8): the
// placements of the state do not change the numbers (one rank: stage 0 in
// memory == stage 3 on NVMe, bitwise; two ranks: every sharded placement
// alike), the loss falls, the NVMe bytes moved equal the plan's, int8 blocks
// are the 256-element windows of a rank's range cut at parameter groups (the
// scales after one step from zero checked against that rule element by
// element; compact_runs, the GPU optimizer's cuts, are the CPU optimizer's),
// checkpoints resume bitwise in each format, the CUDA backend's
// data paths (emulated) with compact state in the GPU optimizer's memory are
// the CPU backend's run bitwise and resume bitwise, and a resume into another
// format or int8 at another world size is refused in one line.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <map>
#include <random>

#include "core/optimizer/optimizer.h"
#include "core/plan/training_plan.h"
#include "engine_test_support.h"

namespace strata {
namespace {

using testing::EngineOutcome;
using testing::EngineRun;

class EngineStateFormat : public testing::EngineRunsTest {
 protected:
  EngineStateFormat() : EngineRunsTest("engine_state_format") {}
  // Tokens a model can learn in a few steps (each the last plus 1 or 2,
  // drawn fresh), so that "the loss falls" means something.
  void SetUp() override {
    EngineRunsTest::SetUp();
    if (IsSkipped()) return;
    std::mt19937_64 random(seed_ + 2);
    const int64_t vocab = testing::small_gqa_model().vocab_size;
    for (size_t i = 1; i < tokens_->size(); ++i)
      (*tokens_)[i] = int32_t(((*tokens_)[i - 1] + 1 + int64_t(random() % 2)) % vocab);
  }
  std::unique_ptr<Engine> engine(const EngineRun& run, const std::string& resume,
                                 std::string* error = nullptr) {
    Result<EngineOptions> options = testing::engine_options(run, dir_.path(), tokens_, seed_);
    EXPECT_TRUE(options.is_ok());
    options->resume_from = resume;
    Result<std::unique_ptr<Engine>> made = Engine::create(*options);
    if (error != nullptr) {
      *error = made ? "" : made.status().message();
      return made ? std::move(*made) : nullptr;
    }
    EXPECT_TRUE(made.is_ok()) << made.status().message();
    return made ? std::move(*made) : nullptr;
  }
  std::vector<double> steps(Engine& e, int n) {
    std::vector<double> losses;
    for (int s = 0; s < n; ++s) {
      Result<StepResult> step = e.step();
      EXPECT_TRUE(step.is_ok()) << step.status().message();
      if (step) losses.push_back(step->loss);
    }
    return losses;
  }
  // `run` saved after 2 of 4 steps to DIR/`name` (*saved), resumed into each
  // of `resumed_runs`: their 2 steps and final weights are the straight run's, bitwise.
  void expect_resumes_bitwise(const EngineRun& run, const std::string& name,
                              const std::vector<EngineRun>& resumed_runs, std::string* saved) {
    auto straight = engine(run, "");
    ASSERT_TRUE(straight);
    const std::vector<double> all = steps(*straight, 4);
    ASSERT_EQ(all.size(), 4u);
    Result<HostModel> expected = straight->read_model();
    ASSERT_TRUE(expected.is_ok());
    auto first = engine(run, "");
    ASSERT_TRUE(first);
    steps(*first, 2);
    Result<std::string> written = first->save_checkpoint(dir_.path() + "/" + name, 0);
    ASSERT_TRUE(written.is_ok()) << written.status().message();
    first.reset();
    *saved = *written;
    for (const EngineRun& resumed_run : resumed_runs) {
      auto resumed = engine(resumed_run, *saved);
      ASSERT_TRUE(resumed);
      const std::vector<double> rest = steps(*resumed, 2);
      ASSERT_EQ(rest.size(), 2u);
      EXPECT_EQ(rest[0], all[2]) << resumed_run.label();
      EXPECT_EQ(rest[1], all[3]) << resumed_run.label();
      Result<HostModel> got = resumed->read_model();
      ASSERT_TRUE(got.is_ok());
      EXPECT_TRUE(testing::weights_bitwise_equal(*got, *expected)) << resumed_run.label();
    }
  }
};

EngineRun placed(int world, int stage, const char* param, const char* optimizer,
                 const char* precision, const char* state) {
  EngineRun run;
  run.world = world;
  run.stage = stage;
  run.offload_param = param;
  run.offload_optimizer = optimizer;
  run.precision = precision;
  run.state_dtype = state;
  run.steps = 6;
  run.sub_group_size = 4096;  // several chunks per unit, cut inside parameter groups
  // Placements are compared within one schedule: at two ranks each sums in its own order.
  if (world > 1) run.schedule = "micro_batch";
  return run;
}

TEST_F(EngineStateFormat, OneRankInMemoryEqualsNvmeBitwiseAndTheLossFalls) {
  for (const char* precision : {"fp32", "bf16"}) {
    for (const char* state : {"bf16", "int8"}) {
      const EngineOutcome memory = train(placed(1, 0, "none", "none", precision, state));
      ASSERT_EQ(memory.steps.size(), 6u);
      EXPECT_LT(memory.steps.back().loss, memory.steps.front().loss) << precision << " " << state;
      for (auto [param, optimizer] :
           {std::pair{"nvme", "nvme"}, std::pair{"cpu", "cpu"}, std::pair{"none", "nvme"}}) {
        const EngineRun run = placed(1, 3, param, optimizer, precision, state);
        const EngineOutcome other = train(run);
        testing::expect_identical(memory, other, run.label());
        const TrainingPlan& plan = other.plan;
        EXPECT_EQ(other.nvme_read, uint64_t(plan.traffic_per_step.nvme_read) * 6) << run.label();
        EXPECT_EQ(other.nvme_written, uint64_t(plan.traffic_per_step.nvme_written) * 6)
            << run.label();
      }
    }
  }
}

// What each format buys on NVMe: the bytes per step the I/O engines moved
// equal the plan's, and fall from fp32 to bf16 to int8 (gradients on NVMe too).
TEST_F(EngineStateFormat, NvmeBytesPerStepFallWithTheFormatAndEqualThePlan) {
  uint64_t previous = ~uint64_t{0};
  for (const char* state : {"fp32", "bf16", "int8"}) {
    EngineRun run = placed(1, 3, "nvme", "nvme", "bf16", state);
    run.gradient_home = "nvme";
    run.steps = 2;
    const EngineOutcome outcome = train(run);
    const TrainingPlan& plan = outcome.plan;
    EXPECT_EQ(outcome.nvme_read, uint64_t(plan.traffic_per_step.nvme_read) * 2) << state;
    EXPECT_EQ(outcome.nvme_written, uint64_t(plan.traffic_per_step.nvme_written) * 2) << state;
    const uint64_t per_step = (outcome.nvme_read + outcome.nvme_written) / 2;
    EXPECT_LT(per_step, previous) << state;
    previous = per_step;
    std::printf("%s state: NVMe per step %llu read + %llu written (plan %lld + %lld)\n", state,
                static_cast<unsigned long long>(outcome.nvme_read / 2),
                static_cast<unsigned long long>(outcome.nvme_written / 2),
                static_cast<long long>(plan.traffic_per_step.nvme_read),
                static_cast<long long>(plan.traffic_per_step.nvme_written));
  }
}

// Compact formats change the numbers (they are not fp32), and fp32 state is
// what it always was: a run with fp32 named explicitly is the default run.
TEST_F(EngineStateFormat, CompactFormatsDifferFromFp32AndFp32IsTheDefault) {
  EngineRun base = placed(1, 3, "nvme", "nvme", "bf16", "fp32");
  const EngineOutcome fp32 = train(base);
  EngineRun plain = base;
  plain.state_dtype = "fp32";
  testing::expect_identical(fp32, train(plain), "fp32 named");
  for (const char* state : {"bf16", "int8"}) {
    EngineRun run = base;
    run.state_dtype = state;
    const EngineOutcome compact = train(run);
    EXPECT_FALSE(testing::weights_bitwise_equal(compact.weights, fp32.weights)) << state;
    // Close to fp32 after a few steps: the same training, rounded moments.
    EXPECT_LT(testing::weights_relative_error(compact.weights, fp32.weights), 0.05) << state;
  }
}

TEST_F(EngineStateFormat, TwoRanksEverySharedPlacementAlikeBitwise) {
  for (const char* state : {"bf16", "int8"}) {
    // Stages 1-3 keep the same range per rank, so the same int8 blocks.
    const EngineOutcome first = train(placed(2, 1, "none", "cpu", "bf16", state));
    EXPECT_LT(first.steps.back().loss, first.steps.front().loss) << state;
    for (EngineRun run :
         {placed(2, 2, "none", "none", "bf16", state), placed(2, 2, "none", "nvme", "bf16", state),
          placed(2, 3, "nvme", "nvme", "bf16", state), placed(2, 3, "cpu", "cpu", "bf16", state)}) {
      const EngineOutcome other = train(run);
      testing::expect_identical(first, other, run.label());
      EXPECT_EQ(other.nvme_read, uint64_t(other.plan.traffic_per_step.nvme_read) * 6 * 2)
          << run.label();
    }
    // Stage 0 keeps the whole unit per rank: bf16 is elementwise, so equal;
    // int8's blocks are the whole unit's, so it only has to train.
    const EngineOutcome whole = train(placed(2, 0, "none", "none", "bf16", state));
    if (std::string(state) == "bf16")
      testing::expect_identical(first, whole, "stage 0, bf16 state");
    else
      EXPECT_LT(whole.steps.back().loss, whole.steps.front().loss);
  }
}

TEST_F(EngineStateFormat, CheckpointsResumeBitwiseInEachFormat) {
  for (const char* state : {"fp32", "bf16", "int8"}) {
    const EngineRun run = placed(2, 3, "nvme", "nvme", "bf16", state);
    std::string saved;
    expect_resumes_bitwise(run, std::string("save-") + state,
                           {run, placed(2, 1, "none", "cpu", "bf16", state),
                            placed(2, 2, "none", "none", "bf16", state)},
                           &saved);
    if (HasFatalFailure()) return;
    if (std::string(state) == "int8") {
      std::string error;
      EXPECT_FALSE(engine(placed(1, 3, "nvme", "nvme", "bf16", state), saved, &error));
      EXPECT_NE(error.find("--world-size 2"), std::string::npos) << error;
      EXPECT_EQ(error.find('\n'), std::string::npos) << error;
    } else {
      // bf16 and fp32 moments are stored in unit order: another world size reads its ranges.
      auto resumed = engine(placed(1, 0, "none", "none", "bf16", state), saved);
      ASSERT_TRUE(resumed);
      EXPECT_EQ(steps(*resumed, 1).size(), 1u);
    }
    // Another format is refused, naming both.
    const char* other = std::string(state) == "int8" ? "bf16" : "int8";
    std::string error;
    EXPECT_FALSE(engine(placed(2, 3, "nvme", "nvme", "bf16", other), saved, &error));
    EXPECT_NE(error.find(std::string(state) + " but"), std::string::npos) << error;
    EXPECT_NE(error.find(std::string("is ") + other), std::string::npos) << error;
    EXPECT_EQ(error.find('\n'), std::string::npos) << error;
  }
}

// The CUDA backend's data paths (emulated on the CPU) with the optimizer
// offloaded: compact state and every gradient home give the CPU backend's
// run bitwise.
TEST_F(EngineStateFormat, GpuPathsWithTheOptimizerOffloadedEqualTheCpuBackend) {
  for (auto [state, home] :
       {std::pair{"int8", "auto"}, std::pair{"bf16", "nvme"}, std::pair{"fp32", "host_bf16"}}) {
    for (auto [world, optimizer] : {std::pair{1, "nvme"}, std::pair{2, "cpu"}}) {
      EngineRun cpu = placed(world, 3, "cpu", optimizer, "bf16", state);
      cpu.steps = 3;
      if (std::string(home) != "nvme" || std::string(optimizer) == "nvme") cpu.gradient_home = home;
      EngineRun gpu = cpu;
      gpu.emulate_gpu = true;
      testing::expect_identical(train(cpu), train(gpu), gpu.label() + " vs the CPU backend");
    }
  }
}

// The CUDA backend's data paths (emulated on the CPU, whose GPU rank runs the
// CPU kernels) with compact state in the GPU optimizer's memory, int8 scales
// there too: the CPU backend's run bitwise, and a checkpoint saved there
// (codes and scales read back from the device) resumes bitwise on the GPU
// path and on the CPU backend. Two ranks, so that gradients pass through host
// memory (one rank with the optimizer on the GPU accumulates them inside the
// backward, close to the CPU backend but not bitwise: engine_gpu_paths_test).
TEST_F(EngineStateFormat, GpuResidentCompactStateEqualsTheCpuBackendAndResumesBitwise) {
  for (const char* state : {"bf16", "int8"}) {
    for (const int stage : {0, 2}) {
      EngineRun cpu = placed(2, stage, "none", "none", "bf16", state);
      cpu.steps = 3;
      EngineRun gpu = cpu;
      gpu.emulate_gpu = true;
      const EngineOutcome on_gpu = train(gpu);
      const PlanBuffer* scales = on_gpu.plan.buffer(BufferRole::int8_scales);
      EXPECT_EQ(scales != nullptr, std::string(state) == "int8") << gpu.label();
      if (scales != nullptr) {
        EXPECT_EQ(scales->tier, tiers::Tier::device) << gpu.label();
      }
      testing::expect_identical(train(cpu), on_gpu, gpu.label() + " vs the CPU backend");
    }
    EngineRun run = placed(2, 2, "none", "none", "bf16", state);
    run.emulate_gpu = true;
    std::string saved;
    expect_resumes_bitwise(run, std::string("gpu-save-") + state,
                           {run, placed(2, 3, "nvme", "nvme", "bf16", state)}, &saved);
  }
}

TEST(StateFormatPlan, MomentsTakeTheirFormatsBytesAndInt8ScalesLieBesideTheOptimizer) {
  PlanInput in;
  in.model = testing::small_gqa_model();
  in.world_size = 2;
  in.stage = 3;
  in.offload_param = OffloadDevice::nvme;
  in.offload_optimizer = OffloadDevice::nvme;
  in.precision = Precision::bf16;
  in.optimizer_chunk_elements = 4096;
  in.schedule = Schedule::micro_batch;
  Result<TrainingPlan> fp32 = build_training_plan(in);
  ASSERT_TRUE(fp32.is_ok());
  int64_t elements = 0;
  for (const UnitPlacement& p : fp32->units) elements += p.optimizer_numel;
  for (auto [state, bytes] :
       {std::pair{OptimizerStateDtype::bf16, 2}, std::pair{OptimizerStateDtype::int8, 1}}) {
    in.optimizer_state = state;
    Result<TrainingPlan> plan = build_training_plan(in);
    ASSERT_TRUE(plan.is_ok()) << plan.status().message();
    const PlanBuffer* m = plan->buffer(BufferRole::m_state);
    ASSERT_NE(m, nullptr);
    EXPECT_EQ(m->elements, elements);
    EXPECT_EQ(buffer_element_bytes(m->element), bytes);
    EXPECT_EQ(plan->buffer(BufferRole::int8_scales) != nullptr, state == OptimizerStateDtype::int8);
    if (state == OptimizerStateDtype::int8) {
      EXPECT_EQ(plan->buffer(BufferRole::int8_scales)->tier, tiers::Tier::host);
    }
    // Per optimizer element, the streamed step reads and writes master + 2 moments.
    EXPECT_EQ(plan->traffic_per_step.nvme_read - fp32->traffic_per_step.nvme_read,
              elements * (2 * bytes - 8));
  }
  // The CUDA backend's optimizer in GPU memory keeps compact m and v there,
  // and int8's scales beside them, charged to the device: the device peak
  // grows by exactly the scales over bf16 state's, whose moments take as
  // many bytes as int8's twice.
  in.gpu = true;
  in.offload_param = OffloadDevice::none;
  in.offload_optimizer = OffloadDevice::none;
  in.stage = 0;
  std::map<OptimizerStateDtype, TrainingPlan> gpu;
  for (const OptimizerStateDtype state : {OptimizerStateDtype::bf16, OptimizerStateDtype::int8}) {
    in.optimizer_state = state;
    Result<TrainingPlan> plan = build_training_plan(in);
    ASSERT_TRUE(plan.is_ok()) << plan.status().message();
    EXPECT_EQ(plan->homes.optimizer, tiers::Tier::device);
    EXPECT_EQ(plan->buffer(BufferRole::m_state)->tier, tiers::Tier::device);
    gpu.emplace(state, std::move(*plan));
  }
  const TrainingPlan& int8 = gpu.at(OptimizerStateDtype::int8);
  const PlanBuffer* scales = int8.buffer(BufferRole::int8_scales);
  ASSERT_NE(scales, nullptr);
  EXPECT_EQ(scales->tier, tiers::Tier::device);
  int64_t blocks = 0;
  for (const UnitPlacement& p : int8.units) blocks += p.int8_blocks;
  EXPECT_EQ(scales->elements, blocks);
  EXPECT_GE(scales->copy_bytes(), blocks * 4);
  const int host = static_cast<int>(tiers::Tier::host);
  const int device = static_cast<int>(tiers::Tier::device);
  const TrainingPlan& bf16 = gpu.at(OptimizerStateDtype::bf16);
  EXPECT_EQ(int8.peak_bytes[host], bf16.peak_bytes[host]);
  const int64_t moments_saved =
      bf16.buffer(BufferRole::m_state)->bytes - int8.buffer(BufferRole::m_state)->bytes +
      bf16.buffer(BufferRole::v_state)->bytes - int8.buffer(BufferRole::v_state)->bytes;
  EXPECT_EQ(int8.peak_bytes[device], bf16.peak_bytes[device] - moments_saved + scales->bytes);
}

// The blocks of int8 state, checked against the rule written out by brute
// force: after one step from the zero state m = (1 - beta1) g, and each
// block's m scale is the largest |m| of its elements, where a block is the
// elements of one segment in one 256-element window of the shard. The shard
// is updated whole and in chunks cut at multiples of 256, which must agree.
TEST(StateFormatBlocks, Int8ScalesFollowWindowsCutAtSegments) {
  std::mt19937_64 random(tiers::testing::fresh_seed("int8_blocks"));
  const int64_t n = 3000;
  std::vector<ShardSegment> segments = {{0, 100, ParamGroup::no_decay},
                                        {100, 700, ParamGroup::decay},
                                        {700, 710, ParamGroup::no_decay},
                                        {710, 2049, ParamGroup::decay},
                                        {2049, 3000, ParamGroup::no_decay}};
  const int64_t blocks = int8_block_count(segments, n);
  int64_t brute = 0;
  std::vector<int64_t> block_of(static_cast<size_t>(n));
  {
    int64_t last_segment = -1, last_window = -1;
    for (int64_t i = 0; i < n; ++i) {
      int64_t s = 0;
      while (segments[size_t(s)].end <= i) ++s;
      if (s != last_segment || i / 256 != last_window) ++brute;
      last_segment = s;
      last_window = i / 256;
      block_of[size_t(i)] = brute - 1;
    }
  }
  ASSERT_EQ(blocks, brute);

  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> grad(static_cast<size_t>(n)), master(static_cast<size_t>(n));
  for (auto& g : grad) g = normal(random) * std::exp(normal(random));
  for (auto& p : master) p = normal(random);
  OptimizerOptions options;
  options.adamw.beta1 = 0.9;
  options.adamw.weight_decay = 0.1;
  Result<Optimizer> optimizer = Optimizer::create(options);
  ASSERT_TRUE(optimizer.is_ok());
  Result<StepDecision> plan = optimizer->begin_step(kernels::cpu::GradNormPartial{});
  ASSERT_TRUE(plan.is_ok());

  auto run = [&](int64_t chunk, std::vector<float>& p, std::vector<int8_t>& m,
                 std::vector<uint8_t>& v, std::vector<float>& ms, std::vector<float>& vs) {
    p = master;
    m.assign(size_t(n), 0);
    v.assign(size_t(n), 0);
    ms.assign(size_t(blocks), 0.0f);
    vs.assign(size_t(blocks), 0.0f);
    for (int64_t begin = 0; begin < n; begin += chunk) {
      const int64_t end = std::min(n, begin + chunk);
      std::vector<ShardSegment> part;
      std::vector<ShardSegment> before;
      for (const ShardSegment& s : segments) {
        if (s.begin < end && s.end > begin)
          part.push_back({std::max(s.begin, begin) - begin, std::min(s.end, end) - begin, s.group});
        if (s.begin < begin) before.push_back({s.begin, std::min(s.end, begin), s.group});
      }
      const int64_t first = int8_block_count(before, begin);
      kernels::cpu::AdamWShard shard;
      shard.numel = end - begin;
      shard.state_type = kernels::cpu::AdamWStateType::int8;
      shard.master = p.data() + begin;
      shard.exp_avg = m.data() + begin;
      shard.exp_avg_sq = v.data() + begin;
      shard.exp_avg_scale = ms.data() + first;
      shard.exp_avg_sq_scale = vs.data() + first;
      shard.grad = grad.data() + begin;
      shard.grad_type = kernels::cpu::ElementType::f32;
      shard.segments = part;
      ASSERT_TRUE(optimizer->update_shard(*plan, shard).is_ok());
    }
  };
  std::vector<float> p1, ms1, vs1, p2, ms2, vs2;
  std::vector<int8_t> m1, m2;
  std::vector<uint8_t> v1, v2;
  run(n, p1, m1, v1, ms1, vs1);
  run(1024, p2, m2, v2, ms2, vs2);
  EXPECT_EQ(p1, p2);
  EXPECT_EQ(m1, m2);
  EXPECT_EQ(v1, v2);
  EXPECT_EQ(ms1, ms2);
  EXPECT_EQ(vs1, vs2);

  const float c1 = float(1.0 - options.adamw.beta1);
  std::vector<float> expected(size_t(blocks), 0.0f);
  for (int64_t i = 0; i < n; ++i) {
    const float m = c1 * grad[size_t(i)];
    float& e = expected[size_t(block_of[size_t(i)])];
    e = std::max(e, std::fabs(m));
  }
  for (int64_t b = 0; b < blocks; ++b)
    EXPECT_EQ(ms1[size_t(b)], expected[size_t(b)]) << "block " << b;
  // The element holding a block's largest |m| carries the full code.
  for (int64_t i = 0; i < n; ++i) {
    if (std::fabs(c1 * grad[size_t(i)]) == expected[size_t(block_of[size_t(i)])]) {
      EXPECT_EQ(std::abs(int(m1[size_t(i)])), 127) << "element " << i;
    }
  }
}

// compact_runs, the cuts the GPU optimizer makes itself: runs that cover the
// shard in order, one parameter group each, an int8 run inside one window or
// starting on one, their blocks counted as int8_block_count counts them; and
// the CPU kernel run on them is Optimizer::update_shard bitwise.
TEST(StateFormatBlocks, CompactRunsAreTheOptimizersCuts) {
  std::mt19937_64 random(tiers::testing::fresh_seed("compact_runs"));
  const int64_t n = 3000;
  const std::vector<ShardSegment> segments = {{0, 100, ParamGroup::no_decay},
                                              {100, 700, ParamGroup::decay},
                                              {700, 710, ParamGroup::no_decay},
                                              {710, 2049, ParamGroup::decay},
                                              {2049, 3000, ParamGroup::no_decay}};
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> grad(static_cast<size_t>(n)), master(static_cast<size_t>(n));
  for (auto& g : grad) g = normal(random);
  for (auto& p : master) p = normal(random);
  OptimizerOptions options;
  options.adamw.weight_decay = 0.1;
  Result<Optimizer> optimizer = Optimizer::create(options);
  ASSERT_TRUE(optimizer.is_ok());
  Result<StepDecision> plan = optimizer->begin_step(kernels::cpu::GradNormPartial{});
  ASSERT_TRUE(plan.is_ok());
  for (const auto state :
       {kernels::cpu::AdamWStateType::bf16, kernels::cpu::AdamWStateType::int8}) {
    const bool int8 = state == kernels::cpu::AdamWStateType::int8;
    Result<std::vector<CompactRun>> runs = compact_runs(segments, n, state);
    ASSERT_TRUE(runs.is_ok()) << runs.status().message();
    int64_t at = 0, block = 0;
    size_t segment = 0;
    for (const CompactRun& r : *runs) {
      EXPECT_EQ(r.begin, at);
      EXPECT_LT(r.begin, r.end);
      while (segments[segment].end <= r.begin) ++segment;
      EXPECT_LE(r.end, segments[segment].end);
      EXPECT_EQ(r.group, segments[segment].group);
      if (int8) {
        EXPECT_EQ(r.block, block);
        // Inside one window, or from the start of one.
        EXPECT_TRUE(r.begin % 256 == 0 || r.end <= (r.begin / 256 + 1) * 256) << r.begin;
        block += (r.end - r.begin + 255) / 256;
      } else {
        EXPECT_EQ(r.block, 0);
        EXPECT_EQ(r.end, segments[segment].end);  // bf16: a whole group
      }
      at = r.end;
    }
    EXPECT_EQ(at, n);
    if (int8) {
      EXPECT_EQ(block, int8_block_count(segments, n));
    }

    const int64_t mb = int8 ? 1 : 2;
    const int64_t blocks = int8 ? int8_block_count(segments, n) : 0;
    std::vector<float> p1 = master, p2 = master;
    std::vector<uint8_t> m1(static_cast<size_t>(n * mb)), v1(static_cast<size_t>(n * mb));
    std::vector<uint8_t> m2 = m1, v2 = v1;
    std::vector<float> ms1(static_cast<size_t>(blocks)), vs1(static_cast<size_t>(blocks));
    std::vector<float> ms2 = ms1, vs2 = vs1;
    for (int step = 0; step < 2; ++step) {
      kernels::cpu::AdamWShard shard;
      shard.numel = n;
      shard.state_type = state;
      shard.master = p1.data();
      shard.exp_avg = m1.data();
      shard.exp_avg_sq = v1.data();
      shard.exp_avg_scale = int8 ? ms1.data() : nullptr;
      shard.exp_avg_sq_scale = int8 ? vs1.data() : nullptr;
      shard.grad = grad.data();
      shard.grad_type = kernels::cpu::ElementType::f32;
      shard.segments = segments;
      ASSERT_TRUE(optimizer->update_shard(*plan, shard).is_ok());
      for (const CompactRun& r : *runs) {
        kernels::cpu::AdamWShard part;
        part.numel = r.end - r.begin;
        part.state_type = state;
        part.master = p2.data() + r.begin;
        part.exp_avg = m2.data() + r.begin * mb;
        part.exp_avg_sq = v2.data() + r.begin * mb;
        part.exp_avg_scale = int8 ? ms2.data() + r.block : nullptr;
        part.exp_avg_sq_scale = int8 ? vs2.data() + r.block : nullptr;
        part.grad = grad.data() + r.begin;
        part.grad_type = kernels::cpu::ElementType::f32;
        ASSERT_TRUE(kernels::cpu::adamw_step(part, optimizer->hyperparams(*plan, r.group)).is_ok());
      }
    }
    EXPECT_EQ(p1, p2);
    EXPECT_EQ(m1, m2);
    EXPECT_EQ(v1, v2);
    EXPECT_EQ(ms1, ms2);
    EXPECT_EQ(vs1, vs2);
  }
  // Segments that leave a gap are refused.
  const std::vector<ShardSegment> gap = {{0, 10, ParamGroup::decay}, {11, 20, ParamGroup::decay}};
  EXPECT_FALSE(compact_runs(gap, 20, kernels::cpu::AdamWStateType::int8).is_ok());
}

}  // namespace
}  // namespace strata
