// GlooComm (comm/gloo_comm.h): the collectives as direct sends between every
// pair of ranks over Gloo's TCP transport, summed in rank order here.
//
// A header is 32 bytes, integers little-endian:
//   collective u32, dtype u32, count u64 (elements per rank, as in the call),
//   root i32, unused 12 bytes.
#include "comm/gloo_comm.h"

#include <fmt/format.h>
#include <gloo/context.h>
#include <gloo/transport/context.h>
#include <gloo/transport/device.h>
#include <gloo/transport/pair.h>
#include <gloo/transport/tcp/address.h>
#include <gloo/transport/tcp/device.h>
#include <gloo/transport/unbound_buffer.h>
#include <gloo/types.h>

#include <algorithm>
#include <csignal>
#include <cstring>
#include <exception>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "comm/reduction.h"

namespace strata::comm {
namespace {

using Clock = std::chrono::steady_clock;

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

struct Header {
  Collective collective = Collective::barrier;
  DataType dtype = DataType::fp32;
  uint64_t count = 0;
  int32_t root = 0;

  bool operator==(const Header&) const = default;
};

constexpr size_t kHeaderBytes = 32;

// Gloo's own collectives take slot prefixes from 0x01 up; these are above them.
constexpr uint8_t kHeaderSlot = 0x70;
constexpr uint8_t kPieceSlot = 0x71;   // reduce_scatter, all_reduce's first half, all_gather
constexpr uint8_t kResultSlot = 0x72;  // all_reduce's second half, broadcast

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
}

Header decode(const uint8_t* in) {
  Header header;
  header.collective = static_cast<Collective>(get_le(in, 4));
  header.dtype = get_le(in + 4, 4) == 0 ? DataType::fp32 : DataType::bf16;
  header.count = get_le(in + 8, 8);
  header.root = static_cast<int32_t>(static_cast<uint32_t>(get_le(in + 16, 4)));
  return header;
}

// "all_reduce of 1037 fp32 elements", with the root of a broadcast.
std::string describe(const Header& header) {
  if (header.collective == Collective::barrier) return "barrier";
  std::string text = fmt::format("{} of {} {} elements", collective_name(header.collective),
                                 header.count, header.dtype == DataType::fp32 ? "fp32" : "bf16");
  if (header.collective == Collective::broadcast) text += fmt::format(" from root {}", header.root);
  return text;
}

// Gloo's messages start with "[file:line] ": the reader needs what follows.
std::string without_source_location(std::string text) {
  if (!text.empty() && text.front() == '[') {
    const size_t end = text.find("] ");
    if (end != std::string::npos) text.erase(0, end + 2);
  }
  std::replace(text.begin(), text.end(), '\n', ' ');
  return text;
}

// A wait on one peer that failed: which peer, and Gloo's reason.
struct PeerFailure {
  int peer;
  std::string reason;
  bool timed_out;
};

// The ranks' pairs, connected by exchanging their addresses through the
// rendezvous (Gloo's own connectFullMesh needs a key-value store; the
// rendezvous is a group of all-gathers, which is all this takes).
class MeshContext final : public gloo::Context {
 public:
  MeshContext(int rank, int size) : gloo::Context(rank, size) {}

  // Connects a pair to every other rank; returns each peer's address as Gloo
  // prints it ("" for this rank), to name ranks in Gloo's errors.
  std::vector<std::string> connect(Rendezvous& rendezvous,
                                   const std::shared_ptr<gloo::transport::Device>& device) {
    auto transport = device->createContext(rank, size);
    transport->setTimeout(getTimeout());
    // This rank's blob: for each other rank q, q (u32), the length (u32) and
    // the address of the pair that q is to connect to.
    Blob mine;
    for (int q = 0; q < size; ++q) {
      if (q == rank) continue;
      const std::vector<char> address = transport->createPair(q)->address().bytes();
      uint8_t prefix[8];
      put_le(prefix, uint32_t(q), 4);
      put_le(prefix + 4, uint32_t(address.size()), 4);
      mine.insert(mine.end(), prefix, prefix + 8);
      mine.insert(mine.end(), address.begin(), address.end());
    }
    Result<std::vector<Blob>> all = rendezvous.all_gather(mine);
    if (!all) throw std::runtime_error(all.status().message());
    std::vector<std::string> names(static_cast<size_t>(size));
    for (int q = 0; q < size; ++q) {
      if (q == rank) continue;
      const std::vector<char> address = address_for_me((*all)[size_t(q)], q);
      names[size_t(q)] = gloo::transport::tcp::Address(address).str();
      transport->getPair(q)->connect(address);
    }
    device_ = device;
    transportContext_ = std::move(transport);
    return names;
  }

