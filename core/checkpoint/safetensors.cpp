#include "core/checkpoint/safetensors.h"

#include <fmt/format.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cmath>
#include <filesystem>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>

#include "core/config/json_util.h"
#include "io/file_system.h"

namespace strata {
namespace {

constexpr uint64_t kMaxHeaderBytes = 100ull << 20;  // the limit the safetensors library sets
constexpr int64_t kChunkElements = 1 << 18;         // conversion buffer: 1 MiB of fp32

Result<DType> float_dtype(const TensorEntry& entry, const std::string& path) {
  Result<DType> dtype = parse_dtype(entry.dtype);
  if (!dtype.is_ok()) {
    return Status::invalid_argument(
        fmt::format("{}: tensor {} has dtype {}; strata reads F32, BF16 and F16", path, entry.name,
                    entry.dtype));
  }
  return dtype;
}

}  // namespace

const char* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::f32:
      return "F32";
    case DType::bf16:
      return "BF16";
    case DType::f16:
      return "F16";
  }
  return "?";
}

int64_t dtype_bytes(DType dtype) {
  return dtype == DType::f32 ? 4 : 2;
}

Result<DType> parse_dtype(const std::string& text) {
  if (text == "F32" || text == "fp32" || text == "float32") return DType::f32;
  if (text == "BF16" || text == "bf16" || text == "bfloat16") return DType::bf16;
  if (text == "F16" || text == "fp16" || text == "float16") return DType::f16;
  return Status::invalid_argument(
      fmt::format("unknown dtype '{}'; expected F32, BF16 or F16", text));
}

uint16_t float_to_bf16(float value) {
  const uint32_t bits = std::bit_cast<uint32_t>(value);
  if (std::isnan(value)) return static_cast<uint16_t>((bits >> 16) | 0x40);
  const uint32_t rounding = 0x7fff + ((bits >> 16) & 1);
  return static_cast<uint16_t>((bits + rounding) >> 16);
}

float bf16_to_float(uint16_t bits) {
  return std::bit_cast<float>(static_cast<uint32_t>(bits) << 16);
}

uint16_t float_to_f16(float value) {
  const uint32_t bits = std::bit_cast<uint32_t>(value);
  const uint32_t sign = (bits >> 16) & 0x8000;
  const uint32_t abs_bits = bits & 0x7fffffff;
  if (abs_bits >= 0x7f800000) {  // inf or NaN
    return static_cast<uint16_t>(sign | 0x7c00 | (abs_bits > 0x7f800000 ? 0x200 : 0));
  }
  if (abs_bits >= 0x477ff000) return static_cast<uint16_t>(sign | 0x7c00);  // rounds past 65504
  if (abs_bits < 0x38800000) {  // below the smallest normal half: subnormal or zero
    if (abs_bits < 0x33000000)
      return static_cast<uint16_t>(sign);  // under half the smallest subnormal
    const uint32_t mantissa = (abs_bits & 0x7fffff) | 0x800000;
    // value / 2^-24 = mantissa * 2^(exponent - 126); the shift is 14..24.
    const int shift = 126 - static_cast<int>(abs_bits >> 23);
    const uint32_t remainder = mantissa & ((1u << shift) - 1);
    const uint32_t halfway = 1u << (shift - 1);
    uint32_t result = mantissa >> shift;
    if (remainder > halfway || (remainder == halfway && (result & 1))) ++result;
    return static_cast<uint16_t>(sign | result);
  }
  // Normal: rebias the exponent (127 -> 15) and round the mantissa from 23 to 10 bits.
  uint32_t result = ((abs_bits - 0x38000000) >> 13);
  const uint32_t remainder = abs_bits & 0x1fff;
  if (remainder > 0x1000 || (remainder == 0x1000 && (result & 1))) ++result;
  return static_cast<uint16_t>(sign | result);
}

float f16_to_float(uint16_t bits) {
  const uint32_t sign = static_cast<uint32_t>(bits & 0x8000) << 16;
  const uint32_t exponent = (bits >> 10) & 0x1f;
  const uint32_t mantissa = bits & 0x3ff;
  if (exponent == 0) {
    const float magnitude = std::ldexp(static_cast<float>(mantissa), -24);
    return sign ? -magnitude : magnitude;
  }
  if (exponent == 31) return std::bit_cast<float>(sign | 0x7f800000 | (mantissa << 13));
  return std::bit_cast<float>(sign | ((exponent + 112) << 23) | (mantissa << 13));
}

