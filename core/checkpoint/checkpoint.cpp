#include "core/checkpoint/checkpoint.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <nmmintrin.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <utility>

#include "core/model/model.h"
#include "core/model/model_config.h"
#include "io/base/status.h"
#include "io/file_system.h"
#include "io/safe_write.h"

namespace strata {
namespace fs = std::filesystem;

namespace {

// CRC32C with the SSE4.2 instruction where the CPU has it, a table otherwise.
const std::array<uint32_t, 256>& crc_table() {
  static const std::array<uint32_t, 256> table = [] {
    std::array<uint32_t, 256> t{};
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? 0x82F63B78u ^ (c >> 1) : c >> 1;
      t[i] = c;
    }
    return t;
  }();
  return table;
}

__attribute__((target("sse4.2"))) uint32_t crc32c_hardware(const unsigned char* p, size_t n,
                                                           uint32_t crc) {
  uint64_t c = crc;
  for (; n >= 8; n -= 8, p += 8) {
    uint64_t word;
    std::memcpy(&word, p, 8);
    c = _mm_crc32_u64(c, word);
  }
  uint32_t c32 = static_cast<uint32_t>(c);
  for (; n > 0; --n, ++p) c32 = _mm_crc32_u8(c32, *p);
  return c32;
}

// What a CheckpointWriter creates, writes, flushes, renames and removes goes through here.
io::FileSystem& file_system() {
  return io::FileSystem::real();
}

// A file of a checkpoint opened for reading; a missing one makes the checkpoint incomplete.
Result<int> open_checkpoint_file(io::FileSystem& file_system, const std::string& path) {
  const int fd = file_system.open(path, O_RDONLY | O_CLOEXEC, 0);
  if (fd == -ENOENT)
    return Status::not_found(fmt::format("{}: missing; the checkpoint is incomplete", path));
  if (fd < 0) return io::file_error(path, "opening", -fd, io::FileAccess::kRead);
  return fd;
}

struct FileDigest {
  uint64_t bytes = 0;
  uint32_t crc = 0;
};

// The size and CRC32C of an open file, read in blocks.
Result<FileDigest> file_digest(io::FileSystem& file_system, int fd, const std::string& path) {
  const int64_t size = file_system.file_size(fd);
  if (size < 0) return io::file_error(path, "finding its size", int(-size), io::FileAccess::kRead);
  std::vector<unsigned char> block(size_t(8) << 20);
  FileDigest digest{uint64_t(size), 0};
  for (uint64_t offset = 0; offset < digest.bytes; offset += block.size()) {
    const size_t bytes = size_t(std::min<uint64_t>(block.size(), digest.bytes - offset));
    if (Status s = io::read_fully(file_system, fd, block.data(), bytes, offset, path); !s) return s;
    digest.crc = crc32c(block.data(), bytes, digest.crc);
  }
  return digest;
}

Result<FileDigest> file_digest(io::FileSystem& file_system, const std::string& path) {
  Result<int> fd = open_checkpoint_file(file_system, path);
  if (!fd) return fd.status();
  Result<FileDigest> digest = file_digest(file_system, *fd, path);
  file_system.close(*fd);  // read-only: nothing a failed close could lose
  return digest;
}

// A file the manifest lists has the size and CRC32C it records.
Status check_against_manifest(io::FileSystem& file_system, const std::string& path,
                              const nlohmann::json& info) {
  Result<int> fd = open_checkpoint_file(file_system, path);
  if (!fd) return fd.status();
  const uint64_t expected = info.value("bytes", uint64_t{0});
  const std::string expected_crc = info.value("crc32c", std::string());
  Status checked = Status::ok();
  if (const int64_t size = file_system.file_size(*fd); size < 0) {
    checked = io::file_error(path, "finding its size", int(-size), io::FileAccess::kRead);
  } else if (uint64_t(size) != expected) {
    checked = Status::corruption(
        fmt::format("{}: {} bytes, the manifest says {}; the file is truncated or damaged", path,
                    size, expected));
  } else if (Result<FileDigest> digest = file_digest(file_system, *fd, path); !digest) {
    checked = digest.status();
  } else if (const std::string crc = fmt::format("{:08x}", digest->crc); crc != expected_crc) {
    checked = Status::corruption(
        fmt::format("{}: CRC32C {} does not match the manifest's {}; the file is damaged", path,
                    crc, expected_crc));
  }
  file_system.close(*fd);
  return checked;
}

Result<nlohmann::json> read_json(io::FileSystem& file_system, const std::string& path) {
  Result<std::string> text = io::read_whole_file(file_system, path);
  if (!text && text.status().is(StatusCode::not_found))
    return Status::not_found(fmt::format("{}: missing; the checkpoint is incomplete", path));
  if (!text) return text.status();
  nlohmann::json j = nlohmann::json::parse(*text, nullptr, false);
  if (j.is_discarded())
    return Status::corruption(fmt::format("{}: not valid JSON; the checkpoint is damaged", path));
  return j;
}

bool is_step_directory(const fs::path& p, int64_t* step) {
  const std::string name = p.filename().string();
  if (name.rfind("step-", 0) != 0) return false;
  try {
    size_t used = 0;
    *step = std::stoll(name.substr(5), &used);
    return used == name.size() - 5;
  } catch (...) {
    return false;
  }
}

}  // namespace

