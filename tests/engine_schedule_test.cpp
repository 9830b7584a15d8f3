// The layer-major schedule computes what the micro-batch order computes. At
// one rank a unit's micro-batches reach it in order, so every gradient sums
// in the same order and the runs are bitwise equal, at every placement and
// precision, with clipping and with fp16 loss scaling. At more than one rank
// layer-major sums each unit's micro-batch gradients on the rank first and
// reduces the sum once per step: a reference summing in that order gives its
// bits, and it is within the rounding bound of the micro-batch order
// (core/README.md, "Numbers"). What it changes is what moves: each unit's
// parameters cross each link once for the forward and once for the
// backward, and its gradient the network once, whatever the number of
// micro-batches, for the activation copies the plan lists.
#include <gtest/gtest.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <tuple>
#include <utility>

#include "engine_test_support.h"
#include "io/fault_injection.h"

namespace strata {
namespace {

using testing::EngineOutcome;
using testing::EngineRun;

class EngineSchedule : public testing::EngineRunsTest {
 protected:
  EngineSchedule() : EngineRunsTest("engine_schedule") {}

  // Trains `run` in both orders and expects the same bits at one rank; at
  // more, where the sums are taken in another order, the same losses, norms
  // and weights to within kNearRelative (a few steps of rounding differences
  // of about 2^-24 relative, checked bitwise against a reference below), but
  // for the few weights AdamW's division flips (testing::expect_weights_near).
  void expect_schedules_agree(EngineRun run) {
    run.schedule = "micro_batch";
    const EngineOutcome micro = train(run);
    run.schedule = "layer";
    const EngineOutcome layer = train(run);
    ASSERT_EQ(micro.plan.input.schedule, Schedule::micro_batch) << run.label();
    ASSERT_EQ(layer.plan.input.schedule, Schedule::layer) << run.label();
    if (run.world == 1 || run.grad_accum == 1) {
      testing::expect_identical(layer, micro, run.label());
      return;
    }
    expect_near(layer, micro, run);
  }

  static constexpr double kNearRelative = 1e-4;