 private:
  // The address rank `from` made for this rank, from its blob.
  std::vector<char> address_for_me(const Blob& blob, int from) const {
    size_t at = 0;
    while (blob.size() - at >= 8) {
      const uint64_t to = get_le(blob.data() + at, 4);
      const uint64_t length = get_le(blob.data() + at + 4, 4);
      at += 8;
      if (blob.size() - at < length) break;
      if (to == uint64_t(rank)) {
        return std::vector<char>(blob.begin() + long(at), blob.begin() + long(at + length));
      }
      at += length;
    }
    throw std::runtime_error(
        fmt::format("rank {} sent no address for rank {}; run the same strata build on every rank",
                    from, rank));
  }
};

class GlooComm final : public Communicator {
 public:
  GlooComm(std::shared_ptr<MeshContext> context, std::vector<std::string> peer_names,
           const GlooCommOptions& options)
      : context_(std::move(context)),
        peer_names_(std::move(peer_names)),
        rank_(context_->rank),
        world_size_(context_->size),
        timeout_(options.timeout),
        exchange_bytes_(std::max<size_t>(1, options.exchange_bytes)) {}

  int rank() const override { return rank_; }
  int world_size() const override { return world_size_; }
  uint64_t bytes_sent() const override { return data_bytes_sent_; }

  Status all_gather(const void* send, void* recv, size_t count, DataType dtype) override {
    const Header header{Collective::all_gather, dtype, count, 0};
    return run(header, [&](Clock::time_point deadline) {
      const size_t bytes = count * dtype_bytes(dtype);
      char* out = static_cast<char*>(recv);
      // send may lie inside recv (in place): move this rank's part last.
      exchange_pieces(
          bytes, deadline, kPieceSlot,
          [&](int, size_t first) { return static_cast<const char*>(send) + first; },
          [&](int from, size_t first) { return out + from * bytes + first; });
      std::memmove(out + rank_ * bytes, send, bytes);
    });
  }

  Status reduce_scatter(const void* send, void* recv, size_t count, DataType dtype) override {
    const Header header{Collective::reduce_scatter, dtype, count, 0};
    return run(header, [&](Clock::time_point deadline) {
      const char* in = static_cast<const char*>(send);
      const size_t slice = count * dtype_bytes(dtype);
      reduce_pieces(
          count, dtype, deadline, [&](int owner) { return in + owner * slice; }, recv);
    });
  }

  Status all_reduce(const void* send, void* recv, size_t count, DataType dtype) override {
    // Segment r of the buffer, [begin(r), begin(r + 1)), is summed by rank r.
    // send may be recv: a rank writes only its own segment in the first half,
    // which it never sends there, and the others' in the second, after the
    // first half is done.
    const Header header{Collective::all_reduce, dtype, count, 0};
    return run(header, [&](Clock::time_point deadline) {
      const size_t element = dtype_bytes(dtype);
      const auto begin = [&](int r) { return count * size_t(r) / size_t(world_size_); };
      const char* in = static_cast<const char*>(send);
      char* out = static_cast<char*>(recv);
      const size_t mine = begin(rank_ + 1) - begin(rank_);
      reduce_pieces(
          mine, dtype, deadline, [&](int) { return in + begin(rank_) * element; },
          out + begin(rank_) * element, [&](int owner) { return in + begin(owner) * element; },
          [&](int owner) { return (begin(owner + 1) - begin(owner)) * element; });
      exchange_pieces_varied(
          deadline, kResultSlot, [&](int) { return mine * element; },
          [&](int, size_t first) { return out + begin(rank_) * element + first; },
          [&](int from) { return (begin(from + 1) - begin(from)) * element; },
          [&](int from, size_t first) { return out + begin(from) * element + first; });
    });
  }

