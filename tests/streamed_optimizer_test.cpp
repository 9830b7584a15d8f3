// StreamedOptimizer: the AdamW step over state homed on NVMe (and on host),
// streamed chunk by chunk, gives bitwise the same master, m, v and compute
// copy as Optimizer::update_shard over the same state in memory, for units of
// any size, parameter groups that cross chunk boundaries, clipping, and
// several steps; an I/O fault mid-step is an error naming the unit. Ranged
// updates and replays of missed steps give the whole steps' bits.
#include "core/optimizer/streamed_optimizer.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "tiers_test_support.h"

namespace strata {
namespace {

using io::testing::TemporaryDirectory;
using kernels::cpu::ElementType;
using tiers::ShardKind;
using tiers::Tier;

struct UnitState {
  int64_t numel = 0;
  Tier home = Tier::nvme;
  std::vector<float> master, m, v;
  std::vector<uint16_t> grad;  // bf16
  std::vector<uint16_t> copy;  // bf16, written by the step
  std::vector<ShardSegment> segments;
};

uint16_t to_bf16(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, 4);
  return uint16_t(bits >> 16);
}

std::vector<std::byte> as_bytes(const std::vector<float>& values) {
  std::vector<std::byte> bytes(values.size() * 4);
  std::memcpy(bytes.data(), values.data(), bytes.size());
  return bytes;
}

class StreamedOptimizerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    STRATA_SKIP_WITHOUT_DIRECT_IO(directory_);
    injector_ = std::make_shared<io::FaultInjector>();
    auto store = tiers::testing::open_test_store(directory_.path(), {0, 16 << 20, 64 << 20},
                                                 notices_, injector_);
    ASSERT_TRUE(store.is_ok()) << store.status().message();
    store_ = std::move(store).value();
  }

  // Units of random sizes (not multiples of the chunk), with decay / no_decay
  // segments, state homed on NVMe (most) or host.
  void make_units(std::mt19937_64& random) {
    std::normal_distribution<float> normal;
    for (int u = 0; u < 5; ++u) {
      UnitState unit;
      unit.numel = 1 + int64_t(random() % 40000);
      unit.home = u == 3 ? Tier::host : Tier::nvme;
      for (int64_t i = 0; i < unit.numel; ++i) {
        unit.master.push_back(normal(random));
        unit.m.push_back(0.01f * normal(random));
        unit.v.push_back(1e-4f * std::fabs(normal(random)));
        unit.grad.push_back(to_bf16(0.1f * normal(random)));
      }
      unit.copy.assign(unit.numel, 0);
      int64_t begin = 0;
      while (begin < unit.numel) {
        const int64_t end = std::min(unit.numel, begin + 1 + int64_t(random() % 9000));
        unit.segments.push_back(
            {begin, end, random() % 2 ? ParamGroup::decay : ParamGroup::no_decay});
        begin = end;
      }
      ASSERT_TRUE(StreamedOptimizer::add_unit_state(*store_, u, unit.numel, unit.home).is_ok());
      ASSERT_TRUE(store_->write_shard({u, ShardKind::master}, as_bytes(unit.master)).is_ok());
      ASSERT_TRUE(store_->write_shard({u, ShardKind::m}, as_bytes(unit.m)).is_ok());
      ASSERT_TRUE(store_->write_shard({u, ShardKind::v}, as_bytes(unit.v)).is_ok());
      units_.push_back(std::move(unit));
    }
  }

  std::vector<StreamedOptimizerUnit> streamed_units(std::vector<std::vector<uint16_t>>& copies) {
    std::vector<StreamedOptimizerUnit> result;
    copies.clear();
    for (size_t u = 0; u < units_.size(); ++u) copies.emplace_back(units_[u].numel, 0);
    for (size_t u = 0; u < units_.size(); ++u) {
      const UnitState& unit = units_[u];
      StreamedOptimizerUnit streamed;
      streamed.unit = int(u);
      streamed.shard.numel = unit.numel;
      streamed.shard.segments = unit.segments;
      streamed.shard.grad = unit.grad.data();
      streamed.shard.grad_type = ElementType::bf16;
      streamed.shard.copy = copies[u].data();
      streamed.shard.copy_type = ElementType::bf16;
      result.push_back(streamed);
    }
    return result;
  }

  // The reference: the same step on the in-memory copy of the state.
  void reference_step(const Optimizer& optimizer, const StepDecision& plan) {
    for (UnitState& unit : units_) {
      kernels::cpu::AdamWShard shard;
      shard.numel = unit.numel;
      shard.master = unit.master.data();
      shard.exp_avg = unit.m.data();
      shard.exp_avg_sq = unit.v.data();
      shard.grad = unit.grad.data();
      shard.grad_type = ElementType::bf16;
      shard.copy = unit.copy.data();
      shard.copy_type = ElementType::bf16;
      shard.segments = unit.segments;
      ASSERT_TRUE(optimizer.update_shard(plan, shard).is_ok());
    }
  }

  void expect_state_matches(const std::vector<std::vector<uint16_t>>& copies) {
    for (size_t u = 0; u < units_.size(); ++u) {
      const UnitState& unit = units_[u];
      for (auto [kind, values] :
           {std::pair{ShardKind::master, &unit.master}, std::pair{ShardKind::m, &unit.m},
            std::pair{ShardKind::v, &unit.v}}) {
        std::vector<std::byte> back(unit.numel * 4);
        ASSERT_TRUE(store_->read_shard({int(u), kind}, back).is_ok());
        EXPECT_EQ(std::memcmp(back.data(), values->data(), back.size()), 0)
            << tiers::shard_name({int(u), kind}) << " differs from the in-memory step";
      }
      EXPECT_EQ(copies[u], unit.copy) << "unit " << u << " compute copy";
    }
  }

  TemporaryDirectory directory_;
  tiers::testing::Notices notices_;
  std::shared_ptr<io::FaultInjector> injector_;
  std::unique_ptr<tiers::TieredStore> store_;
  std::vector<UnitState> units_;
};