uint32_t crc32c(const void* data, size_t size, uint32_t crc) {
  const auto* p = static_cast<const unsigned char*>(data);
  crc = ~crc;
  if (__builtin_cpu_supports("sse4.2")) {
    crc = crc32c_hardware(p, size, crc);
  } else {
    const auto& table = crc_table();
    for (size_t i = 0; i < size; ++i) crc = table[(crc ^ p[i]) & 0xFF] ^ (crc >> 8);
  }
  return ~crc;
}

// --- writing -------------------------------------------------------------------------

Result<CheckpointWriter> CheckpointWriter::begin(const std::string& root, int64_t step,
                                                 uint64_t bytes) {
  return begin(root, step, bytes, bytes);
}

Result<CheckpointWriter> CheckpointWriter::begin(const std::string& root, int64_t step,
                                                 uint64_t master_bytes, uint64_t moment_bytes) {
  std::error_code error;
  fs::create_directories(root, error);
  if (error)
    return Status::from_errno(error.value(),
                              fmt::format("--save {}: cannot create the directory", root));
  CheckpointWriter writer(root, step);
  // Unfinished checkpoints of runs that were killed while saving.
  for (const auto& entry : fs::directory_iterator(root, error))
    if (entry.path().filename().string().rfind(".tmp-step-", 0) == 0)
      file_system().remove_tree(entry.path().string());
  error.clear();
  if (!fs::create_directory(writer.temporary_, error) || error)
    return Status::error(
        fmt::format("--save {}: cannot create {}: {}; check the directory's permissions", root,
                    writer.temporary_, error ? error.message() : "exists"));
  for (int f = 0; f < 3; ++f) {
    const std::string path = writer.temporary_ + "/" + kCheckpointStateFiles[f];
    const int fd = file_system().open(path, O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0) return io::file_error(path, "creating", -fd);
    writer.fds_[f] = fd;
    const uint64_t bytes = f == 0 ? master_bytes : moment_bytes;
    if (bytes == 0) continue;
    if (const int reserved = file_system().allocate(fd, bytes); reserved != 0)
      return io::file_error(path, fmt::format("reserving {} bytes", bytes), -reserved);
  }
  return writer;
}

Result<CheckpointWriter> CheckpointWriter::join(const std::string& root, int64_t step) {
  CheckpointWriter writer(root, step);
  writer.owner_ = false;
  for (int f = 0; f < 3; ++f) {
    const std::string path = writer.temporary_ + "/" + kCheckpointStateFiles[f];
    const int fd = file_system().open(path, O_RDWR | O_CLOEXEC, 0);
    if (fd < 0)
      return Status::from_errno(
          -fd, fmt::format("{}: cannot open the checkpoint rank 0 began", path),
          "every rank needs the same --save directory, on a file system they share");
    writer.fds_[f] = fd;
  }
  return writer;
}