  Status broadcast(void* buffer, size_t count, DataType dtype, int root) override {
    const Header header{Collective::broadcast, dtype, count, root};
    if (root < 0 || root >= world_size_) {
      // Every rank still exchanges headers, so all of them refuse alike.
      Status agreed = run(header, [](Clock::time_point) {});
      if (!agreed) return agreed;
      return Status::error(
          fmt::format("GlooComm broadcast: root {} is not a rank of a world of {}; pass a root "
                      "in 0..{}",
                      root, world_size_, world_size_ - 1));
    }
    return run(header, [&](Clock::time_point deadline) {
      const size_t bytes = count * dtype_bytes(dtype);
      char* data = static_cast<char*>(buffer);
      exchange_pieces_varied(
          deadline, kResultSlot, [&](int) { return rank_ == root ? bytes : 0; },
          [&](int, size_t first) { return data + first; },
          [&](int from) { return from == root ? bytes : 0; },
          [&](int, size_t first) { return data + first; });
    });
  }

  // Every rank sends its header to every other and waits for all of theirs:
  // that is a barrier.
  Status barrier() override { return run({Collective::barrier, DataType::fp32, 0, 0}, nullptr); }

 private:
  using Body = std::function<void(Clock::time_point)>;
  using Buffers = std::vector<std::unique_ptr<gloo::transport::UnboundBuffer>>;

  // Exchanges and checks headers, then runs `body` (may be null), turning
  // Gloo's exceptions into one-line errors.
  Status run(const Header& header, const Body& body) {
    const std::string what = fmt::format("GlooComm {} on rank {}", describe(header), rank_);
    if (!failure_.empty()) {
      return Status::error(fmt::format(
          "{}: the communicator failed earlier ({}); restart every rank", what, failure_));
    }
    const Clock::time_point deadline = Clock::now() + timeout_;
    try {
      std::vector<uint8_t> headers(size_t(world_size_) * kHeaderBytes);
      encode(header, headers.data() + size_t(rank_) * kHeaderBytes);
      exchange(
          deadline, gloo::Slot::build(kHeaderSlot, 0),
          [&](int) { return headers.data() + size_t(rank_) * kHeaderBytes; },
          [&](int from) { return headers.data() + size_t(from) * kHeaderBytes; },
          [&](int) { return kHeaderBytes; }, [&](int) { return kHeaderBytes; });
      const Header reference = decode(headers.data());
      for (int r = 1; r < world_size_; ++r) {
        const Header other = decode(headers.data() + size_t(r) * kHeaderBytes);
        if (other == reference) continue;
        // Every rank sees the same headers, so every rank returns this message.
        return Status::error(fmt::format(
            "GlooComm {}: ranks disagree: rank 0 called {}, rank {} called {}; every rank must "
            "call the same collectives in the same order with the same count, dtype and root",
            collective_name(reference.collective), describe(reference), r, describe(other)));
      }
      if (body) body(deadline);
      return Status::ok();
    } catch (const PeerFailure& failure) {
      const double seconds = timeout_.count() / 1000.0;
      const std::string reason =
          failure.timed_out
              ? fmt::format(
                    "waited {} s for rank {}; is rank {} still running (see its error), or "
                    "does it need a longer timeout?",
                    seconds, failure.peer, failure.peer)
              : fmt::format("rank {} closed the connection (did it fail? see its error): {}",
                            failure.peer, name_peers(failure.reason));
      return fail(what, reason);
    } catch (const std::exception& error) {
      return fail(what, name_peers(without_source_location(error.what())));
    }
  }

