// The CPU processes' collectives: all-reduce and reduce-scatter bandwidth of
// each communicator named in --comms (today GlooComm; its figures against the
// SocketComm it replaced, from this bench side by side before SocketComm was
// removed, are in benches/README.md), at each world size and buffer size, one
// process per rank on this machine (over 127.0.0.1).
//
//   comm_bench [--comms gloo] [--worlds 2,3,4] [--sizes-mib 1,4,16,64,256] [--repeats 5]
//
// A buffer size is what each rank holds (an all-reduce's count, a
// reduce-scatter's whole send buffer). The time of a call is the slowest
// rank's; the figure printed is the median over the repeats as algorithm
// bandwidth (buffer bytes / time), and, with more than one communicator, each
// one's against the first.
#include <fmt/format.h>
#include <sys/wait.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "comm/bootstrap.h"
#include "comm/gloo_comm.h"

namespace {

using namespace strata;
using namespace strata::comm;

using Factory = std::function<Result<std::unique_ptr<Communicator>>(const LaunchEnvironment&)>;

std::map<std::string, Factory> communicators() {
  return {
      {"gloo", [](const LaunchEnvironment& env) { return make_gloo_comm(env); }},
  };
}

LaunchEnvironment rank_of(int rank, int world, int port) {
  LaunchEnvironment env;
  env.rank = rank;
  env.world_size = world;
  env.local_rank = rank;
  env.local_world_size = world;
  env.master_addr = "127.0.0.1";
  env.master_port = port;
  env.source = "torchrun";
  return env;
}

// Seconds per call on this rank, one per repeat, after a warm-up call; a
// barrier before each so that the ranks start together.
std::vector<double> time_calls(Communicator& comm, const std::string& op, size_t bytes, int repeats,
                               std::string& error) {
  const size_t count = bytes / 4;
  const int world = comm.world_size();
  std::vector<float> send(count), recv(op == "all_reduce" ? count : count / size_t(world));
  std::mt19937 rng(uint32_t(comm.rank()) + 1);
  std::normal_distribution<float> normal;
  for (float& x : send) x = normal(rng);
  std::vector<double> seconds;
  for (int i = 0; i <= repeats; ++i) {
    Status status = comm.barrier();
    const auto start = std::chrono::steady_clock::now();
    if (status.is_ok()) {
      status = op == "all_reduce" ? comm.all_reduce(send.data(), recv.data(), count, DataType::fp32)
                                  : comm.reduce_scatter(send.data(), recv.data(),
                                                        count / size_t(world), DataType::fp32);
    }
    const double s =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (!status.is_ok()) {
      error = status.message();
      return {};
    }
    if (i > 0) seconds.push_back(s);
  }
  return seconds;
}

// Runs one measurement in `world` forked processes; returns the median over
// the repeats of the slowest rank's time, or a negative number on failure.
double measure(const Factory& make, int world, const std::string& op, size_t bytes, int repeats) {
  Result<int> port = find_free_port();
  if (!port) {
    std::fprintf(stderr, "%s\n", port.status().message().c_str());
    return -1;
  }
  std::vector<pid_t> children;
  std::vector<int> pipes;
  for (int r = 0; r < world; ++r) {
    int fds[2];
    if (::pipe(fds) != 0) return -1;
    const pid_t pid = ::fork();
    if (pid == 0) {
      ::close(fds[0]);
      std::string error;
      std::vector<double> seconds;
      Result<std::unique_ptr<Communicator>> comm = make(rank_of(r, world, *port));
      if (!comm) {
        error = comm.status().message();
      } else {
        seconds = time_calls(**comm, op, bytes, repeats, error);
      }
      std::string text = error.empty() ? "" : "error " + error;
      for (double s : seconds) text += fmt::format("{:.9f}\n", s);
      if (::write(fds[1], text.data(), text.size()) < 0) ::_exit(1);
      ::_exit(0);
    }
    ::close(fds[1]);
    children.push_back(pid);
    pipes.push_back(fds[0]);
  }
  std::vector<double> slowest(size_t(repeats), 0.0);
  bool failed = false;
  for (int r = 0; r < world; ++r) {
    std::string text;
    char buffer[4096];
    ssize_t n;
    while ((n = ::read(pipes[size_t(r)], buffer, sizeof(buffer))) > 0)
      text.append(buffer, size_t(n));
    ::close(pipes[size_t(r)]);
    ::waitpid(children[size_t(r)], nullptr, 0);
    if (text.rfind("error ", 0) == 0 || text.empty()) {
      std::fprintf(stderr, "rank %d: %s\n", r, text.empty() ? "no report" : text.c_str());
      failed = true;
      continue;
    }
    size_t at = 0;
    for (int i = 0; i < repeats && at < text.size(); ++i) {
      const size_t end = text.find('\n', at);
      slowest[size_t(i)] = std::max(slowest[size_t(i)], std::stod(text.substr(at, end - at)));
      at = end + 1;
    }
  }
  if (failed) return -1;
  std::sort(slowest.begin(), slowest.end());
  return slowest[slowest.size() / 2];
}

std::vector<int> parse_list(const std::string& text) {
  std::vector<int> values;
  size_t at = 0;
  while (at <= text.size()) {
    const size_t end = std::min(text.find(',', at), text.size());
    values.push_back(std::stoi(text.substr(at, end - at)));
    at = end + 1;
  }
  return values;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"The CPU processes' collectives side by side (algorithm bandwidth)."};
  std::string comms = "gloo", worlds = "2,3,4", sizes = "1,4,16,64,256";
  int repeats = 5;
  app.add_option("--comms", comms, "communicators, the first the reference: gloo");
  app.add_option("--worlds", worlds, "processes per measurement");
  app.add_option("--sizes-mib", sizes, "buffer sizes per rank in MiB");
  app.add_option("--repeats", repeats, "timed calls per measurement (after one warm-up)")
      ->check(CLI::PositiveNumber);
  CLI11_PARSE(app, argc, argv);

  const std::map<std::string, Factory> known = communicators();
  std::vector<std::string> names;
  for (size_t at = 0; at <= comms.size();) {
    const size_t end = std::min(comms.find(',', at), comms.size());
    names.push_back(comms.substr(at, end - at));
    at = end + 1;
  }
  for (const std::string& name : names) {
    if (!known.count(name)) {
      std::fprintf(stderr, "comm_bench: --comms names '%s'; known: gloo\n", name.c_str());
      return 2;
    }
  }
  std::printf("%-15s %2s %8s", "collective", "W", "MiB");
  for (const std::string& name : names) std::printf(" %12s", (name + " GB/s").c_str());
  for (size_t i = 1; i < names.size(); ++i)
    std::printf(" %16s", (names[i] + "/" + names[0]).c_str());
  std::printf("\n");
  for (const std::string op : {"all_reduce", "reduce_scatter"}) {
    for (int world : parse_list(worlds)) {
      for (int mib : parse_list(sizes)) {
        const size_t bytes = size_t(mib) << 20;
        std::vector<double> gbps;
        for (const std::string& name : names) {
          const double seconds = measure(known.at(name), world, op, bytes, repeats);
          gbps.push_back(seconds > 0 ? double(bytes) / seconds / 1e9 : 0);
        }
        std::printf("%-15s %2d %8d", op.c_str(), world, mib);
        for (double g : gbps) std::printf(" %12.3f", g);
        for (size_t i = 1; i < gbps.size(); ++i)
          std::printf(" %15.2fx", gbps[0] > 0 ? gbps[i] / gbps[0] : 0);
        std::printf("\n");
        std::fflush(stdout);
      }
    }
  }
  return 0;
}