Status CheckpointWriter::flush() {
  for (int f = 0; f < 3; ++f) {
    if (fds_[f] < 0) continue;
    // The files' sizes were reserved up front, so their data is all there is to flush.
    if (const int synced = file_system().sync(fds_[f], /*data_only=*/true); synced != 0)
      return io::file_error(temporary_ + "/" + kCheckpointStateFiles[f], "flushing", -synced);
  }
  return Status::ok();
}

CheckpointWriter::CheckpointWriter(const std::string& root, int64_t step)
    : root_(root),
      temporary_((fs::path(root) / fmt::format(".tmp-step-{}", step)).string()),
      final_((fs::path(root) / fmt::format("step-{}", step)).string()) {}

CheckpointWriter::CheckpointWriter(CheckpointWriter&& other) noexcept {
  *this = std::move(other);
}

CheckpointWriter& CheckpointWriter::operator=(CheckpointWriter&& other) noexcept {
  std::swap(root_, other.root_);
  std::swap(temporary_, other.temporary_);
  std::swap(final_, other.final_);
  std::swap(fds_, other.fds_);
  std::swap(json_files_, other.json_files_);
  std::swap(owner_, other.owner_);
  return *this;
}

CheckpointWriter::~CheckpointWriter() {
  for (int& fd : fds_)
    if (fd >= 0) file_system().close(fd);
  // An unfinished checkpoint leaves nothing behind (the previous ones are untouched).
  if (owner_ && !temporary_.empty()) file_system().remove_tree(temporary_);
}

Status CheckpointWriter::write(int file, uint64_t offset, const void* bytes, uint64_t size) {
  return io::write_fully(file_system(), fds_[file], bytes, size, offset,
                         temporary_ + "/" + kCheckpointStateFiles[file]);
}

Status CheckpointWriter::write_json(const std::string& name, const nlohmann::json& value) {
  Status status = io::write_file_atomically(temporary_ + "/" + name, value.dump(2) + "\n");
  if (status) json_files_.push_back(name);
  return status;
}

Result<std::string> CheckpointWriter::finish(int keep) {
  nlohmann::ordered_json manifest;
  manifest["format"] = kCheckpointFormat;
  nlohmann::ordered_json files = nlohmann::ordered_json::object();
  if (Status s = flush(); !s) return s;
  for (int f = 0; f < 3; ++f) {
    if (fds_[f] < 0) continue;
    if (const int closed = file_system().close(std::exchange(fds_[f], -1)); closed != 0)
      return io::file_error(temporary_ + "/" + kCheckpointStateFiles[f], "closing", -closed);
  }
  std::vector<std::string> names(json_files_);
  for (const char* name : kCheckpointStateFiles) names.push_back(name);
  for (const std::string& name : names) {
    Result<FileDigest> digest = file_digest(file_system(), temporary_ + "/" + name);
    if (!digest) return digest.status();
    files[name] = {{"bytes", digest->bytes}, {"crc32c", fmt::format("{:08x}", digest->crc)}};
  }
  manifest["files"] = files;
  if (Status s = write_json("manifest.json", manifest); !s) return s;
  // A checkpoint of the same step already there (a rerun) is swapped out, not removed first.
  if (Status s = io::move_directory_into_place(temporary_, final_, file_system()); !s) return s;
  temporary_.clear();

  if (keep > 0) {
    std::error_code error;
    std::vector<std::pair<int64_t, fs::path>> steps;
    for (const auto& entry : fs::directory_iterator(root_, error)) {
      int64_t step = 0;
      if (entry.is_directory() && is_step_directory(entry.path(), &step))
        steps.push_back({step, entry.path()});
    }
    std::sort(steps.begin(), steps.end());
    for (size_t i = 0; i + size_t(keep) < steps.size(); ++i)
      file_system().remove_tree(steps[i].second.string());
  }
  return final_;
}