  // Sends send_at(q) (send_bytes(q) bytes) to every other rank q and receives
  // recv_bytes(q) bytes from it into recv_at(q), in one go, on `slot`; returns
  // when all are done. A rank with nothing to send or receive skips it.
  template <typename SendAt, typename RecvAt, typename SendBytes, typename RecvBytes>
  void exchange(Clock::time_point deadline, uint64_t slot, SendAt send_at, RecvAt recv_at,
                SendBytes send_bytes, RecvBytes recv_bytes) {
    Buffers recvs(static_cast<size_t>(world_size_)), sends(static_cast<size_t>(world_size_));
    for (int q = 0; q < world_size_; ++q) {
      if (q == rank_) continue;
      if (const size_t n = recv_bytes(q); n > 0) {
        recvs[size_t(q)] = context_->createUnboundBuffer(recv_at(q), n);
        with_peer(q, [&] { recvs[size_t(q)]->recv(q, slot); });
      }
    }
    for (int q = 0; q < world_size_; ++q) {
      if (q == rank_) continue;
      if (const size_t n = send_bytes(q); n > 0) {
        sends[size_t(q)] = context_->createUnboundBuffer(
            const_cast<void*>(static_cast<const void*>(send_at(q))), n);
        with_peer(q, [&] { sends[size_t(q)]->send(q, slot); });
      }
    }
    for (int q = 0; q < world_size_; ++q) {
      if (recvs[size_t(q)]) wait(*recvs[size_t(q)], q, deadline, true);
    }
    for (int q = 0; q < world_size_; ++q) {
      if (sends[size_t(q)]) wait(*sends[size_t(q)], q, deadline, false);
    }
  }

  // `bytes` from send_at(q, first) to every q and from every q into
  // recv_at(q, first), in pieces of at most exchange_bytes_.
  template <typename SendAt, typename RecvAt>
  void exchange_pieces(size_t bytes, Clock::time_point deadline, uint8_t prefix, SendAt send_at,
                       RecvAt recv_at) {
    exchange_pieces_varied(
        deadline, prefix, [&](int) { return bytes; }, send_at, [&](int) { return bytes; }, recv_at);
  }

  // As exchange_pieces, with per-peer sizes: send_bytes(q) bytes to q from
  // send_at(q, first), recv_bytes(q) from q into recv_at(q, first).
  template <typename SendBytes, typename SendAt, typename RecvBytes, typename RecvAt>
  void exchange_pieces_varied(Clock::time_point deadline, uint8_t prefix, SendBytes send_bytes,
                              SendAt send_at, RecvBytes recv_bytes, RecvAt recv_at) {
    size_t most = 0;
    for (int q = 0; q < world_size_; ++q) {
      if (q == rank_) continue;
      most = std::max({most, send_bytes(q), recv_bytes(q)});
    }
    for (size_t first = 0, piece = 0; first < most; first += exchange_bytes_, ++piece) {
      const auto part = [&](size_t total) {
        return first < total ? std::min(exchange_bytes_, total - first) : size_t(0);
      };
      exchange(
          deadline, gloo::Slot::build(prefix, uint32_t(piece)),
          [&](int q) { return send_at(q, first); }, [&](int q) { return recv_at(q, first); },
          [&](int q) { return part(send_bytes(q)); }, [&](int q) { return part(recv_bytes(q)); });
      for (int q = 0; q < world_size_; ++q) {
        if (q != rank_) data_bytes_sent_ += part(send_bytes(q));
      }
    }
  }

  // The rank-order sum of one slice: `count` elements, rank r's at
  // contribution(r) (this rank's own and, through the wire, the others'),
  // into `out`. Every other rank q is sent q's slice, peer_slice(q) (of
  // peer_bytes(q) bytes); by default the slices of a reduce_scatter:
  // contribution(q), count elements. The next piece travels while this one
  // is summed.
  template <typename Contribution>
  void reduce_pieces(size_t count, DataType dtype, Clock::time_point deadline,
                     Contribution contribution, void* out) {
    const size_t bytes = count * dtype_bytes(dtype);
    reduce_pieces(count, dtype, deadline, contribution, out, contribution,
                  [bytes](int) { return bytes; });
  }

