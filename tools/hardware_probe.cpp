#include "tools/hardware_probe.h"

#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <random>
#include <thread>
#include <vector>

#include "core/model/model.h"
#include "core/plan/step_model.h"
#include "io/aligned_buffer.h"
#include "io/io_engine.h"
#include "io/safe_write.h"
#include "kernels/cpu/adamw.h"

namespace strata::tools {
namespace {

using Clock = std::chrono::steady_clock;

constexpr int kProbedRanks = 4;  // ranks of one process the probe runs at once

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// The median of up to `runs` timings of `work` (after one warm-up), stopping
// early once `budget` seconds are spent: what a run's steps see on a machine
// others share, where the fastest timing would promise too much.
template <typename Work>
double median_seconds(int runs, double budget, Work&& work) {
  work();
  std::vector<double> times;
  const auto start = Clock::now();
  for (int i = 0; i < runs; ++i) {
    const auto t = Clock::now();
    work();
    times.push_back(seconds_since(t));
    if (seconds_since(start) > budget) break;
  }
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

void say(const ProbeOptions& options, const std::string& line) {
  if (options.progress) options.progress(line);
}

void probe_memcpy(const ProbeOptions& options, HardwareProfile& p) {
  const size_t bytes = size_t(64) << 20;
  std::vector<char> from(bytes, 1), to(bytes, 0);
  const double s = median_seconds(8, 2.0, [&] { std::memcpy(to.data(), from.data(), bytes); });
  p.memcpy_gbps = 2.0 * double(bytes) / s / 1e9;  // read and written
  if (!p.gpu) p.memory_gbps = p.memcpy_gbps;  // the CPU backend's device memory is the host's
  say(options, fmt::format("host copies: {:.1f} GB/s (read + written)", p.memcpy_gbps));
}

void probe_adamw(const ProbeOptions& options, HardwareProfile& p) {
  using kernels::cpu::AdamWStateType;
  const int64_t n = int64_t(4) << 20;
  std::vector<float> master(size_t(n), 0.5f), grad(size_t(n), 0.01f);
  const size_t count = static_cast<size_t>(n);
  std::vector<float> m32(count), v32(count);
  std::vector<uint16_t> m16(count), v16(count);
  std::vector<int8_t> m8(count), v8(count);
  std::vector<float> scales(size_t(2 * n / kernels::cpu::kAdamWInt8Block + 2), 0.0f);
  kernels::cpu::AdamWHyperparams hyper;
  for (AdamWStateType type : {AdamWStateType::f32, AdamWStateType::bf16, AdamWStateType::int8}) {
    kernels::cpu::AdamWShard shard;
    shard.numel = n;
    shard.state_type = type;
    shard.master = master.data();
    shard.grad = grad.data();
    shard.grad_type = kernels::cpu::ElementType::f32;
    if (type == AdamWStateType::f32) {
      shard.exp_avg = m32.data();
      shard.exp_avg_sq = v32.data();
    } else if (type == AdamWStateType::bf16) {
      shard.exp_avg = m16.data();
      shard.exp_avg_sq = v16.data();
    } else {
      shard.exp_avg = m8.data();
      shard.exp_avg_sq = v8.data();
      shard.exp_avg_scale = scales.data();
      shard.exp_avg_sq_scale = scales.data() + n / kernels::cpu::kAdamWInt8Block + 1;
    }
    (void)kernels::cpu::first_touch_zero(shard);
    const double s = median_seconds(5, 2.0, [&] { (void)kernels::cpu::adamw_step(shard, hyper); });
    const double rate = double(n) / s / 1e6;
    (type == AdamWStateType::f32    ? p.adamw_mparams_fp32
     : type == AdamWStateType::bf16 ? p.adamw_mparams_bf16
                                    : p.adamw_mparams_int8) = rate;
    say(options, fmt::format("AdamW {}: {:.0f} M parameters/s (one thread)",
                             kernels::cpu::adamw_state_type_name(type), rate));
  }
}

}  // namespace

Status probe_nvme(const ProbeOptions& options, HardwareProfile& p) {
  p.nvme.clear();
  if (options.nvme_paths.empty()) return Status::ok();
  io::IoOptions io;
  io.paths = options.nvme_paths;
  io.queue_depth = 8;
  Result<std::unique_ptr<io::IoEngine>> engine = io::IoEngine::open(io);
  if (!engine) return engine.status().with_context("probing NVMe");
  const uint64_t total = options.short_probe ? uint64_t(256) << 20 : uint64_t(1) << 30;
  const uint64_t block = (*engine)->options().block_size;
  Result<io::FileId> file = (*engine)->create_file(fmt::format("strata-probe-{}", getpid()), total);
  if (!file) return file.status().with_context("probing NVMe");
  io::AlignedBuffer buffer(size_t(16 * block), (*engine)->alignment());
  std::memset(buffer.data(), 0x5a, buffer.size());
  // Whole passes over the file, 16 blocks in flight: reads, writes, or both
  // at once (mixed: even blocks read, odd ones written, as the streamed
  // optimizer reads its next chunk while it writes the last).
  enum class Pass { read, write, mixed };
  auto pass = [&](Pass kind) -> Result<double> {
    const auto start = Clock::now();
    std::vector<io::IoHandle> flight;
    for (uint64_t at = 0; at < total; at += block) {
      std::byte* data = buffer.data() + ((at / block) % 16) * block;
      if (flight.size() == 16) {
        if (Status s = flight.front().wait(); !s) return s;
        flight.erase(flight.begin());
      }
      const bool write = kind == Pass::write || (kind == Pass::mixed && (at / block) % 2 == 1);
      flight.push_back(write ? (*engine)->write(*file, at, data, block)
                             : (*engine)->read(*file, at, data, block));
    }
    for (io::IoHandle& h : flight)
      if (Status s = h.wait(); !s) return s;
    return seconds_since(start);
  };
  Result<double> written = pass(Pass::write);
  Result<double> read = written ? pass(Pass::read) : written;
  // One 4 KiB read at a time, over the file: the latency of a request, the
  // median of 31 (a mean takes in whatever else the drive is doing). Before
  // the mixed pass, whose writes a drive may still be flushing after it.
  std::vector<double> waits;
  const uint64_t blocks = std::max<uint64_t>(1, total / block);
  for (uint64_t i = 0; i < 31 && read; ++i) {
    const auto one = Clock::now();
    (void)(*engine)->read(*file, (i * 37 % blocks) * block, buffer.data(), 4096).wait();
    waits.push_back(seconds_since(one));
  }
  std::nth_element(waits.begin(), waits.begin() + ptrdiff_t(waits.size() / 2), waits.end());
  const double latency_us = waits.empty() ? 0 : waits[waits.size() / 2] * 1e6;
  Result<double> mixed = read ? pass(Pass::mixed) : read;
  (void)(*engine)->take_request_latencies_us();
  (void)(*engine)->remove_file(*file);
  if (!written) return written.status().with_context("probing NVMe");
  if (!read) return read.status().with_context("probing NVMe");
  if (!mixed) return mixed.status().with_context("probing NVMe");
  NvmeDrive drive;
  drive.read_gbps = double(total) / *read / 1e9;
  drive.write_gbps = double(total) / *written / 1e9;
  drive.mixed_gbps = double(total) / *mixed / 1e9;
  drive.latency_us = latency_us;
  p.nvme.push_back(drive);
  say(options,
      fmt::format("NVMe under {}: read {:.2f} GB/s, write {:.2f} GB/s, both at once {:.2f} "
                  "GB/s, {:.0f} us a request ({} MiB, {} KiB blocks, {} in flight, {})",
                  options.nvme_paths.front(), drive.read_gbps, drive.write_gbps, drive.mixed_gbps,
                  latency_us, total >> 20, block >> 10, 16, (*engine)->backend_description()));
  return Status::ok();
}

std::string unit_shapes(const ProbeOptions& o) {
  const ModelConfig& m = o.model;
  return fmt::format(
      "vocab {} hidden {} intermediate {} layers {} heads {}/{} head_dim {} window {} "
      "qkv_bias {} qk_norm {}; micro-batch {} x {} tokens",
      m.vocab_size, m.hidden_size, m.intermediate_size, m.num_hidden_layers, m.num_attention_heads,
      m.num_key_value_heads, m.head_dim, m.sliding_window, m.qkv_bias, m.qk_norm, o.micro_batch,
      o.seq_len) +
         (m.is_moe() ? fmt::format("; experts {} top {} of {} in {} sparse layers", m.num_experts,
                                   m.num_experts_per_tok, m.moe_intermediate_size,
                                   m.sparse_layer_count())
                     : std::string());
}

Status probe_units(const ProbeOptions& options, HardwareProfile& p) {
  // The model's layers (up to 8, at most 3/4 of the memory, 1 GiB by
  // default, with their gradients) and the head at the run's shapes, made
  // smaller where they would not fit a quick probe: at most 4096 tokens, a
  // vocabulary of at most 64 MiB of fp32 per matrix (and at most 1/16 of the
  // memory: the embedding, the head and their gradients take 1/4), a layer of
  // at most 256 MiB (and at most 3/8 of the memory). The layers run one after
  // another, as in a step, so each finds the caches holding the one before
  // it, not itself.
  const int64_t memory =
      std::clamp<int64_t>(options.memory_bytes > 0 ? options.memory_bytes : int64_t(1) << 30,
                          int64_t(64) << 20, int64_t(1) << 30);
  const int64_t vocab_matrix = std::min<int64_t>(int64_t(64) << 20, memory / 16);
  const int64_t layer_limit = std::min<int64_t>(int64_t(256) << 20, memory * 3 / 8);
  ModelConfig m = options.model;
  // The largest layer (a mixture's sparse layers hold every expert).
  auto largest_layer = [](const ModelConfig& c) {
    int64_t most = 0;
    for (int64_t i = 0; i < c.num_hidden_layers; ++i)
      most = std::max(most, c.layer_parameter_count(i));
    return most;
  };
  const int64_t layer_bytes = std::max<int64_t>(1, largest_layer(m) * 8);
  m.num_hidden_layers = std::clamp<int64_t>(memory * 3 / 4 / layer_bytes, 1,
                                            std::min<int64_t>(8, m.num_hidden_layers));
  const int64_t T = std::min<int64_t>(options.seq_len, 4096);
  const int64_t B = std::clamp<int64_t>(4096 / std::max<int64_t>(T, 1), 1, options.micro_batch);
  std::string scaled;
  if (m.vocab_size * m.hidden_size * 4 > vocab_matrix) {
    m.vocab_size = std::max<int64_t>(256, vocab_matrix / (4 * m.hidden_size));
    scaled += fmt::format(", vocabulary {}", m.vocab_size);
  }
  if (largest_layer(m) * 4 > layer_limit) {
    const double shrink = std::sqrt(double(layer_limit) / double(largest_layer(m) * 4));
    const int64_t D = m.head_dim > 0 ? m.head_dim : m.hidden_size / m.num_attention_heads;
    m.num_attention_heads = std::max<int64_t>(1, int64_t(double(m.num_attention_heads) * shrink));
    m.num_key_value_heads = std::clamp<int64_t>(m.num_key_value_heads, 1, m.num_attention_heads);
    while (m.num_attention_heads % m.num_key_value_heads != 0) --m.num_key_value_heads;
    m.head_dim = D;
    m.hidden_size = m.num_attention_heads * D;
    m.intermediate_size = std::max<int64_t>(64, int64_t(double(m.intermediate_size) * shrink));
    // A mixture keeps its experts and top k (the routing's work), each expert smaller.
    if (m.is_moe())
      m.moe_intermediate_size =
          std::max<int64_t>(16, int64_t(double(m.moe_intermediate_size) * shrink));
    scaled += fmt::format(", hidden {}", m.hidden_size);
  }
  m.vocab_chunks = 1;  // the whole head's rate: the step model gives a chunk its rows' share
  m.layer_pieces = 1;  // the whole layer's rate: likewise for a piece's products
  m.expert_groups = 1;
  m.mlp_parts = 1;
  HostModel model = make_host_model(m);
  init_host_model(model, 1);
  UnitWorkspace ws(m, B, T);
  std::mt19937 random(7);
  std::vector<int32_t> tokens(size_t(B * T)), targets(size_t(B * T));
  for (size_t i = 0; i < tokens.size(); ++i) {
    tokens[i] = int32_t(random() % uint32_t(m.vocab_size));
    targets[i] = int32_t(random() % uint32_t(m.vocab_size));
  }
  UnitBatch batch{tokens.data(), targets.data(), B, T, 1.0f / float(B * T)};
  // As in a step: layer u reads layer u - 1's output (acts[u - 1]) and keeps
  // its own (acts[u]); the backward passes its gradient down in place.
  const int64_t layers = m.num_hidden_layers, head_unit = layers + 1;
  const size_t activation = size_t(B * T * m.hidden_size);
  std::vector<std::vector<float>> acts(size_t(layers) + 1, std::vector<float>(activation));
  std::vector<float> dy(activation);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (float& v : acts[0]) v = normal(random);
  for (float& v : dy) v = 0.01f * normal(random);
  const double budget = options.short_probe ? 1.0 : 4.0;
  auto forward_all = [&] {
    for (int64_t u = 1; u <= layers; ++u)
      (void)unit_forward(model.layout, u, model.unit_params(u), batch, acts[size_t(u) - 1].data(),
                         acts[size_t(u)].data(), ws);
  };
  const double forward = median_seconds(9, budget, forward_all) / double(layers);
  const double backward =
      median_seconds(3, budget,
                     [&] {
                       for (int64_t u = layers; u >= 1; --u)
                         unit_backward(model.layout, u, model.unit_params(u), batch,
                                       acts[size_t(u) - 1].data(), dy.data(), dy.data(),
                                       model.unit_grads(u), ws, true);
                     }) /
      double(layers);
  const double head = median_seconds(3, budget, [&] {
    (void)head_forward_backward(model.layout, model.unit_params(head_unit), batch,
                                acts[size_t(layers)].data(), dy.data(),
                                model.unit_grads(head_unit), ws);
  });
  // Ranks of one process at once (2 to 4): each its own thread, activations
  // and workspace, the first (up to) two layers' forward, as the engine's
  // ranks share the cores. Each rank's rate as a share of one alone's.
  p.rank_shares = {1.0};
  const int64_t shared_layers = std::min<int64_t>(layers, 2);
  const std::vector<std::vector<float>> first_acts(acts.begin(),
                                                   acts.begin() + shared_layers + 1);
  for (int ranks = 2; ranks <= kProbedRanks; ++ranks) {
    std::vector<std::unique_ptr<UnitWorkspace>> spaces;
    std::vector<std::vector<std::vector<float>>> rank_acts(size_t(ranks), first_acts);
    for (int r = 0; r < ranks; ++r) spaces.push_back(std::make_unique<UnitWorkspace>(m, B, T));
    const double together = median_seconds(3, budget / 2, [&] {
      std::vector<std::thread> threads;
      for (int r = 0; r < ranks; ++r)
        threads.emplace_back([&, r] {
          std::vector<std::vector<float>>& own = rank_acts[size_t(r)];
          for (int64_t u = 1; u <= shared_layers; ++u)
            (void)unit_forward(model.layout, u, model.unit_params(u), batch,
                               own[size_t(u) - 1].data(), own[size_t(u)].data(),
                               *spaces[size_t(r)]);
        });
      for (std::thread& t : threads) t.join();
    });
    p.rank_shares.push_back(
        std::clamp(forward / (together / double(shared_layers)), 0.0001, 1.0));
  }
  p.unit_shapes = unit_shapes(options);
  p.layer_forward_gflops = layer_forward_flops(m, B, T) / forward / 1e9;
  p.layer_backward_gflops = layer_backward_flops(m, B, T, true) / backward / 1e9;
  p.head_gflops = head_flops(m, B, T) / head / 1e9;
  p.matmul_tflops_fp32 = p.layer_forward_gflops / 1e3;
  say(options,
      fmt::format(
          "units at B={} T={}{} ({} layer{} in turn, {:.0f} MiB with their gradients): layer "
          "forward {:.1f} GFLOP/s, backward {:.1f} GFLOP/s (recomputing), head {:.1f} GFLOP/s; "
          "per rank with 2, 3, 4 ranks at once {:.0f}%, {:.0f}%, {:.0f}%",
          B, T, scaled, layers, layers > 1 ? "s" : "",
          double(m.parameter_count() * 8) / double(1 << 20), p.layer_forward_gflops,
          p.layer_backward_gflops, p.head_gflops, 100 * p.rank_shares[1], 100 * p.rank_shares[2],
          100 * p.rank_shares[3]));
  return Status::ok();
}

namespace {

// This machine's name, which names its probe and its cache; empty when unknown.
std::string host_name() {
  char host[256] = {};
  if (gethostname(host, sizeof(host) - 1) != 0) return "";
  return host;
}

}  // namespace

Result<HardwareProfile> probe_hardware(const ProbeOptions& options) {
  HardwareProfile p;
  const std::string host = host_name();
  p.name = fmt::format("probe of {}", host.empty() ? "this machine" : host);
  p.gpu = false;
  p.cores = int(std::max(1u, std::thread::hardware_concurrency()));
  p.matmul_efficiency = 1.0;
  if (options.gpu)  // first: without a GPU there is nothing to measure
    if (Status s = probe_gpu(options, p); !s) return s;
  probe_memcpy(options, p);
  if (!options.gpu) {
    // Ranks of one process exchange through host memory: a copy each way. The
    // network to other nodes is not measured (inter_node_gbps stays unknown).
    p.intra_node_gbps = p.memcpy_gbps / 2;
    p.intra_node_latency_us = 5;
  }
  probe_adamw(options, p);
  if (!options.gpu)
    if (Status s = probe_units(options, p); !s) return s;
  if (Status s = probe_nvme(options, p); !s) return s;
  return p;
}

std::string cached_profile_path(bool gpu) {
  std::string base;
  if (const char* xdg = std::getenv("XDG_CACHE_HOME"); xdg != nullptr && xdg[0] != '\0')
    base = xdg;
  else if (const char* home = std::getenv("HOME"); home != nullptr && home[0] != '\0')
    base = std::string(home) + "/.cache";
  else
    base = "/tmp";
  const std::string host = host_name();
  return fmt::format("{}/strata/hardware-{}{}.json", base, host.empty() ? "local" : host,
                     gpu ? "-gpu" : "");
}

Status write_profile(const HardwareProfile& profile, const std::string& path) {
  std::error_code error;
  std::filesystem::create_directories(std::filesystem::path(path).parent_path(), error);
  if (error)
    return Status::io_error(fmt::format("{}: cannot create its directory: {}; give another path",
                                        path, error.message()));
  Result<io::AtomicFileWriter> writer = io::AtomicFileWriter::create(path);
  if (!writer) return writer.status();
  const std::string text = hardware_profile_json(profile);
  if (Status s = writer->append(text.data(), text.size()); !s) return s;
  return writer->commit();
}

}  // namespace strata::tools
