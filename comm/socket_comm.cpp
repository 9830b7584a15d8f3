// SocketComm (comm/socket_comm.h): collectives as all-gathers of messages
// through the rendezvous.
//
// A message is a 32-byte header, integers little-endian:
//   collective u32, dtype u32, count u64 (elements per rank, as in the call),
//   root i32, unused u32, first u64 (the first element this exchange covers)
// followed by this rank's data for the exchange, in the host's byte order.
// Every rank checks every header against rank 0's before it reads any data.
#include "comm/socket_comm.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "comm/reduction.h"

namespace strata::comm {
namespace {

enum class Collective : uint32_t {
  all_gather = 1,
  reduce_scatter = 2,
  all_reduce = 3,
  broadcast = 4,
  barrier = 5
};

const char* collective_name(Collective collective) {
  switch (collective) {
    case Collective::all_gather:
      return "all_gather";
    case Collective::reduce_scatter:
      return "reduce_scatter";
    case Collective::all_reduce:
      return "all_reduce";
    case Collective::broadcast:
      return "broadcast";
    case Collective::barrier:
      return "barrier";
  }
  return "an unknown collective";
}

const char* dtype_name(DataType dtype) {
  return dtype == DataType::fp32 ? "fp32" : "bf16";
}

struct Header {
  Collective collective = Collective::barrier;
  DataType dtype = DataType::fp32;
  uint64_t count = 0;
  int32_t root = 0;
  uint64_t first = 0;

  bool operator==(const Header&) const = default;
};

constexpr size_t kHeaderBytes = 32;

// The rendezvous refuses messages over 1 GiB in all (rank 0 packs every
// rank's into one): keep one exchange of all ranks well below that.
constexpr size_t kMaxBytesPerExchange = size_t(256) << 20;

void put_le(uint8_t* out, uint64_t value, int bytes) {
  for (int i = 0; i < bytes; ++i) out[i] = static_cast<uint8_t>(value >> (8 * i));
}

uint64_t get_le(const uint8_t* in, int bytes) {
  uint64_t value = 0;
  for (int i = 0; i < bytes; ++i) value |= static_cast<uint64_t>(in[i]) << (8 * i);
  return value;
}

void encode(const Header& header, uint8_t* out) {
  std::memset(out, 0, kHeaderBytes);
  put_le(out, static_cast<uint32_t>(header.collective), 4);
  put_le(out + 4, header.dtype == DataType::fp32 ? 0 : 1, 4);
  put_le(out + 8, header.count, 8);
  put_le(out + 16, static_cast<uint32_t>(header.root), 4);
  put_le(out + 24, header.first, 8);
}

Header decode(const uint8_t* in) {
  Header header;
  header.collective = static_cast<Collective>(get_le(in, 4));
  header.dtype = get_le(in + 4, 4) == 0 ? DataType::fp32 : DataType::bf16;
  header.count = get_le(in + 8, 8);
  header.root = static_cast<int32_t>(static_cast<uint32_t>(get_le(in + 16, 4)));
  header.first = get_le(in + 24, 8);
  return header;
}

// "all_reduce of 1037 fp32 elements", with the root of a broadcast.
std::string describe(const Header& header) {
  if (header.collective == Collective::barrier) return "barrier";
  std::string text = fmt::format("{} of {} {} elements", collective_name(header.collective),
                                 header.count, dtype_name(header.dtype));
  if (header.collective == Collective::broadcast) text += fmt::format(" from root {}", header.root);
  return text;
}

class SocketComm final : public Communicator {
 public:
  SocketComm(std::unique_ptr<Rendezvous> rendezvous, const SocketCommOptions& options)
      : rendezvous_(std::move(rendezvous)),
        rank_(rendezvous_->rank()),
        world_size_(rendezvous_->world_size()),
        exchange_bytes_(std::min(options.exchange_bytes,
                                 kMaxBytesPerExchange / static_cast<size_t>(world_size_))) {}

  int rank() const override { return rank_; }
  int world_size() const override { return world_size_; }
  // What the direct schedule would send (this relay sends more, through rank 0).
  uint64_t bytes_sent() const override { return sent_; }