int64_t TensorEntry::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

int64_t TensorSpec::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

std::string shape_string(const std::vector<int64_t>& shape) {
  return fmt::format("[{}]", fmt::join(shape, ", "));
}

// --- reading -------------------------------------------------------------------

struct SafetensorsFile::Handle {
  io::FileSystem* file_system = nullptr;
  int fd = -1;
  ~Handle() {
    if (fd >= 0) file_system->close(fd);
  }
};

namespace {

// One tensor's entry of a header, checked against the data section's size.
Result<TensorEntry> parse_tensor_entry(const std::string& path, const std::string& name,
                                       const nlohmann::json& value, uint64_t data_bytes) {
  auto bad = [&](const std::string& why) {
    return Status::corruption(fmt::format("{}: bad header for tensor {}: {}", path, name, why));
  };
  if (!value.is_object()) return bad("not a JSON object");
  TensorEntry entry;
  entry.name = name;
  if (!value.contains("dtype") || !value["dtype"].is_string()) return bad("missing dtype");
  entry.dtype = value["dtype"].get<std::string>();
  if (!value.contains("shape") || !value["shape"].is_array()) return bad("missing shape");
  for (const auto& d : value["shape"]) {
    if (!d.is_number_integer() || d.get<int64_t>() < 0)
      return bad("shape holds a non-integer or negative");
    entry.shape.push_back(d.get<int64_t>());
  }
  const auto& offsets = value.contains("data_offsets") ? value["data_offsets"] : nlohmann::json();
  if (!offsets.is_array() || offsets.size() != 2 || !offsets[0].is_number_unsigned() ||
      !offsets[1].is_number_unsigned()) {
    return bad("data_offsets must be [begin, end]");
  }
  entry.begin = offsets[0].get<uint64_t>();
  entry.end = offsets[1].get<uint64_t>();
  if (entry.end < entry.begin) return bad("data_offsets end before they begin");
  Result<DType> dtype = parse_dtype(entry.dtype);
  if (dtype.is_ok() &&
      entry.end - entry.begin != static_cast<uint64_t>(entry.numel() * dtype_bytes(*dtype))) {
    return bad(fmt::format("{} bytes in data_offsets but shape {} of {} needs {}",
                           entry.end - entry.begin, shape_string(entry.shape), entry.dtype,
                           entry.numel() * dtype_bytes(*dtype)));
  }
  if (entry.end > data_bytes) {
    return Status::corruption(
        fmt::format("{}: truncated: tensor {} needs data bytes [{}, {}) but the file holds only {}",
                    path, name, entry.begin, entry.end, data_bytes));
  }
  return entry;
}

}  // namespace

Result<SafetensorsFile> SafetensorsFile::open(const std::string& path,
                                              io::FileSystem& file_system) {
  SafetensorsFile file;
  file.path_ = path;
  file.handle_ = std::make_shared<Handle>();
  file.handle_->file_system = &file_system;
  Result<int> fd = io::open_for_reading(file_system, path);
  if (!fd) return fd.status();
  file.handle_->fd = *fd;
  const int64_t size = file_system.file_size(*fd);
  if (size < 0) return io::file_error(path, "finding its size", int(-size), io::FileAccess::kRead);
  const uint64_t file_size = static_cast<uint64_t>(size);
  if (file_size < 8) {
    return Status::corruption(fmt::format(
        "{}: truncated or not a safetensors file: {} bytes, less than the 8-byte header length",
        path, file_size));
  }
  unsigned char length_bytes[8];
  if (Status s = io::read_fully(file_system, *fd, length_bytes, 8, 0, path); !s) return s;
  uint64_t header_bytes = 0;
  for (int i = 7; i >= 0; --i) header_bytes = (header_bytes << 8) | length_bytes[i];
  if (header_bytes > kMaxHeaderBytes) {
    return Status::corruption(fmt::format(
        "{}: bad header: declares a {}-byte JSON header (limit {}); not a safetensors file?", path,
        header_bytes, kMaxHeaderBytes));
  }
  if (8 + header_bytes > file_size) {
    return Status::corruption(fmt::format(
        "{}: truncated: the header declares {} bytes but the file has only {} after the length",
        path, header_bytes, file_size - 8));
  }
  std::string header(header_bytes, '\0');
  if (Status s = io::read_fully(file_system, *fd, header.data(), header_bytes, 8, path); !s)
    return s;
  file.data_offset_ = 8 + header_bytes;
  const uint64_t data_bytes = file_size - file.data_offset_;
  Result<nlohmann::json> json = parse_json_text(header, path + " (safetensors header)");
  if (!json.is_ok())
    return Status::corruption(fmt::format("bad header: {}", json.status().message()));
  if (!json->is_object())
    return Status::corruption(fmt::format("{}: bad header: not a JSON object", path));
  for (const auto& [name, value] : json->items()) {
    if (name == "__metadata__") {
      if (!value.is_object()) {
        return Status::corruption(
            fmt::format("{}: bad header: __metadata__ is not an object", path));
      }
      for (const auto& [key, text] : value.items()) {
        if (text.is_string()) file.metadata_[key] = text.get<std::string>();
      }
      continue;
    }
    Result<TensorEntry> entry = parse_tensor_entry(path, name, value, data_bytes);
    if (!entry) return entry.status();
    file.entries_.push_back(std::move(entry).value());
  }
  std::sort(file.entries_.begin(), file.entries_.end(),
            [](const TensorEntry& a, const TensorEntry& b) { return a.begin < b.begin; });
  for (size_t i = 0; i < file.entries_.size(); ++i) file.by_name_[file.entries_[i].name] = i;
  return file;
}