OptimizerOptions options_with_clipping() {
  OptimizerOptions options;
  options.adamw.lr = 1e-3;
  options.adamw.weight_decay = 0.1;
  options.gradient_clipping = 0.5;
  return options;
}

StepDecision begin(Optimizer& optimizer, const std::vector<UnitState>& units) {
  kernels::cpu::GradNormPartial total;
  for (const UnitState& unit : units)
    total.add(*kernels::cpu::grad_norm_squared(unit.grad.data(), ElementType::bf16, unit.numel));
  Result<StepDecision> plan = optimizer.begin_step(total);
  EXPECT_TRUE(plan.is_ok()) << plan.status().message();
  return *plan;
}

TEST_F(StreamedOptimizerTest, MatchesTheInMemoryStepBitwise) {
  const uint64_t seed = tiers::testing::fresh_seed("MatchesTheInMemoryStepBitwise");
  std::mt19937_64 random(seed);
  make_units(random);
  const uint64_t host_before = store_->usage(Tier::host).used;
  // Small chunks: many per unit, groups crossing their boundaries.
  StreamedOptimizerOptions options{.chunk_elements = 4096 * (1 + int64_t(random() % 3)),
                                   .buffer_count = 3 + unsigned(random() % 3)};
  auto streamed = StreamedOptimizer::create(*store_, options);
  ASSERT_TRUE(streamed.is_ok()) << streamed.status().message();
  EXPECT_EQ(store_->usage(Tier::host).used - host_before,
            StreamedOptimizer::host_buffer_bytes(options));

  Result<Optimizer> created = Optimizer::create(options_with_clipping());
  ASSERT_TRUE(created.is_ok()) << created.status().message();
  Optimizer optimizer = *created;
  for (int step = 0; step < 3; ++step) {
    const StepDecision plan = begin(optimizer, units_);
    ASSERT_TRUE(plan.apply);
    std::vector<std::vector<uint16_t>> copies;
    std::vector<StreamedOptimizerUnit> units = streamed_units(copies);
    Status status = (*streamed)->step(optimizer, plan, units);
    ASSERT_TRUE(status.is_ok()) << status.message();
    reference_step(optimizer, plan);
    expect_state_matches(copies);
  }
  EXPECT_GT((*streamed)->last_step().bytes_read, 0u);
  EXPECT_EQ((*streamed)->last_step().bytes_read, (*streamed)->last_step().bytes_written);
}

