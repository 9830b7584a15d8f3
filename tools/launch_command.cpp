// `strata launch -n N [--master-addr A] [--master-port P] -- COMMAND ARGS...`:
// starts N local processes of COMMAND as the ranks of one run, the way torchrun
// does on one node. Each gets RANK (0..N-1), WORLD_SIZE=N, LOCAL_RANK=RANK,
// LOCAL_WORLD_SIZE=N, MASTER_ADDR (default 127.0.0.1) and MASTER_PORT (default:
// a port that was free when launch started); CUDA_VISIBLE_DEVICES is left as it
// is, so each rank picks GPU LOCAL_RANK (comm/bootstrap.h reads these).
//
// The children inherit stdout and stderr (nothing is prefixed). Each rank runs
// in a process group of its own, so that stopping a rank also stops what it
// started (a shell's children); a rank therefore cannot read the terminal. A
// rank whose launch dies (even by SIGKILL) gets SIGTERM (PR_SET_PDEATHSIG).
// When a child fails (non-zero status or killed), launch prints one line naming
// its rank and pid, sends SIGTERM to the others, SIGKILL after --grace-period,
// and exits with that child's status (128 + signal for a killed child). SIGINT
// and SIGTERM sent to launch (Ctrl-C included) are forwarded to every rank; the
// same stop follows and launch exits 128 + the signal; a second signal kills at
// once. Bad input (N < 1, no command, a command not found) is a one-line error
// and exit status 2.
#include <fcntl.h>
#include <fmt/format.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include "comm/bootstrap.h"
#include "tools/subcommand.h"

extern char** environ;

namespace strata::tools {
namespace {

using Clock = std::chrono::steady_clock;

bool is_executable_file(const std::string& path) {
  struct stat info {};
  return ::stat(path.c_str(), &info) == 0 && S_ISREG(info.st_mode) &&
         ::access(path.c_str(), X_OK) == 0;
}

// The file execvp would run for `name`, or nothing.
std::optional<std::string> find_executable(const std::string& name) {
  if (name.find('/') != std::string::npos) {
    if (is_executable_file(name)) return name;
    return std::nullopt;
  }
  const char* path = std::getenv("PATH");
  const std::string directories = path ? path : "/usr/local/bin:/usr/bin:/bin";
  size_t begin = 0;
  for (;;) {
    const size_t end = directories.find(':', begin);
    std::string directory = directories.substr(begin, end - begin);
    if (directory.empty()) directory = ".";
    const std::string candidate = directory + "/" + name;
    if (is_executable_file(candidate)) return candidate;
    if (end == std::string::npos) return std::nullopt;
    begin = end + 1;
  }
}

std::string describe_status(int status) {
  if (WIFSIGNALED(status)) {
    return fmt::format("was killed by signal {} ({})", WTERMSIG(status),
                       ::strsignal(WTERMSIG(status)));
  }
  return fmt::format("exited with status {}", WEXITSTATUS(status));
}

int exit_code_of(int status) {
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return WEXITSTATUS(status);
}

bool succeeded(int status) {
  return WIFEXITED(status) && WEXITSTATUS(status) == 0;
}

struct Child {
  int rank = 0;
  pid_t pid = -1;
  bool running = false;
};

class LaunchCommand : public Subcommand {
 public:
  CLI::App* add_to(CLI::App& app) override {
    CLI::App* cmd = app.add_subcommand(
        "launch",
        "Start N local processes of a command as the ranks of one run (RANK, WORLD_SIZE, "
        "LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT, as torchrun sets them); "
        "usage: strata launch -n N -- COMMAND ARGS...");
    cmd->add_option("-n,--nproc", processes_, "Processes (ranks) to start");
    cmd->add_option("--master-addr", master_addr_, "MASTER_ADDR for the ranks (default 127.0.0.1)");
    cmd->add_option("--master-port", master_port_,
                    "MASTER_PORT for the ranks (default: a free port found at start)");
    cmd->add_option("--gpus-per-node", gpus_per_node_,
                    "GPUs on this node: refuse -n above it (NCCL runs one process per GPU)");
    cmd->add_option("--grace-period", grace_seconds_,
                    "Seconds between SIGTERM and SIGKILL when stopping the ranks (default 10)");
    cmd->add_option("command", command_, "The command and its arguments, after --");
    return cmd;
  }