  static void expect_near(const EngineOutcome& a, const EngineOutcome& b, const EngineRun& run) {
    const std::string what = run.label();
    ASSERT_EQ(a.steps.size(), b.steps.size()) << what;
    for (size_t s = 0; s < a.steps.size(); ++s) {
      EXPECT_EQ(a.steps[s].skipped, b.steps[s].skipped) << what << ", step " << s + 1;
      EXPECT_NEAR(a.steps[s].loss, b.steps[s].loss, kNearRelative * std::fabs(b.steps[s].loss))
          << what << ", step " << s + 1;
      EXPECT_NEAR(a.steps[s].grad_norm, b.steps[s].grad_norm,
                  kNearRelative * std::fabs(b.steps[s].grad_norm))
          << what << ", step " << s + 1;
    }
    testing::expect_weights_near(a, b, run.lr, kNearRelative, what);
  }
};

// At one rank bitwise; at 2 and 3 within kNearRelative (the bits are the
// reference's of LayerMajorSumsOnTheRankThenReducesOnce).
TEST_F(EngineSchedule, LayerMajorIsBitwiseTheMicroBatchOrderAtEveryPlacement) {
  for (int world : {1, 2, 3}) {
    for (const char* precision : {"fp32", "bf16"}) {
      if (world == 3 && std::string(precision) == "bf16") continue;
      for (EngineRun run : testing::every_placement(world, precision)) {
        run.grad_accum = 3;
        run.steps = 2;
        expect_schedules_agree(run);
      }
    }
  }
}

// What EngineOptions::gradient_observer saw in one step, per (rank, unit, micro).
struct SeenGradients {
  std::mutex lock;
  std::map<std::tuple<int, int, int>, std::vector<float>> unreduced, reduced;
};

// The rounding bound of a sum of n + 1 terms (Higham's gamma_n, u = 2^-24).
double gamma_n(int n) {
  const double u = std::ldexp(1.0, -24);
  return n * u / (1 - n * u);
}

// At W ranks and G micro-batches the micro-batch order reduces each
// micro-batch's gradient (0 + g[0][m] + ... + g[W-1][m], rank order) and adds
// the sums up in micro-batch order; layer-major first sums each rank's in
// micro-batch order (s[r] = g[r][0] + ... + g[r][G-1]) and reduces those once
// (0 + s[0] + ... + s[W-1]). References computing each order from the
// observed micro-batch gradients give both runs' bits, and the two differ by
// at most 2 gamma_(W+G-2) sum |g| per element.
TEST_F(EngineSchedule, LayerMajorSumsOnTheRankThenReducesOnce) {
  const int G = 3;
  for (int world : {2, 3}) {
    for (auto [stage, param, optimizer] :
         {std::tuple{0, "none", "none"}, std::tuple{2, "none", "cpu"},
          std::tuple{3, "nvme", "nvme"}}) {
      EngineRun run;
      run.stage = stage;
      run.offload_param = param;
      run.offload_optimizer = optimizer;
      run.world = world;
      run.grad_accum = G;
      run.steps = 1;
      SeenGradients seen[2];  // the micro-batch order, layer-major
      for (int s = 0; s < 2; ++s) {
        run.schedule = s == 0 ? "micro_batch" : "layer";
        Result<EngineOptions> options = testing::engine_options(run, dir_.path(), tokens_, seed_);
        ASSERT_TRUE(options.is_ok()) << options.status().message();
        SeenGradients& into = seen[s];
        options->gradient_observer = [&into](const GradientSeen& g) {
          std::lock_guard<std::mutex> hold(into.lock);
          (g.reduced ? into.reduced : into.unreduced)[{g.rank, g.unit, g.micro}].assign(
              g.data, g.data + g.count);
        };
        Result<std::unique_ptr<Engine>> engine = Engine::create(*options);
        ASSERT_TRUE(engine.is_ok()) << engine.status().message();
        Result<StepResult> step = (*engine)->step();
        ASSERT_TRUE(step.is_ok()) << run.label() << ": " << step.status().message();
      }
      const std::string what = run.label();
      // The same parameters and tokens: the same micro-batch gradients.
      ASSERT_FALSE(seen[1].unreduced.empty()) << what;
      EXPECT_TRUE(seen[0].unreduced == seen[1].unreduced) << what;
      double worst_ratio = 0;
      for (const auto& [key, ignored] : seen[1].unreduced) {
        const auto [r, u, m] = key;
        if (m != 0) continue;
        const size_t padded = seen[1].unreduced.at({r, u, 0}).size();
        std::vector<float> new_order(padded, 0.0f), old_order(padded), size(padded, 0.0f);
        for (int q = 0; q < world; ++q) {
          std::vector<float> sum = seen[1].unreduced.at({q, u, 0});
          for (int k = 1; k < G; ++k) {
            const std::vector<float>& g = seen[1].unreduced.at({q, u, k});
            for (size_t i = 0; i < padded; ++i) sum[i] += g[i];
          }
          for (size_t i = 0; i < padded; ++i) new_order[i] += sum[i];
        }
        for (int k = 0; k < G; ++k) {
          std::vector<float> reduced(padded, 0.0f);
          for (int q = 0; q < world; ++q) {
            const std::vector<float>& g = seen[1].unreduced.at({q, u, k});
            for (size_t i = 0; i < padded; ++i) {
              reduced[i] += g[i];
              size[i] += std::fabs(g[i]);
            }
          }
          for (size_t i = 0; i < padded; ++i)
            old_order[i] = k == 0 ? reduced[i] : old_order[i] + reduced[i];
        }
        // Layer-major reduced once, at the last micro-batch.
        for (int k = 0; k + 1 < G; ++k)
          EXPECT_EQ(seen[1].reduced.count({r, u, k}), 0u) << what << ", unit " << u;
        const std::vector<float>& got = seen[1].reduced.at({r, u, G - 1});
        const size_t from = got.size() == padded ? 0 : size_t(r) * got.size();
        ASSERT_LE(from + got.size(), padded) << what;
        EXPECT_EQ(std::memcmp(got.data(), new_order.data() + from, got.size() * 4), 0)
            << what << ", rank " << r << ", unit " << u << ": not the layer-major reference's bits";
        // The micro-batch order's accumulated sums, as the accumulator adds them.
        std::vector<float> micro = seen[0].reduced.at({r, u, 0});
        for (int k = 1; k < G; ++k) {
          const std::vector<float>& reduced = seen[0].reduced.at({r, u, k});
          for (size_t i = 0; i < micro.size(); ++i) micro[i] += reduced[i];
        }
        EXPECT_EQ(std::memcmp(micro.data(), old_order.data() + from, micro.size() * 4), 0)
            << what << ", rank " << r << ", unit " << u << ": not the micro-batch reference's bits";
        const double bound = 2 * gamma_n(world + G - 2);
        for (size_t i = 0; i < got.size(); ++i) {
          const double difference = std::fabs(double(got[i]) - double(old_order[from + i]));
          const double allowed = bound * size[from + i];
          ASSERT_LE(difference, allowed) << what << ", unit " << u << ", element " << from + i;
          if (allowed > 0) worst_ratio = std::max(worst_ratio, difference / allowed);
        }
      }
      std::printf("%s: the largest difference is %.3f of the bound\n", what.c_str(), worst_ratio);
    }
  }
}

// The bytes the communicators send each step are the plan's (per rank, times
// the ranks); layer-major reduces a unit's gradient once per step, so at 8
// micro-batches its reductions carry 1/8 of the micro-batch order's bytes.
TEST_F(EngineSchedule, NetworkBytesEqualThePlanAndGradientsCrossOncePerStep) {
  const int G = 8;
  for (int world : {2, 3}) {
    for (auto [stage, param] : {std::pair{0, "none"}, std::pair{2, "none"}, std::pair{3, "cpu"}}) {
      EngineRun run;
      run.stage = stage;
      run.offload_param = param;
      run.world = world;
      run.grad_accum = G;
      run.steps = 2;
      int64_t reduced[2] = {0, 0};
      for (int s = 0; s < 2; ++s) {
        run.schedule = s == 0 ? "micro_batch" : "layer";
        const EngineOutcome outcome = train(run);
        ASSERT_EQ(outcome.steps.size(), size_t(run.steps)) << run.label();
        for (const PlanOp& op : outcome.plan.ops)
          if (op.kind == OpKind::reduce) reduced[s] += op.bytes;
        // Stage 2's parameter all-gathers of a step's updates may run into
        // the next step: there the steps together carry the plan's bytes.
        uint64_t sent = 0;
        for (const StepResult& step : outcome.steps) {
          if (stage != 2) {
            EXPECT_EQ(step.network_bytes,
                      uint64_t(outcome.plan.traffic_per_step.collective()) * uint64_t(world))
                << run.label() << ", step " << step.step;
          }
          sent += step.network_bytes;
        }
        EXPECT_LE(sent, uint64_t(outcome.plan.traffic_per_step.collective()) * uint64_t(world) *
                            uint64_t(run.steps))
            << run.label();
      }
      EXPECT_GT(reduced[0], 0) << run.label();
      EXPECT_EQ(reduced[1] * G, reduced[0]) << run.label();
    }
  }
}

TEST_F(EngineSchedule, TiedEmbeddingsAndTheGpuDataPathsAgree) {
  for (int world : {1, 2}) {
    for (EngineRun run : testing::every_placement(world, "bf16")) {
      run.tied = true;
      run.grad_accum = 3;
      run.steps = 2;
      expect_schedules_agree(run);
    }
    // The CUDA backend's data paths, emulated: uploads per use, gradients
    // through host slots, tied copies per micro-batch.
    for (EngineRun run : testing::every_placement(world, "fp32")) {
      run.emulate_gpu = true;
      run.grad_accum = 3;
      run.steps = 2;
      expect_schedules_agree(run);
      // A tied embedding accumulating in place on the GPU is refused (the
      // order of its sum would change), so those runs are not compared.
      run.tied = true;
      if (world == 1 && run.offload_optimizer == "none") continue;
      expect_schedules_agree(run);
    }
  }
}

// The steps of a run until it ends or fails: (skipped, loss scale) per step, and the failure.
struct Skips {
  std::vector<std::pair<bool, double>> steps;
  std::string failure;
};

TEST_F(EngineSchedule, Fp16OverflowSkipsTheSameStepsAndClippingOffUpdatesDuringBackward) {
  // An infinite lm_head element: every step's gradients overflow, the scaler
  // halves its scale, skipping, until it gives up; both orders alike.
  HostModel model = make_host_model(testing::small_gqa_model(), 1);
  init_host_model(model, seed_);
  const TensorSlot* slot = model.layout.units.back().find("lm_head.weight");
  model.params.back()[size_t(slot->offset + 7)] = std::numeric_limits<float>::infinity();
  const std::string poisoned = dir_.subdirectory("poisoned");
  ASSERT_TRUE(save_host_model(model, poisoned, DType::f32).is_ok());
  for (int world : {1, 2}) {
    for (const char* optimizer : {"none", "nvme"}) {
      EngineRun run;
      run.stage = 3;
      run.offload_param = "nvme";
      run.offload_optimizer = optimizer;
      run.world = world;
      run.precision = "fp16";
      run.grad_accum = 3;
      run.initial_scale_power = 3;
      run.steps = 8;
      Skips seen[2];
      for (int s = 0; s < 2; ++s) {
        run.init = poisoned;
        run.schedule = s == 0 ? "micro_batch" : "layer";
        Result<EngineOptions> options = testing::engine_options(run, dir_.path(), tokens_, seed_);
        ASSERT_TRUE(options.is_ok()) << options.status().message();
        Result<std::unique_ptr<Engine>> engine = Engine::create(*options);
        ASSERT_TRUE(engine.is_ok()) << engine.status().message();
        ASSERT_EQ((*engine)->plan().input.schedule,
                  s == 0 ? Schedule::micro_batch : Schedule::layer);
        for (int step = 0; step < run.steps; ++step) {
          Result<StepResult> result = (*engine)->step();
          if (!result) {
            seen[s].failure = result.status().message();
            break;
          }
          seen[s].steps.push_back({result->skipped, result->loss_scale});
        }
      }
      EXPECT_EQ(seen[0].steps, seen[1].steps) << run.label();
      ASSERT_FALSE(seen[0].steps.empty()) << run.label();
      EXPECT_TRUE(seen[0].steps[0].first) << run.label() << ": the overflow skipped the step";
      // The same failure, whichever rank reported it first.
      auto without_rank = [](const std::string& message) {
        return message.substr(message.find(", ") == std::string::npos ? 0 : message.find(", "));
      };
      EXPECT_EQ(without_rank(seen[0].failure), without_rank(seen[1].failure)) << run.label();
      // And at a scale that does not overflow, the same bits.
      run.init.clear();
      run.initial_scale_power = 12;
      run.steps = 2;
      expect_schedules_agree(run);
    }
    // No clipping in fp32: each unit's update runs during backward.
    EngineRun run;
    run.stage = 3;
    run.offload_param = "cpu";
    run.offload_optimizer = "cpu";
    run.world = world;
    run.clipping = 0.0;
    run.grad_accum = 4;
    run.steps = 2;
    expect_schedules_agree(run);
  }
}

TEST_F(EngineSchedule, NvmeBytesEqualThePlanAndParameterReadsDoNotGrowWithAccumulation) {
  int64_t layer_reads_at_one = 0;
  for (int64_t accum : {1, 2, 4, 8}) {
    for (const char* schedule : {"micro_batch", "layer"}) {
      EngineRun run;
      run.stage = 3;
      run.offload_param = "nvme";
      run.offload_optimizer = "nvme";
      run.micro_batch = 1;
      run.grad_accum = accum;
      run.steps = 2;
      run.schedule = schedule;
      const EngineOutcome outcome = train(run);
      const StepTraffic& planned = outcome.plan.traffic_per_step;
      EXPECT_EQ(outcome.nvme_read, uint64_t(planned.nvme_read) * 2) << run.label() << " x" << accum;
      EXPECT_EQ(outcome.nvme_written, uint64_t(planned.nvme_written) * 2)
          << run.label() << " x" << accum;
      // The parameters' share of the reads: the fetches.
      int64_t fetched = 0;
      for (const PlanOp& op : outcome.plan.ops)
        if (op.kind == OpKind::fetch) fetched += op.bytes;
      if (std::string(schedule) == "layer") {
        if (accum == 1) layer_reads_at_one = fetched;
        EXPECT_EQ(fetched, layer_reads_at_one) << "layer-major fetches at accumulation " << accum;
        // What grows instead: the activation copies the plan keeps.
        const PlanBuffer* kept = outcome.plan.buffer(BufferRole::saved_inputs);
        ASSERT_NE(kept, nullptr);
        EXPECT_EQ(kept->copies, accum);
      } else if (accum > 1) {
        EXPECT_GT(fetched, layer_reads_at_one) << "micro-batch-major fetches at " << accum;
      }
    }
  }
}

TEST_F(EngineSchedule, GradientsOnNvmeAreWrittenOnceAndAgree) {
  // Layer-major keeps a unit's sum over its micro-batches in host memory and
  // writes it once; the micro-batch order reads back and rewrites it each time.
  for (int world : {1, 2}) {
    for (const char* state : {"fp32", "int8"}) {
      EngineRun run;
      run.stage = 3;
      run.offload_param = "nvme";
      run.offload_optimizer = "nvme";
      run.gradient_home = "nvme";
      run.state_dtype = state;
      run.world = world;
      run.grad_accum = 3;
      run.steps = 2;
      run.schedule = "micro_batch";
      const EngineOutcome micro = train(run);
      run.schedule = "layer";
      const EngineOutcome layer = train(run);
      if (world == 1) {
        testing::expect_identical(layer, micro, run.label());
      } else {
        expect_near(layer, micro, run);
      }
      for (const EngineOutcome* o : {&micro, &layer}) {
        EXPECT_EQ(o->nvme_read, uint64_t(o->plan.traffic_per_step.nvme_read) * 2 * world)
            << run.label();
        EXPECT_EQ(o->nvme_written, uint64_t(o->plan.traffic_per_step.nvme_written) * 2 * world)
            << run.label();
      }
      EXPECT_LT(layer.nvme_written, micro.nvme_written) << run.label();
    }
  }
}

TEST_F(EngineSchedule, AutoPicksLayerWhereParametersMoveAndRefusesWhatCannotRun) {
  EngineRun run;
  run.stage = 3;
  run.offload_param = "nvme";
  run.offload_optimizer = "nvme";
  run.grad_accum = 4;
  run.steps = 1;
  EXPECT_EQ(train(run).plan.input.schedule, Schedule::layer);
  run.offload_param = "none";
  run.offload_optimizer = "none";
  run.stage = 0;
  EXPECT_EQ(train(run).plan.input.schedule, Schedule::micro_batch);
  // Activations that do not fit the device budget go to host memory on the CPU backend.
  run.stage = 3;
  run.offload_param = "nvme";
  run.offload_optimizer = "nvme";
  run.grad_accum = 8;
  run.schedule = "layer";
  const EngineOutcome planned = train(run);
  const PlanBuffer* kept = planned.plan.buffer(BufferRole::saved_inputs);
  ASSERT_NE(kept, nullptr);
  EXPECT_EQ(planned.plan.activation_home(), tiers::Tier::device);
  // A tied embedding accumulating in GPU memory cannot run layer-major: one line, up front.
  run = EngineRun();
  run.tied = true;
  run.emulate_gpu = true;
  run.stage = 3;
  run.offload_param = "cpu";
  run.schedule = "layer";
  run.grad_accum = 2;
  Result<testing::EngineOutcome> refused = testing::train_engine(run, dir_.path(), tokens_, seed_);
  ASSERT_FALSE(refused.is_ok());
  EXPECT_NE(refused.status().message().find("--schedule micro_batch"), std::string::npos)
      << refused.status().message();
  EXPECT_EQ(refused.status().message().find('\n'), std::string::npos);
}

// Checkpoints spilled to their home (NVMe on either backend, host memory on
// a GPU's) come back bit for bit: the runs equal the micro-batch order's at
// every placement, and with the state in memory the only NVMe traffic is
// theirs, as much as the plan says.
TEST_F(EngineSchedule, SpilledActivationsAreBitwiseAndMoveWhatThePlanSays) {
  for (int world : {1, 2}) {
    for (const char* precision : {"fp32", "bf16"}) {
      if (world == 2 && std::string(precision) == "bf16") continue;
      for (EngineRun run : testing::every_placement(world, precision)) {
        run.layers = 4;
        run.grad_accum = 3;
        run.steps = 2;
        run.activation_home = "nvme";
        expect_schedules_agree(run);
      }
    }
    // The GPU's data paths, emulated (in fp32: its checkpoints are fp32):
    // to NVMe through the staging copy, and to pinned host memory.
    for (const char* home : {"nvme", "host"}) {
      if (world == 2 && std::string(home) == "host") continue;  // the same path as NVMe's, less I/O
      for (EngineRun run : testing::every_placement(world, "fp32")) {
        run.layers = 4;
        run.emulate_gpu = true;
        run.grad_accum = 3;
        run.steps = 2;
        run.activation_home = home;
        expect_schedules_agree(run);
      }
    }
  }
  for (bool gpu : {false, true}) {
    EngineRun run;
    run.layers = 5;
    run.emulate_gpu = gpu;
    run.micro_batch = 1;
    run.grad_accum = 4;
    run.steps = 2;
    run.schedule = "layer";
    run.activation_home = "nvme";
    const EngineOutcome outcome = train(run);
    const TrainingPlan& plan = outcome.plan;
    ASSERT_TRUE(plan.activations_spilled()) << run.label();
    // Levels 0-3 of 6 (embedding, 5 layers) go out, each micro-batch's once,
    // and come back once: nothing else touches NVMe.
    EXPECT_EQ(plan.spilled_levels(), 4);
    const int64_t bytes = 4 * 4 * plan.saved_input_transfer_bytes();
    EXPECT_EQ(plan.traffic_per_step.nvme_written, bytes);
    EXPECT_EQ(plan.traffic_per_step.nvme_read, bytes);
    EXPECT_EQ(outcome.nvme_written, uint64_t(bytes) * 2) << run.label();
    EXPECT_EQ(outcome.nvme_read, uint64_t(bytes) * 2) << run.label();
  }
}

// The micro-batch order spills as well, at one micro-batch (where both
// orders are the same) or several (one micro-batch's levels out at a time):
// the same bits as with the saved inputs kept, and on NVMe as many bytes as
// the plan says.
TEST_F(EngineSchedule, TheMicroBatchOrderSpillsItsSavedInputsBitwise) {
  for (bool gpu : {false, true}) {
    for (int accumulation : {1, 3}) {
      for (const char* home : {"nvme", "host"}) {
        if (!gpu && std::string(home) == "host") continue;  // the CPU's host home keeps them
        EngineRun run;
        run.layers = 5;
        run.emulate_gpu = gpu;
        run.stage = 3;
        run.offload_param = "cpu";
        run.offload_optimizer = "cpu";
        run.grad_accum = accumulation;
        run.steps = 2;
        run.schedule = "micro_batch";
        run.activation_home = "device";
        const EngineOutcome kept = train(run);
        run.activation_home = home;
        const EngineOutcome spilled = train(run);
        const TrainingPlan& plan = spilled.plan;
        ASSERT_EQ(plan.input.schedule, Schedule::micro_batch) << run.label();
        ASSERT_TRUE(plan.activations_spilled()) << run.label();
        EXPECT_FALSE(kept.plan.activations_spilled()) << run.label();
        testing::expect_identical(spilled, kept, run.label());
        // Levels 0-3 of 6 (embedding, 5 layers) go out and come back, each
        // micro-batch's once, through one copy per level.
        EXPECT_EQ(plan.spilled_levels(), 4);
        EXPECT_EQ(plan.buffer(BufferRole::activation_spill)->copies, 4) << run.label();
        if (std::string(home) == "nvme") {
          const int64_t bytes = 4 * accumulation * plan.saved_input_transfer_bytes();
          EXPECT_EQ(plan.traffic_per_step.nvme_written, bytes);
          EXPECT_EQ(plan.traffic_per_step.nvme_read, bytes);
          EXPECT_EQ(spilled.nvme_written, uint64_t(bytes) * 2) << run.label();
          EXPECT_EQ(spilled.nvme_read, uint64_t(bytes) * 2) << run.label();
        }
      }
    }
  }
  // Left to the plan, a step whose saved inputs do not fit the device budget
  // spills them (a GPU's to its host memory first), with the same bits.
  EngineRun run;
  run.layers = 5;
  run.emulate_gpu = true;
  run.stage = 3;
  run.offload_param = "nvme";
  run.offload_optimizer = "nvme";
  run.grad_accum = 1;
  run.steps = 2;
  const EngineOutcome roomy = train(run);
  EXPECT_FALSE(roomy.plan.activations_spilled());
  const PlanBuffer* saved = roomy.plan.buffer(BufferRole::gpu_saved_inputs);
  ASSERT_NE(saved, nullptr);
  run.device_budget = uint64_t(roomy.plan.peak(tiers::Tier::device) - saved->bytes / 2);
  const EngineOutcome tight = train(run);
  EXPECT_EQ(tight.plan.activation_home(), tiers::Tier::host);
  EXPECT_TRUE(tight.plan.activations_spilled());
  EXPECT_LE(tight.plan.peak(tiers::Tier::device), int64_t(run.device_budget));
  testing::expect_identical(tight, roomy, run.label());
}

// The spilled plan's shape: two levels of device slots whatever the depth,
// each spill before the forward that overwrites its slot, each restore after
// the last read of its slot and before the backward that needs it; in the
// micro-batch order one micro-batch at a time.
TEST(SpilledActivations, SlotsAreReusedOnlyOnceTheirLevelIsOut) {
  for (auto [gpu, schedule] :
       {std::pair{false, Schedule::layer}, std::pair{true, Schedule::layer},
        std::pair{false, Schedule::micro_batch}, std::pair{true, Schedule::micro_batch}}) {
    PlanInput in;
    in.model = testing::small_gqa_model();
    in.model.num_hidden_layers = 6;
    in.stage = 3;
    in.offload_param = OffloadDevice::nvme;
    in.offload_optimizer = OffloadDevice::nvme;
    in.gpu = gpu;
    in.micro_batch = 2;
    in.seq_len = 16;
    in.grad_accum = 5;
    in.schedule = schedule;
    in.activation_home = tiers::Tier::device;
    Result<TrainingPlan> kept = build_training_plan(in);
    ASSERT_TRUE(kept.is_ok()) << kept.status().message();
    in.activation_home = tiers::Tier::nvme;
    Result<TrainingPlan> built = build_training_plan(in);
    ASSERT_TRUE(built.is_ok()) << built.status().message();
    const TrainingPlan& plan = *built;
    const int G = 5, head = int(plan.units.size()) - 1;
    const int copies = schedule == Schedule::layer ? G : 1;  // of a level, in the device and out
    ASSERT_EQ(plan.spilled_levels(), head - 2);
    const BufferRole slots_role =
        gpu ? BufferRole::gpu_saved_inputs : BufferRole::saved_inputs;
    const PlanBuffer* slots = plan.buffer(slots_role);
    const PlanBuffer* spilled = plan.buffer(BufferRole::activation_spill);
    ASSERT_NE(slots, nullptr);
    ASSERT_NE(spilled, nullptr);
    EXPECT_EQ(slots->copies, 2 * copies);
    EXPECT_EQ(spilled->tier, tiers::Tier::nvme);
    EXPECT_EQ(spilled->copies, (head - 2) * copies);
    EXPECT_EQ(plan.buffer(BufferRole::activation_staging) != nullptr, gpu);
    EXPECT_LT(plan.peak(tiers::Tier::device), kept->peak(tiers::Tier::device));
    EXPECT_EQ(kept->buffer(slots_role)->bytes - slots->bytes,
              int64_t(head - 2) * copies * plan.saved_input_bytes());

    // Index the operations.
    auto find = [&](OpKind kind, int unit, int micro) {
      for (size_t i = 0; i < plan.ops.size(); ++i)
        if (plan.ops[i].kind == kind && plan.ops[i].unit == unit && plan.ops[i].micro == micro)
          return int(i);
      return -1;
    };
    auto depends = [&](int op, int on) {
      const std::vector<int>& deps = plan.ops[size_t(op)].deps;
      return std::find(deps.begin(), deps.end(), on) != deps.end();
    };
    int spills = 0, restores = 0;
    for (const PlanOp& op : plan.ops) {
      spills += op.kind == OpKind::spill;
      restores += op.kind == OpKind::restore;
      if (op.kind == OpKind::spill || op.kind == OpKind::restore) {
        EXPECT_EQ(op.lane, Lane::activations);
        EXPECT_EQ(op.slot, plan.saved_input_place(op.unit, op.micro).copy);
      }
    }
    EXPECT_EQ(spills, (head - 2) * G);
    EXPECT_EQ(restores, (head - 2) * G);
    for (int k = 0; k < head - 2; ++k) {
      for (int m = 0; m < G; ++m) {
        const int spill = find(OpKind::spill, k, m), restore = find(OpKind::restore, k, m);
        ASSERT_GE(spill, 0);
        ASSERT_GE(restore, 0);
        EXPECT_TRUE(depends(spill, find(OpKind::forward, k, m)));
        EXPECT_TRUE(depends(find(OpKind::forward, k + 2, m), spill)) << k << " " << m;
        // The slot's later level (k + 2) was last read by the backward of unit k + 3, or the head.
        const int last_reader =
            k + 3 == head ? find(OpKind::forward, head, m) : find(OpKind::backward, k + 3, m);
        EXPECT_TRUE(depends(restore, last_reader)) << k << " " << m;
        EXPECT_TRUE(depends(restore, spill));
        EXPECT_TRUE(depends(find(OpKind::backward, k + 1, m), restore)) << k << " " << m;
        // A unit ahead: before the backward of unit k + 2 begins (layer-major:
        // a whole unit of micro-batches ahead).
        EXPECT_LT(restore, find(OpKind::backward, k + 2, schedule == Schedule::layer ? G - 1 : m));
        // The micro-batch order's micro-batches share a level's copies: the
        // next one's spill comes after this one's restore on the one
        // activations lane, and its forward after this one's backward.
        if (schedule == Schedule::micro_batch && m + 1 < G) {
          EXPECT_LT(restore, find(OpKind::spill, k, m + 1)) << k << " " << m;
          EXPECT_LT(find(OpKind::backward, k + 1, m), find(OpKind::forward, k, m + 1));
        }
      }
    }
    // What the home costs: the checkpoints through NVMe and, on a GPU, over PCIe.
    const int64_t moved = int64_t(head - 2) * G * plan.saved_input_transfer_bytes();
    EXPECT_EQ(plan.traffic_per_step.nvme_written - kept->traffic_per_step.nvme_written, moved);
    EXPECT_EQ(plan.traffic_per_step.nvme_read - kept->traffic_per_step.nvme_read, moved);
    if (gpu) {
      EXPECT_EQ(plan.traffic_per_step.d2h - kept->traffic_per_step.d2h,
                int64_t(head - 2) * G * plan.saved_input_bytes());
      EXPECT_EQ(plan.traffic_per_step.h2d - kept->traffic_per_step.h2d,
                int64_t(head - 2) * G * plan.saved_input_bytes());
    }
  }
}

// A failed spill or restore fails its step in one line naming the operation,
// the unit and the micro-batch.
TEST_F(EngineSchedule, AFailedSpillOrRestoreFailsTheStepInOneLine) {
  for (io::RingOp op : {io::RingOp::kWrite, io::RingOp::kRead}) {
    EngineRun run;
    run.layers = 4;
    run.grad_accum = 3;
    run.steps = 3;
    run.schedule = "layer";
    run.activation_home = "nvme";
    // With the state in memory every NVMe call of the steps is a checkpoint's.
    auto counter = std::make_shared<io::FaultInjector>();
    run.fault_injector = counter;
    train(run);
    auto injector = std::make_shared<io::FaultInjector>();
    io::Fault fault;
    fault.op = op;
    fault.nth_call = counter->calls(op) / 2;
    fault.error_number = ENOSPC;
    fault.times = 1000000;
    injector->add(fault);
    run.fault_injector = injector;
    Result<EngineOutcome> outcome = testing::train_engine(run, dir_.path(), tokens_, seed_);
    ASSERT_FALSE(outcome.is_ok());
    const std::string& message = outcome.status().message();
    EXPECT_NE(message.find(op == io::RingOp::kWrite ? "spilling the saved input of "
                                                    : "restoring the saved input of "),
              std::string::npos)
        << message;
    EXPECT_NE(message.find("micro-batch"), std::string::npos) << message;
    EXPECT_NE(message.find("No space left on device"), std::string::npos) << message;
    EXPECT_EQ(message.find('\n'), std::string::npos) << message;
  }
}

}  // namespace
}  // namespace strata