TEST_F(StreamedOptimizerTest, AnIoFaultIsAnErrorNamingTheUnit) {
  std::mt19937_64 random(9);
  make_units(random);
  auto streamed = StreamedOptimizer::create(*store_, {.chunk_elements = 4096, .buffer_count = 3});
  ASSERT_TRUE(streamed.is_ok()) << streamed.status().message();
  Result<Optimizer> created = Optimizer::create(options_with_clipping());
  ASSERT_TRUE(created.is_ok());
  const StepDecision plan = begin(*created, units_);
  injector_->add({.op = io::RingOp::kWrite,
                  .nth_call = injector_->calls(io::RingOp::kWrite) + 4,
                  .kind = io::FaultKind::kError,
                  .error_number = EIO});
  std::vector<std::vector<uint16_t>> copies;
  std::vector<StreamedOptimizerUnit> units = streamed_units(copies);
  Status status = (*streamed)->step(*created, plan, units);
  ASSERT_FALSE(status.is_ok());
  EXPECT_NE(status.message().find("streamed optimizer step: streamed pass: item"),
            std::string::npos)
      << status.message();
  EXPECT_NE(status.message().find("(write-back)"), std::string::npos) << status.message();
}

// Ranged updates (deferred expert updates, core/plan/expert_update.h): two
// steps that update only some ranges, whose other elements have a zero
// gradient, then those elements replayed with both steps' decisions and a
// zero gradient, leave master, m, v and the compute copy (a piece of each
// window) bitwise as two whole steps do.
TEST_F(StreamedOptimizerTest, RangedUpdatesAndReplaysGiveTheWholeStepsBits) {
  const uint64_t seed = tiers::testing::fresh_seed("RangedUpdatesAndReplays");
  std::mt19937_64 random(seed);
  std::normal_distribution<float> normal;
  UnitState unit;
  unit.numel = 5 * 4096 + 1 + int64_t(random() % 4000);
  for (int64_t i = 0; i < unit.numel; ++i) {
    unit.master.push_back(normal(random));
    unit.m.push_back(0.01f * normal(random));
    unit.v.push_back(1e-4f * std::fabs(normal(random)));
  }
  unit.copy.assign(size_t(unit.numel), 0);
  unit.segments = {{0, 7000, ParamGroup::no_decay}, {7000, unit.numel, ParamGroup::decay}};
  ASSERT_TRUE(StreamedOptimizer::add_unit_state(*store_, 0, unit.numel, Tier::nvme).is_ok());
  ASSERT_TRUE(
      store_->add_shard({0, ShardKind::param}, uint64_t(unit.numel) * 2, Tier::nvme).is_ok());
  ASSERT_TRUE(store_->write_shard({0, ShardKind::master}, as_bytes(unit.master)).is_ok());
  ASSERT_TRUE(store_->write_shard({0, ShardKind::m}, as_bytes(unit.m)).is_ok());
  ASSERT_TRUE(store_->write_shard({0, ShardKind::v}, as_bytes(unit.v)).is_ok());
  std::vector<std::byte> zeros(size_t(unit.numel) * 2);
  ASSERT_TRUE(store_->write_shard({0, ShardKind::param}, zeros).is_ok());
  // Updated every step, and idle (a zero gradient) in both steps.
  const std::vector<ElementRange> active = {{0, 3000}, {9000, 15000}, {20000, unit.numel}};
  const std::vector<ElementRange> idle = {{3000, 9000}, {15000, 20000}};
  // Whole 4096-element blocks, cut at the 8192-element chunks.
  auto windows_of = [&](const std::vector<ElementRange>& ranges) {
    std::vector<ElementRange> widened, windows;
    for (const ElementRange& r : ranges) {
      const ElementRange w{r.begin / 4096 * 4096,
                           std::min(unit.numel, (r.end + 4095) / 4096 * 4096)};
      if (!widened.empty() && widened.back().end >= w.begin)
        widened.back().end = std::max(widened.back().end, w.end);
      else
        widened.push_back(w);
    }
    for (const ElementRange& w : widened)
      for (int64_t at = w.begin; at < w.end; at = std::min(w.end, (at / 8192 + 1) * 8192))
        windows.push_back({at, std::min(w.end, (at / 8192 + 1) * 8192)});
    return windows;
  };
  auto streamed = StreamedOptimizer::create(
      *store_, {.chunk_elements = 8192, .buffer_count = 3, .copy_bytes = 2});
  ASSERT_TRUE(streamed.is_ok()) << streamed.status().message();
  Result<Optimizer> created = Optimizer::create(options_with_clipping());
  ASSERT_TRUE(created.is_ok()) << created.status().message();
  Optimizer& optimizer = *created;
  StreamedOptimizerUnit ranged;
  ranged.unit = 0;
  ranged.shard.numel = unit.numel;
  ranged.shard.segments = unit.segments;
  ranged.shard.grad_type = ElementType::bf16;
  ranged.shard.copy_type = ElementType::bf16;
  std::vector<StepDecision> decisions;
  for (int step = 0; step < 2; ++step) {
    unit.grad.assign(size_t(unit.numel), 0);
    for (const ElementRange& r : active)
      for (int64_t i = r.begin; i < r.end; ++i)
        unit.grad[size_t(i)] = to_bf16(0.1f * normal(random));
    units_ = {unit};
    decisions.push_back(begin(optimizer, units_));
    std::vector<RangeUpdate> updates;
    for (const ElementRange& r : active) updates.push_back({r, {decisions.back()}});
    ranged.shard.grad = unit.grad.data();
    Status status = (*streamed)->step_ranges(optimizer, ranged, windows_of(active), updates, false);
    ASSERT_TRUE(status.is_ok()) << status.message();
    reference_step(optimizer, decisions.back());
    unit = units_[0];
  }
  std::vector<RangeUpdate> replays;
  for (const ElementRange& r : idle) replays.push_back({r, decisions});
  ranged.shard.grad = nullptr;
  Status status = (*streamed)->step_ranges(optimizer, ranged, windows_of(idle), replays, true);
  ASSERT_TRUE(status.is_ok()) << status.message();
  std::vector<std::byte> copy(size_t(unit.numel) * 2);
  ASSERT_TRUE(store_->read_shard({0, ShardKind::param}, copy).is_ok());
  std::vector<uint16_t> copy_values(size_t(unit.numel));
  std::memcpy(copy_values.data(), copy.data(), copy.size());
  expect_state_matches({copy_values});
  // A fault mid-replay is an error naming the ranged update and the item.
  injector_->add({.op = io::RingOp::kRead,
                  .nth_call = injector_->calls(io::RingOp::kRead) + 2,
                  .kind = io::FaultKind::kError,
                  .error_number = EIO});
  status = (*streamed)->step_ranges(optimizer, ranged, windows_of(idle), replays, true);
  ASSERT_FALSE(status.is_ok());
  EXPECT_NE(status.message().find("streamed optimizer ranged update: streamed pass: item"),
            std::string::npos)
      << status.message();
  EXPECT_EQ(status.message().find('\n'), std::string::npos);
}

TEST_F(StreamedOptimizerTest, ChunksMustBeIoAligned) {
  auto streamed = StreamedOptimizer::create(*store_, {.chunk_elements = 1000, .buffer_count = 3});
  ASSERT_FALSE(streamed.is_ok());
  EXPECT_NE(streamed.status().message().find("multiple of 1024"), std::string::npos);
}

}  // namespace
}  // namespace strata
