#include "core/data/token_data.h"

#include <fmt/format.h>
#include <sys/mman.h>

#include <cstring>
#include <filesystem>

namespace strata {

struct TokenFile::Mapping {
  io::FileSystem* file_system = nullptr;
  const void* address = nullptr;
  size_t bytes = 0;
  ~Mapping() {
    if (address != nullptr) file_system->unmap(address, bytes);
  }
};

Result<TokenFormat> parse_token_format(const std::string& text) {
  if (text == "auto") return TokenFormat::automatic;
  if (text == "nanogpt") return TokenFormat::nanogpt_uint16;
  if (text == "llmc") return TokenFormat::llmc;
  if (text == "uint32") return TokenFormat::raw_uint32;
  return Status::invalid_argument(
      fmt::format("unknown token format '{}'; expected auto, nanogpt, llmc or uint32", text));
}

const char* token_format_name(TokenFormat format) {
  switch (format) {
    case TokenFormat::automatic:
      return "auto";
    case TokenFormat::nanogpt_uint16:
      return "nanogpt";
    case TokenFormat::llmc:
      return "llmc";
    case TokenFormat::raw_uint32:
      return "uint32";
  }
  return "?";
}

// The whole of a token file, mapped read-only; the descriptor is closed either way.
Result<std::shared_ptr<TokenFile::Mapping>> TokenFile::map_file(const std::string& path,
                                                                io::FileSystem& file_system) {
  Result<int> fd = io::open_for_reading(file_system, path);
  if (!fd) return fd.status();
  auto mapping = std::make_shared<Mapping>();
  mapping->file_system = &file_system;
  Status status = Status::ok();
  if (const int64_t size = file_system.file_size(*fd); size < 0) {
    status = io::file_error(path, "finding its size", int(-size), io::FileAccess::kRead);
  } else if (size == 0) {
    status = Status::corruption(fmt::format("{}: empty token file", path));
  } else if (const int mapped = file_system.map(*fd, size_t(size), &mapping->address);
             mapped != 0) {
    status = io::file_error(path, fmt::format("mapping its {} bytes", size), -mapped,
                            io::FileAccess::kRead);
  } else {
    mapping->bytes = size_t(size);
  }
  file_system.close(*fd);  // a mapping outlives its descriptor
  if (!status) return status;
  return mapping;
}

Result<TokenFile> TokenFile::open(const std::string& path, TokenFormat format,
                                  io::FileSystem& file_system) {
  Result<std::shared_ptr<Mapping>> mapped = map_file(path, file_system);
  if (!mapped) return mapped.status();
  TokenFile file;
  file.path_ = path;
  file.mapping_ = std::move(mapped).value();
  const uint64_t bytes = file.mapping_->bytes;
  ::madvise(const_cast<void*>(file.mapping_->address), bytes, MADV_SEQUENTIAL);
  const auto* data = static_cast<const unsigned char*>(file.mapping_->address);

  int32_t first = 0;
  if (bytes >= 4) std::memcpy(&first, data, 4);
  const bool llmc_magic = first == kLlmcMagicUint16 || first == kLlmcMagicUint32;
  if (format == TokenFormat::automatic)
    format = llmc_magic ? TokenFormat::llmc : TokenFormat::nanogpt_uint16;
  file.format_ = format;

  if (format == TokenFormat::llmc) {
    const uint64_t header_bytes = kLlmcHeaderInts * 4;
    if (!llmc_magic) {
      return Status::corruption(fmt::format(
          "{}: not an llm.c token shard: magic {} (expected {} for uint16 or {} for uint32 tokens)",
          path, first, kLlmcMagicUint16, kLlmcMagicUint32));
    }
    if (bytes < header_bytes) {
      return Status::corruption(
          fmt::format("{}: truncated llm.c shard: {} bytes, less than its {}-byte header", path,
                      bytes, header_bytes));
    }
    int32_t header[kLlmcHeaderInts];
    std::memcpy(header, data, header_bytes);
    file.token_bytes_ = first == kLlmcMagicUint16 ? 2 : 4;
    const int64_t declared = header[2];
    const uint64_t payload = bytes - header_bytes;
    if (declared < 0 || payload != static_cast<uint64_t>(declared) * file.token_bytes_) {
      return Status::corruption(fmt::format(
          "{}: corrupt llm.c shard: the header declares {} tokens ({} bytes) but the file holds {} "
          "bytes after the header (truncated or wrong format)",
          path, declared, declared * file.token_bytes_, payload));
    }
    file.tokens_begin_ = data + header_bytes;
    file.tokens_ = declared;
  } else {
    file.token_bytes_ = format == TokenFormat::raw_uint32 ? 4 : 2;
    if (bytes % file.token_bytes_ != 0) {
      return Status::corruption(
          fmt::format("{}: {} bytes is not a whole number of {}-byte tokens ({} format)", path,
                      bytes, file.token_bytes_, token_format_name(format)));
    }
    file.tokens_begin_ = data;
    file.tokens_ = static_cast<int64_t>(bytes / file.token_bytes_);
  }
  if (file.tokens_ < 2) {
    return Status::invalid_argument(
        fmt::format("{}: holds {} token(s); training needs at least 2", path, file.tokens_));
  }
  return file;
}

uint32_t TokenFile::at(int64_t i) const {
  if (token_bytes_ == 2) {
    uint16_t value;
    std::memcpy(&value, tokens_begin_ + i * 2, 2);
    return value;
  }
  uint32_t value;
  std::memcpy(&value, tokens_begin_ + i * 4, 4);
  return value;
}

Status TokenFile::read_sequence(int64_t j, int64_t T, int64_t vocab_size, int32_t* inputs,
                                int32_t* targets) const {
  const int64_t sequences = sequence_count(T);
  if (j < 0 || j >= sequences) {
    return Status::invalid_argument(
        fmt::format("{}: sequence {} out of range: {} tokens hold {} sequences of {}+1", path_, j,
                    tokens_, sequences, T));
  }
  const int64_t start = j * T;
  for (int64_t t = 0; t <= T; ++t) {
    const uint32_t token = at(start + t);
    if (static_cast<int64_t>(token) >= vocab_size) {
      return Status::invalid_argument(fmt::format(
          "{}: token {} at position {} is outside the model's vocabulary of {} (data tokenized for "
          "another model, or the wrong format: this file was read as {})",
          path_, token, start + t, vocab_size, token_format_name(format_)));
    }
    if (t < T) inputs[t] = static_cast<int32_t>(token);
    if (t > 0) targets[t - 1] = static_cast<int32_t>(token);
  }
  return Status::ok();
}

std::string loss_mask_path(const std::string& token_path) {
  return std::filesystem::path(token_path).replace_extension(".mask").string();
}

void TokenFile::expect_random_access() const {
  if (mapping_ && mapping_->address != nullptr)
    ::madvise(const_cast<void*>(mapping_->address), mapping_->bytes, MADV_RANDOM);
}

int64_t sequence_index(const SequenceOrder& order, int64_t offset, int64_t micro, int64_t rank,
                       int64_t world, int64_t B, int64_t b, int64_t sequences) {
  return order.sequence(batch_position(offset, micro, rank, world, B, b), sequences);
}

int64_t sequence_index(int64_t offset, int64_t micro, int64_t rank, int64_t world, int64_t B,
                       int64_t b, int64_t sequences) {
  return sequence_index(SequenceOrder(), offset, micro, rank, world, B, b, sequences);
}

Status read_micro_batch(const TokenFile& file, const SequenceOrder& order, int64_t offset,
                        int64_t micro, int64_t rank, int64_t world, int64_t B, int64_t T,
                        int64_t vocab_size, int32_t* inputs, int32_t* targets) {
  const int64_t sequences = file.sequence_count(T);
  if (sequences == 0) {
    return Status::invalid_argument(
        fmt::format("{}: {} tokens are fewer than one sequence of {} + 1; use a shorter sequence "
                    "length or more data",
                    file.path(), file.size(), T));
  }
  for (int64_t b = 0; b < B; ++b) {
    const int64_t j = sequence_index(order, offset, micro, rank, world, B, b, sequences);
    if (Status s = file.read_sequence(j, T, vocab_size, inputs + b * T, targets + b * T); !s)
      return s;
  }
  return Status::ok();
}

Status read_micro_batch(const TokenFile& file, int64_t offset, int64_t micro, int64_t rank,
                        int64_t world, int64_t B, int64_t T, int64_t vocab_size, int32_t* inputs,
                        int32_t* targets) {
  return read_micro_batch(file, SequenceOrder(), offset, micro, rank, world, B, T, vocab_size,
                          inputs, targets);
}

}  // namespace strata