  int run() override {
    if (processes_ < 1) {
      return bad_input(
          processes_ == kUnset
              ? "give the number of processes with -n N; usage: strata launch -n N -- COMMAND "
                "ARGS..."
              : fmt::format("-n {} must be at least 1 (the number of processes to start)",
                            processes_));
    }
    if (command_.empty()) {
      return bad_input("no command to run; usage: strata launch -n N -- COMMAND ARGS...");
    }
    if (gpus_per_node_ && processes_ > *gpus_per_node_) {
      return bad_input(fmt::format(
          "-n {} is more than --gpus-per-node {}; NCCL runs one process per GPU: use -n {} or "
          "fewer",
          processes_, *gpus_per_node_, *gpus_per_node_));
    }
    if (master_port_ && (*master_port_ < 1 || *master_port_ > 65535)) {
      return bad_input(fmt::format("--master-port {} is not a TCP port (1-65535)", *master_port_));
    }
    if (grace_seconds_ < 0) {
      return bad_input(fmt::format("--grace-period {} must not be negative", grace_seconds_));
    }
    const std::optional<std::string> program = find_executable(command_[0]);
    if (!program) {
      return bad_input(fmt::format(
          "command '{}' not found (not an executable file{}); check its name", command_[0],
          command_[0].find('/') == std::string::npos ? ", nor on PATH" : ""));
    }
    int port = master_port_.value_or(0);
    if (!master_port_) {
      Result<int> free_port = comm::find_free_port();
      if (!free_port) {
        std::fprintf(stderr, "strata launch: %s; pass --master-port\n",
                     free_port.status().message().c_str());
        return 1;
      }
      port = *free_port;
    }
    return supervise(*program, port);
  }

 private:
  static constexpr int kUnset = -1;

  static int bad_input(const std::string& message) {
    std::fprintf(stderr, "strata launch: %s\n", message.c_str());
    return 2;
  }

  // Starts the ranks and waits for them; returns launch's exit status.
  int supervise(const std::string& program, int port) {
    // The signals launch handles are blocked and taken with sigtimedwait; the
    // children start with the mask launch had.
    sigset_t handled, original;
    sigemptyset(&handled);
    sigaddset(&handled, SIGCHLD);
    sigaddset(&handled, SIGINT);
    sigaddset(&handled, SIGTERM);
    pthread_sigmask(SIG_BLOCK, &handled, &original);

    std::vector<Child> children;
    for (int rank = 0; rank < processes_; ++rank) {
      Result<pid_t> pid = spawn(program, rank, port, original);
      if (!pid) {
        std::fprintf(stderr, "strata launch: %s\n", pid.status().message().c_str());
        stop(children, SIGTERM);
        wait_for_stop(children);
        return 2;
      }
      children.push_back({rank, *pid, true});
    }

    int running = processes_;
    int failure_exit = 0;   // the first failed child's exit code
    int signal_taken = 0;   // the first signal launch received
    bool stopping = false;  // the others were sent SIGTERM
    bool killed = false;    // ... and then SIGKILL
    auto kill_at = Clock::time_point::max();
    const auto grace =
        std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(grace_seconds_));

    while (running > 0) {
      int status = 0;
      pid_t pid;
      while ((pid = ::waitpid(-1, &status, WNOHANG)) > 0) {
        for (Child& child : children) {
          if (child.pid != pid || !child.running) continue;
          child.running = false;
          --running;
          if (succeeded(status) || stopping) break;
          // A rank failed on its own: say so, and stop the others (once).
          const bool first = failure_exit == 0;
          if (first) failure_exit = exit_code_of(status);
          std::fprintf(stderr, "strata launch: rank %d (pid %d) %s%s\n", child.rank,
                       static_cast<int>(pid), describe_status(status).c_str(),
                       first && running > 0 ? "; stopping the others" : "");
        }
      }
      if (failure_exit != 0 && !stopping) {
        stopping = true;
        stop(children, SIGTERM);
        kill_at = Clock::now() + grace;
      }
      if (running == 0) break;
      if (stopping && !killed && Clock::now() >= kill_at) {
        stop(children, SIGKILL);
        killed = true;
      }
      auto wait = std::chrono::milliseconds(200);
      if (stopping && !killed) {
        wait = std::min(
            wait, std::chrono::duration_cast<std::chrono::milliseconds>(kill_at - Clock::now()) +
                      std::chrono::milliseconds(1));
      }
      timespec timeout{0, static_cast<long>(std::max<int64_t>(0, wait.count())) * 1'000'000};
      const int signal = sigtimedwait(&handled, nullptr, &timeout);
      if (signal == SIGINT || signal == SIGTERM) {
        stop(children, signal);
        if (signal_taken != 0) {
          kill_at = Clock::now();  // a second signal: no more grace
        } else {
          signal_taken = signal;
          if (!stopping) kill_at = Clock::now() + grace;
        }
        stopping = true;
      }
    }
    pthread_sigmask(SIG_SETMASK, &original, nullptr);
    if (failure_exit != 0) return failure_exit;
    if (signal_taken != 0) return 128 + signal_taken;
    return 0;
  }

