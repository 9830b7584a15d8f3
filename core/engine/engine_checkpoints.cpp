#include <algorithm>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "core/data/sequence_order.h"
#include "core/engine/engine_impl.h"

namespace strata {

// --- checkpoints -----------------------------------------------------------------------

namespace {

// The shape keys a checkpoint must share with the model it resumes.
nlohmann::json model_shape(const nlohmann::json& config) {
  nlohmann::json shape;
  for (const char* key :
       {"model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
        "num_attention_heads", "num_key_value_heads", "head_dim", "tie_word_embeddings"})
    shape[key] = config.contains(key) ? config[key] : nlohmann::json();
  return shape;
}

// The order a checkpoint's sequence offset counts in (written by
// finish_checkpoint); checkpoints from before shuffling existed read in order.
SequenceOrder stored_data_order(const nlohmann::json& state) {
  const nlohmann::json order = state.value("data_order", nlohmann::json::object());
  if (!order.value("shuffle", false)) return SequenceOrder();
  return SequenceOrder::shuffled(order.value("shuffle_seed", uint64_t{0}));
}

// A resume continues the checkpoint's data order exactly, or not at all: the
// offset alone does not say which sequences the steps before it read.
Status check_data_order(const SequenceOrder& stored, const SequenceOrder& here) {
  if (stored == here) return Status::ok();
  const std::string fix =
      !stored.is_shuffled()
          ? std::string("leave out --shuffle (strata.shuffle false)")
          : fmt::format("pass --shuffle --shuffle-seed {} (strata.shuffle, strata.shuffle_seed)",
                        stored.seed());
  return Status::error(fmt::format(
      "the checkpoint read its data {} but this run reads them {}; {} to continue its order",
      stored.describe(), here.describe(), fix));
}

// The checkpoint's layout: this model with the cuts its units were stored
// in (strata.vocab_chunks, strata.layer_pieces, strata.expert_groups,
// strata.mlp_parts).
ModelLayout stored_layout(const nlohmann::json& stored, const ModelLayout& layout) {
  ModelConfig config = layout.config;
  config.vocab_chunks = stored_vocab_chunks(stored);
  config.layer_pieces = stored_layer_pieces(stored);
  config.expert_groups = stored_expert_groups(stored);
  config.mlp_parts = stored_mlp_parts(stored);
  return model_layout(config, 1);
}

using StoredUnits = std::vector<std::pair<std::string, int64_t>>;
StoredUnits unit_names(const ModelLayout& layout) {
  StoredUnits units;
  for (const UnitLayout& unit : layout.units) units.push_back({unit.unit.name, unit.numel});
  return units;
}

// The checkpoint's units against its layout and this run's. Its files hold
// the units one after another, and each tensor is read where it lies
// (stored_tensor_offsets), so fp32 and bf16 state resumes with other cuts;
// int8 state is blocked per unit and needs the same ones.
Status check_stored_units(const nlohmann::json& stored, const ModelLayout& theirs,
                          const ModelLayout& ours, OptimizerStateDtype format) {
  StoredUnits listed;
  for (const nlohmann::json& unit : stored.is_array() ? stored : nlohmann::json::array()) {
    if (!unit.is_object()) {
      listed.push_back({"", -1});
      continue;
    }
    listed.push_back({unit.value("name", std::string()), unit.value("numel", int64_t{-1})});
  }
  if (listed != unit_names(theirs))
    return Status::error(fmt::format(
        "state.json: the checkpoint's {} units are not this model's {}; resume it with the model "
        "it was written for",
        listed.size(), ours.units.size()));
  if (format != OptimizerStateDtype::int8 || unit_names(theirs) == unit_names(ours))
    return Status::ok();
  const ModelConfig& t = theirs.config;
  const ModelConfig& o = ours.config;
  // The cuts either side uses, each named as its key and its flag.
  struct Cut {
    const char* key;
    const char* flag;
    int64_t theirs, ours;
  };
  std::vector<Cut> cuts = {{"vocab_chunks", "--vocab-chunks", t.vocab_chunks, o.vocab_chunks},
                           {"layer_pieces", "--layer-pieces", t.layer_pieces, o.layer_pieces}};
  if (t.expert_groups > 1 || o.expert_groups > 1)
    cuts.push_back({"expert_groups", "--expert-groups", t.expert_groups, o.expert_groups});
  if (t.mlp_parts > 1 || o.mlp_parts > 1)
    cuts.push_back({"mlp_parts", "--mlp-parts", t.mlp_parts, o.mlp_parts});
  std::string keys, here, flags;
  for (size_t i = 0; i < cuts.size(); ++i) {
    const char* sep = i == 0 ? "" : i + 1 == cuts.size() ? " and " : ", ";
    keys += fmt::format("{}strata.{} {}", i == 0 ? "" : ", ", cuts[i].key, cuts[i].theirs);
    here += fmt::format("{}{}", sep, cuts[i].ours);
    flags += fmt::format("{}{} {}", i == 0 ? "" : " ", cuts[i].flag, cuts[i].theirs);
  }
  return Status::error(
      fmt::format("the checkpoint's int8 optimizer state is blocked per unit of its cut ({}), and "
                  "this run's is {}; pass {} to resume it",
                  keys, here, flags));
}

// Where each tensor of the checkpoint's layout lies in its state files: its
// runs of adjacent elements (a whole tensor is one, a vocabulary chunk's
// rows one, an MLP part's columns one per row), by their first element in
// the whole tensor.
struct StoredRun {
  int64_t first = 0;  // in the whole tensor
  int64_t numel = 0;
  int64_t at = 0;  // in the state files, in elements
};
using StoredRuns = std::unordered_map<std::string, std::vector<StoredRun>>;
StoredRuns stored_tensor_runs(const ModelLayout& stored) {
  StoredRuns runs;
  int64_t unit_offset = 0;
  for (const UnitLayout& unit : stored.units) {
    for (const TensorSlot& slot : unit.tensors) {
      std::vector<StoredRun>& list = runs[slot.name];
      if (!slot.is_part()) {
        list.push_back({0, slot.numel, unit_offset + slot.offset});
        continue;
      }
      for (int64_t r = 0; r < slot.runs(); ++r)
        list.push_back({slot.run_first(r), slot.run_numel(),
                        unit_offset + slot.offset + r * slot.run_numel()});
    }
    unit_offset += unit.numel;
  }
  for (auto& [name, list] : runs)
    std::sort(list.begin(), list.end(),
              [](const StoredRun& a, const StoredRun& b) { return a.first < b.first; });
  return runs;
}

// Calls read(at, numel, offset) for the stored pieces of elements [first,
// first + numel) of a tensor: `at` in the state files, `offset` from
// `first`. A corruption with no message when the checkpoint lacks some of
// them (the caller names the tensor), or the first failed read's status.
template <typename Read>
Status read_stored_range(const std::vector<StoredRun>& runs, int64_t first, int64_t numel,
                         Read&& read) {
  auto run = std::upper_bound(runs.begin(), runs.end(), first,
                              [](int64_t x, const StoredRun& r) { return x < r.first; });
  if (run == runs.begin()) return Status::corruption("");
  --run;
  for (int64_t done = 0; done < numel;) {
    const int64_t element = first + done;
    if (run == runs.end() || element < run->first || element >= run->first + run->numel)
      return Status::corruption("");
    const int64_t take = std::min(numel - done, run->first + run->numel - element);
    if (Status s = read(run->at + element - run->first, take, done); !s) return s;
    done += take;
    ++run;
  }
  return Status::ok();
}

}  // namespace

Engine::Impl::MomentFiles Engine::Impl::moment_files(int64_t total_numel) const {
  MomentFiles files;
  if (plan.input.optimizer_state != OptimizerStateDtype::int8) {
    files.bytes = total_numel * plan.moment_bytes();
    return files;
  }
  const int ranges = plan.input.stage == 0 ? 1 : world();
  for (int u = 0; u < units(); ++u) {
    const int64_t numel = plan.units[size_t(u)].optimizer_numel;
    files.int8_offset.emplace_back();
    for (int r = 0; r < ranges; ++r) {
      files.int8_offset.back().push_back(files.bytes);
      files.bytes += numel + 4 * int8_block_count(plan.segments(u, r), numel);
    }
  }
  return files;
}

Status Engine::Impl::load_int8_moments(Rank& rank, int u, const CheckpointReader& checkpoint,
                                       const MomentFiles& files) {
  const int64_t numel = plan.units[size_t(u)].optimizer_numel;
  const int64_t offset =
      files.int8_offset[size_t(u)][plan.input.stage == 0 ? 0 : size_t(rank.rank)];
  const int64_t blocks = int8_block_count(rank.segments[size_t(u)], numel);
  std::vector<std::byte> codes(static_cast<size_t>(numel));
  for (int f = 1; f <= 2; ++f) {
    if (Status s = checkpoint.read(f, uint64_t(offset), codes.data(), uint64_t(numel)); !s)
      return s;
    if (Status s = rank.store->write_shard({u, f == 1 ? ShardKind::m : ShardKind::v}, codes); !s)
      return s;
    float* scales = (f == 1 ? rank.m_scales : rank.v_scales)[size_t(u)];
    if (!optimizer_on_gpu()) {
      if (Status s = checkpoint.read(f, uint64_t(offset + numel), scales, uint64_t(blocks) * 4); !s)
        return s;
      continue;
    }
    // Scales in device memory: through host memory once (outside the budgets).
    std::vector<float> on_host(static_cast<size_t>(blocks));
    if (Status s =
            checkpoint.read(f, uint64_t(offset + numel), on_host.data(), uint64_t(blocks) * 4);
        !s)
      return s;
    if (Status s = rank.compute->upload(scales, on_host.data(), blocks * 4); !s) return s;
  }
  return Status::ok();
}

Status Engine::Impl::resume(const CheckpointReader& checkpoint) {
  const nlohmann::json here = model_shape(model_config_to_json(plan.layout.config));
  const nlohmann::json there = model_shape(checkpoint.model);
  for (const auto& [key, value] : here.items()) {
    if (there[key] != value)
      return Status::error(
          fmt::format("the checkpoint belongs to another model shape: {} is {} there and {} "
                      "here; pass the model it was trained with",
                      key, there[key].dump(), value.dump()));
  }
  const nlohmann::json& state = checkpoint.state;
  if (Status s = check_data_order(stored_data_order(state),
                                  SequenceOrder::from_config(options.config.strata, options.seed));
      !s)
    return s;
  // m and v are read in their stored format, never converted: a resume
  // continues the run exactly or not at all.
  const OptimizerStateDtype format = plan.input.optimizer_state;
  const std::string stored_format = state.value("optimizer_state_dtype", std::string("fp32"));
  if (stored_format != optimizer_state_dtype_name(format))
    return Status::error(fmt::format(
        "the checkpoint's optimizer state (m, v) is {} but this run's strata.optimizer_state_dtype "
        "is {}; pass --optimizer-state-dtype {} to resume it (strata export reads any format)",
        stored_format, optimizer_state_dtype_name(format), stored_format));
  if (format == OptimizerStateDtype::int8) {
    const int stored_world = state.value("world_size", 0);
    const int stored_stage = state.value("stage", -1);
    if (stored_world != world() || (stored_stage == 0) != (plan.input.stage == 0))
      return Status::error(fmt::format(
          "the checkpoint's int8 optimizer state is blocked per rank range of {} rank(s) at stage "
          "{}; resume it with --world-size {} and {}",
          stored_world, stored_stage, stored_world,
          stored_stage == 0 ? "--zero-stage 0" : "a ZeRO stage of 1 to 3"));
  }
  const ModelLayout theirs = stored_layout(state["units"], plan.layout);
  if (Status s = check_stored_units(state["units"], theirs, plan.layout, format); !s) return s;
  const StoredRuns stored_runs = stored_tensor_runs(theirs);
  int64_t total = 0;
  for (const UnitLayout& unit : plan.layout.units) total += unit.numel;
  const MomentFiles files = moment_files(total);
  const int64_t mb = plan.moment_bytes();
  std::vector<float> master;
  std::vector<std::byte> m, v;
  for (int u = 0; u < units(); ++u) {
    const UnitLayout& unit = plan.layout.units[size_t(u)];
    const size_t padded = size_t(unit.padded_numel);
    master.assign(padded, 0.0f);
    const bool int8 = format == OptimizerStateDtype::int8;
    if (!int8) {
      m.assign(padded * size_t(mb), std::byte{0});
      v.assign(padded * size_t(mb), std::byte{0});
    }
    // Tensor by tensor, from where the checkpoint's layout keeps it.
    for (const TensorSlot& slot : unit.tensors) {
      const auto found = stored_runs.find(slot.name);
      auto missing = [&] {
        return Status::corruption(fmt::format(
            "state.json: the checkpoint has no {}; resume it with the model it was written for",
            slot.name));
      };
      if (found == stored_runs.end()) return missing();
      // Each run of this slot from the runs the checkpoint's layout stored it in.
      const bool part = slot.is_part();
      const int64_t run = part ? slot.run_numel() : slot.numel;
      for (int64_t r = 0; r < (part ? slot.runs() : 1); ++r) {
        const int64_t into = slot.offset + r * run;
        Status s = read_stored_range(
            found->second, part ? slot.run_first(r) : 0, run,
            [&](int64_t at, int64_t numel, int64_t offset) -> Status {
              const int64_t to = into + offset;
              if (Status s =
                      checkpoint.read(0, uint64_t(at) * 4, master.data() + to, uint64_t(numel) * 4);
                  !s || int8)
                return s;
              const uint64_t bytes = uint64_t(numel * mb);
              if (Status s = checkpoint.read(1, uint64_t(at * mb), m.data() + to * mb, bytes); !s)
                return s;
              return checkpoint.read(2, uint64_t(at * mb), v.data() + to * mb, bytes);
            });
        if (!s) return s.message().empty() ? missing() : s;
      }
    }
    for (auto& rank : ranks) {
      if (Status s = init_unit(*rank, u, master.data()); !s) return s;
      const Status loaded = int8 ? load_int8_moments(*rank, u, checkpoint, files)
                                 : load_moments(*rank, u, m.data(), v.data());
      if (!loaded) return loaded;
    }
  }
  OptimizerState optimizer;
  const nlohmann::json& o = state["optimizer"];
  optimizer.applied_steps = o.value("applied_steps", int64_t{0});
  optimizer.skipped_steps = o.value("skipped_steps", int64_t{0});
  optimizer.scheduler_iteration = o.value("scheduler_iteration", int64_t{-1});
  optimizer.loss_scaler.scale = o["loss_scaler"].value("scale", 1.0);
  optimizer.loss_scaler.iteration = o["loss_scaler"].value("iteration", int64_t{0});
  optimizer.loss_scaler.last_overflow_iteration =
      o["loss_scaler"].value("last_overflow_iteration", int64_t{-1});
  optimizer.loss_scaler.hysteresis_left = o["loss_scaler"].value("hysteresis_left", 2);
  for (auto& rank : ranks) rank->optimizer->restore(optimizer);
  steps_done = state.value("step", int64_t{0});
  sequence_offset = state.value("sequence_offset", int64_t{0});
  // The loaded parameters are the update of the step before the next one.
  for (auto& rank : ranks)
    for (int u = 0; u < units(); ++u) rank->params_ready[size_t(u)] = steps_done - 1;
  return Status::ok();
}

Status Engine::Impl::save_rank(Rank& rank, CheckpointWriter& writer,
                               const std::vector<int64_t>& unit_offsets) {
  const bool master_is_param = !plan.homes.separate_master;
  const bool int8 = plan.input.optimizer_state == OptimizerStateDtype::int8;
  const int64_t mb = plan.moment_bytes();
  const MomentFiles files = int8 ? moment_files(0) : MomentFiles{};
  for (int u = 0; u < units(); ++u) {
    const UnitLayout& unit = plan.layout.units[size_t(u)];
    const UnitPlacement& p = plan.units[size_t(u)];
    const int64_t begin = plan.optimizer_offset(u, rank.rank);
    const int64_t count = std::min(unit.numel, begin + p.optimizer_numel) - begin;  // unpadded part
    // int8 ranges keep their codes whole (padding included) and their scales.
    if (count <= 0 && !int8) continue;
    const uint64_t file_offset = uint64_t(unit_offsets[size_t(u)] + begin) * 4;
    // Per file: where this range starts and how many elements of it are written.
    const uint64_t offsets[3] = {
        file_offset,
        int8 ? uint64_t(files.int8_offset[size_t(u)][size_t(plan.input.stage == 0 ? 0 : rank.rank)])
             : uint64_t((unit_offsets[size_t(u)] + begin) * mb),
        0};
    const int64_t counts[3] = {std::max<int64_t>(count, 0), int8 ? p.optimizer_numel : count,
                               int8 ? p.optimizer_numel : count};
    const int64_t element[3] = {4, mb, mb};
    auto file_at = [&](int f) { return offsets[f == 0 ? 0 : 1]; };
    if (int8) {
      const int64_t blocks = int8_block_count(rank.segments[size_t(u)], p.optimizer_numel);
      for (int f = 1; f <= 2; ++f) {
        const float* scales = (f == 1 ? rank.m_scales : rank.v_scales)[size_t(u)];
        std::vector<float> on_host;
        if (optimizer_on_gpu()) {
          // Scales in device memory: through host memory once (outside the budgets).
          on_host.resize(static_cast<size_t>(blocks));
          if (Status s = rank.compute->download(on_host.data(), scales, blocks * 4); !s) return s;
          scales = on_host.data();
        }
        if (Status s = writer.write(f, file_at(f) + uint64_t(p.optimizer_numel), scales,
                                    uint64_t(blocks) * 4);
            !s)
          return s;
      }
    }
    const ShardKey keys[3] = {{u, master_is_param ? ShardKind::param : ShardKind::master},
                              {u, ShardKind::m},
                              {u, ShardKind::v}};
    // Element `begin` of the unit sits at this element of each shard.
    const int64_t master_start = master_is_param && plan.input.stage < 3 ? begin : 0;
    if (optimizer_on_gpu()) {
      // Homes on the GPU: each shard passes through host memory once (outside the budgets).
      for (int f = 0; f < 3; ++f) {
        Result<tiers::ShardHome> home = rank.store->home(keys[f]);
        if (!home) return home.status();
        std::vector<std::byte> bytes(size_t(home->bytes));
        if (Status s = rank.store->read_shard(keys[f], bytes); !s) return s;
        const std::byte* data = bytes.data() + (f == 0 ? master_start : 0) * 4;
        if (counts[f] == 0) continue;
        if (Status s = writer.write(f, file_at(f), data, uint64_t(counts[f] * element[f])); !s)
          return s;
      }
      continue;
    }
    if (plan.homes.optimizer != tiers::Tier::nvme) {
      for (int f = 0; f < 3; ++f) {
        const std::byte* data = home_data(rank, keys[f]) + (f == 0 ? master_start : 0) * 4;
        if (counts[f] == 0) continue;
        if (Status s = writer.write(f, file_at(f), data, uint64_t(counts[f] * element[f])); !s)
          return s;
      }
      continue;
    }
    // NVMe homes: chunk by chunk through the streamed pass's buffers, read-only.
    std::vector<tiers::StreamItem> items;
    const int64_t chunk = plan.optimizer_chunk_elements;
    for (int64_t at = 0; at < p.optimizer_numel; at += chunk) {
      const int64_t n = std::min(chunk, p.optimizer_numel - at);
      tiers::StreamItem item;
      for (int f = 0; f < 3; ++f) {
        tiers::StreamPiece piece{keys[f], uint64_t(at * element[f]), uint64_t(n * element[f])};
        piece.write = false;
        item.pieces.push_back(piece);
      }
      items.push_back(std::move(item));
    }
    Status status = rank.streamed->pass().run(
        items, [&](size_t index, std::span<std::byte* const> pieces) -> Status {
          const int64_t at = int64_t(index) * chunk;
          for (int f = 0; f < 3; ++f) {
            const int64_t n = std::min(chunk, counts[f] - at);
            if (n <= 0) continue;
            if (Status s = writer.write(f, file_at(f) + uint64_t(at * element[f]),
                                        pieces[size_t(f)], uint64_t(n * element[f]));
                !s)
              return s;
          }
          return Status::ok();
        });
    if (!status) return status;
  }
  return Status::ok();
}

Result<std::string> Engine::save_checkpoint(const std::string& root, int keep) {
  Impl& im = *impl_;
  if (im.poisoned)
    return Status::error("engine: an earlier step failed (" + im.poison_reason + "); not saving");
  // Several processes agree on it first (save_in_processes).
  Status finished = finish();
  // Deferred expert updates: every expert's state as the eager update leaves it.
  if (finished) finished = im.apply_deferred_updates();
  if (!finished && !im.process_mode()) return finished;
  std::vector<int64_t> unit_offsets;
  int64_t total = 0;
  nlohmann::ordered_json units = nlohmann::ordered_json::array();
  for (const UnitLayout& unit : im.plan.layout.units) {
    unit_offsets.push_back(total);
    units.push_back({{"name", unit.unit.name}, {"numel", unit.numel}, {"offset", total}});
    total += unit.numel;
  }
  // At stage 0 every rank holds the whole state: rank 0 writes it.
  auto writes = [&](const Impl::Rank& rank) { return im.plan.input.stage != 0 || rank.rank == 0; };
  if (im.process_mode())
    return im.save_in_processes(finished, root, keep, unit_offsets, total, units);
  Result<CheckpointWriter> writer = CheckpointWriter::begin(
      root, im.steps_done, uint64_t(total) * 4, uint64_t(im.moment_files(total).bytes));
  if (!writer) return writer.status();
  std::vector<Status> results(im.ranks.size());
  {
    std::vector<std::thread> threads;
    for (size_t i = 0; i < im.ranks.size(); ++i)
      threads.emplace_back([&, i] {
        if (writes(*im.ranks[i])) results[i] = im.save_rank(*im.ranks[i], *writer, unit_offsets);
      });
    for (auto& t : threads) t.join();
  }
  for (const Status& s : results)
    if (!s) return s.with_context("saving a checkpoint");
  return im.finish_checkpoint(*writer, keep, units);
}

// One rank of several processes: rank 0 begins the checkpoint, every rank
// writes its part into the same files, rank 0 finishes it once all have.
// Every step is followed by an agreement, so a failure on one rank fails all.
Result<std::string> Engine::Impl::save_in_processes(Status ready, const std::string& root, int keep,
                                                    const std::vector<int64_t>& unit_offsets,
                                                    int64_t total,
                                                    const nlohmann::ordered_json& units) {
  Rank& rank = *ranks[0];
  auto agree = [&](Status status, const char* what) {
    return this->agree(status, fmt::format("saving a checkpoint: another rank failed to {}", what));
  };
  std::optional<CheckpointWriter> writer;
  Status begun = ready;
  if (begun && rank.rank == 0) {
    Result<CheckpointWriter> made = CheckpointWriter::begin(root, steps_done, uint64_t(total) * 4,
                                                            uint64_t(moment_files(total).bytes));
    if (made)
      writer.emplace(std::move(*made));
    else
      begun = made.status();
  }
  if (Status s = agree(begun, "begin it"); !s) return s;
  Status written = Status::ok();
  if (rank.rank != 0) {
    Result<CheckpointWriter> joined = CheckpointWriter::join(root, steps_done);
    if (joined)
      writer.emplace(std::move(*joined));
    else
      written = joined.status();
  }
  if (written && (plan.input.stage != 0 || rank.rank == 0))
    written = save_rank(rank, *writer, unit_offsets);
  if (written) written = writer->flush();
  if (Status s = agree(written.with_context("saving a checkpoint"), "write its part"); !s) return s;
  Result<std::string> finished = writer->final_directory();
  if (rank.rank == 0) finished = finish_checkpoint(*writer, keep, units);
  if (Status s = agree(finished.status(), "finish it"); !s) return s;
  return finished;
}

Result<std::string> Engine::Impl::finish_checkpoint(CheckpointWriter& writer, int keep,
                                                    const nlohmann::ordered_json& units) {
  const OptimizerState& o = ranks[0]->optimizer->state();
  nlohmann::ordered_json state;
  state["format"] = kCheckpointFormat;
  state["step"] = steps_done;
  state["sequence_offset"] = sequence_offset;
  state["seed"] = options.seed;
  const SequenceOrder order = SequenceOrder::from_config(options.config.strata, options.seed);
  state["data_order"] = {{"shuffle", order.is_shuffled()},
                         {"shuffle_seed", order.is_shuffled() ? nlohmann::json(order.seed())
                                                              : nlohmann::json(nullptr)}};
  state["world_size"] = world();
  state["stage"] = plan.input.stage;
  state["precision"] = precision_name(plan.input.precision);
  state["optimizer_state_dtype"] = optimizer_state_dtype_name(plan.input.optimizer_state);
  state["optimizer"] = {{"applied_steps", o.applied_steps},
                        {"skipped_steps", o.skipped_steps},
                        {"scheduler_iteration", o.scheduler_iteration},
                        {"loss_scaler",
                         {{"scale", o.loss_scaler.scale},
                          {"iteration", o.loss_scaler.iteration},
                          {"last_overflow_iteration", o.loss_scaler.last_overflow_iteration},
                          {"hysteresis_left", o.loss_scaler.hysteresis_left}}}};
  state["units"] = units;
  if (Status s = writer.write_json("model.json", model_config_to_json(plan.layout.config)); !s)
    return s;
  if (Status s = writer.write_json("train.json", train_config_to_json(options.config)); !s)
    return s;
  if (Status s = writer.write_json("state.json", state); !s) return s;
  return writer.finish(keep);
}

// --- reading the state back --------------------------------------------------------

Status Engine::read_unit_parameters(int unit, float* flat) {
  Impl& im = *impl_;
  if (unit < 0 || unit >= im.units()) return Status::error(fmt::format("no unit {}", unit));
  const UnitPlacement& p = im.plan.units[size_t(unit)];
  const bool master = im.plan.homes.separate_master;
  const int ranks = im.plan.input.stage == 0 ? 1 : im.world();
  if (im.process_mode() && ranks > 1) {
    // Each process holds one rank's range: read it, then gather every rank's.
    // The processes agree first, so one that failed does not leave the others waiting.
    Impl::Rank& rank = *im.ranks[0];
    const ShardKey key{unit, master ? ShardKind::master : ShardKind::param};
    const int64_t stored = master ? p.optimizer_numel : p.param_numel;
    std::vector<std::byte> bytes(size_t(stored) * 4);
    Status read = finish();
    if (read) read = im.apply_deferred_updates();
    if (read) read = rank.store->read_shard(key, bytes);
    if (Status s =
            im.agree(read, "another rank failed to read its parameters (its own error says why)");
        !s)
      return s;
    const int64_t from =
        master || im.plan.input.stage == 3 ? 0 : im.plan.optimizer_offset(unit, rank.rank);
    return rank.comm->all_gather(bytes.data() + from * 4, flat, size_t(p.optimizer_numel),
                                 comm::DataType::fp32);
  }
  if (Status s = finish(); !s) return s;
  if (Status s = im.apply_deferred_updates(); !s) return s;
  for (int r = 0; r < ranks; ++r) {
    Impl::Rank& rank = *im.ranks[size_t(r)];
    const int64_t offset = im.plan.optimizer_offset(unit, r);
    const ShardKey key{unit, master ? ShardKind::master : ShardKind::param};
    const int64_t stored = master ? p.optimizer_numel : p.param_numel;
    std::vector<std::byte> bytes(size_t(stored) * 4);
    if (Status s = rank.store->read_shard(key, bytes); !s) return s;
    const int64_t from = master || im.plan.input.stage == 3 ? 0 : offset;
    std::memcpy(flat + offset, bytes.data() + from * 4, size_t(p.optimizer_numel) * 4);
  }
  return Status::ok();
}

Result<HostModel> Engine::read_model() {
  Impl& im = *impl_;
  HostModel model = make_host_model(im.plan.layout.config, 1);
  std::vector<float> flat;
  for (int u = 0; u < im.units(); ++u) {
    flat.assign(size_t(im.plan.units[size_t(u)].padded_numel), 0.0f);
    if (Status s = read_unit_parameters(u, flat.data()); !s) return s;
    for (const TensorSlot& slot : im.plan.layout.units[size_t(u)].tensors)
      std::memcpy(model.params[size_t(u)].data() + slot.offset, flat.data() + slot.offset,
                  size_t(slot.numel) * 4);
  }
  return model;
}

}  // namespace strata
