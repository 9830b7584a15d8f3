#include "core/engine/engine_impl.h"

#include <optional>

namespace strata {

// --- set-up ----------------------------------------------------------------------

Status Engine::Impl::initialize() {
  std::optional<SafetensorsCheckpoint> checkpoint;
  if (!options.init_checkpoint.empty()) {
    Result<SafetensorsCheckpoint> opened = SafetensorsCheckpoint::open(options.init_checkpoint);
    if (!opened) return opened.status().with_context("--init");
    checkpoint.emplace(std::move(*opened));
  }
  std::vector<float> full;
  for (int u = 0; u < units(); ++u) {
    full.assign(size_t(plan.units[size_t(u)].padded_numel), 0.0f);
    if (checkpoint) {
      if (Status s = load_unit_parameters(*checkpoint, plan.layout, u, full.data()); !s)
        return s.with_context("--init " + options.init_checkpoint);
    } else {
      init_unit_parameters(plan.layout, u, options.seed, full.data());
    }
    for (auto& rank : ranks)
      if (Status s = init_unit(*rank, u, full.data()); !s) return s;
  }
  return Status::ok();
}

namespace {

// Rank r's store: pools of what the plan needs within the budgets, the NVMe
// options of the config, and a swap file of its own.
tiers::TieredStoreOptions rank_store_options(const TrainingPlan& plan, const EngineOptions& options,
                                             int r, uint64_t engine_serial) {
  const PlanInput& in = plan.input;
  tiers::TieredStoreOptions store;
  // The pools hold what the plan needs (plus a page per buffer of slack),
  // never more than the budgets: a budget is a limit, and the host pool is
  // resident (first-touched, pinned) from the start.
  const uint64_t slack = (plan.buffers.size() + 16) * 4096;
  const uint64_t device_need = uint64_t(plan.peak(tiers::Tier::device)) + slack;
  const uint64_t host_need = uint64_t(plan.peak(tiers::Tier::host)) + slack;
  const std::optional<int64_t> host_budget = options.budgets.host_per_rank(in.world_size);
  store.device_capacity = options.budgets.device_per_rank
                              ? std::min<uint64_t>(uint64_t(*options.budgets.device_per_rank),
                                                   device_need)
                              : device_need;
  store.host_capacity =
      host_budget ? std::min<uint64_t>(uint64_t(*host_budget), host_need) : host_need;
  // The NVMe parameter copies the plan counts as slots of the largest shard
  // take exactly that each, so copies of units of other sizes do not
  // fragment the pool; the NVMe shard staging it counts is reserved once.
  for (const PlanBuffer& buffer : plan.buffers) {
    if (buffer.role == BufferRole::nvme_parameter_copies)
      store.param_copy_bytes = uint64_t(buffer.copy_bytes());
    if (buffer.role == BufferRole::nvme_shard_staging) {
      store.staging_bytes = uint64_t(buffer.copy_bytes());
      store.staging_blocks = int(buffer.copies);
    }
  }
  // The CPU backend: host memory stands in for the device.
  store.use_gpu = in.gpu && !options.emulate_gpu;
  store.gpu_index = options.gpu_index;
  store.pin_host = options.pin_host;
  store.notice = options.notice;
  if (plan.peak(tiers::Tier::nvme) > 0) {
    store.io.paths = options.nvme_paths;
    store.io.block_size = uint64_t(options.config.aio.block_size);
    store.io.queue_depth = unsigned(std::max(1, options.config.aio.queue_depth));
    store.io.threads_per_path = unsigned(std::max(1, options.config.aio.intra_op_parallelism));
    store.io.fault_injector = options.fault_injector;
    store.io.notice = options.notice;
    // Extents are rounded to the alignment; a stripe of slack covers the last block.
    const uint64_t stripe = store.io.block_size * std::max<size_t>(1, options.nvme_paths.size());
    store.nvme_capacity =
        (uint64_t(plan.peak(tiers::Tier::nvme)) + stripe - 1) / stripe * stripe + stripe;
    // One file per engine and rank: engines of one process (or of several) may share a directory.
    store.nvme_file_name = fmt::format("strata-{}-{}-rank{}.swap", ::getpid(), engine_serial, r);
  }
  return store;
}

}  // namespace

Status Engine::Impl::open_rank(Rank& rank) {
  const PlanInput& in = plan.input;
  const int r = rank.rank;
  const tiers::TieredStoreOptions store = rank_store_options(plan, options, r, engine_serial);
  Result<std::unique_ptr<tiers::TieredStore>> opened = tiers::TieredStore::open(store);
  if (!opened) return opened.status().with_context(fmt::format("rank {}", r));
  rank.store = std::move(*opened);
  tiers::TieredStore& s = *rank.store;

  // Model state: one shard per unit for each state line of the plan.
  for (const PlanBuffer& b : plan.buffers) {
    const std::optional<ShardKind> kind = state_shard_kind(b.role);
    if (!kind) continue;
    for (int u = 0; u < units(); ++u) {
      const uint64_t bytes = uint64_t(plan.state_numel(u, b.role) * buffer_element_bytes(b.element));
      if (Status added = s.add_shard({u, *kind}, bytes, b.tier); !added)
        return added.with_context(fmt::format("rank {}", r));
    }
  }

  // The rank's buffers: the plan's list, walked (core/engine/rank_buffers.h).
  Result<RankBuffers> buffers = RankBuffers::allocate(
      plan, BufferOwner::rank,
      [&](tiers::Tier tier, uint64_t bytes, const std::string& what) -> Result<std::byte*> {
        if (tier == tiers::Tier::host) {
          Result<tiers::HostBlock> block = s.host_tier().allocate(bytes, what);
          if (!block) return block.status();
          rank.host_blocks.push_back(*block);
          return block->data;
        }
        Result<tiers::DeviceBlock> block = s.device_tier()->allocate(bytes, what);
        if (!block) return block.status();
        rank.device_blocks.push_back(*block);
        return block->data;
      });
  if (!buffers) return buffers.status().with_context(fmt::format("rank {}", r));
  rank.buffers = std::move(*buffers);
  const RankBuffers& b = rank.buffers;
  using R = BufferRole;
  rank.gathered = b.all_as<std::byte>(R::gathered_unit);
  rank.grad_slots = b.all_as<float>(R::unit_gradient);
  rank.tied_grads = b.all_as<float>(R::tied_gradient);
  rank.reduce_out = b.as<float>(R::reduce_scatter_output);
  rank.sync_staging = b.at(R::sync_staging);
  rank.param_out = b.at(R::new_parameters);
  rank.grad_staging = b.as<float>(R::gradient_staging);
  rank.grad_sum = b.as<float>(R::gradient_sum);
  rank.spilled_inputs = b.all_as<std::byte>(R::activation_spill);
  rank.spill_staging = b.at(R::activation_staging);
  if (const PlanBuffer* spill = plan.buffer(R::activation_spill);
      spill != nullptr && spill->tier == tiers::Tier::nvme) {
    // Each copy starts on the plan's alignment; the tier's must divide it.
    const uint64_t alignment = s.nvme_tier()->alignment();
    if (uint64_t(spill->copy_bytes()) % alignment != 0)
      return Status::error(fmt::format(
          "rank {}: saved inputs of {} bytes do not start on the NVMe alignment of {} "
          "bytes the swap directory asks for; use --activation-home host or device",
          r, spill->copy_bytes(), alignment));
    Result<tiers::NvmeExtent> extent = s.nvme_tier()->allocate(uint64_t(spill->bytes), spill->name);
    if (!extent) return extent.status().with_context(fmt::format("rank {}", r));
    rank.spill_extent = *extent;
  }
  rank.tokens = b.as<int32_t>(R::tokens_and_targets);
  rank.targets = rank.tokens + plan.tokens_per_micro * in.grad_accum;
  if (b.at(R::nccl_staging) != nullptr) {
    // NCCL stages the collectives' host buffers through the pool, not memory of its own.
    if (auto* nccl = dynamic_cast<comm::NcclComm*>(rank.comm.get()))
      nccl->use_staging(b.at(R::nccl_staging, 0), b.at(R::nccl_staging, 1),
                        size_t(plan.buffer(R::nccl_staging)->elements) * 4);
  }
  // What the rank computes with: a GPU (its working set is the plan's
  // buffers of owner gpu), or the CPU over the rank's buffers above.
  if (in.gpu) {
    Result<std::unique_ptr<GpuRank>> created =
        options.emulate_gpu
            ? GpuRank::create_emulated(plan)
            : GpuRank::create(plan, options.gpu_index, *s.device_tier(), rank.device_blocks);
    if (!created) return created.status().with_context(fmt::format("rank {}", r));
    rank.compute = RankCompute::gpu(plan, std::move(*created));
  } else {
    rank.compute = RankCompute::cpu(plan, rank.buffers);
  }
  // NVMe parameter copies, the streamed optimizer's buffers and the shard
  // staging (owner: store) are taken by the store and the streamed optimizer.
  if (plan.streamed_optimizer) {
    StreamedOptimizerOptions streamed;
    streamed.buffer_count = unsigned(in.optimizer_buffers);
    streamed.chunk_elements = plan.optimizer_chunk_elements;
    streamed.state_type = plan.state_type();
    streamed.grads_in_store = plan.homes.grad == tiers::Tier::nvme;
    // Deferred expert updates carry the separate compute copy in their windows.
    if (plan.deferred_expert_updates && plan.homes.separate_master)
      streamed.copy_bytes = plan.compute_bytes;
    Result<std::unique_ptr<StreamedOptimizer>> created = StreamedOptimizer::create(s, streamed);
    if (!created) return created.status().with_context(fmt::format("rank {}", r));
    rank.streamed = std::move(*created);
  }

  Result<Optimizer> optimizer =
      Optimizer::create(optimizer_options_from_config(options.config, options.total_steps));
  if (!optimizer) return optimizer.status();
  rank.optimizer.emplace(std::move(*optimizer));

  // Parameter groups over this rank's optimizer range of each unit; padding has no decay.
  rank.segments.resize(size_t(units()));
  for (int u = 0; u < units(); ++u) rank.segments[size_t(u)] = plan.segments(u, r);
  if (Status s = zero_moments(rank); !s) return s.with_context(fmt::format("rank {}", r));
  rank.micro_loss.assign(size_t(in.grad_accum), 0.0);
  rank.micro_aux.assign(size_t(in.grad_accum), 0.0);
  rank.router_stats.assign(size_t(in.grad_accum), {});
  rank.routing.assign(plan.units.size(), {});
  for (int u = 0; u < int(plan.units.size()); ++u)
    if (routes_expert_reads(plan, u))
      rank.routing[size_t(u)].assign(size_t(in.grad_accum),
                                     std::vector<uint8_t>(size_t(in.model.num_experts), 0));
  rank.experts_loaded.assign(size_t(plan.gather_slots), {});
  rank.shared_pieces.assign(size_t(plan.gather_slots), {});
  rank.deferred = ExpertUpdateLedger(plan);
  rank.partials.assign(size_t(units()), {});
  rank.params_ready = std::make_unique<std::atomic<int64_t>[]>(size_t(units()));
  for (int u = 0; u < units(); ++u) rank.params_ready[size_t(u)] = -1;
  return Status::ok();
}

// Compact moments start as the kernel's zero state (codes and scales 0),
// zeroed block by block with its range-to-thread mapping; a new swap file
// reads as zeros, so NVMe-homed codes need only their scales zeroed here.
// On the GPU the store zeroed the codes (device shards start zeroed) and the
// scales, in device memory, are zeroed by an upload.
Status Engine::Impl::zero_moments(Rank& rank) {
  if (plan.input.optimizer_state == OptimizerStateDtype::fp32) return Status::ok();
  const bool int8 = plan.input.optimizer_state == OptimizerStateDtype::int8;
  if (int8) {
    float* m_scales = rank.buffers.as<float>(BufferRole::int8_scales, 0);
    float* v_scales = rank.buffers.as<float>(BufferRole::int8_scales, 1);
    if (m_scales == nullptr || v_scales == nullptr)
      return Status::error("no int8 scales in the plan (plan error)");
    int64_t at = 0;
    for (int u = 0; u < units(); ++u) {
      rank.m_scales.push_back(m_scales + at);
      rank.v_scales.push_back(v_scales + at);
      at += plan.units[size_t(u)].int8_blocks;
    }
  }
  if (optimizer_on_gpu()) {
    if (!int8) return Status::ok();
    const PlanBuffer* scales = plan.buffer(BufferRole::int8_scales);
    const std::vector<std::byte> zeros(size_t(scales->copy_bytes()));
    for (int f = 0; f < 2; ++f) {
      if (Status s = rank.compute->upload(rank.buffers.at(BufferRole::int8_scales, f), zeros.data(),
                                          int64_t(zeros.size()));
          !s)
        return s.with_context("zeroing the int8 scales");
    }
    return Status::ok();
  }
  for (int u = 0; u < units(); ++u) {
    const UnitPlacement& p = plan.units[size_t(u)];
    kernels::cpu::AdamWShard shard;
    shard.numel = p.optimizer_numel;
    shard.state_type = plan.state_type();
    shard.segments = rank.segments[size_t(u)];
    if (int8) {
      shard.exp_avg_scale = rank.m_scales[size_t(u)];
      shard.exp_avg_sq_scale = rank.v_scales[size_t(u)];
    }
    if (plan.homes.optimizer == tiers::Tier::nvme) {
      if (int8) {
        const int64_t blocks = int8_block_count(shard.segments, p.optimizer_numel);
        std::fill_n(shard.exp_avg_scale, blocks, 0.0f);
        std::fill_n(shard.exp_avg_sq_scale, blocks, 0.0f);
      }
      continue;
    }
    shard.exp_avg = home_data(rank, {u, ShardKind::m});
    shard.exp_avg_sq = home_data(rank, {u, ShardKind::v});
    if (Status s = kernels::cpu::first_touch_zero(shard); !s) return s;
  }
  return Status::ok();
}

Status Engine::Impl::init_unit(Rank& rank, int u, const float* full) {
  const UnitPlacement& p = plan.units[size_t(u)];
  const int r = rank.rank;
  const int cb = plan.compute_bytes;
  const int64_t param_begin = plan.input.stage == 3 ? int64_t(r) * p.shard_numel : 0;
  std::vector<std::byte> bytes(size_t(p.param_numel * cb));
  narrow(full + param_begin, compute_type(), bytes.data(), p.param_numel);
  if (Status s = rank.store->write_shard({u, ShardKind::param}, bytes); !s) return s;
  if (plan.homes.separate_master) {
    const int64_t begin = plan.optimizer_offset(u, r);
    std::span<const std::byte> master(reinterpret_cast<const std::byte*>(full + begin),
                                      size_t(p.optimizer_numel) * 4);
    if (Status s = rank.store->write_shard({u, ShardKind::master}, master); !s) return s;
  }
  return Status::ok();
}

Status Engine::Impl::load_moments(Rank& rank, int u, const std::byte* m, const std::byte* v) {
  const UnitPlacement& p = plan.units[size_t(u)];
  const int64_t mb = plan.moment_bytes();
  const int64_t begin = plan.optimizer_offset(u, rank.rank) * mb;
  const size_t bytes = size_t(p.optimizer_numel * mb);
  if (Status s = rank.store->write_shard({u, ShardKind::m}, {m + begin, bytes}); !s) return s;
  return rank.store->write_shard({u, ShardKind::v}, {v + begin, bytes});
}

}  // namespace strata