  Status all_gather(const void* send, void* recv, size_t count, DataType dtype) override {
    sent_ += bytes_sent_by(CollectiveKind::all_gather, count, dtype, world_size_, rank_);
    const size_t element = dtype_bytes(dtype);
    return in_pieces(count, elements_per_exchange(element), [&](size_t first, size_t n) -> Status {
      Result<std::vector<Blob>> messages =
          exchange({Collective::all_gather, dtype, count, 0, first},
                   static_cast<const char*>(send) + first * element, n * element);
      if (!messages) return messages.status();
      for (int r = 0; r < world_size_ && n > 0; ++r) {
        std::memcpy(static_cast<char*>(recv) + (r * count + first) * element,
                    (*messages)[r].data() + kHeaderBytes, n * element);
      }
      return Status::ok();
    });
  }

  Status reduce_scatter(const void* send, void* recv, size_t count, DataType dtype) override {
    sent_ += bytes_sent_by(CollectiveKind::reduce_scatter, count, dtype, world_size_, rank_);
    // Each exchange covers elements [first, first + n) of every rank's slice:
    // this rank sends those of all W slices and sums the ones of its own.
    const size_t element = dtype_bytes(dtype);
    const size_t step = std::max<size_t>(1, elements_per_exchange(element) / world_size_);
    std::vector<char> data;
    std::vector<float> sums;
    return in_pieces(count, step, [&](size_t first, size_t n) -> Status {
      data.resize(world_size_ * n * element);
      for (int q = 0; q < world_size_ && n > 0; ++q) {
        std::memcpy(data.data() + q * n * element,
                    static_cast<const char*>(send) + (q * count + first) * element, n * element);
      }
      Result<std::vector<Blob>> messages =
          exchange({Collective::reduce_scatter, dtype, count, 0, first}, data.data(), data.size());
      if (!messages) return messages.status();
      std::vector<const void*> sources;
      for (const Blob& message : *messages) {
        sources.push_back(message.data() + kHeaderBytes + rank_ * n * element);
      }
      sums.resize(n);
      sum_in_rank_order(sources, 0, n, dtype, sums.data());
      store_sums(sums.data(), n, dtype, recv, first);
      return Status::ok();
    });
  }

  Status all_reduce(const void* send, void* recv, size_t count, DataType dtype) override {
    sent_ += bytes_sent_by(CollectiveKind::all_reduce, count, dtype, world_size_, rank_);
    // send may be recv: an exchange copies its part of send before this rank
    // writes the same part of recv, and later exchanges read later parts.
    const size_t element = dtype_bytes(dtype);
    std::vector<float> sums;
    return in_pieces(count, elements_per_exchange(element), [&](size_t first, size_t n) -> Status {
      Result<std::vector<Blob>> messages =
          exchange({Collective::all_reduce, dtype, count, 0, first},
                   static_cast<const char*>(send) + first * element, n * element);
      if (!messages) return messages.status();
      std::vector<const void*> sources;
      for (const Blob& message : *messages) sources.push_back(message.data() + kHeaderBytes);
      sums.resize(n);
      sum_in_rank_order(sources, 0, n, dtype, sums.data());
      store_sums(sums.data(), n, dtype, recv, first);
      return Status::ok();
    });
  }

  Status broadcast(void* buffer, size_t count, DataType dtype, int root) override {
    sent_ += bytes_sent_by(CollectiveKind::broadcast, count, dtype, world_size_, rank_, root);
    // The root is checked after the first exchange, so that a bad root fails
    // on every rank alike instead of leaving the others waiting.
    const size_t element = dtype_bytes(dtype);
    return in_pieces(count, elements_per_exchange(element), [&](size_t first, size_t n) -> Status {
      Result<std::vector<Blob>> messages =
          exchange({Collective::broadcast, dtype, count, root, first},
                   static_cast<const char*>(buffer) + first * element, n * element, root);
      if (!messages) return messages.status();
      if (root < 0 || root >= world_size_) {
        return Status::error(
            fmt::format("SocketComm broadcast: root {} is not a rank of a world of {}; pass a "
                        "root in 0..{}",
                        root, world_size_, world_size_ - 1));
      }
      if (rank_ != root && n > 0) {
        std::memcpy(static_cast<char*>(buffer) + first * element,
                    (*messages)[root].data() + kHeaderBytes, n * element);
      }
      return Status::ok();
    });
  }

  Status barrier() override {
    return exchange({Collective::barrier, DataType::fp32, 0, 0, 0}, nullptr, 0).status();
  }

