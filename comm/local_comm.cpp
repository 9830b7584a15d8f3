// LocalComm: ranks as threads, collectives through shared memory.
//
// Each collective is two or three phases separated by a barrier: every rank
// posts its buffers and arguments; every rank computes its own part reading the
// others' buffers (in rank order, for a fixed reduction order); and a final
// barrier keeps a rank from reusing a buffer another rank may still read.
#include <fmt/format.h>

#include <algorithm>
#include <barrier>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "comm/reduction.h"

namespace strata::comm {
namespace {

struct Post {
  const void* send = nullptr;
  void* recv = nullptr;
  size_t count = 0;
  DataType dtype = DataType::fp32;
  int root = 0;
  const char* op = "";
};

struct SharedState {
  explicit SharedState(int world) : world_size(world), posts(world), sync(world) {}
  int world_size;
  std::vector<Post> posts;
  std::vector<std::vector<float>> partials;  // all_reduce: rank r's slice of the sum
  std::barrier<> sync;
};

class LocalComm final : public Communicator {
 public:
  LocalComm(std::shared_ptr<SharedState> shared, int rank)
      : shared_(std::move(shared)), rank_(rank) {}

  int rank() const override { return rank_; }
  int world_size() const override { return shared_->world_size; }

  Status all_gather(const void* send, void* recv, size_t count, DataType dtype) override {
    Status agreed = post({send, recv, count, dtype, 0, "all_gather"});
    if (!agreed.is_ok()) return agreed;
    sent_ += bytes_sent_by(CollectiveKind::all_gather, count, dtype, world_size(), rank_);
    const size_t bytes = count * dtype_bytes(dtype);
    for (int r = 0; r < world_size(); ++r) {
      std::memcpy(static_cast<char*>(recv) + r * bytes, shared_->posts[r].send, bytes);
    }
    shared_->sync.arrive_and_wait();
    return Status::ok();
  }

  Status reduce_scatter(const void* send, void* recv, size_t count, DataType dtype) override {
    Status agreed = post({send, recv, count, dtype, 0, "reduce_scatter"});
    if (!agreed.is_ok()) return agreed;
    sent_ += bytes_sent_by(CollectiveKind::reduce_scatter, count, dtype, world_size(), rank_);
    std::vector<float> sums(count);
    sum_in_rank_order(sends(), static_cast<size_t>(rank_) * count, count, dtype, sums.data());
    store_sums(sums.data(), count, dtype, recv, 0);
    shared_->sync.arrive_and_wait();
    return Status::ok();
  }

  Status all_reduce(const void* send, void* recv, size_t count, DataType dtype) override {
    Status agreed = post({send, recv, count, dtype, 0, "all_reduce"});
    if (!agreed.is_ok()) return agreed;
    sent_ += bytes_sent_by(CollectiveKind::all_reduce, count, dtype, world_size(), rank_);
    // Rank r sums slice r of every rank's buffer in rank order into its partial;
    // after a barrier every rank copies all slices (send may alias recv).
    const int w = world_size();
    const size_t slice = (count + w - 1) / w;
    const size_t begin = std::min(count, slice * rank_);
    const size_t end = std::min(count, begin + slice);
    std::vector<float>& partial = shared_->partials[rank_];
    partial.resize(end - begin);
    sum_in_rank_order(sends(), begin, end - begin, dtype, partial.data());
    shared_->sync.arrive_and_wait();
    for (int r = 0; r < w; ++r) {
      const size_t r_begin = std::min(count, slice * r);
      const std::vector<float>& values = shared_->partials[r];
      store_sums(values.data(), values.size(), dtype, recv, r_begin);
    }
    shared_->sync.arrive_and_wait();
    return Status::ok();
  }

  Status broadcast(void* buffer, size_t count, DataType dtype, int root) override {
    if (root < 0 || root >= world_size()) {
      return Status::error(
          fmt::format("broadcast: root {} is not a rank of a world of {}", root, world_size()));
    }
    Status agreed = post({buffer, buffer, count, dtype, root, "broadcast"});
    if (!agreed.is_ok()) return agreed;
    sent_ += bytes_sent_by(CollectiveKind::broadcast, count, dtype, world_size(), rank_, root);
    if (rank_ != root) {
      std::memcpy(buffer, shared_->posts[root].send, count * dtype_bytes(dtype));
    }
    shared_->sync.arrive_and_wait();
    return Status::ok();
  }

  Status barrier() override {
    shared_->sync.arrive_and_wait();
    return Status::ok();
  }

  uint64_t bytes_sent() const override { return sent_; }

 private:
  // Every rank's posted send buffer, in rank order.
  std::vector<const void*> sends() const {
    std::vector<const void*> buffers;
    for (const Post& post : shared_->posts) buffers.push_back(post.send);
    return buffers;
  }

  // Publishes this rank's arguments and waits for every rank's; then checks
  // that all agree. Every rank sees the same posts, so all fail alike.
  Status post(const Post& mine) {
    shared_->posts[rank_] = mine;
    shared_->sync.arrive_and_wait();
    const Post& first = shared_->posts[0];
    for (int r = 0; r < world_size(); ++r) {
      const Post& other = shared_->posts[r];
      if (std::strcmp(other.op, first.op) != 0 || other.count != first.count ||
          other.dtype != first.dtype || other.root != first.root) {
        std::string message = fmt::format(
            "{}: ranks disagree: rank 0 called {} with {} elements, rank {} called {} with {} "
            "elements; every rank must call the same collectives in the same order",
            mine.op, first.op, first.count, r, other.op, other.count);
        shared_->sync.arrive_and_wait();  // nobody returns while others still read the posts
        return Status::error(message);
      }
    }
    return Status::ok();
  }

  std::shared_ptr<SharedState> shared_;
  int rank_;
  uint64_t sent_ = 0;
};

}  // namespace

size_t dtype_bytes(DataType dtype) {
  return dtype == DataType::fp32 ? 4 : 2;
}

uint64_t bytes_sent_by(CollectiveKind kind, size_t count, DataType dtype, int world, int rank,
                       int root) {
  const uint64_t element = dtype_bytes(dtype), others = uint64_t(std::max(0, world - 1));
  switch (kind) {
    case CollectiveKind::all_gather:
    case CollectiveKind::reduce_scatter:
      return others * count * element;
    case CollectiveKind::all_reduce: {
      const uint64_t begin = count * uint64_t(rank) / uint64_t(world);
      const uint64_t mine = count * uint64_t(rank + 1) / uint64_t(world) - begin;
      return (count - mine) * element + others * mine * element;
    }
    case CollectiveKind::broadcast:
      return rank == root ? others * count * element : 0;
  }
  return 0;
}

std::vector<std::unique_ptr<Communicator>> make_local_group(int world_size) {
  auto shared = std::make_shared<SharedState>(world_size);
  shared->partials.resize(world_size);
  std::vector<std::unique_ptr<Communicator>> group;
  for (int r = 0; r < world_size; ++r) group.push_back(std::make_unique<LocalComm>(shared, r));
  return group;
}

}  // namespace strata::comm
