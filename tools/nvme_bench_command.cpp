// `strata nvme-bench`: write then read a striped O_DIRECT file through the I/O
// engine and report GB/s, per-request latency and CPU time; `--sweep` tries
// block sizes x queue depths x threads and prints the best as DeepSpeed's `aio`
// block. The file is removed afterwards, also on Ctrl-C.
#include <fcntl.h>
#include <fmt/format.h>
#include <signal.h>
#include <sys/resource.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <deque>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>

#include "io/base/sizes.h"
#include "io/aligned_buffer.h"
#include "io/io_engine.h"
#include "io/swap_directory.h"
#include "tools/subcommand.h"

namespace strata::tools {
namespace {

using io::IoEngine;
using io::IoHandle;
using Clock = std::chrono::steady_clock;

std::atomic<bool> interrupted{false};

void on_interrupt(int) {
  interrupted.store(true);
}

// Ctrl-C (and SIGTERM) set a flag; the bench stops submitting, waits for what
// is in flight, removes its file and exits 130.
class InterruptGuard {
 public:
  InterruptGuard() {
    struct sigaction action {};
    action.sa_handler = on_interrupt;
    sigemptyset(&action.sa_mask);
    sigaction(SIGINT, &action, &old_interrupt_);
    sigaction(SIGTERM, &action, &old_terminate_);
  }
  ~InterruptGuard() {
    sigaction(SIGINT, &old_interrupt_, nullptr);
    sigaction(SIGTERM, &old_terminate_, nullptr);
  }

 private:
  struct sigaction old_interrupt_ {};
  struct sigaction old_terminate_ {};
};

// What the process has used so far: wall clock, CPU seconds (all threads),
// and the bytes the kernel accounted to it as storage I/O (/proc/self/io).
struct ProcessSnapshot {
  Clock::time_point time;
  double cpu_seconds = 0;
  uint64_t kernel_read_bytes = 0;
  uint64_t kernel_write_bytes = 0;

  static ProcessSnapshot now() {
    ProcessSnapshot snapshot;
    snapshot.time = Clock::now();
    rusage usage{};
    getrusage(RUSAGE_SELF, &usage);
    auto seconds = [](timeval value) { return double(value.tv_sec) + value.tv_usec * 1e-6; };
    snapshot.cpu_seconds = seconds(usage.ru_utime) + seconds(usage.ru_stime);
    std::ifstream io("/proc/self/io");
    std::string key;
    uint64_t value;
    while (io >> key >> value) {
      if (key == "read_bytes:") snapshot.kernel_read_bytes = value;
      if (key == "write_bytes:") snapshot.kernel_write_bytes = value;
    }
    return snapshot;
  }
};

struct PhaseResult {
  uint64_t bytes = 0;
  double seconds = 0;
  double cpu_seconds = 0;
  uint64_t kernel_bytes = 0;
  float latency_p50_us = 0;
  float latency_p99_us = 0;
  double gb_per_second() const { return seconds > 0 ? bytes / seconds / 1e9 : 0; }
  double cpu_seconds_per_gb() const { return bytes > 0 ? cpu_seconds / (bytes / 1e9) : 0; }
};

struct Setting {
  uint64_t block_size = 0;
  unsigned queue_depth = 0;
  unsigned threads = 0;
};

struct SettingResult {
  Setting setting;
  std::string backend;
  uint64_t alignment = 0;
  std::optional<PhaseResult> write;
  std::optional<PhaseResult> read;
  // Seconds to move the file once in each direction measured.
  double seconds_per_pass(uint64_t size) const {
    double total = 0;
    if (write) total += size / (write->gb_per_second() * 1e9);
    if (read) total += size / (read->gb_per_second() * 1e9);
    return total;
  }
};

float percentile(std::vector<float>& values, double fraction) {
  if (values.empty()) return 0;
  size_t index = std::min(values.size() - 1, size_t(fraction * (values.size() - 1) + 0.5));
  std::nth_element(values.begin(), values.begin() + index, values.end());
  return values[index];
}

std::string size_label(uint64_t bytes) {
  if (bytes % (1 << 30) == 0) return fmt::format("{}G", bytes >> 30);
  if (bytes % (1 << 20) == 0) return fmt::format("{}M", bytes >> 20);
  if (bytes % (1 << 10) == 0) return fmt::format("{}K", bytes >> 10);
  return fmt::format("{}", bytes);
}

// One line on stderr, rewritten in place while a phase runs (terminals only).
class ProgressLine {
 public:
  explicit ProgressLine(std::string label, uint64_t total)
      : label_(std::move(label)),
        total_(total),
        enabled_(isatty(STDERR_FILENO)),
        start_(Clock::now()) {}
  ~ProgressLine() {
    if (enabled_ && shown_) fmt::print(stderr, "\r\033[K");
  }
  void update(uint64_t done) {
    if (!enabled_) return;
    Clock::time_point now = Clock::now();
    if (now - last_ < std::chrono::milliseconds(200)) return;
    last_ = now;
    shown_ = true;
    double seconds = std::chrono::duration<double>(now - start_).count();
    fmt::print(stderr, "\r\033[K  {}  {} / {}  {:.2f} GB/s", label_, format_bytes(double(done)),
               format_bytes(double(total_)), seconds > 0 ? done / seconds / 1e9 : 0.0);
  }

