// Bootstrap: where this process sits in a multi-process run, and a TCP
// rendezvous through which the processes find each other before NCCL starts.
//
// LaunchEnvironment. A launcher tells each process its rank through
// environment variables. Read in this order (the first family present wins):
//   1. torchrun style (also `strata launch`): RANK, WORLD_SIZE, LOCAL_RANK,
//      LOCAL_WORLD_SIZE (optional), MASTER_ADDR, MASTER_PORT.
//   2. SLURM (srun): SLURM_PROCID, SLURM_NTASKS (or SLURM_NPROCS), SLURM_LOCALID,
//      SLURM_NTASKS_PER_NODE when it is a plain number (else the local world size
//      is unknown). The master address is MASTER_ADDR when set, else the first
//      host of SLURM_JOB_NODELIST (or SLURM_NODELIST). Supported node lists: plain
//      names separated by commas ("gpu7,gpu9") and one bracket range per name
//      ("gpu[07-10,12],cpu3" -> "gpu07"); anything else needs MASTER_ADDR. The
//      port is MASTER_PORT when set, else 15000 + SLURM_JOB_ID % 20000, so that
//      every task of a job computes the same one.
//   3. Open MPI (mpirun): OMPI_COMM_WORLD_RANK, OMPI_COMM_WORLD_SIZE,
//      OMPI_COMM_WORLD_LOCAL_RANK, OMPI_COMM_WORLD_LOCAL_SIZE; MASTER_ADDR and
//      MASTER_PORT must be exported to every rank (mpirun -x).
// None of them: world size 1, rank 0 ("not launched"). With more than one rank
// every value is checked; a malformed one is a one-line error naming the
// variable, its value and what to do. Note that a SLURM batch script itself sees
// SLURM_PROCID=0 and SLURM_NTASKS=N: start the ranks with srun.
//
// Rendezvous. Rank 0 listens on MASTER_PORT (every interface) and the other
// ranks connect to MASTER_ADDR:MASTER_PORT, retrying until a deadline (default
// 120 s). Once all ranks are in, it moves small blobs (an ncclUniqueId, host
// names): broadcast from rank 0 and all-gather, both through rank 0. Every
// operation fails, rather than waits forever, when a rank does not come or
// disappears; errors name the address and port. A world of one needs no socket.
// A Rendezvous belongs to one rank and is used by one thread at a time.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "io/base/status.h"

namespace strata::comm {

struct LaunchEnvironment {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  std::optional<int> local_world_size;  // unknown under some launchers
  std::string master_addr;              // "" when world_size is 1 and none was given
  int master_port = 0;                  // 0 when world_size is 1 and none was given
  std::string source = "none";          // "torchrun", "slurm", "openmpi" or "none"

  bool launched() const { return source != "none"; }
};

// Parses the variables above from `variables` (name -> value).
Result<LaunchEnvironment> launch_environment_from(
    const std::map<std::string, std::string>& variables);

// Parses this process's environment.
Result<LaunchEnvironment> launch_environment();

// The first host name of a SLURM node list ("gpu[07-10],cpu1" -> "gpu07"), or an
// error when the list is of a form this parser does not support.
Result<std::string> first_slurm_host(const std::string& node_list);

// A TCP port that was free on this machine a moment ago (the kernel's choice
// for port 0), for a launcher that picks MASTER_PORT.
Result<int> find_free_port();

inline constexpr std::chrono::milliseconds kDefaultRendezvousTimeout{120'000};

using Blob = std::vector<uint8_t>;

class Rendezvous {
 public:
  // Joins the rendezvous of `env`: returns once every rank is connected, or an
  // error after `timeout` (which also bounds each later operation).
  static Result<std::unique_ptr<Rendezvous>> join(
      const LaunchEnvironment& env, std::chrono::milliseconds timeout = kDefaultRendezvousTimeout);

  virtual ~Rendezvous() = default;
  virtual int rank() const = 0;
  virtual int world_size() const = 0;

  // Rank 0's `blob` to every rank: on rank 0 it is sent, elsewhere replaced by
  // rank 0's (any size).
  virtual Status broadcast(Blob& blob) = 0;
  // Every rank's `mine`, indexed by rank, on every rank.
  virtual Result<std::vector<Blob>> all_gather(const Blob& mine) = 0;
  // Returns when every rank has reached it.
  virtual Status barrier() = 0;
  // The numeric IP address of this end of this rank's connection to the
  // rendezvous (rank 0: of its connection to rank 1), so the address the
  // other ranks reach this machine at on the interface the rendezvous uses:
  // a collective library started from here listens on it. A world of one:
  // "127.0.0.1".
  virtual std::string local_address() const = 0;
};

}  // namespace strata::comm
