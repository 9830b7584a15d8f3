// AlignedBuffer: heap memory whose start and size are multiples of an alignment,
// as O_DIRECT transfers need. Buffers of 2 MiB or more are 2 MiB-aligned, sized
// in whole 2 MiB units and ask for transparent huge pages, which keeps large
// requests in few segments. Owns its memory; move-only; not thread-safe.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

namespace strata::io {

class AlignedBuffer {
 public:
  AlignedBuffer() = default;
  // Size is rounded up to a multiple of the alignment (a power of two). Contents zeroed.
  AlignedBuffer(size_t size, size_t alignment = 4096);
  AlignedBuffer(AlignedBuffer&& other) noexcept;
  AlignedBuffer& operator=(AlignedBuffer&& other) noexcept;
  AlignedBuffer(const AlignedBuffer&) = delete;
  AlignedBuffer& operator=(const AlignedBuffer&) = delete;
  ~AlignedBuffer();

  std::byte* data() const { return data_; }
  size_t size() const { return size_; }
  std::span<std::byte> bytes() const { return {data_, size_}; }

 private:
  std::byte* data_ = nullptr;
  size_t size_ = 0;
};

}  // namespace strata::io
