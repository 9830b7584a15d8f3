// The launch environment parser and the TCP rendezvous (comm/bootstrap.h).
//
// Wire format of the rendezvous, all integers little-endian:
//   hello (rank r -> rank 0):  magic u32, version u32, rank u32, world size u32
//   frame:                     length u64, then `length` bytes
//   after the hellos, rank 0 sends every rank one frame: empty = welcome, else
//   the reason it refuses the group (then every rank fails with that reason).
//   broadcast: rank 0 sends one frame to each rank.
//   all_gather: each rank sends one frame to rank 0; rank 0 sends each rank one
//   frame holding all of them (u32 count, then count frames).
// Sockets are non-blocking and every wait is a poll() bounded by the deadline.
#include "comm/bootstrap.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <fmt/format.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <charconv>
#include <limits>
#include <thread>

extern char** environ;

namespace strata::comm {
namespace {

// --- the launch environment ---------------------------------------------------

using Variables = std::map<std::string, std::string>;

std::optional<std::string> lookup(const Variables& variables, const std::string& name) {
  auto it = variables.find(name);
  if (it == variables.end() || it->second.empty()) return std::nullopt;
  return it->second;
}

// `name`=`value` as an integer in [low, high]; `what_to_do` ends the error.
Result<int> parse_int(const std::string& name, const std::string& value, long low, long high,
                      const std::string& what_to_do) {
  long parsed = 0;
  const char* end = value.data() + value.size();
  auto [stop, error] = std::from_chars(value.data(), end, parsed);
  if (error != std::errc() || stop != end) {
    return Status::error(fmt::format("{}='{}' is not a whole number; {}", name, value, what_to_do));
  }
  if (parsed < low || parsed > high) {
    return Status::error(
        fmt::format("{}={} is outside {}..{}; {}", name, value, low, high, what_to_do));
  }
  return static_cast<int>(parsed);
}

// The variable names of one launcher family.
struct Names {
  const char* source;
  std::vector<const char*> world;  // the first one set is used
  const char* rank;
  const char* local_rank;
  const char* local_world;  // may be unparseable under SLURM: then unknown
  const char* how_to_launch;
};

Result<LaunchEnvironment> parse_ranks(const Variables& variables, const Names& names) {
  LaunchEnvironment env;
  env.source = names.source;
  std::optional<std::string> world_value;
  const char* world_name = names.world.front();
  for (const char* candidate : names.world) {
    if ((world_value = lookup(variables, candidate))) {
      world_name = candidate;
      break;
    }
  }
  const std::optional<std::string> rank_value = lookup(variables, names.rank);
  if (!world_value) {
    return Status::error(fmt::format(
        "{}={} is set but {} is not; set {} to the number of processes ({})", names.rank,
        rank_value.value_or(""), world_name, world_name, names.how_to_launch));
  }
  Result<int> world =
      parse_int(world_name, *world_value, 1, 1 << 20,
                fmt::format("set it to the number of processes ({})", names.how_to_launch));
  if (!world) return world.status();
  env.world_size = *world;
  if (!rank_value) {
    if (env.world_size > 1) {
      return Status::error(fmt::format(
          "{}={} is set but {} is not; set {} to this process's index, 0..{} ({})", world_name,
          env.world_size, names.rank, names.rank, env.world_size - 1, names.how_to_launch));
    }
  } else {
    Result<int> rank = parse_int(
        names.rank, *rank_value, 0, env.world_size - 1,
        fmt::format("ranks run from 0 to {}-1 ({}={})", world_name, world_name, env.world_size));
    if (!rank) return rank.status();
    env.rank = *rank;
  }
  if (const auto local_world_value = lookup(variables, names.local_world)) {
    if (names.source == std::string("slurm")) {
      // "4" is usable; "4(x2)" and "2,1" are not one number: leave it unknown.
      Result<int> local_world =
          parse_int(names.local_world, *local_world_value, 1, env.world_size, "");
      if (local_world) env.local_world_size = *local_world;
    } else {
      Result<int> local_world =
          parse_int(names.local_world, *local_world_value, 1, env.world_size,
                    fmt::format("set it to the number of processes on this node, at most {}={}",
                                world_name, env.world_size));
      if (!local_world) return local_world.status();
      env.local_world_size = *local_world;
    }
  }
  const std::optional<std::string> local_rank_value = lookup(variables, names.local_rank);
  if (!local_rank_value) {
    if (env.world_size > 1) {
      return Status::error(fmt::format(
          "{}={} is set but {} is not; set {} to this process's index on its node (it picks the "
          "GPU) ({})",
          world_name, env.world_size, names.local_rank, names.local_rank, names.how_to_launch));
    }
  } else {
    const int local_limit = env.local_world_size.value_or(env.world_size);
    Result<int> local_rank =
        parse_int(names.local_rank, *local_rank_value, 0, local_limit - 1,
                  fmt::format("it must be below the processes on this node ({})", local_limit));
    if (!local_rank) return local_rank.status();
    env.local_rank = *local_rank;
  }
  return env;
}

// MASTER_ADDR / MASTER_PORT: required when world_size > 1 unless a default is given.
Status parse_master(const Variables& variables, const std::string& default_addr,
                    std::optional<int> default_port, const std::string& world_name,
                    LaunchEnvironment& env) {
  if (const auto addr = lookup(variables, "MASTER_ADDR")) {
    env.master_addr = *addr;
  } else if (!default_addr.empty()) {
    env.master_addr = default_addr;
  } else if (env.world_size > 1) {
    return Status::error(fmt::format(
        "MASTER_ADDR is not set while {}={}; set it to rank 0's host name or IP address "
        "(127.0.0.1 when every rank runs on one machine)",
        world_name, env.world_size));
  }
  if (const auto port = lookup(variables, "MASTER_PORT")) {
    Result<int> parsed = parse_int("MASTER_PORT", *port, 1, 65535,
                                   "choose a free TCP port on rank 0's host, e.g. 29500");
    if (!parsed) return parsed.status();
    env.master_port = *parsed;
  } else if (default_port) {
    env.master_port = *default_port;
  } else if (env.world_size > 1) {
    return Status::error(fmt::format(
        "MASTER_PORT is not set while {}={}; set it to a free TCP port on rank 0's host, e.g. "
        "29500",
        world_name, env.world_size));
  }
  return Status::ok();
}

// --- sockets ---------------------------------------------------------------------

using Clock = std::chrono::steady_clock;

class Socket {
 public:
  Socket() = default;
  explicit Socket(int fd) : fd_(fd) {}
  ~Socket() { reset(); }
  Socket(Socket&& other) noexcept : fd_(other.release()) {}
  Socket& operator=(Socket&& other) noexcept {
    if (this != &other) {
      reset();
      fd_ = other.release();
    }
    return *this;
  }
  int fd() const { return fd_; }
  bool valid() const { return fd_ >= 0; }
  int release() {
    int fd = fd_;
    fd_ = -1;
    return fd;
  }
  void reset() {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }

