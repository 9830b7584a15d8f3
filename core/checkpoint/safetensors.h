// The Hugging Face safetensors format, read and written tensor by tensor.
//
// A file is an 8-byte little-endian header length, a JSON header mapping each
// tensor name to {dtype, shape, data_offsets}, then the raw data. A checkpoint
// is one such file or several shards listed in model.safetensors.index.json
// ({"weight_map": {name: file}}). strata reads F32, BF16 and F16 tensors into
// fp32 and writes any of the three from fp32.
//
// Reading streams: only the header is held in memory, and each tensor is read
// through a bounded buffer and converted straight into the caller's memory.
// Every read goes through an io::FileSystem (the kernel's unless one is
// given), which must outlive the readers opened through it. Every error is a
// Status whose message names the file and the tensor, and whose code says
// what kind it is: a missing file or tensor is not_found; a truncated file or
// a bad header corruption; a tensor of another shape or dtype than asked
// invalid_argument; a failed read an I/O error. Writing goes through
// io::AtomicFileWriter (io/safe_write.h): a temporary file beside the real one,
// flushed and renamed into place only when complete, so an interrupted or
// failed write never leaves a half-written checkpoint under the real name.
//
// Readers are immutable after open() and safe to share between threads;
// writers are not thread-safe.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "io/base/status.h"
#include "io/file_system.h"
#include "io/safe_write.h"

namespace strata {

enum class DType { f32, bf16, f16 };

const char* dtype_name(DType dtype);  // "F32", "BF16", "F16"
int64_t dtype_bytes(DType dtype);
// "F32"/"BF16"/"F16" (as in safetensors headers) or "fp32"/"bf16"/"fp16"/"float32"/...
Result<DType> parse_dtype(const std::string& text);

// fp32 <-> bf16 / f16 with round-to-nearest-even; NaN stays NaN.
uint16_t float_to_bf16(float value);
float bf16_to_float(uint16_t bits);
uint16_t float_to_f16(float value);
float f16_to_float(uint16_t bits);

struct TensorEntry {
  std::string name;
  std::string dtype;  // as written in the header ("F32", "BF16", "I64", ...)
  std::vector<int64_t> shape;
  uint64_t begin = 0;  // byte offsets within the data section
  uint64_t end = 0;
  int64_t numel() const;
};

std::string shape_string(const std::vector<int64_t>& shape);  // "[4, 8]"

// One .safetensors file.
class SafetensorsFile {
 public:
  static Result<SafetensorsFile> open(const std::string& path,
                                      io::FileSystem& file_system = io::FileSystem::real());

  const std::string& path() const { return path_; }
  const std::vector<TensorEntry>& tensors() const { return entries_; }
  const TensorEntry* find(const std::string& name) const;
  const std::map<std::string, std::string>& metadata() const { return metadata_; }

  // Reads `name` into `out` as fp32. The tensor must have exactly `shape`.
  // Elements [first, first + count) of the row-major tensor (count < 0: to the
  // end), so one expert's slice of a fused (E, ...) tensor reads alone.
  Status read_f32(const std::string& name, const std::vector<int64_t>& shape, float* out,
                  int64_t first = 0, int64_t count = -1) const;

 private:
  struct Handle;
  std::string path_;
  std::shared_ptr<Handle> handle_;  // the open file descriptor and its file system
  uint64_t data_offset_ = 0;
  std::vector<TensorEntry> entries_;
  std::map<std::string, size_t> by_name_;
  std::map<std::string, std::string> metadata_;
};

// A checkpoint: one file or a sharded set with model.safetensors.index.json.
class SafetensorsCheckpoint {
 public:
  // `path`: a .safetensors file, a model.safetensors.index.json, or a directory
  // holding model.safetensors or model.safetensors.index.json.
  static Result<SafetensorsCheckpoint> open(const std::string& path,
                                            io::FileSystem& file_system = io::FileSystem::real());

  const std::string& path() const { return path_; }
  std::vector<std::string> tensor_names() const;
  // The entry and the file holding it, or null when the checkpoint lacks it.
  const TensorEntry* find(const std::string& name, const SafetensorsFile** file = nullptr) const;
  // Elements [first, first + count) of the row-major tensor (count < 0: to the
  // end), so one expert's slice of a fused (E, ...) tensor reads alone.
  Status read_f32(const std::string& name, const std::vector<int64_t>& shape, float* out,
                  int64_t first = 0, int64_t count = -1) const;

 private:
  std::string path_;
  std::vector<SafetensorsFile> files_;
  std::map<std::string, size_t> file_of_;  // tensor name -> index into files_
};

struct TensorSpec {
  std::string name;
  std::vector<int64_t> shape;
  int64_t numel() const;
};

// Writes one file; tensors are written in the declared order.
class SafetensorsWriter {
 public:
  static Result<SafetensorsWriter> create(const std::string& path, std::vector<TensorSpec> tensors,
                                          DType dtype,
                                          const std::map<std::string, std::string>& metadata = {
                                              {"format", "pt"}});
  SafetensorsWriter(SafetensorsWriter&&) noexcept;
  SafetensorsWriter& operator=(SafetensorsWriter&&) noexcept;
  ~SafetensorsWriter();  // an unfinished writer removes its temporary file

  // Converts `data` (numel floats of the next declared tensor, which must be `name`).
  Status write(const std::string& name, const float* data);
  // Checks that every tensor was written, flushes, renames the file into place.
  Status finish();

 private:
  SafetensorsWriter() = default;
  std::string path_;
  std::optional<io::AtomicFileWriter> file_;  // empty once finished
  DType dtype_ = DType::f32;
  std::vector<TensorSpec> tensors_;
  size_t next_ = 0;
};

// Writes `tensors` into directory `dir` (created if missing): model.safetensors
// when they fit in one shard of `max_shard_bytes`, else model-0000k-of-0000n
// shards plus model.safetensors.index.json. `fetch(i)` returns the fp32 data of
// tensors[i]; it is called once per tensor, in order.
Status write_safetensors_checkpoint(const std::string& dir, const std::vector<TensorSpec>& tensors,
                                    DType dtype, uint64_t max_shard_bytes,
                                    const std::function<const float*(size_t)>& fetch);

}  // namespace strata