 private:
  // Runs body(first, n) over the elements [0, count) in pieces of at most
  // `step`, stopping at the first error; a count of 0 is one empty piece, so
  // every rank still exchanges (and disagreements still surface).
  template <typename Body>
  static Status in_pieces(size_t count, size_t step, Body&& body) {
    size_t first = 0;
    do {
      const size_t n = std::min(step, count - first);
      if (Status s = body(first, n); !s) return s;
      first += n;
    } while (first < count);
    return Status::ok();
  }
  // Elements of `element` bytes that one rank sends in one exchange (at least one).
  size_t elements_per_exchange(size_t element) const {
    return std::max<size_t>(1, exchange_bytes_ / element);
  }

  // Sends `header` and `bytes` of `data` and returns every rank's message
  // (header, then data), once every header has been checked against rank 0's.
  // `only_from` >= 0: only that rank sends its data; the others send none.
  Result<std::vector<Blob>> exchange(const Header& header, const void* data, size_t bytes,
                                     int only_from = -1) {
    const std::string what = fmt::format("SocketComm {} on rank {}", describe(header), rank_);
    if (!rendezvous_) {
      return Status::error(fmt::format(
          "{}: the communicator failed earlier ({}); restart every rank", what, first_failure_));
    }
    const bool sends = only_from < 0 || rank_ == only_from;
    Blob mine(kHeaderBytes + (sends ? bytes : 0));
    encode(header, mine.data());
    if (sends && bytes > 0) std::memcpy(mine.data() + kHeaderBytes, data, bytes);
    Result<std::vector<Blob>> messages = rendezvous_->all_gather(mine);
    if (!messages) return fail(what, messages.status().message());
    if (static_cast<int>(messages->size()) != world_size_) {
      return fail(what,
                  fmt::format("received {} messages for {} ranks", messages->size(), world_size_));
    }
    for (int r = 0; r < world_size_; ++r) {
      if ((*messages)[r].size() < kHeaderBytes) {
        return fail(what, fmt::format("rank {} sent a message of {} bytes, shorter than a header; "
                                      "run the same strata build on every rank",
                                      r, (*messages)[r].size()));
      }
    }
    const Header reference = decode((*messages)[0].data());
    for (int r = 1; r < world_size_; ++r) {
      const Header other = decode((*messages)[r].data());
      if (other == reference) continue;
      // Every rank sees the same headers, so every rank returns this message.
      std::string difference = fmt::format("rank 0 called {}, rank {} called {}",
                                           describe(reference), r, describe(other));
      if (describe(reference) == describe(other)) {
        difference += fmt::format(
            " but split it differently (an exchange from element {} against {}; give every "
            "rank the same SocketCommOptions::exchange_bytes)",
            reference.first, other.first);
      }
      return Status::error(fmt::format(
          "SocketComm {}: ranks disagree: {}; every rank must call the same collectives in "
          "the same order with the same count, dtype and root",
          collective_name(reference.collective), difference));
    }
    for (int r = 0; r < world_size_; ++r) {
      const size_t expected = kHeaderBytes + (only_from < 0 || r == only_from ? bytes : 0);
      if ((*messages)[r].size() != expected) {
        return fail(what, fmt::format("rank {} sent {} bytes where {} were expected; run the "
                                      "same strata build on every rank",
                                      r, (*messages)[r].size(), expected));
      }
    }
    return messages;
  }

  // Closes this rank's connections (so that the other ranks fail at once
  // rather than at their timeout) and remembers why, for later calls.
  Status fail(const std::string& what, const std::string& reason) {
    rendezvous_.reset();
    first_failure_ = reason;
    return Status::error(
        fmt::format("{}: {}; the communicator is closed: restart every rank", what, reason));
  }

  std::unique_ptr<Rendezvous> rendezvous_;  // null once an exchange failed
  int rank_;
  int world_size_;
  size_t exchange_bytes_;
  uint64_t sent_ = 0;
  std::string first_failure_;
};

}  // namespace

Result<std::unique_ptr<Communicator>> make_socket_comm(const LaunchEnvironment& env,
                                                       SocketCommOptions options) {
  Result<std::unique_ptr<Rendezvous>> rendezvous = Rendezvous::join(env, options.timeout);
  if (!rendezvous) {
    return Status::error(fmt::format("SocketComm start-up of rank {} of {}: {}", env.rank,
                                     env.world_size, rendezvous.status().message()));
  }
  return std::unique_ptr<Communicator>(
      std::make_unique<SocketComm>(std::move(*rendezvous), options));
}

}  // namespace strata::comm