 private:
  int fd_ = -1;
};

void make_nonblocking(int fd) {
  const int flags = ::fcntl(fd, F_GETFL, 0);
  ::fcntl(fd, F_SETFL, flags | O_NONBLOCK);
}

// Milliseconds left until `deadline`, at least 0.
int remaining_ms(Clock::time_point deadline) {
  auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
  return static_cast<int>(std::max<int64_t>(0, std::min<int64_t>(left.count(), 1 << 30)));
}

// Waits for `events` on fd. false on timeout; errno set on error (returns false too).
enum class Wait { ready, timeout, error };
Wait wait_for(int fd, short events, Clock::time_point deadline) {
  for (;;) {
    pollfd entry{fd, events, 0};
    const int n = ::poll(&entry, 1, remaining_ms(deadline));
    if (n > 0) return Wait::ready;
    if (n == 0) return Wait::timeout;
    if (errno != EINTR) return Wait::error;
  }
}

// Why an I/O helper failed; the caller turns it into a message naming the peer.
struct IoError {
  enum Kind { none, timeout, closed, system } kind = none;
  int error = 0;
  std::string text() const {
    switch (kind) {
      case timeout:
        return "timed out";
      case closed:
        return "the connection was closed";
      case system:
        return errno_text(error);
      case none:
        break;
    }
    return "ok";
  }
};

IoError send_all(int fd, const void* data, size_t bytes, Clock::time_point deadline) {
  const char* p = static_cast<const char*>(data);
  while (bytes > 0) {
    const ssize_t n = ::send(fd, p, bytes, MSG_NOSIGNAL);
    if (n > 0) {
      p += n;
      bytes -= static_cast<size_t>(n);
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      Wait wait = wait_for(fd, POLLOUT, deadline);
      if (wait == Wait::timeout) return {IoError::timeout};
      if (wait == Wait::error) return {IoError::system, errno};
      continue;
    }
    if (n < 0 && (errno == EPIPE || errno == ECONNRESET)) return {IoError::closed};
    return {IoError::system, errno};
  }
  return {};
}

IoError recv_all(int fd, void* data, size_t bytes, Clock::time_point deadline) {
  char* p = static_cast<char*>(data);
  while (bytes > 0) {
    const ssize_t n = ::recv(fd, p, bytes, 0);
    if (n > 0) {
      p += n;
      bytes -= static_cast<size_t>(n);
      continue;
    }
    if (n == 0) return {IoError::closed};
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) {
      Wait wait = wait_for(fd, POLLIN, deadline);
      if (wait == Wait::timeout) return {IoError::timeout};
      if (wait == Wait::error) return {IoError::system, errno};
      continue;
    }
    if (errno == ECONNRESET) return {IoError::closed};
    return {IoError::system, errno};
  }
  return {};
}

void put_u32(Blob& out, uint32_t value) {
  for (int i = 0; i < 4; ++i) out.push_back(static_cast<uint8_t>(value >> (8 * i)));
}
void put_u64(Blob& out, uint64_t value) {
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<uint8_t>(value >> (8 * i)));
}
uint64_t get_uint(const uint8_t* p, int bytes) {
  uint64_t value = 0;
  for (int i = 0; i < bytes; ++i) value |= static_cast<uint64_t>(p[i]) << (8 * i);
  return value;
}