namespace strata {
namespace {

// With the updates during backward the step's decision comes from `decide`
// on the optimizer lane: the step returns (and reports its learning rate)
// once the exchange is done, so the exchange waits for the decision.
TEST(StepDecision, TheExchangeWaitsForTheDecisionMadeAtTheStart) {
  for (Schedule schedule : {Schedule::micro_batch, Schedule::layer}) {
    for (bool during_backward : {false, true}) {
      PlanInput in;
      in.model = testing::small_gqa_model();
      in.stage = 3;
      in.grad_accum = 2;
      in.schedule = schedule;
      in.optimizer_during_backward = during_backward;
      Result<TrainingPlan> plan = build_training_plan(in);
      ASSERT_TRUE(plan.is_ok()) << plan.status().message();
      int decide = -1, exchange = -1;
      for (size_t i = 0; i < plan->ops.size(); ++i) {
        if (plan->ops[i].kind == OpKind::decide) decide = int(i);
        if (plan->ops[i].kind == OpKind::exchange) exchange = int(i);
      }
      ASSERT_GE(exchange, 0);
      EXPECT_EQ(decide >= 0, during_backward);
      if (decide < 0) continue;
      const std::vector<int>& deps = plan->ops[size_t(exchange)].deps;
      EXPECT_NE(std::find(deps.begin(), deps.end(), decide), deps.end()) << schedule_name(schedule);
    }
  }
}

// PCIe on the CUDA backend, from the plan: layer-major uploads each unit once
// per use whatever the accumulation, and with one rank sends each gradient
// down once per step (summed on the device), where the micro-batch order
// sends one per micro-batch.
TEST(ScheduleTraffic, LayerMajorCrossesPcieOncePerUseAndSendsEachGradientOnce) {
  auto plan = [](Schedule schedule, int64_t accum) {
    PlanInput in;
    in.model = testing::small_gqa_model();
    in.stage = 3;
    in.offload_param = OffloadDevice::cpu;
    in.offload_optimizer = OffloadDevice::cpu;
    in.gpu = true;
    in.micro_batch = 1;
    in.seq_len = 16;
    in.grad_accum = accum;
    in.schedule = schedule;
    Result<TrainingPlan> built = build_training_plan(in);
    EXPECT_TRUE(built.is_ok()) << built.status().message();
    return built ? built->traffic_per_step : StepTraffic{};
  };
  const StepTraffic micro4 = plan(Schedule::micro_batch, 4), layer4 = plan(Schedule::layer, 4);
  const StepTraffic layer8 = plan(Schedule::layer, 8), layer1 = plan(Schedule::layer, 1);
  EXPECT_EQ(micro4.d2h, 4 * layer4.d2h);
  EXPECT_EQ(layer4.d2h, layer1.d2h);
  EXPECT_EQ(layer8.d2h, layer1.d2h);
  EXPECT_EQ(layer8.h2d, layer4.h2d);
  EXPECT_GT(micro4.h2d, 3 * layer4.h2d);
}

}  // namespace
}  // namespace strata