const TensorEntry* SafetensorsFile::find(const std::string& name) const {
  auto it = by_name_.find(name);
  return it == by_name_.end() ? nullptr : &entries_[it->second];
}

Status SafetensorsFile::read_f32(const std::string& name, const std::vector<int64_t>& shape,
                                 float* out, int64_t first, int64_t count) const {
  const TensorEntry* entry = find(name);
  if (entry == nullptr) return Status::not_found(fmt::format("{}: no tensor {}", path_, name));
  if (entry->shape != shape) {
    return Status::invalid_argument(fmt::format("{}: tensor {} has shape {}, expected {}", path_,
                                                name, shape_string(entry->shape),
                                                shape_string(shape)));
  }
  Result<DType> dtype = float_dtype(*entry, path_);
  if (!dtype.is_ok()) return dtype.status();
  const int64_t element_bytes = dtype_bytes(*dtype);
  const int64_t numel = count >= 0 ? count : entry->numel() - first;
  if (first < 0 || numel < 0 || first + numel > entry->numel()) {
    return Status::invalid_argument(fmt::format("{}: tensor {}: elements [{}, {}) lie outside its {}",
                                                path_, name, first, first + numel, entry->numel()));
  }
  const uint64_t begin = entry->begin + static_cast<uint64_t>(first * element_bytes);
  // The tensor's name first, then the file's line: "tensor x: <path>: reading ...".
  auto read = [&](void* data, uint64_t bytes, uint64_t offset) {
    return io::read_fully(*handle_->file_system, handle_->fd, data, bytes, data_offset_ + offset,
                          path_)
        .with_context(fmt::format("tensor {}", name));
  };
  if (*dtype == DType::f32) return read(out, static_cast<uint64_t>(numel) * 4, begin);
  std::vector<uint16_t> buffer(static_cast<size_t>(std::min(numel, kChunkElements)));
  for (int64_t start = 0; start < numel; start += kChunkElements) {
    const int64_t count = std::min(kChunkElements, numel - start);
    if (Status s = read(buffer.data(), static_cast<uint64_t>(count * element_bytes),
                        begin + static_cast<uint64_t>(start * element_bytes));
        !s) {
      return s;
    }
    if (*dtype == DType::bf16) {
      for (int64_t i = 0; i < count; ++i) out[start + i] = bf16_to_float(buffer[i]);
    } else {
      for (int64_t i = 0; i < count; ++i) out[start + i] = f16_to_float(buffer[i]);
    }
  }
  return Status::ok();
}

