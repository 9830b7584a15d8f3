// The engine on the CUDA backend (core/gpu_rank.h), in its two placements:
// everything on the GPU (one rank, stage 0), or the units computing on the GPU
// while parameters and optimizer state stay in host memory or on NVMe (stage 3).
//
// Everywhere: the offloaded plan keeps every kind of state off the device and
// lists the device's working set, the resident plan keeps it all there, and
// other placements are refused in one line; creating a CUDA engine where no
// GPU is usable is a one-line error.
// With a GPU: fp32 runs of both placements match the CPU backend's losses,
// gradient norms and weights; every offloaded placement (param and optimizer
// each on cpu or nvme) is bitwise identical at 1, 2 and 3 ranks sharing the
// GPU, and 2 or 3 ranks agree with one; tied embeddings; bf16 stays close to
// the CPU backend; a resident run resumed from a checkpoint gives the straight
// run bitwise; the device peak stays within the plan and the budget.
#include <gtest/gtest.h>

#include <cstdio>
#include <string>

#include "core/engine.h"
#include "core/training_plan.h"
#include "engine_test_support.h"
#include "kernels/backend.h"

namespace strata {
namespace {

using testing::EngineOutcome;
using testing::EngineRun;

std::vector<EngineRun> offloaded_placements(int world, const std::string& precision) {
  std::vector<EngineRun> runs;
  for (const char* param : {"cpu", "nvme"}) {
    for (const char* optimizer : {"cpu", "nvme"}) {
      EngineRun run;
      run.stage = 3;
      run.offload_param = param;
      run.offload_optimizer = optimizer;
      run.world = world;
      run.precision = precision;
      run.backend = kernels::BackendKind::cuda;
      run.device_budget = 512ull << 20;
      runs.push_back(run);
    }
  }
  return runs;
}

EngineRun resident_run(const std::string& precision) {
  EngineRun run;
  run.precision = precision;
  run.backend = kernels::BackendKind::cuda;
  run.device_budget = 512ull << 20;
  return run;
}

Result<TrainingPlan> gpu_plan(const EngineRun& run) {
  Result<TrainConfig> config = testing::engine_config(run, "/nonexistent-nvme-dir");
  if (!config) return config.status();
  TrainingPlanInput input = training_plan_input(testing::small_gqa_model(run.tied), *config);
  input.gpu = true;
  return build_training_plan(input);
}

TEST(CudaEnginePlan, KeepsEveryKindOfStateOffTheDevice) {
  for (bool tied : {false, true}) {
    for (EngineRun run : offloaded_placements(2, "bf16")) {
      run.tied = tied;
      Result<TrainingPlan> plan = gpu_plan(run);
      ASSERT_TRUE(plan.is_ok()) << run.label() << ": " << plan.status().message();
      int64_t device_sum = 0;
      bool has_checkpoints = false, has_slots = false;
      for (const PlanBuffer& b : plan->buffers) {
        const bool state = b.name.rfind("parameters (", 0) == 0 ||
                           b.name.rfind("gradients (", 0) == 0 || b.name == "fp32 master" ||
                           b.name == "Adam m" || b.name == "Adam v";
        if (state) {
          EXPECT_NE(b.tier, tiers::Tier::device) << run.label() << ": " << b.name;
        }
        if (b.name.rfind("gathered units", 0) == 0 || b.name.rfind("unit gradients", 0) == 0) {
          EXPECT_EQ(b.tier, tiers::Tier::host) << run.label() << ": " << b.name;
        }
        if (b.tier == tiers::Tier::device) device_sum += b.bytes;
        has_checkpoints |= b.name.rfind("activation checkpoints", 0) == 0;
        has_slots |= b.name.rfind("device parameter slots", 0) == 0;
      }
      EXPECT_TRUE(has_checkpoints && has_slots) << run.label();
      EXPECT_EQ(device_sum, plan->peak(tiers::Tier::device)) << run.label();
      // Activations are kept in the compute precision: bf16 halves them against fp32.
      EngineRun fp32 = run;
      fp32.precision = "fp32";
      Result<TrainingPlan> wide = gpu_plan(fp32);
      ASSERT_TRUE(wide.is_ok());
      EXPECT_LT(plan->peak(tiers::Tier::device), wide->peak(tiers::Tier::device));
    }
  }
}

TEST(CudaEnginePlan, ResidentStateIsAllOnTheDevice) {
  for (const char* precision : {"fp32", "bf16"}) {
    Result<TrainingPlan> plan = gpu_plan(resident_run(precision));
    ASSERT_TRUE(plan.is_ok()) << plan.status().message();
    for (const PlanBuffer& b : plan->buffers) {
      if (b.name == "tokens and targets") {
        EXPECT_EQ(b.tier, tiers::Tier::host);
      } else {
        EXPECT_EQ(b.tier, tiers::Tier::device) << b.name;
      }
      EXPECT_EQ(b.name.find("gathered"), std::string::npos) << b.name;
    }
  }
}

TEST(CudaEnginePlan, RefusesOtherPlacements) {
  for (int world : {1, 2}) {
    for (EngineRun run : testing::every_placement(world, "fp32")) {
      const bool offloaded =
          run.stage == 3 && run.offload_param != "none" && run.offload_optimizer != "none";
      const bool resident = run.stage == 0 && world == 1 && run.offload_param == "none" &&
                            run.offload_optimizer == "none";
      if (offloaded || resident) continue;
      Result<TrainingPlan> plan = gpu_plan(run);
      ASSERT_FALSE(plan.is_ok()) << run.label();
      EXPECT_NE(plan.status().message().find("--zero-stage 3 --offload-param cpu|nvme"),
                std::string::npos)
          << plan.status().message();
      EXPECT_EQ(plan.status().message().find('\n'), std::string::npos);
    }
  }
}

TEST(CudaEnginePlan, WithoutAGpuCreatingACudaEngineIsAOneLineError) {
  if (!kernels::query_gpus().devices.empty()) GTEST_SKIP() << "a GPU is present";
  io::testing::TemporaryDirectory dir;
  auto tokens = std::make_shared<std::vector<int32_t>>(
      testing::random_tokens(2048, testing::small_gqa_model().vocab_size, 7));
  EngineRun run = offloaded_placements(1, "fp32")[0];
  Result<EngineOptions> options = testing::engine_options(run, dir.path(), tokens, 7);
  ASSERT_TRUE(options.is_ok()) << options.status().message();
  Result<std::unique_ptr<Engine>> engine = Engine::create(*options);
  ASSERT_FALSE(engine.is_ok());
  EXPECT_NE(engine.status().message().find("--backend cpu"), std::string::npos)
      << engine.status().message();
  EXPECT_EQ(engine.status().message().find('\n'), std::string::npos);
}

// The GPU tests: skipped where no GPU can be used.
class CudaEngine : public testing::EngineRunsTest {
 protected:
  CudaEngine() : EngineRunsTest("cuda_engine") {}
  void SetUp() override {
    const kernels::GpuQuery query = kernels::query_gpus();
    if (query.devices.empty()) GTEST_SKIP() << "no GPU: " << query.why_none;
    EngineRunsTest::SetUp();
  }
  void expect_identical(const EngineOutcome& a, const EngineOutcome& b, const std::string& what) {
    testing::expect_identical(a, b, what);
  }
  // Losses and gradient norms within `tolerance` relative, weights per tensor within `weights`.
  void expect_close(const EngineOutcome& a, const EngineOutcome& b, double tolerance,
                    double weights, const std::string& what) {
    ASSERT_EQ(a.steps.size(), b.steps.size()) << what;
    for (size_t s = 0; s < a.steps.size(); ++s) {
      EXPECT_NEAR(a.steps[s].loss, b.steps[s].loss, tolerance * b.steps[s].loss)
          << what << ", step " << s + 1;
      EXPECT_NEAR(a.steps[s].grad_norm, b.steps[s].grad_norm, 10 * tolerance * b.steps[s].grad_norm)
          << what << ", step " << s + 1;
    }
    std::string worst;
    const double error = testing::weights_relative_error(a.weights, b.weights, &worst);
    std::printf("%s: worst per-tensor weight error %.2e (%s)\n", what.c_str(), error,
                worst.c_str());
    EXPECT_LT(error, weights) << what << ", worst tensor " << worst;
  }
};

TEST_F(CudaEngine, Fp32MatchesTheCpuBackend) {
  for (bool tied : {false, true}) {
    EngineRun gpu = offloaded_placements(1, "fp32")[0];
    gpu.tied = tied;
    gpu.lr = 1e-3;
    gpu.eps = 1e-6;
    gpu.steps = 3;
    EngineRun cpu = gpu;
    cpu.backend = kernels::BackendKind::cpu;
    const EngineOutcome on_gpu = train(gpu);
    const EngineOutcome on_cpu = train(cpu);
    ASSERT_EQ(on_gpu.steps.size(), 3u);
    EXPECT_NE(on_gpu.steps[0].loss, on_gpu.steps[2].loss);  // it trained
    // TF32 is off: the difference is fp32 summation order (cuBLAS against OpenBLAS).
    expect_close(on_gpu, on_cpu, 1e-5, 1e-4,
                 std::string("GPU against CPU") + (tied ? ", tied" : ""));
    // Within its budget and plan.
    EXPECT_LE(on_gpu.rank_usage[0].peak, on_gpu.plan.peak(tiers::Tier::device) + (1 << 20));
    EXPECT_LE(on_gpu.rank_usage[0].peak, gpu.device_budget);
  }
}

TEST_F(CudaEngine, ResidentStateMatchesTheCpuBackendAndTheOffloadedRun) {
  for (bool tied : {false, true}) {
    EngineRun gpu = resident_run("fp32");
    gpu.tied = tied;
    gpu.lr = 1e-3;
    gpu.eps = 1e-6;
    gpu.steps = 3;
    EngineRun cpu = gpu;
    cpu.backend = kernels::BackendKind::cpu;
    EngineRun offloaded = offloaded_placements(1, "fp32")[0];
    offloaded.tied = tied;
    offloaded.lr = gpu.lr;
    offloaded.eps = gpu.eps;
    offloaded.steps = gpu.steps;
    const EngineOutcome resident = train(gpu);
    const std::string label = tied ? ", tied" : "";
    expect_close(resident, train(cpu), 1e-5, 1e-4, "resident GPU against CPU" + label);
    // Gradients accumulate in place on the GPU and on the host when offloaded.
    expect_close(resident, train(offloaded), 1e-5, 1e-4, "resident against offloaded" + label);
    EXPECT_LE(resident.rank_usage[0].peak, resident.plan.peak(tiers::Tier::device) + (1 << 20));
  }
  // bf16 parameters with an fp32 master on the GPU.
  EngineRun bf16 = resident_run("bf16");
  bf16.steps = 4;
  EngineRun cpu = bf16;
  cpu.backend = kernels::BackendKind::cpu;
  const EngineOutcome on_gpu = train(bf16), on_cpu = train(cpu);
  ASSERT_EQ(on_gpu.steps.size(), on_cpu.steps.size());
  for (size_t s = 0; s < on_gpu.steps.size(); ++s)
    EXPECT_NEAR(on_gpu.steps[s].loss, on_cpu.steps[s].loss, 2e-2 * on_cpu.steps[s].loss)
        << "bf16 step " << s + 1;
}

TEST_F(CudaEngine, ResidentStateResumesBitwise) {
  EngineRun run = resident_run("bf16");
  run.steps = 4;
  const EngineOutcome straight = train(run);
  Result<EngineOptions> options = testing::engine_options(run, dir_.path(), tokens_, seed_);
  ASSERT_TRUE(options.is_ok());
  Result<std::unique_ptr<Engine>> first = Engine::create(*options);
  ASSERT_TRUE(first.is_ok()) << first.status().message();
  for (int s = 0; s < 2; ++s) ASSERT_TRUE((*first)->step().is_ok());
  Result<std::string> saved = (*first)->save_checkpoint(dir_.path() + "/ckpt");
  ASSERT_TRUE(saved.is_ok()) << saved.status().message();
  first->reset();
  options->resume_from = *saved;
  Result<std::unique_ptr<Engine>> second = Engine::create(*options);
  ASSERT_TRUE(second.is_ok()) << second.status().message();
  for (int s = 2; s < 4; ++s) {
    Result<StepResult> step = (*second)->step();
    ASSERT_TRUE(step.is_ok()) << step.status().message();
    EXPECT_EQ(step->loss, straight.steps[size_t(s)].loss) << "step " << s + 1;
  }
  Result<HostModel> weights = (*second)->read_model();
  ASSERT_TRUE(weights.is_ok());
  EXPECT_TRUE(testing::weights_bitwise_equal(*weights, straight.weights));
}

TEST_F(CudaEngine, EveryOffloadedPlacementIsBitwiseIdenticalAtEachWorldSize) {
  EngineOutcome one_rank;
  for (int world : {1, 2, 3}) {
    std::vector<EngineRun> runs = offloaded_placements(world, "fp32");
    for (EngineRun& run : runs) {
      run.grad_accum = 6 / world;  // the same global batch at every world size
      run.lr = 1e-3;
      run.eps = 1e-6;
      run.steps = 2;
    }
    const EngineOutcome reference = train(runs[0]);
    ASSERT_EQ(reference.steps.size(), 2u);
    for (size_t i = 1; i < runs.size(); ++i)
      expect_identical(train(runs[i]), reference, runs[i].label() + " vs " + runs[0].label());
    if (world == 1) {
      one_rank = reference;
      continue;
    }
    expect_close(reference, one_rank, 1e-6, 1e-5, "world " + std::to_string(world) + " vs one");
  }
}

TEST_F(CudaEngine, Bf16PlacementsAgreeAndStayCloseToTheCpuBackend) {
  std::vector<EngineRun> runs = offloaded_placements(2, "bf16");
  for (EngineRun& run : runs) {
    run.tied = true;
    run.steps = 4;
  }
  const EngineOutcome reference = train(runs[0]);
  for (size_t i = 1; i < runs.size(); ++i)
    expect_identical(train(runs[i]), reference, runs[i].label());
  EngineRun cpu = runs[0];
  cpu.backend = kernels::BackendKind::cpu;
  const EngineOutcome on_cpu = train(cpu);
  // The GPU keeps activations in bf16 where the CPU backend computes in fp32.
  for (size_t s = 0; s < reference.steps.size(); ++s)
    EXPECT_NEAR(reference.steps[s].loss, on_cpu.steps[s].loss, 2e-2 * on_cpu.steps[s].loss)
        << "step " << s + 1;
  EXPECT_LT(reference.steps.back().loss, reference.steps.front().loss);
}

TEST_F(CudaEngine, OverlapSettingsAndAccumulationChangeTimingNotResults) {
  EngineRun base = offloaded_placements(2, "fp32")[1];
  base.steps = 2;
  const EngineOutcome reference = train(base);
  EngineRun no_overlap = base;
  no_overlap.overlap_comm = false;
  expect_identical(train(no_overlap), reference, no_overlap.label());
  EngineRun tight = base;
  tight.param_buffers = 1;
  tight.optimizer_buffers = 2;
  expect_identical(train(tight), reference, "tightest buffers " + tight.label());
}

}  // namespace
}  // namespace strata