  template <typename Contribution, typename PeerSlice, typename PeerBytes>
  void reduce_pieces(size_t count, DataType dtype, Clock::time_point deadline, Contribution own,
                     void* out, PeerSlice peer_slice, PeerBytes peer_bytes) {
    const size_t element = dtype_bytes(dtype);
    const size_t step = std::max<size_t>(1, exchange_bytes_ / element);
    size_t most = 0;  // bytes, the largest slice any peer is sent
    for (int q = 0; q < world_size_; ++q) {
      if (q != rank_) most = std::max(most, peer_bytes(q));
    }
    const size_t pieces =
        std::max((count + step - 1) / step, (most + step * element - 1) / (step * element));
    // Two sets of staging buffers, kept between calls: piece k lands in set
    // k % 2, peer q's part at q * piece_bytes.
    const size_t piece_bytes = std::min(step, count) * element;
    for (std::vector<char>& set : staging_) {
      if (set.size() < size_t(world_size_) * piece_bytes)
        set.resize(size_t(world_size_) * piece_bytes);
    }
    struct InFlight {
      Buffers recvs, sends;
    };
    InFlight flights[2];
    const auto post = [&](size_t piece) {
      InFlight& flight = flights[piece % 2];
      flight.recvs.clear();
      flight.recvs.resize(size_t(world_size_));
      flight.sends.clear();
      flight.sends.resize(size_t(world_size_));
      const uint64_t slot = gloo::Slot::build(kPieceSlot, uint32_t(piece));
      const size_t first = piece * step;
      const size_t mine = first < count ? std::min(step, count - first) : 0;
      for (int q = 0; q < world_size_; ++q) {
        if (q == rank_ || mine == 0) continue;
        flight.recvs[size_t(q)] = context_->createUnboundBuffer(
            staging_[piece % 2].data() + size_t(q) * piece_bytes, mine * element);
        with_peer(q, [&] { flight.recvs[size_t(q)]->recv(q, slot); });
      }
      for (int q = 0; q < world_size_; ++q) {
        if (q == rank_) continue;
        const size_t total = peer_bytes(q), from = first * element;
        if (from >= total) continue;
        const size_t n = std::min(step * element, total - from);
        flight.sends[size_t(q)] = context_->createUnboundBuffer(
            const_cast<char*>(static_cast<const char*>(peer_slice(q)) + from), n);
        with_peer(q, [&] { flight.sends[size_t(q)]->send(q, slot); });
        data_bytes_sent_ += n;
      }
    };
    if (sums_.size() < std::min(step, count)) sums_.resize(std::min(step, count));
    std::vector<const void*> sources(static_cast<size_t>(world_size_));
    if (pieces > 0) post(0);
    for (size_t piece = 0; piece < pieces; ++piece) {
      if (piece + 1 < pieces) post(piece + 1);
      InFlight& flight = flights[piece % 2];
      const size_t first = piece * step;
      const size_t n = first < count ? std::min(step, count - first) : 0;
      for (int q = 0; q < world_size_; ++q) {
        if (flight.recvs[size_t(q)]) wait(*flight.recvs[size_t(q)], q, deadline, true);
      }
      if (n > 0) {
        for (int q = 0; q < world_size_; ++q) {
          sources[size_t(q)] = q == rank_ ? static_cast<const char*>(own(q)) + first * element
                                          : staging_[piece % 2].data() + size_t(q) * piece_bytes;
        }
        sum_in_rank_order(sources, 0, n, dtype, sums_.data());
        store_sums(sums_.data(), n, dtype, out, first);
      }
      for (int q = 0; q < world_size_; ++q) {
        if (flight.sends[size_t(q)]) wait(*flight.sends[size_t(q)], q, deadline, false);
      }
    }
  }