constexpr uint32_t kMagic = 0x56525453;  // "STRV"
constexpr uint32_t kVersion = 1;
constexpr uint64_t kMaxFrame = uint64_t(1) << 30;

IoError send_frame(int fd, const Blob& blob, Clock::time_point deadline) {
  Blob header;
  put_u64(header, blob.size());
  IoError error = send_all(fd, header.data(), header.size(), deadline);
  if (error.kind != IoError::none) return error;
  return send_all(fd, blob.data(), blob.size(), deadline);
}

IoError recv_frame(int fd, Blob& blob, Clock::time_point deadline) {
  uint8_t header[8];
  IoError error = recv_all(fd, header, sizeof(header), deadline);
  if (error.kind != IoError::none) return error;
  const uint64_t length = get_uint(header, 8);
  if (length > kMaxFrame) return {IoError::system, EPROTO};
  blob.resize(length);
  return recv_all(fd, blob.data(), blob.size(), deadline);
}

// A world of one: nothing to exchange.
// The numeric address of this end of a connected socket ("" if unknown); an
// IPv4 address mapped into IPv6 is written as IPv4.
std::string numeric_local_address(int fd) {
  sockaddr_storage address{};
  socklen_t length = sizeof(address);
  if (::getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length) != 0) return "";
  char text[INET6_ADDRSTRLEN] = {};
  if (address.ss_family == AF_INET) {
    ::inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(&address)->sin_addr, text, sizeof(text));
  } else if (address.ss_family == AF_INET6) {
    const in6_addr& in6 = reinterpret_cast<sockaddr_in6*>(&address)->sin6_addr;
    if (IN6_IS_ADDR_V4MAPPED(&in6)) {
      ::inet_ntop(AF_INET, &in6.s6_addr[12], text, sizeof(text));
    } else {
      ::inet_ntop(AF_INET6, &in6, text, sizeof(text));
    }
  }
  return text;
}

class SoloRendezvous final : public Rendezvous {
 public:
  int rank() const override { return 0; }
  int world_size() const override { return 1; }
  Status broadcast(Blob&) override { return Status::ok(); }
  Result<std::vector<Blob>> all_gather(const Blob& mine) override {
    return std::vector<Blob>{mine};
  }
  Status barrier() override { return Status::ok(); }
  std::string local_address() const override { return "127.0.0.1"; }
};

