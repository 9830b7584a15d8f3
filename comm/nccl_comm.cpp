// NcclComm (comm/nccl_comm.h): NCCL collectives on one GPU per process, host
// buffers staged through device buffers it owns.
#include "comm/nccl_comm.h"

#include <fmt/format.h>
#include <unistd.h>

#include <cstring>
#include <map>
#include <string>
#include <thread>

#if STRATA_HAS_CUDA
#include <cuda_runtime_api.h>
#include <nccl.h>
#endif

namespace strata::comm {

#if STRATA_HAS_CUDA
namespace {

const char* dtype_name(DataType dtype) {
  return dtype == DataType::fp32 ? "fp32" : "bf16";
}

ncclDataType_t nccl_type(DataType dtype) {
  return dtype == DataType::fp32 ? ncclFloat32 : ncclBfloat16;
}

// NCCL's last-error text can span lines; a Status is one.
std::string one_line(const char* text) {
  std::string line = text ? text : "";
  while (!line.empty() && (line.back() == '\n' || line.back() == ' ')) line.pop_back();
  for (size_t at = 0; (at = line.find('\n', at)) != std::string::npos;) line.replace(at, 1, "; ");
  return line;
}

std::string host_name() {
  char name[256] = {};
  if (::gethostname(name, sizeof(name) - 1) != 0) return "unknown-host";
  return name;
}

// Makes `gpu` the current device for a scope and restores the previous one.
class DeviceScope {
 public:
  explicit DeviceScope(int gpu) {
    if (cudaGetDevice(&previous_) != cudaSuccess) previous_ = -1;
    if (previous_ != gpu) cudaSetDevice(gpu);
  }
  ~DeviceScope() {
    if (previous_ >= 0) cudaSetDevice(previous_);
  }
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;

 private:
  int previous_ = -1;
};

// Device memory this communicator owns, grown to the largest request so far,
// or memory handed to it (adopt), used as long as requests fit.
class StagingBuffer {
 public:
  StagingBuffer() = default;
  ~StagingBuffer() { release(); }
  StagingBuffer(const StagingBuffer&) = delete;
  StagingBuffer& operator=(const StagingBuffer&) = delete;

  // At least `bytes` of device memory, or the CUDA error.
  cudaError_t reserve(size_t bytes) {
    if (bytes <= bytes_) return cudaSuccess;
    release();
    const cudaError_t error = cudaMalloc(&data_, bytes);
    if (error != cudaSuccess) {
      data_ = nullptr;
      cudaGetLastError();  // not sticky: a later, smaller call may succeed
      return error;
    }
    bytes_ = bytes;
    return cudaSuccess;
  }
  void* get() const { return data_; }
  // Uses `bytes` at `data` (not freed here) from now on.
  void adopt(void* data, size_t bytes) {
    release();
    data_ = data;
    bytes_ = bytes;
    owned_ = false;
  }
  void release() {
    if (data_ && owned_) cudaFree(data_);
    data_ = nullptr;
    bytes_ = 0;
    owned_ = true;
  }

 private:
  void* data_ = nullptr;
  size_t bytes_ = 0;
  bool owned_ = true;
};

// One collective call, for error messages: "all_reduce of 1000 bf16 elements".
struct Call {
  const char* op;
  size_t count;
  DataType dtype;
};

class NcclCommImpl final : public NcclComm {
 public:
  NcclCommImpl(int rank, int world_size, int gpu)
      : rank_(rank), world_size_(world_size), gpu_(gpu) {}

  ~NcclCommImpl() override {
    DeviceScope scope(gpu_);
    if (stream_ && comm_) {
      wait({"closing", 0, DataType::fp32});  // aborts rather than hangs if a peer has gone
    } else if (stream_) {
      cudaStreamSynchronize(stream_);
    }
    if (comm_) ncclCommDestroy(comm_);
    if (stream_) cudaStreamDestroy(stream_);
    if (scratch_) cudaFree(scratch_);
    staging_send_.release();
    staging_recv_.release();
  }