Result<SafetensorsCheckpoint> SafetensorsCheckpoint::open(const std::string& path,
                                                          io::FileSystem& file_system) {
  namespace fs = std::filesystem;
  std::error_code ec;
  fs::path target(path);
  if (fs::is_directory(target, ec)) {
    if (fs::exists(target / "model.safetensors.index.json", ec)) {
      target /= "model.safetensors.index.json";
    } else if (fs::exists(target / "model.safetensors", ec)) {
      target /= "model.safetensors";
    } else {
      return Status::not_found(fmt::format(
          "{}: no model.safetensors or model.safetensors.index.json in this directory", path));
    }
  } else if (!fs::exists(target, ec)) {
    return Status::not_found(fmt::format("{}: no such file or directory", path));
  }
  SafetensorsCheckpoint checkpoint;
  checkpoint.path_ = target.string();
  if (target.extension() != ".json") {
    Result<SafetensorsFile> file = SafetensorsFile::open(target.string(), file_system);
    if (!file.is_ok()) return file.status();
    for (const TensorEntry& entry : file->tensors()) checkpoint.file_of_[entry.name] = 0;
    checkpoint.files_.push_back(std::move(file).value());
    return checkpoint;
  }
  Result<std::string> index_text = io::read_whole_file(file_system, target.string());
  if (!index_text) return index_text.status();
  Result<nlohmann::json> index = parse_json_text(*index_text, target.string());
  if (!index.is_ok()) return Status::corruption(index.status().message());
  if (!index->is_object() || !index->contains("weight_map") ||
      !(*index)["weight_map"].is_object()) {
    return Status::corruption(fmt::format(
        "{}: bad index: expected an object with a \"weight_map\" object", target.string()));
  }
  std::map<std::string, size_t> file_index;
  for (const auto& [name, file_name] : (*index)["weight_map"].items()) {
    if (!file_name.is_string()) {
      return Status::corruption(
          fmt::format("{}: bad index: weight_map.{} is not a file name", target.string(), name));
    }
    const std::string shard = file_name.get<std::string>();
    auto it = file_index.find(shard);
    if (it == file_index.end()) {
      Result<SafetensorsFile> file =
          SafetensorsFile::open((target.parent_path() / shard).string(), file_system);
      if (!file.is_ok()) {
        return file.status().with_context(
            fmt::format("{} (shard listed in the index for {})", target.string(), name));
      }
      it = file_index.emplace(shard, checkpoint.files_.size()).first;
      checkpoint.files_.push_back(std::move(file).value());
    }
    if (checkpoint.files_[it->second].find(name) == nullptr) {
      return Status::corruption(
          fmt::format("{}: the index places tensor {} in {}, which has no such tensor",
                      target.string(), name, shard));
    }
    checkpoint.file_of_[name] = it->second;
  }
  return checkpoint;
}

std::vector<std::string> SafetensorsCheckpoint::tensor_names() const {
  std::vector<std::string> names;
  for (const auto& [name, file] : file_of_) names.push_back(name);
  return names;
}

const TensorEntry* SafetensorsCheckpoint::find(const std::string& name,
                                               const SafetensorsFile** file) const {
  auto it = file_of_.find(name);
  if (it == file_of_.end()) return nullptr;
  if (file != nullptr) *file = &files_[it->second];
  return files_[it->second].find(name);
}

Status SafetensorsCheckpoint::read_f32(const std::string& name, const std::vector<int64_t>& shape,
                                       float* out, int64_t first, int64_t count) const {
  auto it = file_of_.find(name);
  if (it == file_of_.end()) {
    return Status::not_found(
        fmt::format("{}: missing tensor {} (shape {})", path_, name, shape_string(shape)));
  }
  return files_[it->second].read_f32(name, shape, out, first, count);
}

// --- writing -------------------------------------------------------------------