class TcpRendezvous final : public Rendezvous {
 public:
  TcpRendezvous(const LaunchEnvironment& env, std::chrono::milliseconds timeout)
      : rank_(env.rank),
        world_size_(env.world_size),
        timeout_(timeout),
        where_(fmt::format("rendezvous at MASTER_ADDR:MASTER_PORT {}:{}", env.master_addr,
                           env.master_port)),
        addr_(env.master_addr),
        port_(env.master_port) {}

  int rank() const override { return rank_; }
  int world_size() const override { return world_size_; }

  Status listen_and_accept();
  Status connect_to_rank0();

  Status broadcast(Blob& blob) override {
    const auto deadline = Clock::now() + timeout_;
    if (rank_ == 0) {
      if (blob.size() > kMaxFrame) return too_big(blob.size());
      for (int r = 1; r < world_size_; ++r) {
        IoError error = send_frame(peers_[r].fd(), blob, deadline);
        if (error.kind != IoError::none) return peer_error(r, "broadcast", error);
      }
      return Status::ok();
    }
    IoError error = recv_frame(server_.fd(), blob, deadline);
    if (error.kind != IoError::none) return peer_error(0, "broadcast", error);
    return Status::ok();
  }

  Result<std::vector<Blob>> all_gather(const Blob& mine) override {
    const auto deadline = Clock::now() + timeout_;
    if (mine.size() > kMaxFrame / static_cast<uint64_t>(world_size_)) return too_big(mine.size());
    std::vector<Blob> all(world_size_);
    if (rank_ == 0) {
      all[0] = mine;
      for (int r = 1; r < world_size_; ++r) {
        IoError error = recv_frame(peers_[r].fd(), all[r], deadline);
        if (error.kind != IoError::none) return peer_error(r, "all_gather", error);
      }
      Blob packed;
      put_u32(packed, static_cast<uint32_t>(world_size_));
      for (const Blob& blob : all) {
        put_u64(packed, blob.size());
        packed.insert(packed.end(), blob.begin(), blob.end());
      }
      for (int r = 1; r < world_size_; ++r) {
        IoError error = send_frame(peers_[r].fd(), packed, deadline);
        if (error.kind != IoError::none) return peer_error(r, "all_gather", error);
      }
      return all;
    }
    IoError error = send_frame(server_.fd(), mine, deadline);
    if (error.kind == IoError::none) {
      Blob packed;
      error = recv_frame(server_.fd(), packed, deadline);
      if (error.kind == IoError::none && unpack(packed, all)) return all;
      if (error.kind == IoError::none) error = {IoError::system, EPROTO};
    }
    return peer_error(0, "all_gather", error);
  }

  Status barrier() override {
    Result<std::vector<Blob>> gathered = all_gather({});
    return gathered.status();
  }

  std::string local_address() const override {
    return numeric_local_address(rank_ == 0 ? peers_[1].fd() : server_.fd());
  }

 private:
  bool unpack(const Blob& packed, std::vector<Blob>& all) const {
    size_t at = 0;
    if (packed.size() < 4 || get_uint(packed.data(), 4) != static_cast<uint64_t>(world_size_)) {
      return false;
    }
    at = 4;
    for (Blob& blob : all) {
      if (packed.size() - at < 8) return false;
      const uint64_t length = get_uint(packed.data() + at, 8);
      at += 8;
      if (packed.size() - at < length) return false;
      blob.assign(packed.begin() + at, packed.begin() + at + length);
      at += length;
    }
    return at == packed.size();
  }

  Status too_big(size_t bytes) const {
    return Status::error(fmt::format(
        "{}: a blob of {} bytes is over the rendezvous's limit; it is meant for small messages",
        where_, bytes));
  }