 private:
  std::string label_;
  uint64_t total_;
  bool enabled_;
  bool shown_ = false;
  Clock::time_point start_, last_{};
};

class NvmeBenchCommand : public Subcommand {
 public:
  CLI::App* add_to(CLI::App& app) override {
    CLI::App* cmd = app.add_subcommand(
        "nvme-bench",
        "Measure NVMe read/write bandwidth through strata's I/O engine (and tune aio)");
    cmd->add_option("--path", paths_, "Directory on an NVMe device; repeat to stripe over several")
        ->required();
    cmd->add_option("--size", size_text_, "File size (default 4G; 1G per setting with --sweep)");
    cmd->add_option("--block-size", block_size_text_, "Request size and stripe unit (default 1M)");
    cmd->add_option("--queue-depth", queue_depth_, "Requests in flight per I/O thread (default 32)")
        ->check(CLI::Range(1, 4096));
    cmd->add_option("--threads", threads_, "I/O threads per path (default 1)")
        ->check(CLI::Range(1, 64));
    cmd->add_option("--mode", mode_, "read, write or both (default both)")
        ->check(CLI::IsMember({"read", "write", "both"}));
    cmd->add_flag("--json", json_, "Print one JSON object on stdout instead of the text report");
    cmd->add_flag("--sweep", sweep_,
                  "Try every setting in the lists below; print the best as an aio block");
    cmd->add_option("--sweep-block-sizes", sweep_block_sizes_,
                    "Block sizes for --sweep (default 256K,1M,4M,8M)")
        ->delimiter(',');
    cmd->add_option("--sweep-queue-depths", sweep_queue_depths_,
                    "Queue depths for --sweep (default 8,32,64)")
        ->delimiter(',');
    cmd->add_option("--sweep-threads", sweep_threads_,
                    "Threads per path for --sweep (default 1,2,4)")
        ->delimiter(',');
    cmd->add_flag(
        "--buffered-io", buffered_io_,
        "Allow a filesystem without O_DIRECT (goes through the page cache; numbers mean less)");
    cmd->add_option("--io-backend", backend_, "auto, io_uring or posix (pread/pwrite threads)")
        ->check(CLI::IsMember({"auto", "io_uring", "posix"}));
    return cmd;
  }

  int run() override {
    InterruptGuard guard;
    Result<int> outcome = run_bench();
    if (!outcome) {
      fmt::print(stderr, "strata nvme-bench: {}\n", outcome.status().message());
      return 1;
    }
    return *outcome;
  }

 private:
  Result<int> run_bench() {
    Result<uint64_t> size = parse_size(size_text_.empty() ? (sweep_ ? "1G" : "4G") : size_text_);
    if (!size) return size.status().with_context("--size");
    Result<std::vector<Setting>> settings = settings_to_try();
    if (!settings) return settings.status();
    uint64_t largest_block = 0;
    for (const Setting& setting : *settings)
      largest_block = std::max(largest_block, setting.block_size);
    size_ = *size / largest_block * largest_block;  // whole blocks, like fio
    if (size_ == 0) {
      return Status::error(fmt::format("--size {} is smaller than one block ({})",
                                       format_bytes(double(*size)),
                                       format_bytes(double(largest_block))));
    }
    Status space = check_free_space();
    if (!space) return space;

    if (!json_) {
      fmt::print("strata nvme-bench: {} over {} path{}, mode {}\n", format_bytes(double(size_)),
                 paths_.size(), paths_.size() == 1 ? "" : "s", mode_);
    }
    std::vector<SettingResult> results;
    for (const Setting& setting : *settings) {
      if (interrupted) break;
      Result<SettingResult> result = measure(setting);
      if (!result) return result.status();
      if (interrupted) break;  // a partial measurement means nothing
      if (!json_) print_result(*result, sweep_ && results.empty());
      results.push_back(*result);
    }
    if (interrupted) {
      fmt::print(stderr, "strata nvme-bench: interrupted; the benchmark file was removed\n");
      return 130;
    }
    if (json_) {
      fmt::print("{}\n", to_json(results).dump(2));
    } else if (sweep_) {
      print_best(best_of(results));
    }
    return 0;
  }

