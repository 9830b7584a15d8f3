#include "core/engine/engine_impl.h"

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

Status Engine::Impl::open_rank(Rank& rank) {
  const TrainingPlanInput& in = plan.input;
  const int r = rank.rank;
  const int W = world();
  tiers::TieredStoreOptions store;
  // The pools hold what the plan needs (plus a page per buffer of slack),
  // never more than the budgets: a budget is a limit, and the host pool is
  // resident (first-touched, pinned) from the start.
  const uint64_t slack = (plan.buffers.size() + 16) * 4096;
  store.device_capacity =
      std::min<uint64_t>(options.device_budget, uint64_t(plan.peak(tiers::Tier::device)) + slack);
  store.host_capacity = std::min<uint64_t>(options.host_budget / uint64_t(local_count()),
                                           uint64_t(plan.peak(tiers::Tier::host)) + slack);
  // The CPU backend: host memory stands in for the device.
  const bool gpu = in.gpu;
  store.use_gpu = gpu && !options.emulate_gpu;
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
  Result<std::unique_ptr<tiers::TieredStore>> opened = tiers::TieredStore::open(store);
  if (!opened) return opened.status().with_context(fmt::format("rank {}", r));
  rank.store = std::move(*opened);
  tiers::TieredStore& s = *rank.store;

  const int cb = plan.compute_bytes;
  for (int u = 0; u < units(); ++u) {
    const UnitPlacement& p = plan.units[size_t(u)];
    Status added =
        s.add_shard({u, ShardKind::param}, uint64_t(p.param_numel * cb), plan.homes.param);
    if (added)
      added = s.add_shard({u, ShardKind::grad}, uint64_t(p.grad_numel * 4), plan.homes.grad);
    if (added && plan.homes.separate_master)
      added = s.add_shard({u, ShardKind::master}, uint64_t(p.optimizer_numel * 4),
                          plan.homes.optimizer);
    if (added)
      added = s.add_shard({u, ShardKind::m}, uint64_t(p.optimizer_numel * 4), plan.homes.optimizer);
    if (added)
      added = s.add_shard({u, ShardKind::v}, uint64_t(p.optimizer_numel * 4), plan.homes.optimizer);
    if (!added) return added.with_context(fmt::format("rank {}", r));
  }

  // Buffers, named as the plan lists them.
  auto device = [&](int64_t bytes, const std::string& what) -> Result<std::byte*> {
    Result<tiers::DeviceBlock> block = s.device_tier()->allocate(uint64_t(bytes), what);
    if (!block) return block.status().with_context(fmt::format("rank {}", r));
    rank.device_blocks.push_back(*block);
    return block->data;
  };
  auto host = [&](int64_t bytes, const std::string& what) -> Result<std::byte*> {
    Result<tiers::HostBlock> block = s.host_tier().allocate(uint64_t(bytes), what);
    if (!block) return block.status().with_context(fmt::format("rank {}", r));
    rank.host_blocks.push_back(*block);
    return block->data;
  };
  int64_t largest_padded = 0, largest_shard = 0, largest_optimizer = 0;
  for (const UnitPlacement& p : plan.units) {
    largest_padded = std::max(largest_padded, p.padded_numel);
    largest_shard = std::max(largest_shard, p.shard_numel);
    largest_optimizer = std::max(largest_optimizer, p.optimizer_numel);
  }
  // Takes a block for `out`, or returns the allocation's error.
  auto take = [](Result<std::byte*> block, auto*& out) -> Status {
    if (!block) return block.status();
    out = reinterpret_cast<std::remove_reference_t<decltype(out)>>(*block);
    return Status::ok();
  };
  // On the CUDA backend the buffers of the collectives and the optimizer are
  // pinned host memory; GpuRank holds the device's working set.
  auto staging = [&](int64_t bytes, const std::string& what) {
    return gpu ? host(bytes, what) : device(bytes, what);
  };
  for (int k = 0; k < plan.gather_slots && !plan.gpu_params_in_place(); ++k) {
    std::byte* g = nullptr;
    if (Status t = take(staging(largest_padded * cb, "gathered unit"), g); !t) return t;
    rank.gathered.push_back(g);
    if (cb != 4 && !gpu) {
      float* f = nullptr;
      if (Status t = take(device(largest_padded * 4, "gathered unit (fp32)"), f); !t) return t;
      rank.gathered_fp32.push_back(f);
    }
  }
  if (in.stage < 3 && cb != 4 && !gpu) {
    for (int k = 0; k < 2; ++k) {
      float* f = nullptr;
      if (Status t = take(device(largest_padded * 4, "parameters widened to fp32"), f); !t)
        return t;
      rank.widened.push_back(f);
    }
  }
  // Gradients may accumulate straight into their homes on the GPU.
  const bool in_homes = plan.gpu_grads_in_place();
  for (int k = 0; k < plan.grad_slots && !in_homes; ++k) {
    float* g = nullptr;
    if (Status t = take(staging(largest_padded * 4, "unit gradient"), g); !t) return t;
    rank.grad_slots.push_back(g);
  }
  if (plan.tied_grad_buffer && !in_homes) {
    if (Status t = take(staging(plan.units[0].padded_numel * 4, "tied embedding gradient"),
                        rank.tied_grad);
        !t)
      return t;
  }
  if (in.stage >= 2 && in.reduce_scatter && W > 1 && !in_homes) {
    if (Status t = take(staging(largest_shard * 4, "reduce-scatter output"), rank.reduce_out); !t)
      return t;
  }
  if (gpu && (in.stage == 1 || in.stage == 2) && W > 1) {
    if (Status t =
            take(host(largest_padded * cb, "parameter all-gather staging"), rank.sync_staging);
        !t)
      return t;
  }
  const int64_t N = plan.tokens_per_micro, C = in.model.hidden_size;
  int32_t* ids = nullptr;
  if (Status t = take(staging(2 * N * 4 * in.grad_accum, "tokens and targets"), ids); !t) return t;
  rank.tokens = ids;
  rank.targets = ids + N * in.grad_accum;
  if (plan.input.nccl_staging) {
    // NCCL stages the collectives' host buffers through the pool, not memory of its own.
    std::byte* send = nullptr;
    std::byte* recv = nullptr;
    if (Status t = take(device(largest_padded * 4, "NCCL staging (send)"), send); !t) return t;
    if (Status t = take(device(largest_padded * 4, "NCCL staging (receive)"), recv); !t) return t;
    if (auto* nccl = dynamic_cast<comm::NcclComm*>(rank.comm.get()))
      nccl->use_staging(send, recv, size_t(largest_padded) * 4);
  }
  if (gpu) {
    Result<std::unique_ptr<GpuRank>> created =
        options.emulate_gpu
            ? GpuRank::create_emulated(plan)
            : GpuRank::create(plan, options.gpu_index, *s.device_tier(), rank.device_blocks);
    if (!created) return created.status().with_context(fmt::format("rank {}", r));
    rank.gpu = std::move(*created);
  } else {
    float* checkpoints = nullptr;
    if (Status t = take(device((units() - 1) * N * C * 4, "activation checkpoints"), checkpoints);
        !t)
      return t;
    for (int u = 0; u + 1 < units(); ++u)
      rank.checkpoints.push_back(checkpoints + int64_t(u) * N * C);
    if (Status t = take(device(N * C * 4, "activation gradient"), rank.activation_grad); !t)
      return t;
    // The workspace allocates its own memory; its bytes are charged to the device budget here.
    std::byte* reserved = nullptr;
    if (Status t = take(device(UnitWorkspace::bytes_for(in.model, in.micro_batch, in.seq_len),
                               "unit working set"),
                        reserved);
        !t)
      return t;
    rank.ws = std::make_unique<UnitWorkspace>(in.model, in.micro_batch, in.seq_len);
  }
  // NVMe parameter copies (plan.fetch_slots) are the store's prefetched copies, charged when
  // fetched.
  if (plan.new_params_staged()) {
    if (Status t = take(host(largest_optimizer * cb, "new parameters"), rank.param_out); !t)
      return t;
  }
  if (plan.streamed_optimizer) {
    StreamedOptimizerOptions streamed;
    streamed.buffer_count = unsigned(in.optimizer_buffers);
    streamed.chunk_elements = plan.optimizer_chunk_elements;
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
  for (int u = 0; u < units(); ++u) {
    const int64_t begin = plan.optimizer_offset(u, r);
    const int64_t end = begin + plan.units[size_t(u)].optimizer_numel;
    std::vector<ShardSegment>& out = rank.segments[size_t(u)];
    int64_t at = begin;
    for (const TensorSlot& slot : plan.layout.units[size_t(u)].tensors) {
      const int64_t b = std::max(begin, slot.offset), e = std::min(end, slot.offset + slot.numel);
      if (b >= e) continue;
      if (b > at) out.push_back({at - begin, b - begin, ParamGroup::no_decay});
      out.push_back({b - begin, e - begin, param_group_for_shape(slot.shape)});
      at = e;
    }
    if (at < end) out.push_back({at - begin, end - begin, ParamGroup::no_decay});
  }
  rank.micro_loss.assign(size_t(in.grad_accum), 0.0);
  rank.partials.assign(size_t(units()), {});
  rank.params_ready = std::make_unique<std::atomic<int64_t>[]>(size_t(units()));
  for (int u = 0; u < units(); ++u) rank.params_ready[size_t(u)] = -1;
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

Status Engine::Impl::load_moments(Rank& rank, int u, const float* m, const float* v) {
  const UnitPlacement& p = plan.units[size_t(u)];
  const int64_t begin = plan.optimizer_offset(u, rank.rank);
  const size_t bytes = size_t(p.optimizer_numel) * 4;
  if (Status s = rank.store->write_shard({u, ShardKind::m},
                                         {reinterpret_cast<const std::byte*>(m + begin), bytes});
      !s)
    return s;
  return rank.store->write_shard({u, ShardKind::v},
                                 {reinterpret_cast<const std::byte*>(v + begin), bytes});
}

}  // namespace strata
