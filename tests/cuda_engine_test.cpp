// The engine on the CUDA backend (core/engine/gpu_rank.h), in every placement of
// the engine's stage x offload matrix.
//
// Everywhere: each placement's plan puts each kind of state where the
// placement says (parameters, gradients and optimizer state on the device
// exactly when they are not offloaded), lists the device's working set and
// passes through pinned host memory only what the collectives and the CPU
// optimizer need; parameter offload below stage 3 is refused in one line as
// on the CPU; creating a CUDA engine where no GPU is usable is a one-line
// error.
// With a GPU: fp32 runs match the CPU backend's losses, gradient norms and
// weights; at 1, 2 and 3 ranks sharing the GPU every placement whose
// optimizer is off the GPU is bitwise identical, so is every placement whose
// optimizer is on it, and both stay close to the CPU backend at that world
// size; tied embeddings; bf16 placements agree and stay close to the CPU
// backend; a run with its state on the GPU resumed from a checkpoint gives
// the straight run bitwise; the device peak stays within the plan and the
// budget; compact optimizer state (bf16, int8) in GPU memory stays close to
// the CPU backend with that format and resumes bitwise; decoder layers cut
// into their attention and MLP (strata.layer_pieces 2) give the whole
// layers' bits on the GPU in both schedules and stay close to the CPU
// backend's pieces, within the plan's device peak; the embedding and head cut
// along the vocabulary stay close to whole units and to the CPU backend's
// chunks; a mixture's routed expert reads and deferred expert updates give
// the bits of reading and updating every expert; expert groups and MLP
// parts stay close to the uncut runs and to the CPU backend's cuts.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <optional>
#include <string>

#include "core/engine/engine.h"
#include "core/plan/expert_fetch.h"
#include "core/plan/training_plan.h"
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