  Result<std::vector<Setting>> settings_to_try() {
    auto parse_block = [](const std::string& text) -> Result<uint64_t> {
      Result<uint64_t> bytes = parse_size(text);
      if (!bytes) return bytes.status().with_context("block size");
      if (*bytes == 0 || *bytes % 4096 != 0)
        return Status::error(fmt::format("block size {} must be a positive multiple of 4K", text));
      return *bytes;
    };
    std::vector<Setting> settings;
    if (!sweep_) {
      Result<uint64_t> block = parse_block(block_size_text_);
      if (!block) return block.status();
      settings.push_back({*block, queue_depth_, threads_});
      return settings;
    }
    for (const std::string& text : sweep_block_sizes_) {
      Result<uint64_t> block = parse_block(text);
      if (!block) return block.status();
      for (unsigned threads : sweep_threads_) {
        for (unsigned depth : sweep_queue_depths_) settings.push_back({*block, depth, threads});
      }
    }
    return settings;
  }

  Status check_free_space() {
    for (const std::string& path : paths_) {
      Result<io::DirectoryInfo> info = io::inspect_swap_directory(path);
      if (!info) return info.status();
      const uint64_t needed = size_ / paths_.size();
      const uint64_t available = io::free_bytes(path);
      if (available < needed) {
        return Status::error(
            fmt::format("not enough free space in '{}': the benchmark needs {} there, {} is "
                        "available; pass a smaller --size",
                        path, format_bytes(double(needed)), format_bytes(double(available))));
      }
    }
    return Status::ok();
  }

  Result<SettingResult> measure(const Setting& setting) {
    io::IoOptions options{.paths = paths_,
                          .block_size = setting.block_size,
                          .queue_depth = setting.queue_depth,
                          .threads_per_path = setting.threads,
                          .backend = backend_ == "posix"      ? io::IoBackend::kPosix
                                     : backend_ == "io_uring" ? io::IoBackend::kIoUring
                                                              : io::IoBackend::kAuto,
                          .allow_buffered_io = buffered_io_};
    Result<std::unique_ptr<IoEngine>> opened = IoEngine::open(options);
    if (!opened) return opened.status();
    IoEngine& engine = **opened;
    const std::string file_name = fmt::format("strata-nvme-bench.{}.swap", getpid());
    Result<io::FileId> file = engine.create_file(file_name, size_);
    if (!file) return file.status();

    SettingResult result{setting, engine.backend_description(), engine.alignment(), {}, {}};
    // Two transfers of queue_depth blocks per I/O thread keep every ring full
    // while the next transfer is queued behind it (capped at 1 GiB of buffers).
    const size_t workers = paths_.size() * setting.threads;
    const size_t transfers_in_flight = 2 * workers;
    uint64_t transfer_size = setting.block_size * setting.queue_depth;
    transfer_size = std::max<uint64_t>(
        setting.block_size,
        std::min<uint64_t>(transfer_size, (uint64_t{1} << 30) / transfers_in_flight) /
            setting.block_size * setting.block_size);
    io::AlignedBuffer buffer(transfer_size * transfers_in_flight, engine.alignment());
    std::mt19937_64 random(42);
    for (size_t i = 0; i + 8 <= buffer.size(); i += 8) {
      uint64_t word = random();
      std::memcpy(buffer.data() + i, &word, 8);
    }
    Status registered = engine.register_buffer(buffer.data(), buffer.size());
    if (!registered && !json_)
      fmt::print(stderr, "  note: {}; using unregistered buffers\n", registered.message());

    Status status;
    const bool wants_write = mode_ != "read";
    const bool wants_read = mode_ != "write";
    // Reads only ever see written data: in read mode the file is filled first, untimed.
    PhaseResult write = run_phase(engine, *file, /*write=*/true, buffer, transfer_size, status);
    if (status && wants_write) result.write = write;
    if (status && wants_read && !interrupted) {
      PhaseResult read = run_phase(engine, *file, /*write=*/false, buffer, transfer_size, status);
      if (status) result.read = read;
    }
    if (registered) engine.unregister_buffer(buffer.data());
    Status removed = engine.remove_file(*file);
    if (!status) return status;
    if (!removed) return removed;
    return result;
  }

