// Launch checks and argument errors of the CUDA kernels (kernels/cuda/common.cuh).
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <string_view>
#include <utility>

#include "io/base/status.h"
#include "kernels/cuda/launch.h"
#include "kernels/cuda/ops.h"

namespace strata::kernels::cuda {

std::string_view dtype_name(DType type) {
  switch (type) {
    case DType::f32:
      return "fp32";
    case DType::bf16:
      return "bf16";
    case DType::f16:
      return "fp16";
  }
  return "unknown";
}

Status check_cuda(cudaError_t error, std::string_view what) {
  if (error == cudaSuccess) return Status::ok();
  cudaGetLastError();
  return Status::error(std::string(what) + ": " + cudaGetErrorString(error));
}

std::size_t dtype_size(DType type) {
  return type == DType::f32 ? 4 : 2;
}

namespace detail {

std::string shape_text(std::initializer_list<std::pair<const char*, int64_t>> dims) {
  std::string text;
  for (const auto& [name, value] : dims) {
    if (!text.empty()) text += ' ';
    text += name;
    text += '=';
    text += std::to_string(value);
  }
  return text;
}

static std::string kernel_label(const char* kernel, DType type, const std::string& shape) {
  return std::string(kernel) + "<" + std::string(dtype_name(type)) + "> (" + shape + ")";
}

Status check_launch(const char* kernel, DType type, const std::string& shape) {
  const cudaError_t err = cudaGetLastError();
  if (err == cudaSuccess) return Status::ok();
  return Status::error(kernel_label(kernel, type, shape) + ": " + cudaGetErrorString(err));
}

Status argument_error(const char* kernel, DType type, const std::string& shape, const char* what) {
  return Status::error(kernel_label(kernel, type, shape) + ": " + what);
}

}  // namespace detail
}  // namespace strata::kernels::cuda