// --- reading -------------------------------------------------------------------------

CheckpointReader::CheckpointReader(CheckpointReader&& other) noexcept {
  *this = std::move(other);
}

CheckpointReader& CheckpointReader::operator=(CheckpointReader&& other) noexcept {
  std::swap(directory, other.directory);
  std::swap(model, other.model);
  std::swap(train, other.train);
  std::swap(state, other.state);
  std::swap(fds, other.fds);
  std::swap(file_system, other.file_system);
  return *this;
}

CheckpointReader::~CheckpointReader() {
  for (int fd : fds)
    if (fd >= 0) file_system->close(fd);
}

Result<CheckpointReader> CheckpointReader::open(const std::string& dir,
                                                io::FileSystem& file_system) {
  CheckpointReader reader;
  reader.directory = dir;
  reader.file_system = &file_system;
  Result<nlohmann::json> manifest = read_json(file_system, dir + "/manifest.json");
  if (!manifest) return manifest.status();
  if (!manifest->contains("files") || manifest->value("format", 0) != kCheckpointFormat)
    return Status::corruption(fmt::format("{}/manifest.json: not a strata checkpoint of format {}",
                                          dir, kCheckpointFormat));
  for (const auto& [name, info] : (*manifest)["files"].items())
    if (Status s = check_against_manifest(file_system, dir + "/" + name, info); !s) return s;
  std::vector<std::string> required = {"model.json", "train.json", "state.json"};
  required.insert(required.end(), std::begin(kCheckpointStateFiles),
                  std::end(kCheckpointStateFiles));
  for (const std::string& name : required) {
    if (!(*manifest)["files"].contains(name))
      return Status::corruption(fmt::format(
          "{}/manifest.json: does not list {}; the checkpoint is incomplete", dir, name));
  }
  Result<nlohmann::json> model = read_json(file_system, dir + "/model.json");
  if (!model) return model.status();
  Result<nlohmann::json> train = read_json(file_system, dir + "/train.json");
  if (!train) return train.status();
  Result<nlohmann::json> state = read_json(file_system, dir + "/state.json");
  if (!state) return state.status();
  reader.model = std::move(*model);
  reader.train = std::move(*train);
  reader.state = std::move(*state);
  for (int f = 0; f < 3; ++f) {
    Result<int> fd = open_checkpoint_file(file_system, dir + "/" + kCheckpointStateFiles[f]);
    if (!fd) return fd.status();
    reader.fds[f] = *fd;
  }
  return reader;
}

Status CheckpointReader::read(int file, uint64_t offset, void* bytes, uint64_t size) const {
  return io::read_fully(*file_system, fds[file], bytes, size, offset,
                        directory + "/" + kCheckpointStateFiles[file]);
}

int64_t stored_vocab_chunks(const nlohmann::json& units) {
  int64_t chunks = 0;
  for (const nlohmann::json& unit : units.is_array() ? units : nlohmann::json::array())
    if (unit.is_object() && unit.value("name", std::string()).starts_with("embedding.")) ++chunks;
  return std::max<int64_t>(1, chunks);
}

int64_t stored_layer_pieces(const nlohmann::json& units) {
  for (const nlohmann::json& unit : units.is_array() ? units : nlohmann::json::array())
    if (unit.is_object() && unit.value("name", std::string()).ends_with(".attention")) return 2;
  return 1;
}

// The units of the first layer whose names hold `marker` ("layers.i" +
// marker + "g"): how many pieces that cut made of a layer; 1 for none.
static int64_t stored_pieces_of_first_layer(const nlohmann::json& units, const char* marker) {
  int64_t pieces = 0;
  std::string layer;  // the first such layer's name, "layers.i."
  for (const nlohmann::json& unit : units.is_array() ? units : nlohmann::json::array()) {
    const std::string name = unit.is_object() ? unit.value("name", std::string()) : "";
    const size_t at = name.find(marker);
    if (at == std::string::npos) continue;
    if (layer.empty()) layer = name.substr(0, at + 1);
    if (name.starts_with(layer)) ++pieces;
  }
  return std::max<int64_t>(1, pieces);
}