  // A failed exchange with rank `peer` during `what`, as one line.
  Status peer_error(int peer, const char* what, const IoError& error) const {
    const double seconds = timeout_.count() / 1000.0;
    switch (error.kind) {
      case IoError::timeout:
        return Status::error(fmt::format(
            "{}: rank {} waited {} s for rank {} during {}; is rank {} still running (see its "
            "error), or does it need a longer rendezvous timeout?",
            where_, rank_, seconds, peer, what, peer));
      case IoError::closed:
        return Status::error(
            fmt::format("{}: rank {} closed the connection during {} (did it fail? see its error)",
                        where_, peer, what));
      default:
        return Status::error(fmt::format("{}: rank {}, {} with rank {}: {}", where_, rank_, what,
                                         peer, error.text()));
    }
  }

  // Sends `reason` (empty: welcome) to every connected rank.
  void answer_hellos(const std::string& reason, Clock::time_point deadline) {
    const Blob blob(reason.begin(), reason.end());
    for (int r = 1; r < world_size_; ++r) {
      if (peers_[r].valid()) send_frame(peers_[r].fd(), blob, deadline);
    }
  }

  int rank_;
  int world_size_;
  std::chrono::milliseconds timeout_;
  std::string where_;
  std::string addr_;
  int port_;
  std::vector<Socket> peers_;  // rank 0: peers_[r] is rank r's connection
  Socket server_;              // other ranks: the connection to rank 0
};