// Every placement of the engine issue's matrix, on the GPU.
std::vector<EngineRun> gpu_placements(int world, const std::string& precision) {
  std::vector<EngineRun> runs = testing::every_placement(world, precision);
  for (EngineRun& run : runs) {
    run.backend = kernels::BackendKind::cuda;
    run.device_budget = 512ull << 20;
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
  return plan_training(
      plan_input_from_config(*config, testing::small_gqa_model(run.tied), {/*gpu=*/true}));
}

bool has_buffer(const TrainingPlan& plan, const std::string& prefix, tiers::Tier tier) {
  for (const PlanBuffer& b : plan.buffers)
    if (b.name.rfind(prefix, 0) == 0 && b.tier == tier) return true;
  return false;
}

TEST(CudaEnginePlan, EachKindOfStateLivesWhereThePlacementSays) {
  for (int world : {1, 2, 3}) {
    for (const char* precision : {"fp32", "bf16"}) {
      for (EngineRun run : gpu_placements(world, precision)) {
        run.tied = world == 2;
        Result<TrainingPlan> plan = gpu_plan(run);
        ASSERT_TRUE(plan.is_ok()) << run.label() << ": " << plan.status().message();
        const std::string label = run.label();
        const tiers::Tier param_home = run.offload_param == "none"  ? tiers::Tier::device
                                       : run.offload_param == "cpu" ? tiers::Tier::host
                                                                    : tiers::Tier::nvme;
        const tiers::Tier optimizer_home = run.offload_optimizer == "none"  ? tiers::Tier::device
                                           : run.offload_optimizer == "cpu" ? tiers::Tier::host
                                                                            : tiers::Tier::nvme;
        const tiers::Tier grad_home =
            run.offload_optimizer == "none" ? tiers::Tier::device : tiers::Tier::host;
        int64_t device_sum = 0;
        for (const PlanBuffer& b : plan->buffers) {
          if (b.name.rfind("parameters (", 0) == 0) {
            EXPECT_EQ(b.tier, param_home) << label;
          }
          if (b.name.rfind("gradients (", 0) == 0) {
            EXPECT_EQ(b.tier, grad_home) << label;
          }
          if (b.name == "fp32 master" || b.name == "Adam m" || b.name == "Adam v") {
            EXPECT_EQ(b.tier, optimizer_home) << label << ": " << b.name;
          }
          if (b.tier == tiers::Tier::device) device_sum += b.bytes;
        }
        EXPECT_EQ(device_sum, plan->peak(tiers::Tier::device)) << label;
        EXPECT_TRUE(has_buffer(*plan, "saved unit inputs", tiers::Tier::device)) << label;

        // Whole units in their device home are computed from in place; a
        // sharded or offloaded home is gathered in host memory and uploaded.
        const bool in_place = param_home == tiers::Tier::device && (run.stage < 3 || world == 1);
        EXPECT_EQ(plan->gpu_params_in_place(), in_place) << label;
        EXPECT_EQ(has_buffer(*plan, "device parameter slots", tiers::Tier::device), !in_place)
            << label;
        EXPECT_EQ(has_buffer(*plan, "gathered units", tiers::Tier::host),
                  run.stage == 3 && !in_place)
            << label;
        // With nothing to reduce and the optimizer on the GPU, gradients stay there.
        const bool grads_in_place = grad_home == tiers::Tier::device && world == 1;
        EXPECT_EQ(plan->gpu_grads_in_place(), grads_in_place) << label;
        EXPECT_EQ(has_buffer(*plan, "unit gradients", tiers::Tier::host), !grads_in_place) << label;
        EXPECT_EQ(has_buffer(*plan, "gradient norm scratch", tiers::Tier::device),
                  grad_home == tiers::Tier::device)
            << label;
        // The CPU optimizer's output passes through host memory on its way to the GPU.
        EXPECT_EQ(has_buffer(*plan, "new parameters on their way to the GPU", tiers::Tier::host),
                  param_home == tiers::Tier::device && optimizer_home != tiers::Tier::device)
            << label;
        EXPECT_EQ(has_buffer(*plan, "parameter all-gather staging", tiers::Tier::host),
                  (run.stage == 1 || run.stage == 2) && world > 1)
            << label;
        // No placement keeps the CPU backend's fp32 twins.
        EXPECT_FALSE(has_buffer(*plan, "parameters widened", tiers::Tier::device)) << label;

        // Activations are kept in the compute precision: bf16 halves them against fp32.
        if (std::string(precision) == "bf16") {
          // The same order and home (fp32's own choice may differ).
          EngineRun fp32 = run;
          fp32.precision = "fp32";
          fp32.schedule = schedule_name(plan->input.schedule);
          fp32.activation_home = tiers::tier_name(plan->activation_home());
          Result<TrainingPlan> wide = gpu_plan(fp32);
          ASSERT_TRUE(wide.is_ok());
          auto saved_bytes = [](const TrainingPlan& p) {
            for (const PlanBuffer& b : p.buffers)
              if (b.name.rfind("saved unit inputs", 0) == 0) return b.bytes;
            return int64_t{0};
          };
          EXPECT_EQ(2 * saved_bytes(*plan), saved_bytes(*wide)) << label;
        }
      }
    }
  }
}

// Compact m and v (bf16, int8) stay on the device with the rest, int8's
// block scales too.
TEST(CudaEnginePlan, ResidentStateIsAllOnTheDevice) {
  for (const char* precision : {"fp32", "bf16"}) {
    for (const char* state : {"fp32", "bf16", "int8"}) {
      for (int stage = 0; stage <= 3; ++stage) {
        EngineRun run = resident_run(precision);
        run.stage = stage;
        run.state_dtype = state;
        Result<TrainingPlan> plan = gpu_plan(run);
        ASSERT_TRUE(plan.is_ok()) << plan.status().message();
        EXPECT_EQ(plan->buffer(BufferRole::int8_scales) != nullptr, std::string(state) == "int8")
            << run.label();
        for (const PlanBuffer& b : plan->buffers) {
          if (b.name == "tokens and targets") {
            EXPECT_EQ(b.tier, tiers::Tier::host);
          } else {
            EXPECT_EQ(b.tier, tiers::Tier::device) << b.name << ", " << run.label();
          }
          EXPECT_EQ(b.name.find("gathered"), std::string::npos) << b.name;
        }
      }
    }
  }
}

TEST(CudaEnginePlan, OneProcessPerGpuChargesNcclStagingToTheDevice) {
  EngineRun run = resident_run("bf16");
  run.stage = 2;
  run.world = 2;
  Result<TrainConfig> config = testing::engine_config(run, "/nonexistent-nvme-dir");
  ASSERT_TRUE(config.is_ok());
  PlanInput input = plan_input_from_config(*config, testing::small_gqa_model(), {/*gpu=*/true});
  Result<TrainingPlan> threads = plan_training(input);
  input.nccl_staging = true;
  Result<TrainingPlan> processes = plan_training(input);
  ASSERT_TRUE(threads.is_ok() && processes.is_ok());
  int64_t largest_padded = 0;
  for (const UnitPlacement& p : processes->units)
    largest_padded = std::max(largest_padded, p.padded_numel);
  EXPECT_FALSE(has_buffer(*threads, "NCCL staging", tiers::Tier::device));
  EXPECT_TRUE(has_buffer(*processes, "NCCL staging", tiers::Tier::device));
  EXPECT_GE(processes->peak(tiers::Tier::device) - threads->peak(tiers::Tier::device),
            2 * largest_padded * 4);
}

TEST(CudaEnginePlan, RefusesParameterOffloadBelowStage3AsTheCpuBackendDoes) {
  for (int stage = 0; stage < 3; ++stage) {
    // The configuration check refuses it too; the plan is checked on its own.
    EngineRun run = resident_run("fp32");
    run.stage = 3;
    run.offload_param = "cpu";
    run.offload_optimizer = "cpu";
    Result<TrainConfig> config = testing::engine_config(run, "/nonexistent-nvme-dir");
    ASSERT_TRUE(config.is_ok());
    PlanInput input = plan_input_from_config(*config, testing::small_gqa_model(), {/*gpu=*/true});
    input.stage = stage;
    Result<TrainingPlan> plan = plan_training(input);
    ASSERT_FALSE(plan.is_ok());
    EXPECT_NE(plan.status().message().find("needs ZeRO stage 3"), std::string::npos)
        << plan.status().message();
    EXPECT_EQ(plan.status().message().find('\n'), std::string::npos);
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
  expect_resumes_bitwise(run, 2);
}

// Compact optimizer state (bf16, int8) in GPU memory, updated by the CUDA
// kernel, against the CPU backend with the same format: close, not bitwise
// (the gradients differ in fp32 summation order, and a moment near a rounding
// boundary of its format may land on the neighbouring code); the run resumes
// from a checkpoint bitwise (codes and int8 scales read from and written to
// the device), within its plan's device peak.
TEST_F(CudaEngine, ResidentCompactStateMatchesTheCpuBackendAndResumesBitwise) {
  for (const char* state : {"bf16", "int8"}) {
    EngineRun gpu = resident_run("fp32");
    gpu.state_dtype = state;
    gpu.lr = 1e-3;
    gpu.eps = 1e-6;
    gpu.steps = 3;
    EngineRun cpu = gpu;
    cpu.backend = kernels::BackendKind::cpu;
    const EngineOutcome on_gpu = train(gpu);
    ASSERT_EQ(on_gpu.steps.size(), 3u);
    EXPECT_NE(on_gpu.steps[0].loss, on_gpu.steps[2].loss) << state;  // it trained
    expect_close(on_gpu, train(cpu), 1e-4, 1e-3, std::string("resident GPU against CPU, ") + state);
    EXPECT_LE(on_gpu.rank_usage[0].peak, on_gpu.plan.peak(tiers::Tier::device) + (1 << 20));

    EngineRun resumed = resident_run("bf16");
    resumed.state_dtype = state;
    resumed.steps = 4;
    expect_resumes_bitwise(resumed, 2);
    // Two ranks, each with its range's blocks and scales.
    resumed.world = 2;
    resumed.stage = 2;
    expect_resumes_bitwise(resumed, 2);
  }
}

// Placements whose optimizer runs on the CPU and those whose optimizer runs
// on the GPU differ in where the gradient norm is summed (and, with one rank,
// in gradients accumulating inside the matrix products): each group is
// bitwise identical within itself, and both stay close to the CPU backend.
TEST_F(CudaEngine, EveryPlacementIsBitwiseIdenticalWithinItsOptimizerLaneAtEachWorldSize) {
  for (int world : {1, 2, 3}) {
    std::vector<EngineRun> runs = gpu_placements(world, "fp32");
    for (EngineRun& run : runs) {
      run.grad_accum = 6 / world;  // the same global batch at every world size
      run.lr = 1e-3;
      run.eps = 1e-6;
      run.steps = 2;
    }
    EngineRun cpu = runs[0];
    cpu.backend = kernels::BackendKind::cpu;
    const EngineOutcome on_cpu = train(cpu);
    std::optional<EngineOutcome> on_gpu_optimizer, on_cpu_optimizer;
    std::string gpu_label, cpu_label;
    for (const EngineRun& run : runs) {
      const EngineOutcome outcome = train(run);
      ASSERT_EQ(outcome.steps.size(), 2u) << run.label();
      EXPECT_LE(outcome.rank_usage[0].peak, outcome.plan.peak(tiers::Tier::device) + (1 << 20))
          << run.label();
      const bool gpu_optimizer = run.offload_optimizer == "none";
      std::optional<EngineOutcome>& reference = gpu_optimizer ? on_gpu_optimizer : on_cpu_optimizer;
      std::string& label = gpu_optimizer ? gpu_label : cpu_label;
      if (!reference) {
        reference = outcome;
        label = run.label();
        expect_close(outcome, on_cpu, 1e-5, 1e-4, run.label() + " against the CPU backend");
        continue;
      }
      expect_identical(outcome, *reference, run.label() + " vs " + label);
    }
  }
}

TEST_F(CudaEngine, Bf16PlacementsAgreeAndStayCloseToTheCpuBackend) {
  std::optional<EngineOutcome> on_gpu_optimizer, on_cpu_optimizer;
  EngineRun first;
  for (EngineRun run : gpu_placements(2, "bf16")) {
    run.tied = true;
    run.steps = 4;
    const EngineOutcome outcome = train(run);
    std::optional<EngineOutcome>& reference =
        run.offload_optimizer == "none" ? on_gpu_optimizer : on_cpu_optimizer;
    if (!reference) {
      reference = outcome;
      if (run.offload_optimizer != "none") first = run;
      continue;
    }
    expect_identical(outcome, *reference, run.label());
  }
  ASSERT_TRUE(on_gpu_optimizer && on_cpu_optimizer);
  EngineRun cpu = first;
  cpu.backend = kernels::BackendKind::cpu;
  const EngineOutcome on_cpu = train(cpu);
  // The GPU keeps activations in bf16 where the CPU backend computes in fp32.
  for (const EngineOutcome* outcome : {&*on_gpu_optimizer, &*on_cpu_optimizer}) {
    for (size_t s = 0; s < outcome->steps.size(); ++s)
      EXPECT_NEAR(outcome->steps[s].loss, on_cpu.steps[s].loss, 2e-2 * on_cpu.steps[s].loss)
          << "step " << s + 1;
    EXPECT_LT(outcome->steps.back().loss, outcome->steps.front().loss);
  }
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

// The layer-major order on a GPU, with its checkpoints on the device, in
// pinned host memory and on NVMe: the same bits as the micro-batch order
// (a unit's micro-batches reach it in order; spilled checkpoints come back
// bit for bit), and the NVMe bytes the plan counts.
TEST_F(CudaEngine, LayerMajorAndSpilledActivationsAreBitwiseTheMicroBatchOrder) {
  for (int world : {1, 2}) {
    for (const char* precision : {"fp32", "bf16"}) {
      for (EngineRun run : offloaded_placements(world, precision)) {
        run.layers = 4;
        run.grad_accum = 3;
        run.steps = 2;
        run.schedule = "micro_batch";
        const EngineOutcome micro = train(run);
        run.schedule = "layer";
        for (const char* home : {"device", "host", "nvme"}) {
          run.activation_home = home;
          const EngineOutcome layer = train(run);
          EXPECT_EQ(layer.plan.activations_spilled(), std::string(home) != "device");
          expect_identical(layer, micro, run.label());
          EXPECT_EQ(layer.nvme_read, uint64_t(layer.plan.traffic_per_step.nvme_read) * 2 * world)
              << run.label();
          EXPECT_EQ(layer.nvme_written,
                    uint64_t(layer.plan.traffic_per_step.nvme_written) * 2 * world)
              << run.label();
        }
      }
    }
  }
}

TEST_F(CudaEngine, LayerPiecesGiveTheWholeLayersBitsAndStayCloseToTheCpuBackend) {
  for (const char* precision : {"fp32", "bf16"}) {
    for (const char* schedule : {"micro_batch", "layer"}) {
      EngineRun cut = offloaded_placements(1, precision).back();  // everything on NVMe
      cut.layer_pieces = 2;
      cut.clipping = 0.0;  // the norm's two partial sums a layer would change clipping's bits
      cut.grad_accum = 2;
      cut.steps = 3;
      cut.schedule = schedule;
      EngineRun whole = cut;
      whole.layer_pieces = 1;
      const EngineOutcome a = train(cut), b = train(whole);
      ASSERT_EQ(a.steps.size(), 3u) << cut.label();
      for (size_t s = 0; s < a.steps.size(); ++s)
        EXPECT_EQ(a.steps[s].loss, b.steps[s].loss) << cut.label() << ", step " << s + 1;
      EXPECT_TRUE(testing::weights_bitwise_equal(a.weights, b.weights)) << cut.label();
      EXPECT_LE(a.rank_usage[0].peak, a.plan.peak(tiers::Tier::device) + (1 << 20)) << cut.label();
      if (std::string(precision) != "fp32") continue;
      EngineRun cpu = cut;
      cpu.backend = kernels::BackendKind::cpu;
      expect_close(a, train(cpu), 1e-5, 1e-4, cut.label() + " against the CPU backend");
    }
  }
}

// A mixture with its parameters on NVMe in layer pieces reads a sparse MLP
// piece's experts as routed on the GPU too (route() on the upload of the
// norm and router, the experts read and added to that upload): the bits of
// reading every expert with its unit, each step's NVMe reads what the plan
// counts for its routing; deferred updates (the optimizer on the CPU) give
// the eager update's bits.
TEST_F(CudaEngine, RoutedExpertReadsAndDeferredUpdatesGiveTheBitsOfReadingEveryExpert) {
  for (const char* precision : {"fp32", "bf16"}) {
    for (const char* schedule : {"micro_batch", "layer"}) {
      EngineRun routed = testing::routed_moe_run(schedule, precision);
      routed.backend = kernels::BackendKind::cuda;
      routed.device_budget = 512ull << 20;
      routed.offload_optimizer = "cpu";
      routed.grad_accum = 2;
      routed.steps = 3;
      EngineRun all = routed;
      all.expert_fetch = "all";
      const EngineOutcome r = train(routed), a = train(all);
      ASSERT_EQ(r.steps.size(), 3u) << routed.label();
      ASSERT_TRUE(r.plan.routed_expert_fetch) << r.plan.expert_fetch_reason;
      testing::expect_identical(r, a, routed.label() + " vs " + all.label());
      for (size_t s = 0; s < r.steps.size(); ++s)
        EXPECT_EQ(int64_t(r.steps[s].nvme_read_bytes),
                  routed_parameter_reads(r.plan, r.steps[s].routing))
            << routed.label() << ", step " << s + 1;
      EngineRun deferred = routed;
      deferred.expert_update = "deferred";
      deferred.steps = 4;
      EngineRun eager = deferred;
      eager.expert_update = "eager";
      const EngineOutcome d = train(deferred), e = train(eager);
      ASSERT_TRUE(d.plan.deferred_expert_updates) << d.plan.expert_update_reason;
      testing::expect_identical(d, e, deferred.label() + " vs " + eager.label());
    }
  }
}

TEST_F(CudaEngine, VocabChunksStayCloseToWholeUnitsAndTheCpuBackend) {
  for (const char* schedule : {"micro_batch", "layer"}) {
    EngineRun cut = offloaded_placements(1, "fp32").back();  // everything on NVMe
    cut.vocab_chunks = 3;
    cut.grad_accum = 2;
    cut.steps = 3;
    cut.lr = 1e-3;
    cut.eps = 1e-6;
    cut.schedule = schedule;
    EngineRun whole = cut;
    whole.vocab_chunks = 1;
    EngineRun cpu = cut;
    cpu.backend = kernels::BackendKind::cpu;
    const EngineOutcome a = train(cut);
    ASSERT_EQ(a.steps.size(), 3u) << cut.label();
    // The products are cut in other shapes (cuBLAS may pick other algorithms)
    // and the head's input gradient sums over the chunks: fp32 rounding apart.
    expect_close(a, train(whole), 1e-5, 1e-4, cut.label() + " against whole units");
    expect_close(a, train(cpu), 1e-5, 1e-4, cut.label() + " against the CPU backend");
    EXPECT_LE(a.rank_usage[0].peak, a.plan.peak(tiers::Tier::device) + (1 << 20)) << cut.label();
  }
}

// A mixture's sparse MLP pieces cut into groups of experts, and a dense
// model's MLP pieces cut into parts, on the GPU: in fp32 close to the
// uncut run and to the CPU backend's cut run (the products come in other
// shapes and alignments, so cuBLAS may pick other algorithms), in both
// schedules, within the plan's device peak; and with the experts read as
// routed, each step's NVMe reads what the plan counts for its routing.
TEST_F(CudaEngine, ExpertGroupsAndMlpPartsStayCloseToUncutRunsAndTheCpuBackend) {
  for (const char* schedule : {"micro_batch", "layer"}) {
    EngineRun groups = testing::routed_moe_run(schedule, "fp32");
    groups.experts_per_token = 2;
    groups.expert_groups = 4;
    EngineRun parts = offloaded_placements(1, "fp32").back();  // everything on NVMe
    parts.layer_pieces = 2;
    parts.mlp_parts = 3;
    parts.schedule = schedule;
    for (EngineRun* cut : {&groups, &parts}) {
      cut->backend = kernels::BackendKind::cuda;
      cut->grad_accum = 2;
      cut->steps = 3;
      cut->lr = 1e-3;
      cut->eps = 1e-6;
      EngineRun whole = *cut, cpu = *cut;
      whole.expert_groups = 1;
      whole.mlp_parts = 1;
      cpu.backend = kernels::BackendKind::cpu;
      const EngineOutcome a = train(*cut);
      ASSERT_EQ(a.steps.size(), 3u) << cut->label();
      EXPECT_NE(a.plan.buffer(BufferRole::gpu_expert_chain), nullptr) << cut->label();
      expect_close(a, train(whole), 1e-5, 1e-4, cut->label() + " against the uncut run");
      expect_close(a, train(cpu), 1e-5, 1e-4, cut->label() + " against the CPU backend");
      EXPECT_LE(a.rank_usage[0].peak, a.plan.peak(tiers::Tier::device) + (1 << 20)) << cut->label();
      if (cut == &groups) {
        EXPECT_TRUE(a.plan.routed_expert_fetch) << a.plan.expert_fetch_reason;
      }
      if (!a.plan.routed_expert_fetch) continue;
      for (size_t s = 0; s < a.steps.size(); ++s)
        EXPECT_EQ(int64_t(a.steps[s].nvme_read_bytes),
                  routed_parameter_reads(a.plan, a.steps[s].routing))
            << cut->label() << ", step " << s + 1;
    }
  }
}

}  // namespace
}  // namespace strata