int64_t stored_expert_groups(const nlohmann::json& units) {
  return stored_pieces_of_first_layer(units, ".experts.");
}

int64_t stored_mlp_parts(const nlohmann::json& units) {
  return stored_pieces_of_first_layer(units, ".mlp.");
}

Status export_checkpoint(const std::string& checkpoint, const std::string& out_dir, DType dtype,
                         uint64_t max_shard_bytes) {
  Result<CheckpointReader> reader = CheckpointReader::open(checkpoint);
  if (!reader) return reader.status();
  Result<ModelConfig> config = model_config_from_json(reader->model, checkpoint + "/model.json");
  if (!config) return config.status();
  const nlohmann::json& units = reader->state["units"];
  config->vocab_chunks = stored_vocab_chunks(units);  // a cut run stored its chunks as units
  config->layer_pieces = stored_layer_pieces(units);  // and its layers' pieces
  config->expert_groups = stored_expert_groups(units);  // and its sparse layers' groups
  config->mlp_parts = stored_mlp_parts(units);          // and its dense MLPs' parts
  const ModelLayout layout = model_layout(*config, 1);
  if (!units.is_array() || units.size() != layout.units.size())
    return Status::corruption(fmt::format("{}/state.json: {} units, the model has {}", checkpoint,
                                          units.is_array() ? units.size() : 0,
                                          layout.units.size()));
  const std::vector<CheckpointTensor> tensors = checkpoint_tensor_groups(layout);
  std::vector<TensorSpec> specs;
  for (const CheckpointTensor& t : tensors) specs.push_back({t.name, t.shape});
  std::vector<float> buffer;
  Status read_status = Status::ok();
  std::error_code error;
  std::filesystem::create_directories(out_dir, error);
  if (error)
    return Status::from_errno(error.value(), fmt::format("--out {}: cannot create", out_dir));
  Status written = write_safetensors_checkpoint(
      out_dir, specs, dtype, max_shard_bytes, [&](size_t i) -> const float* {
        const CheckpointTensor& t = tensors[i];
        buffer.resize(size_t(t.numel()));
        for (const NamedTensor& part : t.parts) {  // a cut tensor's parts, run by run
          const TensorSlot& slot = *part.slot;
          const uint64_t offset =
              (units[size_t(part.unit)].value("offset", uint64_t{0}) + uint64_t(slot.offset)) * 4;
          const int64_t run = slot.is_part() ? slot.run_numel() : slot.numel;
          for (int64_t r = 0; r < (slot.is_part() ? slot.runs() : 1); ++r) {
            float* into = buffer.data() + (slot.is_part() ? slot.run_first(r) : 0);
            if (Status s = reader->read(0, offset + uint64_t(r * run) * 4, into, uint64_t(run) * 4);
                !s && read_status)
              read_status = s;
          }
        }
        return buffer.data();
      });
  if (!read_status) return read_status;
  if (!written) return written;
  return write_model_config_json(*config, out_dir, dtype);
}

Result<std::string> find_latest_checkpoint(const std::string& root) {
  std::error_code error;
  if (!fs::is_directory(root, error))
    return Status::not_found(fmt::format("{}: no such directory", root));
  if (fs::exists(fs::path(root) / "manifest.json", error)) return root;
  int64_t best = -1;
  std::string found;
  for (const auto& entry : fs::directory_iterator(root, error)) {
    int64_t step = 0;
    if (!entry.is_directory() || !is_step_directory(entry.path(), &step)) continue;
    if (!fs::exists(entry.path() / "manifest.json", error)) continue;
    if (step > best) {
      best = step;
      found = entry.path().string();
    }
  }
  return found;
}

}  // namespace strata