  // Creates the stream and the NCCL communicator (every rank must call it).
  Status start(const ncclUniqueId& id) {
    DeviceScope scope(gpu_);
    cudaError_t error = cudaStreamCreate(&stream_);  // ordered after the legacy default stream
    if (error == cudaSuccess) error = cudaMalloc(&scratch_, sizeof(float));
    if (error != cudaSuccess) {
      return Status::error(
          fmt::format("{}: cannot create its CUDA stream and scratch buffer on GPU {}: {}", who(),
                      gpu_, cudaGetErrorString(error)));
    }
    const ncclResult_t result = ncclCommInitRank(&comm_, world_size_, id, rank_);
    if (result != ncclSuccess) {
      comm_ = nullptr;
      return Status::error(fmt::format(
          "{}: ncclCommInitRank on GPU {} failed: {} ({}); set NCCL_DEBUG=WARN for NCCL's view",
          who(), gpu_, ncclGetErrorString(result), one_line(ncclGetLastError(nullptr))));
    }
    return Status::ok();
  }

  int rank() const override { return rank_; }
  int world_size() const override { return world_size_; }
  uint64_t bytes_sent() const override { return sent_; }
  int gpu_index() const override { return gpu_; }
  CUstream_st* stream() const override { return stream_; }

  Status all_gather(const void* send, void* recv, size_t count, DataType dtype) override {
    sent_ += bytes_sent_by(CollectiveKind::all_gather, count, dtype, world_size_, rank_);
    const Call call{"all_gather", count, dtype};
    const size_t bytes = count * dtype_bytes(dtype);
    return run_staged(call, send, bytes, recv, bytes * world_size_, true,
                      [&](const void* s, void* r, cudaStream_t stream) {
                        return ncclAllGather(s, r, count, nccl_type(dtype), comm_, stream);
                      });
  }

  Status reduce_scatter(const void* send, void* recv, size_t count, DataType dtype) override {
    sent_ += bytes_sent_by(CollectiveKind::reduce_scatter, count, dtype, world_size_, rank_);
    const Call call{"reduce_scatter", count, dtype};
    const size_t bytes = count * dtype_bytes(dtype);
    return run_staged(call, send, bytes * world_size_, recv, bytes, true,
                      [&](const void* s, void* r, cudaStream_t stream) {
                        return ncclReduceScatter(s, r, count, nccl_type(dtype), ncclSum, comm_,
                                                 stream);
                      });
  }

  Status all_reduce(const void* send, void* recv, size_t count, DataType dtype) override {
    sent_ += bytes_sent_by(CollectiveKind::all_reduce, count, dtype, world_size_, rank_);
    const Call call{"all_reduce", count, dtype};
    const size_t bytes = count * dtype_bytes(dtype);
    return run_staged(call, send, bytes, recv, bytes, true,
                      [&](const void* s, void* r, cudaStream_t stream) {
                        return ncclAllReduce(s, r, count, nccl_type(dtype), ncclSum, comm_, stream);
                      });
  }

  Status broadcast(void* buffer, size_t count, DataType dtype, int root) override {
    sent_ += bytes_sent_by(CollectiveKind::broadcast, count, dtype, world_size_, rank_, root);
    const Call call{"broadcast", count, dtype};
    Status valid = check_root(call, root);
    if (!valid.is_ok()) return valid;
    const size_t bytes = count * dtype_bytes(dtype);
    // Only the root's contents matter: the others skip the upload.
    return run_staged(call, buffer, bytes, buffer, bytes, rank_ == root,
                      [&](const void* s, void* r, cudaStream_t stream) {
                        return ncclBroadcast(s, r, count, nccl_type(dtype), root, comm_, stream);
                      });
  }

  void use_staging(void* send, void* recv, size_t bytes) override {
    staging_send_.adopt(send, bytes);
    staging_recv_.adopt(recv, bytes);
  }

  Status barrier() override {
    const Call call{"barrier", 1, DataType::fp32};
    DeviceScope scope(gpu_);
    if (!comm_) return closed(call);
    Status status = check_nccl(
        call, ncclAllReduce(scratch_, scratch_, 1, ncclFloat32, ncclSum, comm_, stream_));
    if (!status.is_ok()) return status;
    return wait(call);
  }

  Status all_gather_async(const void* send, void* recv, size_t count, DataType dtype,
                          CUstream_st* stream) override {
    const Call call{"all_gather_async", count, dtype};
    return run_async(call, send, recv, stream, [&](cudaStream_t s) {
      return ncclAllGather(send, recv, count, nccl_type(dtype), comm_, s);
    });
  }

  Status reduce_scatter_async(const void* send, void* recv, size_t count, DataType dtype,
                              CUstream_st* stream) override {
    const Call call{"reduce_scatter_async", count, dtype};
    return run_async(call, send, recv, stream, [&](cudaStream_t s) {
      return ncclReduceScatter(send, recv, count, nccl_type(dtype), ncclSum, comm_, s);
    });
  }