// Binds every interface on port_: IPv6 with IPv4 mapped when the kernel has
// IPv6, else IPv4.
Result<Socket> listen_on(int port, int backlog) {
  int error = 0;
  const char* step = "socket";
  for (int family : {AF_INET6, AF_INET}) {
    Socket socket(::socket(family, SOCK_STREAM | SOCK_CLOEXEC, 0));
    if (!socket.valid()) {
      error = errno;
      step = "socket";
      continue;
    }
    const int one = 1, zero = 0;
    ::setsockopt(socket.fd(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    int bound;
    if (family == AF_INET6) {
      ::setsockopt(socket.fd(), IPPROTO_IPV6, IPV6_V6ONLY, &zero, sizeof(zero));
      sockaddr_in6 address{};
      address.sin6_family = AF_INET6;
      address.sin6_addr = in6addr_any;
      address.sin6_port = htons(static_cast<uint16_t>(port));
      bound = ::bind(socket.fd(), reinterpret_cast<sockaddr*>(&address), sizeof(address));
    } else {
      sockaddr_in address{};
      address.sin_family = AF_INET;
      address.sin_addr.s_addr = htonl(INADDR_ANY);
      address.sin_port = htons(static_cast<uint16_t>(port));
      bound = ::bind(socket.fd(), reinterpret_cast<sockaddr*>(&address), sizeof(address));
    }
    if (bound != 0 || ::listen(socket.fd(), backlog) != 0) {
      error = errno;
      step = bound != 0 ? "bind" : "listen";
      if (error == EADDRINUSE || error == EACCES) break;  // the other family would say the same
      continue;
    }
    make_nonblocking(socket.fd());
    return socket;
  }
  return Status::from_errno(error, step);
}

Status TcpRendezvous::listen_and_accept() {
  const auto deadline = Clock::now() + timeout_;
  Result<Socket> listener = listen_on(port_, world_size_);
  if (!listener) {
    return Status::error(fmt::format(
        "{}: rank 0 cannot listen on port {}: {}; another program or run holds it, or it is "
        "privileged: choose another MASTER_PORT (strata launch picks a free one)",
        where_, port_, listener.status().message()));
  }
  peers_.resize(world_size_);
  int joined = 1;
  while (joined < world_size_) {
    Wait wait = wait_for(listener->fd(), POLLIN, deadline);
    if (wait == Wait::timeout) {
      std::string missing;
      int shown = 0;
      for (int r = 1; r < world_size_; ++r) {
        if (peers_[r].valid()) continue;
        if (shown < 8) missing += fmt::format("{}{}", shown ? ", " : "", r);
        ++shown;
      }
      if (shown > 8) missing += fmt::format(" and {} more", shown - 8);
      peers_.clear();  // the connected ranks see the connection close
      return Status::error(fmt::format(
          "{}: rank 0 waited {} s but rank{} {} of {} did not connect; start every rank with "
          "the same MASTER_ADDR, MASTER_PORT and WORLD_SIZE, or raise the rendezvous timeout",
          where_, timeout_.count() / 1000.0, shown > 1 ? "s" : "", missing, world_size_));
    }
    if (wait == Wait::error) return Status::from_errno(errno, where_ + ": poll");
    Socket peer(::accept4(listener->fd(), nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC));
    if (!peer.valid()) continue;  // the client gave up, or a transient error: keep waiting
    const int one = 1;
    ::setsockopt(peer.fd(), IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    // A stray connection that says nothing must not hold up the group for long.
    uint8_t hello[16];
    const auto hello_deadline = std::min(deadline, Clock::now() + std::chrono::seconds(10));
    if (recv_all(peer.fd(), hello, sizeof(hello), hello_deadline).kind != IoError::none) continue;
    if (get_uint(hello, 4) != kMagic) continue;  // not one of ours
    const auto version = static_cast<uint32_t>(get_uint(hello + 4, 4));
    const auto rank = static_cast<int64_t>(get_uint(hello + 8, 4));
    const auto world = static_cast<int64_t>(get_uint(hello + 12, 4));
    std::string refusal;
    if (version != kVersion) {
      refusal = fmt::format(
          "{}: a rank runs rendezvous protocol version {} and rank 0 version {}; run the same "
          "strata build on every rank",
          where_, version, kVersion);
    } else if (world != world_size_) {
      refusal = fmt::format(
          "{}: rank {} has WORLD_SIZE={} but rank 0 has WORLD_SIZE={}; start every rank with "
          "the same WORLD_SIZE",
          where_, rank, world, world_size_);
    } else if (rank < 1 || rank >= world_size_ || peers_[rank].valid()) {
      refusal =
          fmt::format("{}: two processes claim rank {}; give every process its own RANK (0..{})",
                      where_, rank, world_size_ - 1);
    }
    if (!refusal.empty()) {
      send_frame(peer.fd(), Blob(refusal.begin(), refusal.end()), deadline);
      answer_hellos(refusal, deadline);
      peers_.clear();
      return Status::error(refusal);
    }
    peers_[rank] = std::move(peer);
    ++joined;
  }
  answer_hellos("", deadline);
  return Status::ok();
}

Status TcpRendezvous::connect_to_rank0() {
  const auto deadline = Clock::now() + timeout_;
  const std::string port = std::to_string(port_);
  std::string last_error = "no attempt";
  auto pause = std::chrono::milliseconds(50);
  while (!server_.valid()) {
    addrinfo hints{};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    addrinfo* found = nullptr;
    const int resolved = ::getaddrinfo(addr_.c_str(), port.c_str(), &hints, &found);
    if (resolved == EAI_NONAME || resolved == EAI_FAIL || resolved == EAI_SERVICE) {
      return Status::error(fmt::format(
          "{}: rank {} cannot resolve MASTER_ADDR '{}': {}; set MASTER_ADDR to rank 0's host "
          "name or IP address",
          where_, rank_, addr_, ::gai_strerror(resolved)));
    }
    if (resolved != 0) {
      last_error = ::gai_strerror(resolved);
    } else {
      for (addrinfo* candidate = found; candidate && !server_.valid();
           candidate = candidate->ai_next) {
        Socket socket(::socket(candidate->ai_family,
                               candidate->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC,
                               candidate->ai_protocol));
        if (!socket.valid()) {
          last_error = errno_text(errno);
          continue;
        }
        int error = 0;
        if (::connect(socket.fd(), candidate->ai_addr, candidate->ai_addrlen) != 0) {
          error = errno;
          if (error == EINPROGRESS) {
            Wait wait = wait_for(socket.fd(), POLLOUT, deadline);
            if (wait == Wait::timeout) {
              error = ETIMEDOUT;
            } else {
              socklen_t length = sizeof(error);
              ::getsockopt(socket.fd(), SOL_SOCKET, SO_ERROR, &error, &length);
            }
          }
        }
        if (error == 0) {
          server_ = std::move(socket);
        } else {
          last_error = errno_text(error);
        }
      }
      ::freeaddrinfo(found);
    }
    if (server_.valid()) break;
    if (Clock::now() >= deadline) {
      return Status::error(fmt::format(
          "{}: rank {} could not connect within {} s (last error: {}); is rank 0 running, and "
          "do MASTER_ADDR and MASTER_PORT name its host and port?",
          where_, rank_, timeout_.count() / 1000.0, last_error));
    }
    std::this_thread::sleep_for(std::min(pause, std::chrono::milliseconds(remaining_ms(deadline))));
    pause = std::min(pause * 2, std::chrono::milliseconds(1000));
  }
  const int one = 1;
  ::setsockopt(server_.fd(), IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  Blob hello;
  put_u32(hello, kMagic);
  put_u32(hello, kVersion);
  put_u32(hello, static_cast<uint32_t>(rank_));
  put_u32(hello, static_cast<uint32_t>(world_size_));
  IoError error = send_all(server_.fd(), hello.data(), hello.size(), deadline);
  Blob answer;
  if (error.kind == IoError::none) error = recv_frame(server_.fd(), answer, deadline);
  if (error.kind == IoError::timeout) {
    return Status::error(fmt::format(
        "{}: rank {} connected but the group was not complete within {} s; start every rank "
        "with the same MASTER_ADDR, MASTER_PORT and WORLD_SIZE, or raise the rendezvous timeout",
        where_, rank_, timeout_.count() / 1000.0));
  }
  if (error.kind == IoError::closed) {
    return Status::error(fmt::format(
        "{}: rank 0 closed the connection before every rank had joined (see rank 0's error)",
        where_));
  }
  if (error.kind != IoError::none) return peer_error(0, "the rendezvous", error);
  if (!answer.empty()) return Status::error(std::string(answer.begin(), answer.end()));
  return Status::ok();
}

}  // namespace

Result<std::string> first_slurm_host(const std::string& node_list) {
  const std::string unsupported = fmt::format(
      "SLURM node list '{}' is not of a supported form (name, name[1-4,7], lists of them); set "
      "MASTER_ADDR to the first node's host name",
      node_list);
  // The first entry: up to the first comma outside brackets.
  std::string first;
  int depth = 0;
  for (char c : node_list) {
    if (c == '[') ++depth;
    if (c == ']') --depth;
    if (c == ',' && depth == 0) break;
    first += c;
  }
  if (first.empty() || depth < 0) return Status::error(unsupported);
  const size_t open = first.find('[');
  if (open == std::string::npos) {
    if (first.find(']') != std::string::npos) return Status::error(unsupported);
    return first;
  }
  const size_t close = first.find(']', open);
  if (open == 0 || close == std::string::npos || close != first.size() - 1) {
    return Status::error(unsupported);
  }
  // "prefix[07-10,12]": the first number of the list, as written (keeps zero padding).
  const std::string ranges = first.substr(open + 1, close - open - 1);
  size_t digits = 0;
  while (digits < ranges.size() && std::isdigit(static_cast<unsigned char>(ranges[digits]))) {
    ++digits;
  }
  if (digits == 0) return Status::error(unsupported);
  for (char c : ranges) {
    if (!std::isdigit(static_cast<unsigned char>(c)) && c != '-' && c != ',') {
      return Status::error(unsupported);
    }
  }
  return first.substr(0, open) + ranges.substr(0, digits);
}

Result<LaunchEnvironment> launch_environment_from(const Variables& variables) {
  if (lookup(variables, "RANK") || lookup(variables, "WORLD_SIZE")) {
    Result<LaunchEnvironment> env = parse_ranks(variables, {"torchrun",
                                                            {"WORLD_SIZE"},
                                                            "RANK",
                                                            "LOCAL_RANK",
                                                            "LOCAL_WORLD_SIZE",
                                                            "torchrun and strata launch set it"});
    if (!env) return env;
    Status master = parse_master(variables, "", std::nullopt, "WORLD_SIZE", *env);
    if (!master.is_ok()) return master;
    return env;
  }
  if (lookup(variables, "SLURM_PROCID")) {
    Result<LaunchEnvironment> env =
        parse_ranks(variables, {"slurm",
                                {"SLURM_NTASKS", "SLURM_NPROCS"},
                                "SLURM_PROCID",
                                "SLURM_LOCALID",
                                "SLURM_NTASKS_PER_NODE",
                                "srun sets it; run the ranks with srun"});
    if (!env) return env;
    std::string default_addr;
    std::optional<int> default_port;
    if (env->world_size > 1 && !lookup(variables, "MASTER_ADDR")) {
      const char* list_name = "SLURM_JOB_NODELIST";
      auto list = lookup(variables, list_name);
      if (!list) list = lookup(variables, list_name = "SLURM_NODELIST");
      if (!list) {
        return Status::error(fmt::format(
            "SLURM_NTASKS={} but neither MASTER_ADDR nor SLURM_JOB_NODELIST is set; export "
            "MASTER_ADDR as the first node's host name",
            env->world_size));
      }
      Result<std::string> host = first_slurm_host(*list);
      if (!host) return Status::error(fmt::format("{}: {}", list_name, host.status().message()));
      default_addr = *host;
    }
    if (const auto job = lookup(variables, "SLURM_JOB_ID")) {
      Result<int> id = parse_int("SLURM_JOB_ID", *job, 0, std::numeric_limits<int>::max(),
                                 "export MASTER_PORT instead");
      if (!id) return id.status();
      default_port = 15000 + *id % 20000;
    }
    Status master = parse_master(variables, default_addr, default_port, "SLURM_NTASKS", *env);
    if (!master.is_ok()) return master;
    return env;
  }
  if (lookup(variables, "OMPI_COMM_WORLD_RANK")) {
    Result<LaunchEnvironment> env = parse_ranks(variables, {"openmpi",
                                                            {"OMPI_COMM_WORLD_SIZE"},
                                                            "OMPI_COMM_WORLD_RANK",
                                                            "OMPI_COMM_WORLD_LOCAL_RANK",
                                                            "OMPI_COMM_WORLD_LOCAL_SIZE",
                                                            "mpirun sets it"});
    if (!env) return env;
    Status master = parse_master(variables, "", std::nullopt, "OMPI_COMM_WORLD_SIZE", *env);
    if (!master.is_ok()) {
      return Status::error(master.message() +
                           " (under mpirun, export it to every rank: mpirun -x)");
    }
    return env;
  }
  return LaunchEnvironment{};
}

Result<LaunchEnvironment> launch_environment() {
  Variables variables;
  for (char** entry = environ; entry && *entry; ++entry) {
    const std::string line = *entry;
    const size_t equals = line.find('=');
    if (equals != std::string::npos) variables[line.substr(0, equals)] = line.substr(equals + 1);
  }
  return launch_environment_from(variables);
}

Result<int> find_free_port() {
  Result<Socket> socket = listen_on(0, 1);
  if (!socket) {
    return Status::error("cannot find a free TCP port: " + socket.status().message());
  }
  sockaddr_storage address{};
  socklen_t length = sizeof(address);
  if (::getsockname(socket->fd(), reinterpret_cast<sockaddr*>(&address), &length) != 0) {
    return Status::from_errno(errno, "cannot find a free TCP port: getsockname");
  }
  if (address.ss_family == AF_INET6)
    return ntohs(reinterpret_cast<sockaddr_in6*>(&address)->sin6_port);
  return ntohs(reinterpret_cast<sockaddr_in*>(&address)->sin_port);
}

Result<std::unique_ptr<Rendezvous>> Rendezvous::join(const LaunchEnvironment& env,
                                                     std::chrono::milliseconds timeout) {
  if (env.world_size <= 1) return std::unique_ptr<Rendezvous>(std::make_unique<SoloRendezvous>());
  if (env.master_addr.empty() || env.master_port <= 0 || env.master_port > 65535) {
    return Status::error(fmt::format(
        "rendezvous: a world of {} needs MASTER_ADDR and MASTER_PORT (have '{}' and {}); set "
        "both to rank 0's host and a free port",
        env.world_size, env.master_addr, env.master_port));
  }
  if (env.rank < 0 || env.rank >= env.world_size) {
    return Status::error(fmt::format("rendezvous: rank {} is not a rank of a world of {}", env.rank,
                                     env.world_size));
  }
  auto rendezvous = std::make_unique<TcpRendezvous>(env, timeout);
  Status joined = env.rank == 0 ? rendezvous->listen_and_accept() : rendezvous->connect_to_rank0();
  if (!joined.is_ok()) return joined;
  return std::unique_ptr<Rendezvous>(std::move(rendezvous));
}

}  // namespace strata::comm