  PhaseResult run_phase(IoEngine& engine, io::FileId file, bool write,
                        const io::AlignedBuffer& buffer, uint64_t transfer_size, Status& status) {
    ProgressLine progress(write ? "write" : "read ", size_);
    const size_t slots = buffer.size() / transfer_size;
    engine.take_request_latencies_us();  // drop earlier samples
    const ProcessSnapshot before = ProcessSnapshot::now();
    std::deque<std::pair<IoHandle, uint64_t>> in_flight;  // oldest first; slot i % slots
    uint64_t submitted = 0, completed = 0;
    size_t next_slot = 0;
    while (true) {
      while (status && !interrupted && in_flight.size() < slots && submitted < size_) {
        const uint64_t length = std::min(transfer_size, size_ - submitted);
        std::byte* data = buffer.data() + next_slot * transfer_size;
        in_flight.emplace_back(write ? engine.write(file, submitted, data, length)
                                     : engine.read(file, submitted, data, length),
                               length);
        submitted += length;
        next_slot = (next_slot + 1) % slots;
      }
      if (in_flight.empty()) break;
      Status finished = in_flight.front().first.wait();
      if (!finished && status) status = finished;
      completed += in_flight.front().second;
      in_flight.pop_front();
      progress.update(completed);
    }
    std::vector<float> latencies = engine.take_request_latencies_us();
    if (write && status && !interrupted) status = engine.sync(file).wait();  // as fio's end_fsync=1
    const ProcessSnapshot after = ProcessSnapshot::now();

    PhaseResult result;
    result.bytes = completed;
    result.seconds = std::chrono::duration<double>(after.time - before.time).count();
    result.cpu_seconds = after.cpu_seconds - before.cpu_seconds;
    result.kernel_bytes = write ? after.kernel_write_bytes - before.kernel_write_bytes
                                : after.kernel_read_bytes - before.kernel_read_bytes;
    result.latency_p50_us = percentile(latencies, 0.50);
    result.latency_p99_us = percentile(latencies, 0.99);
    return result;
  }

  void print_result(const SettingResult& result, bool first_of_sweep) const {
    const Setting& setting = result.setting;
    if (!sweep_) {
      fmt::print("  engine: {}, alignment {}\n", result.backend, result.alignment);
      fmt::print("  block {}, queue depth {}, {} thread{} per path\n",
                 size_label(setting.block_size), setting.queue_depth, setting.threads,
                 setting.threads == 1 ? "" : "s");
      auto line = [&](const char* name, const PhaseResult& phase, const char* note) {
        fmt::print(
            "  {}  {:6.2f} GB/s  {} in {:.2f} s{}  latency p50 {:.0f} us  p99 {:.0f} us  CPU "
            "{:.2f} s "
            "({:.3f} s/GB)  kernel-accounted {} bytes\n",
            name, phase.gb_per_second(), format_bytes(double(phase.bytes)), phase.seconds, note,
            phase.latency_p50_us, phase.latency_p99_us, phase.cpu_seconds,
            phase.cpu_seconds_per_gb(), phase.kernel_bytes);
      };
      if (result.write) line("write", *result.write, " incl. fdatasync");
      if (result.read) line("read ", *result.read, "");
      return;
    }
    if (first_of_sweep) {
      fmt::print("  engine: {}, alignment {}\n", result.backend, result.alignment);
      fmt::print("  {:>6} {:>6} {:>8} {:>11} {:>11} {:>10} {:>10}\n", "block", "depth", "threads",
                 "write GB/s", "read GB/s", "p99 write", "p99 read");
    }
    fmt::print("  {:>6} {:>6} {:>8} {:>11} {:>11} {:>10} {:>10}\n", size_label(setting.block_size),
               setting.queue_depth, setting.threads,
               result.write ? fmt::format("{:.2f}", result.write->gb_per_second()) : "-",
               result.read ? fmt::format("{:.2f}", result.read->gb_per_second()) : "-",
               result.write ? fmt::format("{:.1f} ms", result.write->latency_p99_us / 1000) : "-",
               result.read ? fmt::format("{:.1f} ms", result.read->latency_p99_us / 1000) : "-");
    std::fflush(stdout);
  }