  Status all_reduce_async(const void* send, void* recv, size_t count, DataType dtype,
                          CUstream_st* stream) override {
    const Call call{"all_reduce_async", count, dtype};
    return run_async(call, send, recv, stream, [&](cudaStream_t s) {
      return ncclAllReduce(send, recv, count, nccl_type(dtype), ncclSum, comm_, s);
    });
  }

  Status broadcast_async(void* buffer, size_t count, DataType dtype, int root,
                         CUstream_st* stream) override {
    const Call call{"broadcast_async", count, dtype};
    Status valid = check_root(call, root);
    if (!valid.is_ok()) return valid;
    return run_async(call, buffer, buffer, stream, [&](cudaStream_t s) {
      return ncclBroadcast(buffer, buffer, count, nccl_type(dtype), root, comm_, s);
    });
  }

 private:
  std::string who() const { return fmt::format("NcclComm rank {} of {}", rank_, world_size_); }

  std::string describe(const Call& call) const {
    return fmt::format("{}: {} of {} {} elements", who(), call.op, call.count,
                       dtype_name(call.dtype));
  }

  Status check_nccl(const Call& call, ncclResult_t result) const {
    if (result == ncclSuccess) return Status::ok();
    const std::string last = one_line(ncclGetLastError(comm_));
    return Status::error(fmt::format("{}: NCCL error: {}{}{}; set NCCL_DEBUG=WARN for NCCL's view",
                                     describe(call), ncclGetErrorString(result),
                                     last.empty() ? "" : ": ", last));
  }

  Status check_cuda(const Call& call, const char* what, cudaError_t error) const {
    if (error == cudaSuccess) return Status::ok();
    return Status::error(
        fmt::format("{}: {} on GPU {}: {}", describe(call), what, gpu_, cudaGetErrorString(error)));
  }

  Status check_root(const Call& call, int root) const {
    if (root >= 0 && root < world_size_) return Status::ok();
    return Status::error(fmt::format("{}: root {} is not a rank of a world of {}", describe(call),
                                     root, world_size_));
  }

  // Whether `pointer` is device memory usable on this GPU (true), host memory
  // (false), or a device pointer of another GPU (error).
  Result<bool> on_device(const Call& call, const char* which, const void* pointer) const {
    if (pointer == nullptr) {
      return Status::error(fmt::format("{}: the {} buffer is null", describe(call), which));
    }
    cudaPointerAttributes attributes{};
    if (cudaPointerGetAttributes(&attributes, pointer) != cudaSuccess) {
      cudaGetLastError();  // an unknown pointer is host memory; clear the error
      return false;
    }
    if (attributes.type == cudaMemoryTypeManaged) return true;
    if (attributes.type != cudaMemoryTypeDevice) return false;
    if (attributes.device != gpu_) {
      return Status::error(fmt::format(
          "{}: the {} buffer is on GPU {} but this communicator uses GPU {}; allocate it on GPU {}",
          describe(call), which, attributes.device, gpu_, gpu_));
    }
    return true;
  }

  // Runs `collective(device_send, device_recv, stream_)`, staging host buffers:
  // send (send_bytes, uploaded when `upload_send`) and recv (recv_bytes).
  template <typename Collective>
  Status run_staged(const Call& call, const void* send, size_t send_bytes, void* recv,
                    size_t recv_bytes, bool upload_send, Collective&& collective) {
    if (!comm_) return closed(call);
    if (call.count == 0) return Status::ok();
    Result<bool> send_on_device = on_device(call, "send", send);
    if (!send_on_device) return send_on_device.status();
    Result<bool> recv_on_device = on_device(call, "recv", recv);
    if (!recv_on_device) return recv_on_device.status();
    DeviceScope scope(gpu_);

    const void* device_send = send;
    void* device_recv = recv;
    if (!*send_on_device) {
      Status reserved = reserve(call, staging_send_, send_bytes);
      if (!reserved.is_ok()) return reserved;
      device_send = staging_send_.get();
      if (upload_send) {
        Status copied = check_cuda(call, "cudaMemcpyAsync (host to device)",
                                   cudaMemcpyAsync(staging_send_.get(), send, send_bytes,
                                                   cudaMemcpyHostToDevice, stream_));
        if (!copied.is_ok()) return copied;
      }
    }
    if (!*recv_on_device) {
      if (recv == send) {
        device_recv = const_cast<void*>(device_send);  // in place stays in place
      } else {
        Status reserved = reserve(call, staging_recv_, recv_bytes);
        if (!reserved.is_ok()) return reserved;
        device_recv = staging_recv_.get();
      }
    }
    Status ran = check_nccl(call, collective(device_send, device_recv, stream_));
    if (!ran.is_ok()) return ran;
    if (!*recv_on_device) {
      Status copied = check_cuda(
          call, "cudaMemcpyAsync (device to host)",
          cudaMemcpyAsync(recv, device_recv, recv_bytes, cudaMemcpyDeviceToHost, stream_));
      if (!copied.is_ok()) return copied;
    }
    return wait(call);
  }