Result<SafetensorsWriter> SafetensorsWriter::create(
    const std::string& path, std::vector<TensorSpec> tensors, DType dtype,
    const std::map<std::string, std::string>& metadata) {
  std::set<std::string> seen;
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  uint64_t offset = 0;
  for (const TensorSpec& spec : tensors) {
    if (!seen.insert(spec.name).second) {
      return Status::error(fmt::format("{}: tensor {} listed twice", path, spec.name));
    }
    const uint64_t bytes = static_cast<uint64_t>(spec.numel() * dtype_bytes(dtype));
    header[spec.name] = {{"dtype", dtype_name(dtype)},
                         {"shape", spec.shape},
                         {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');  // the data section starts 8-byte aligned
  Result<io::AtomicFileWriter> file = io::AtomicFileWriter::create(path);
  if (!file) return file.status();
  SafetensorsWriter writer;
  writer.path_ = path;
  writer.file_.emplace(std::move(file).value());
  writer.dtype_ = dtype;
  writer.tensors_ = std::move(tensors);
  unsigned char length_bytes[8];
  for (int i = 0; i < 8; ++i) length_bytes[i] = static_cast<unsigned char>(text.size() >> (8 * i));
  if (Status s = writer.file_->append(length_bytes, 8); !s) return s;
  if (Status s = writer.file_->append(text.data(), text.size()); !s) return s;
  return writer;
}

SafetensorsWriter::SafetensorsWriter(SafetensorsWriter&& other) noexcept = default;
SafetensorsWriter& SafetensorsWriter::operator=(SafetensorsWriter&& other) noexcept = default;
SafetensorsWriter::~SafetensorsWriter() = default;

Status SafetensorsWriter::write(const std::string& name, const float* data) {
  if (!file_) return Status::error(fmt::format("{}: writer is closed", path_));
  if (next_ >= tensors_.size() || tensors_[next_].name != name) {
    return Status::error(
        fmt::format("{}: tensor {} written out of the declared order (expected {})", path_, name,
                    next_ < tensors_.size() ? tensors_[next_].name : "none"));
  }
  const int64_t numel = tensors_[next_].numel();
  if (dtype_ == DType::f32) {
    if (Status s = file_->append(data, static_cast<size_t>(numel) * 4); !s) return s;
  } else {
    std::vector<uint16_t> buffer(static_cast<size_t>(std::min(numel, kChunkElements)));
    for (int64_t start = 0; start < numel; start += kChunkElements) {
      const int64_t count = std::min(kChunkElements, numel - start);
      for (int64_t i = 0; i < count; ++i) {
        buffer[i] =
            dtype_ == DType::bf16 ? float_to_bf16(data[start + i]) : float_to_f16(data[start + i]);
      }
      if (Status s = file_->append(buffer.data(), static_cast<size_t>(count) * 2); !s) return s;
    }
  }
  ++next_;
  return Status::ok();
}

Status SafetensorsWriter::finish() {
  if (!file_) return Status::error(fmt::format("{}: writer is closed", path_));
  if (next_ != tensors_.size()) {
    return Status::error(fmt::format("{}: finished after {} of {} tensors (next: {})", path_, next_,
                                     tensors_.size(), tensors_[next_].name));
  }
  const Status committed = file_->commit();
  file_.reset();
  return committed;
}

Status write_safetensors_checkpoint(const std::string& dir, const std::vector<TensorSpec>& tensors,
                                    DType dtype, uint64_t max_shard_bytes,
                                    const std::function<const float*(size_t)>& fetch) {
  namespace fs = std::filesystem;
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) return Status::error(fmt::format("{}: cannot create directory: {}", dir, ec.message()));
  // Greedy shards in order; a tensor larger than the limit gets a shard of its own.
  std::vector<std::vector<size_t>> shards(1);
  uint64_t shard_bytes = 0, total_bytes = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const uint64_t bytes = static_cast<uint64_t>(tensors[i].numel() * dtype_bytes(dtype));
    if (!shards.back().empty() && shard_bytes + bytes > max_shard_bytes) {
      shards.emplace_back();
      shard_bytes = 0;
    }
    shards.back().push_back(i);
    shard_bytes += bytes;
    total_bytes += bytes;
  }
  const size_t count = shards.size();
  nlohmann::ordered_json weight_map = nlohmann::ordered_json::object();
  for (size_t s = 0; s < count; ++s) {
    const std::string name = count == 1
                                 ? "model.safetensors"
                                 : fmt::format("model-{:05d}-of-{:05d}.safetensors", s + 1, count);
    std::vector<TensorSpec> specs;
    for (size_t i : shards[s]) specs.push_back(tensors[i]);
    Result<SafetensorsWriter> writer =
        SafetensorsWriter::create((fs::path(dir) / name).string(), specs, dtype);
    if (!writer.is_ok()) return writer.status();
    for (size_t i : shards[s]) {
      if (Status st = writer->write(tensors[i].name, fetch(i)); !st) return st;
      weight_map[tensors[i].name] = name;
    }
    if (Status st = writer->finish(); !st) return st;
  }
  const fs::path index_path = fs::path(dir) / "model.safetensors.index.json";
  if (count == 1) {  // a stale index would shadow model.safetensors
    const int removed = io::FileSystem::real().remove_file(index_path.string());
    if (removed != 0 && removed != -ENOENT)
      return io::file_error(index_path.string(), "removing the index of an earlier export",
                            -removed);
    return Status::ok();
  }
  nlohmann::ordered_json index;
  index["metadata"] = {{"total_size", total_bytes}};
  index["weight_map"] = weight_map;
  return io::write_file_atomically(index_path.string(), index.dump(2) + "\n");
}

}  // namespace strata