  // Waits for one transfer with peer `q`, until `deadline`.
  void wait(gloo::transport::UnboundBuffer& buffer, int q, Clock::time_point deadline,
            bool receive) {
    const auto left =
        std::max(std::chrono::milliseconds(1),
                 std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()));
    with_peer(q, [&] { receive ? buffer.waitRecv(left) : buffer.waitSend(left); });
  }

  // Runs `post` (a send, a receive or a wait with peer `q`); Gloo's exception
  // becomes a PeerFailure naming q.
  template <typename Post>
  static void with_peer(int q, Post&& post) {
    try {
      post();
    } catch (const std::exception& error) {
      const std::string reason = without_source_location(error.what());
      throw PeerFailure{q, reason, reason.find("Timed out") != std::string::npos};
    }
  }

  // Gloo names a peer by its address; the reader thinks in ranks.
  std::string name_peers(std::string text) const {
    for (int q = 0; q < world_size_; ++q) {
      const std::string& name = peer_names_[size_t(q)];
      if (name.empty()) continue;
      for (size_t at = text.find(name); at != std::string::npos;
           at = text.find(name, at + name.size())) {
        const std::string named = fmt::format("rank {} at {}", q, name);
        text.replace(at, name.size(), named);
        at += named.size() - name.size();
      }
    }
    return text;
  }

  // Closes this rank's connections (so that the other ranks fail at once
  // rather than at their timeout) and remembers why, for later calls.
  Status fail(const std::string& what, const std::string& reason) {
    failure_ = reason;
    try {
      context_->closeConnections();
    } catch (const std::exception&) {
      // Already closed by the failure itself.
    }
    return Status::error(
        fmt::format("{}: {}; the communicator is closed: restart every rank", what, reason));
  }

  std::shared_ptr<MeshContext> context_;
  std::vector<std::string> peer_names_;
  int rank_;
  int world_size_;
  std::chrono::milliseconds timeout_;
  size_t exchange_bytes_;
  uint64_t data_bytes_sent_ = 0;
  std::string failure_;  // non-empty once a call failed
  // The reductions' staging (two pieces from every peer) and sums, grown to
  // the largest piece so far and kept, so that a call allocates nothing.
  std::vector<char> staging_[2];
  std::vector<float> sums_;
};

}  // namespace

Result<std::unique_ptr<Communicator>> make_gloo_comm(const LaunchEnvironment& env,
                                                     GlooCommOptions options) {
  if (env.world_size == 1) return std::move(make_local_group(1)[0]);
  const std::string where =
      fmt::format("GlooComm start-up of rank {} of {}", env.rank, env.world_size);
  Result<std::unique_ptr<Rendezvous>> rendezvous = Rendezvous::join(env, options.timeout);
  if (!rendezvous)
    return Status::error(fmt::format("{}: {}", where, rendezvous.status().message()));
  // A write to a peer that has gone must be an error Gloo reports, not a
  // signal that ends the process.
  std::signal(SIGPIPE, SIG_IGN);
  const std::string address = (*rendezvous)->local_address();
  try {
    gloo::transport::tcp::attr attr;
    attr.hostname = address;
    std::shared_ptr<gloo::transport::Device> device = gloo::transport::tcp::CreateDevice(attr);
    auto context = std::make_shared<MeshContext>(env.rank, env.world_size);
    context->setTimeout(options.timeout);
    std::vector<std::string> names = context->connect(**rendezvous, device);
    return std::unique_ptr<Communicator>(
        std::make_unique<GlooComm>(std::move(context), std::move(names), options));
  } catch (const std::exception& error) {
    return Status::error(fmt::format(
        "{}: connecting the ranks' pairs from {} failed: {}; check that every rank can reach the "
        "others' addresses (the interface that reaches MASTER_ADDR {})",
        where, address, without_source_location(error.what()), env.master_addr));
  }
}

}  // namespace strata::comm