  // Waits for this communicator's stream. Unlike cudaStreamSynchronize it also
  // watches NCCL's asynchronous error (a rank that failed or left), and then
  // aborts the communicator instead of waiting forever.
  Status wait(const Call& call) {
    for (int polls = 0;; ++polls) {
      const cudaError_t state = cudaStreamQuery(stream_);
      if (state == cudaSuccess) return Status::ok();
      if (state != cudaErrorNotReady) return check_cuda(call, "waiting for the stream", state);
      ncclResult_t async = ncclSuccess;
      ncclCommGetAsyncError(comm_, &async);
      if (async != ncclSuccess && async != ncclInProgress) {
        const std::string last = one_line(ncclGetLastError(comm_));
        ncclCommAbort(comm_);
        comm_ = nullptr;
        return Status::error(fmt::format(
            "{}: NCCL failed while it ran: {}{}{}; a rank may have failed or left (see the "
            "other ranks' errors); this communicator is now closed",
            describe(call), ncclGetErrorString(async), last.empty() ? "" : ": ", last));
      }
      // Short collectives finish within the first polls; longer ones need not spin.
      if (polls < 1000) {
        std::this_thread::yield();
      } else {
        std::this_thread::sleep_for(std::chrono::microseconds(50));
      }
    }
  }

  Status closed(const Call& call) const {
    return Status::error(fmt::format(
        "{}: this communicator was closed by an earlier NCCL failure; start a new one (every "
        "rank must)",
        describe(call)));
  }

  template <typename Collective>
  Status run_async(const Call& call, const void* send, const void* recv, CUstream_st* stream,
                   Collective&& collective) {
    if (!comm_) return closed(call);
    if (call.count == 0) return Status::ok();
    for (auto [which, pointer] : {std::pair{"send", send}, std::pair{"recv", recv}}) {
      Result<bool> device = on_device(call, which, pointer);
      if (!device) return device.status();
      if (!*device) {
        return Status::error(fmt::format(
            "{}: the {} buffer is host memory; the async calls take device buffers (use {} "
            "without _async to stage host buffers)",
            describe(call), which,
            std::string(call.op).substr(0, std::string(call.op).size() - 6)));
      }
    }
    DeviceScope scope(gpu_);
    return check_nccl(call, collective(stream));
  }

  Status reserve(const Call& call, StagingBuffer& buffer, size_t bytes) {
    const cudaError_t error = buffer.reserve(bytes);
    if (error == cudaSuccess) return Status::ok();
    return Status::error(fmt::format(
        "{}: cannot allocate {} bytes of staging memory on GPU {}: {}; pass device buffers or "
        "free device memory",
        describe(call), bytes, gpu_, cudaGetErrorString(error)));
  }

