// Checkpoint directories: the complete training state, written so that a
// crash at any moment leaves the previous checkpoint intact, and checked on
// load so that a truncated, corrupted or foreign checkpoint is refused with
// one line.
//
// Layout of <root>/step-<N>/ (format 1):
//   model.json      the model's Hugging Face config
//   train.json      the effective training config (train_config_to_json)
//   state.json      step, data position, seed, optimizer driver state, and the
//                   unpadded size of every unit
//   master.bin      fp32 weights, every unit's tensors back to back in unit
//   m.bin, v.bin    order without padding (so any world size can read its
//                   ranges: resharding is a matter of offsets); in the format
//                   state.json's "optimizer_state_dtype" names (absent: fp32):
//                   fp32 or bf16 in that order; int8 per unit and rank range
//                   (rank 0's alone at stage 0), the range's codes, padding
//                   included, then its block scales (fp32), so only the same
//                   world size (and stage 0 or not) reads them
//   manifest.json   every other file with its size and CRC32C; written last
// A checkpoint is written into <root>/.tmp-step-<N>, every file and the
// directory flushed, then renamed to step-<N> and <root> flushed (through
// io/safe_write.h: a step-<N> already there is swapped out atomically where the
// file system can exchange names). Only a directory with a manifest is a
// checkpoint. `keep` removes the oldest beyond it.
//
// Thread-safety: the functions are independent; a CheckpointWriter is used by
// the ranks of one engine, each writing its own byte ranges.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "core/checkpoint/safetensors.h"
#include "io/base/status.h"
#include "io/file_system.h"

namespace strata {

inline constexpr int kCheckpointFormat = 1;
inline constexpr const char* kCheckpointStateFiles[] = {"master.bin", "m.bin", "v.bin"};

// CRC32C (Castagnoli), as iSCSI and ext4 use it; `crc` continues a running value.
uint32_t crc32c(const void* data, size_t size, uint32_t crc = 0);

// The files of a checkpoint being written: created at their full size, written
// by byte range from any thread, flushed and published by finish().
class CheckpointWriter {
 public:
  // Creates <root>/.tmp-step-<step> (removing a stale one) and the state files of `bytes` each.
  static Result<CheckpointWriter> begin(const std::string& root, int64_t step,
                                        uint64_t state_file_bytes);
  // The same with m.bin and v.bin of `moment_file_bytes` each (compact moments).
  static Result<CheckpointWriter> begin(const std::string& root, int64_t step,
                                        uint64_t master_file_bytes, uint64_t moment_file_bytes);
  // Opens the state files that another process's begin() created for the same
  // checkpoint, to write this process's part of them (one rank of several
  // processes). A joined writer writes and flushes; it never finishes the
  // checkpoint nor removes it.
  static Result<CheckpointWriter> join(const std::string& root, int64_t step);
  CheckpointWriter(CheckpointWriter&&) noexcept;
  CheckpointWriter& operator=(CheckpointWriter&&) noexcept;
  ~CheckpointWriter();

  // Writes `bytes` at `offset` of state file `file` (0 master, 1 m, 2 v).
  Status write(int file, uint64_t offset, const void* bytes, uint64_t size);
  // Writes a small JSON file into the checkpoint.
  Status write_json(const std::string& name, const nlohmann::json& value);
  // Flushes every file, writes the manifest, renames the directory into place
  // and flushes the root; then keeps the newest `keep` checkpoints (0: all).
  // Returns the final directory.
  Result<std::string> finish(int keep);

  // Flushes the state files (what a joined writer does once it has written its part).
  Status flush();

  const std::string& temporary_directory() const { return temporary_; }
  const std::string& final_directory() const { return final_; }

 private:
  // Names <root>/.tmp-step-<step> and <root>/step-<step>; opens nothing.
  CheckpointWriter(const std::string& root, int64_t step);
  std::string root_, temporary_, final_;
  int fds_[3] = {-1, -1, -1};
  bool owner_ = true;  // begin() made the temporary directory; a joined writer did not
  std::vector<std::string> json_files_;
};

// A checkpoint opened for reading: the manifest checked (every file present,
// sizes equal, CRC32C equal), the JSON files parsed. Every read goes through
// `file_system`, which must outlive the reader. Errors say by their code what
// kind they are: a missing file or directory is not_found; a truncated,
// changed or foreign file corruption; a failed read an I/O error.
struct CheckpointReader {
  std::string directory;
  nlohmann::json model;
  nlohmann::json train;
  nlohmann::json state;
  int fds[3] = {-1, -1, -1};
  io::FileSystem* file_system = &io::FileSystem::real();

  static Result<CheckpointReader> open(const std::string& directory,
                                       io::FileSystem& file_system = io::FileSystem::real());
  CheckpointReader() = default;
  CheckpointReader(CheckpointReader&&) noexcept;
  CheckpointReader& operator=(CheckpointReader&&) noexcept;
  ~CheckpointReader();
  // `size` bytes at `offset` of state file `file` (0 master, 1 m, 2 v).
  Status read(int file, uint64_t offset, void* bytes, uint64_t size) const;
};

// The vocabulary chunks (strata.vocab_chunks) of the run that wrote state.json's
// "units": its embedding.k units, or 1 when its embedding was whole.
int64_t stored_vocab_chunks(const nlohmann::json& units);
// The layer pieces (strata.layer_pieces) of that run: 2 when it stored its
// layers as layers.i.attention and layers.i.mlp, else 1.
int64_t stored_layer_pieces(const nlohmann::json& units);
// The groups of experts a sparse layer was stored in (ModelConfig::expert_groups):
// its "layers.i.experts.g" units, 1 when there are none.
int64_t stored_expert_groups(const nlohmann::json& units);
// The parts a dense layer's MLP was stored in (ModelConfig::mlp_parts): 1
// when it stored no `layers.i.mlp.p` units.
int64_t stored_mlp_parts(const nlohmann::json& units);

// Streams a checkpoint's fp32 weights into a Hugging Face directory
// (config.json + safetensors, sharded above max_shard_bytes with an index),
// one tensor in memory at a time.
Status export_checkpoint(const std::string& checkpoint, const std::string& out_dir, DType dtype,
                         uint64_t max_shard_bytes = 5ull << 30);

// The newest complete checkpoint under `root` (a directory holding step-*
// directories), or `root` itself when it is a checkpoint; "" when there is none.
Result<std::string> find_latest_checkpoint(const std::string& root);

}  // namespace strata