  // The fastest setting, or the lightest (fewest threads, then shallowest
  // queue, then smallest block) within 3% of it: the rest is noise.
  const SettingResult& best_of(const std::vector<SettingResult>& results) const {
    double fastest = 1e300;
    for (const SettingResult& result : results)
      fastest = std::min(fastest, result.seconds_per_pass(size_));
    const SettingResult* best = nullptr;
    auto lighter = [](const Setting& a, const Setting& b) {
      return std::tie(a.threads, a.queue_depth, a.block_size) <
             std::tie(b.threads, b.queue_depth, b.block_size);
    };
    for (const SettingResult& result : results) {
      if (result.seconds_per_pass(size_) > fastest * 1.03) continue;
      if (best == nullptr || lighter(result.setting, best->setting)) best = &result;
    }
    return *best;
  }

  static nlohmann::json aio_block(const Setting& setting) {
    return {{"block_size", setting.block_size},
            {"queue_depth", setting.queue_depth},
            {"intra_op_parallelism", setting.threads},
            {"single_submit", false},
            {"overlap_events", true},
            {"use_gds", false}};
  }

  void print_best(const SettingResult& best) const {
    const Setting& setting = best.setting;
    fmt::print("best: block {}, queue depth {}, {} thread{} per path",
               size_label(setting.block_size), setting.queue_depth, setting.threads,
               setting.threads == 1 ? "" : "s");
    if (best.write) fmt::print(", write {:.2f} GB/s", best.write->gb_per_second());
    if (best.read) fmt::print(", read {:.2f} GB/s", best.read->gb_per_second());
    fmt::print(" (fastest, or the lightest within 3% of it)\n");
    fmt::print("DeepSpeed config block (also read by strata):\n\"aio\": {}\n",
               aio_block(setting).dump(2));
  }

  nlohmann::json to_json(const std::vector<SettingResult>& results) const {
    auto phase_json = [](const PhaseResult& phase) {
      return nlohmann::json{
          {"bytes", phase.bytes},
          {"seconds", phase.seconds},
          {"gb_per_s", phase.gb_per_second()},
          {"latency_us", {{"p50", phase.latency_p50_us}, {"p99", phase.latency_p99_us}}},
          {"cpu_seconds", phase.cpu_seconds},
          {"cpu_seconds_per_gb", phase.cpu_seconds_per_gb()},
          {"kernel_bytes", phase.kernel_bytes}};
    };
    auto result_json = [&](const SettingResult& result) {
      nlohmann::json json{{"block_size", result.setting.block_size},
                          {"queue_depth", result.setting.queue_depth},
                          {"threads_per_path", result.setting.threads},
                          {"backend", result.backend},
                          {"alignment", result.alignment}};
      if (result.write) json["write"] = phase_json(*result.write);
      if (result.read) json["read"] = phase_json(*result.read);
      return json;
    };
    nlohmann::json json{{"paths", paths_}, {"size_bytes", size_}, {"mode", mode_}};
    if (!sweep_) {
      json.update(result_json(results.front()));
      return json;
    }
    json["settings"] = nlohmann::json::array();
    for (const SettingResult& result : results) json["settings"].push_back(result_json(result));
    json["best"] = result_json(best_of(results));
    json["aio"] = aio_block(best_of(results).setting);
    return json;
  }

  std::vector<std::string> paths_;
  std::string size_text_;
  std::string block_size_text_ = "1M";
  unsigned queue_depth_ = 32;
  unsigned threads_ = 1;
  std::string mode_ = "both";
  bool json_ = false;
  bool sweep_ = false;
  std::vector<std::string> sweep_block_sizes_ = {"256K", "1M", "4M", "8M"};
  std::vector<unsigned> sweep_queue_depths_ = {8, 32, 64};
  std::vector<unsigned> sweep_threads_ = {1, 2, 4};
  bool buffered_io_ = false;
  std::string backend_ = "auto";
  uint64_t size_ = 0;
};

SubcommandRegistration registration([] { return std::make_unique<NvmeBenchCommand>(); });

}  // namespace
}  // namespace strata::tools