  int rank_;
  int world_size_;
  uint64_t sent_ = 0;
  int gpu_;
  ncclComm_t comm_ = nullptr;
  cudaStream_t stream_ = nullptr;
  float* scratch_ = nullptr;  // (1) the barrier's all-reduce
  StagingBuffer staging_send_;
  StagingBuffer staging_recv_;
};

// This rank's GPU as "host bus-id", or why it cannot be used.
struct LocalGpu {
  std::string identity;  // "host 0000:3b:00.0"
  std::string problem;   // empty when usable
};

LocalGpu inspect_gpu(int gpu_index) {
  int count = 0;
  const cudaError_t error = cudaGetDeviceCount(&count);
  if (error != cudaSuccess || count == 0) {
    cudaGetLastError();
    return {"", fmt::format("no usable GPU ({}); NcclComm needs one GPU per process",
                            error != cudaSuccess ? cudaGetErrorString(error) : "no devices")};
  }
  if (gpu_index < 0 || gpu_index >= count) {
    return {"",
            fmt::format("GPU index {} is not one of the {} GPU(s) this process sees (0..{}); start "
                        "at most one rank per GPU on each node, and check CUDA_VISIBLE_DEVICES",
                        gpu_index, count, count - 1)};
  }
  char bus_id[64] = {};
  const cudaError_t bus = cudaDeviceGetPCIBusId(bus_id, sizeof(bus_id), gpu_index);
  if (bus != cudaSuccess) {
    cudaGetLastError();
    return {"", fmt::format("GPU {} cannot be queried: {}", gpu_index, cudaGetErrorString(bus))};
  }
  return {fmt::format("{} {}", host_name(), bus_id), ""};
}

}  // namespace
#endif  // STRATA_HAS_CUDA

Result<std::unique_ptr<NcclComm>> make_nccl_comm(const LaunchEnvironment& env, int gpu_index,
                                                 const NcclCommOptions& options) {
#if !STRATA_HAS_CUDA
  (void)env;
  (void)gpu_index;
  (void)options;
  return Status::error(
      "NcclComm: strata was built without CUDA; rebuild it where the CUDA toolkit and NCCL are "
      "installed, or run the ranks as threads of one process (--world-size)");
#else
  const std::string who = fmt::format("NcclComm rank {} of {}", env.rank, env.world_size);
  // This rank's GPU first, so that a rank without one can tell the others
  // through the rendezvous rather than leave them waiting.
  const LocalGpu local = inspect_gpu(gpu_index);
  Result<std::unique_ptr<Rendezvous>> rendezvous =
      Rendezvous::join(env, options.rendezvous_timeout);
  const Status local_status = local.problem.empty()
                                  ? Status::ok()
                                  : Status::error(fmt::format("{}: {}", who, local.problem));
  if (!rendezvous)
    return local_status.is_ok() ? rendezvous.status().with_context(who) : local_status;

  const std::string mine =
      local.problem.empty() ? "ok " + local.identity : "error " + local.problem;
  Result<std::vector<Blob>> all = (*rendezvous)->all_gather(Blob(mine.begin(), mine.end()));
  if (!local_status.is_ok()) return local_status;
  if (!all) return all.status().with_context(who);
  std::map<std::string, int> first_rank_on;  // identity -> rank
  for (int r = 0; r < env.world_size; ++r) {
    const std::string text((*all)[r].begin(), (*all)[r].end());
    if (text.rfind("error ", 0) == 0) {
      return Status::error(
          fmt::format("{}: rank {} cannot start: {}; fix it and start every rank again", who, r,
                      text.substr(6)));
    }
    const std::string identity = text.substr(3);
    auto [it, inserted] = first_rank_on.emplace(identity, r);
    if (!inserted) {
      const size_t space = identity.rfind(' ');
      return Status::error(fmt::format(
          "{}: ranks {} and {} both use GPU {} on host {}; NCCL needs one GPU per process: start "
          "at most as many ranks per node as it has GPUs (rank r uses GPU LOCAL_RANK; check "
          "LOCAL_RANK and CUDA_VISIBLE_DEVICES)",
          who, it->second, r, identity.substr(space + 1), identity.substr(0, space)));
    }
  }

  // Rank 0 makes the NCCL id; an empty blob says it could not.
  ncclUniqueId id{};
  Blob id_blob;
  Status id_status;
  if (env.rank == 0) {
    const ncclResult_t result = ncclGetUniqueId(&id);
    if (result == ncclSuccess) {
      id_blob.assign(reinterpret_cast<const uint8_t*>(&id),
                     reinterpret_cast<const uint8_t*>(&id) + sizeof(id));
    } else {
      id_status = Status::error(fmt::format("{}: ncclGetUniqueId failed: {} ({})", who,
                                            ncclGetErrorString(result),
                                            one_line(ncclGetLastError(nullptr))));
    }
  }
  Status sent = (*rendezvous)->broadcast(id_blob);
  if (!id_status.is_ok()) return id_status;
  if (!sent.is_ok()) return sent.with_context(who);
  if (id_blob.size() != sizeof(id)) {
    return Status::error(
        fmt::format("{}: rank 0 could not create the NCCL id (see rank 0's error)", who));
  }
  std::memcpy(&id, id_blob.data(), sizeof(id));

  auto comm = std::make_unique<NcclCommImpl>(env.rank, env.world_size, gpu_index);
  Status started = comm->start(id);
  if (!started.is_ok()) return started;
  return std::unique_ptr<NcclComm>(std::move(comm));
#endif
}

}  // namespace strata::comm