  Result<pid_t> spawn(const std::string& program, int rank, int port, const sigset_t& mask) {
    std::vector<std::string> variables = {fmt::format("RANK={}", rank),
                                          fmt::format("WORLD_SIZE={}", processes_),
                                          fmt::format("LOCAL_RANK={}", rank),
                                          fmt::format("LOCAL_WORLD_SIZE={}", processes_),
                                          fmt::format("MASTER_ADDR={}", master_addr_),
                                          fmt::format("MASTER_PORT={}", port)};
    std::vector<std::string> names;
    for (const std::string& variable : variables)
      names.push_back(variable.substr(0, variable.find('=') + 1));
    for (char** entry = environ; entry && *entry; ++entry) {
      bool replaced = false;
      for (const std::string& name : names)
        replaced |= std::strncmp(*entry, name.c_str(), name.size()) == 0;
      if (!replaced) variables.emplace_back(*entry);
    }
    std::vector<char*> envp;
    for (std::string& variable : variables) envp.push_back(variable.data());
    envp.push_back(nullptr);
    std::vector<char*> argv;
    for (std::string& argument : command_) argv.push_back(argument.data());
    argv.push_back(nullptr);

    // fork + exec rather than posix_spawn, for PR_SET_PDEATHSIG: a rank gets
    // SIGTERM if launch itself dies (even by SIGKILL) instead of running on.
    int report[2];  // the child writes exec's errno here; close-on-exec says it ran
    if (::pipe2(report, O_CLOEXEC) != 0)
      return Status::from_errno(errno, fmt::format("cannot start rank {}: pipe", rank));
    const pid_t parent = ::getpid();
    const pid_t pid = ::fork();
    if (pid < 0) {
      const int error = errno;
      ::close(report[0]);
      ::close(report[1]);
      return Status::from_errno(error, fmt::format("cannot start rank {}: fork", rank));
    }
    if (pid == 0) {  // the child: async-signal-safe calls only
      ::close(report[0]);
      ::setpgid(0, 0);  // a process group of its own, led by the rank
      ::prctl(PR_SET_PDEATHSIG, SIGTERM);
      if (::getppid() != parent) ::_exit(127);  // launch died before prctl
      pthread_sigmask(SIG_SETMASK, &mask, nullptr);
      ::execve(program.c_str(), argv.data(), envp.data());
      const int error = errno;
      [[maybe_unused]] ssize_t written = ::write(report[1], &error, sizeof(error));
      ::_exit(127);
    }
    ::close(report[1]);
    ::setpgid(pid, pid);  // also here, so that the group exists before any kill(-pid)
    int error = 0;
    ssize_t got;
    do {
      got = ::read(report[0], &error, sizeof(error));
    } while (got < 0 && errno == EINTR);
    ::close(report[0]);
    if (got == static_cast<ssize_t>(sizeof(error))) {
      ::waitpid(pid, nullptr, 0);
      return Status::from_errno(error, fmt::format("cannot start rank {} ({})", rank, program),
                                "check the command");
    }
    return pid;
  }

  static void stop(const std::vector<Child>& children, int signal) {
    for (const Child& child : children) {
      if (child.running) ::kill(-child.pid, signal);  // the rank's process group
    }
  }

  // After a failed start: waits for the ranks already started (SIGKILL after the grace).
  void wait_for_stop(std::vector<Child>& children) const {
    const auto kill_at = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                            std::chrono::duration<double>(grace_seconds_));
    bool killed = false;
    for (Child& child : children) {
      while (child.running) {
        if (::waitpid(child.pid, nullptr, WNOHANG) == child.pid) {
          child.running = false;
        } else if (!killed && Clock::now() >= kill_at) {
          stop(children, SIGKILL);
          killed = true;
        } else {
          ::usleep(20'000);
        }
      }
    }
  }

  int processes_ = kUnset;
  std::string master_addr_ = "127.0.0.1";
  std::optional<int> master_port_;
  std::optional<int> gpus_per_node_;
  double grace_seconds_ = 10.0;
  std::vector<std::string> command_;
};

SubcommandRegistration registration([] { return std::make_unique<LaunchCommand>(); });

}  // namespace
}  // namespace strata::tools
