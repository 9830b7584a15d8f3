#include "io/aligned_buffer.h"

#include <cstdlib>
#include <cstring>
#include <new>
#include <utility>

namespace strata::io {

AlignedBuffer::AlignedBuffer(size_t size, size_t alignment)
    : size_((size + alignment - 1) / alignment * alignment) {
  if (size_ == 0) return;
  data_ = static_cast<std::byte*>(std::aligned_alloc(alignment, size_));
  if (data_ == nullptr) throw std::bad_alloc();
  std::memset(data_, 0, size_);
}

AlignedBuffer::AlignedBuffer(AlignedBuffer&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)), size_(std::exchange(other.size_, 0)) {}

AlignedBuffer& AlignedBuffer::operator=(AlignedBuffer&& other) noexcept {
  if (this != &other) {
    std::free(data_);
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
  }
  return *this;
}

AlignedBuffer::~AlignedBuffer() { std::free(data_); }

}  // namespace strata::io
