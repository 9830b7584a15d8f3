// Helpers for the CUDA kernel tests (tests/cuda_*_test.cpp): a fixture that
// skips when this machine has no usable GPU, device buffers that upload and
// download host floats in any DType, host-side rounding to bf16/fp16, and the
// two checks every kernel test makes.
//
// How bf16/fp16 are judged. PyTorch is not on the GPU machine's test binary,
// so "PyTorch's own bf16 version of the operation" is emulated on the CPU: the
// float64 reference function is run again with its intermediate results
// rounded to the compute type at the points where PyTorch materialises a bf16
// tensor (each op's reference takes a `round` hook and says where it calls it).
// A GPU result passes when its error against the float64 reference is at most
// twice the emulated version's error (plus kFloorError, fp32-level noise, so
// that ops whose emulation is exact, such as a row lookup, demand a result
// exact to fp32 rounding rather than bit-exact zero).
#pragma once

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "kernels/backend.h"
#include "kernels/cpu/simd.h"
#include "kernels/cuda/ops.h"
#include "tests/kernel_reference.h"

namespace strata::testing {

using kernels::cuda::DType;

// Skips every test of a fixture derived from it when no GPU can be used.
class CudaTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const kernels::GpuQuery query = kernels::query_gpus();
    if (query.devices.empty()) GTEST_SKIP() << "no GPU: " << query.why_none;
    ASSERT_EQ(cudaSetDevice(query.devices[0].index), cudaSuccess);
  }
};

template <typename Param>
class CudaTestWithParam : public CudaTest, public ::testing::WithParamInterface<Param> {};

// A seed that differs per run (fresh random inputs), printed with every failure.
inline uint32_t fresh_seed() {
  static std::random_device device;
  return device();
}

// Rounds x to `type` (round to nearest even) and back, on the host.
inline float round_to(float x, DType type) {
  switch (type) {
    case DType::bf16:
      return kernels::cpu::bf16_to_float(kernels::cpu::float_to_bf16(x));
    case DType::f16:
      return kernels::cpu::f16_to_float(kernels::cpu::float_to_f16(x));
    case DType::f32:
      break;
  }
  return x;
}

inline std::vector<float> rounded(std::vector<float> v, DType type) {
  for (float& x : v) x = round_to(x, type);
  return v;
}

// A rounding hook for the references: identity for float64, `type` for the emulation.
using Round = std::function<double(double)>;
inline Round exact() {
  return [](double x) { return x; };
}
inline Round rounding_to(DType type) {
  return [type](double x) { return static_cast<double>(round_to(static_cast<float>(x), type)); };
}

// Owns `bytes` of device memory.
class DeviceBuffer {
 public:
  explicit DeviceBuffer(std::size_t bytes) : bytes_(bytes) {
    EXPECT_EQ(cudaMalloc(&data_, bytes == 0 ? 1 : bytes), cudaSuccess);
    EXPECT_EQ(cudaMemset(data_, 0, bytes == 0 ? 1 : bytes), cudaSuccess);
  }
  ~DeviceBuffer() { cudaFree(data_); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  void* get() const { return data_; }
  float* f32() const { return static_cast<float*>(data_); }
  std::size_t bytes() const { return bytes_; }

 private:
  void* data_ = nullptr;
  std::size_t bytes_ = 0;
};

// Host floats converted to `type` and copied to a new device buffer.
inline std::unique_ptr<DeviceBuffer> upload(const std::vector<float>& values, DType type) {
  auto buffer = std::make_unique<DeviceBuffer>(values.size() * kernels::cuda::dtype_size(type));
  if (type == DType::f32) {
    EXPECT_EQ(cudaMemcpy(buffer->get(), values.data(), values.size() * 4, cudaMemcpyHostToDevice),
              cudaSuccess);
  } else {
    std::vector<uint16_t> bits(values.size());
    for (size_t i = 0; i < values.size(); ++i) {
      bits[i] = type == DType::bf16 ? kernels::cpu::float_to_bf16(values[i])
                                    : kernels::cpu::float_to_f16(values[i]);
    }
    EXPECT_EQ(cudaMemcpy(buffer->get(), bits.data(), bits.size() * 2, cudaMemcpyHostToDevice),
              cudaSuccess);
  }
  return buffer;
}

template <typename T>
std::unique_ptr<DeviceBuffer> upload_raw(const std::vector<T>& values) {
  auto buffer = std::make_unique<DeviceBuffer>(values.size() * sizeof(T));
  EXPECT_EQ(
      cudaMemcpy(buffer->get(), values.data(), values.size() * sizeof(T), cudaMemcpyHostToDevice),
      cudaSuccess);
  return buffer;
}

// n elements of `type` at device address `data`, as floats (waits for the device).
inline std::vector<float> download(const void* data, std::size_t n, DType type) {
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  std::vector<float> values(n);
  if (type == DType::f32) {
    EXPECT_EQ(cudaMemcpy(values.data(), data, n * 4, cudaMemcpyDeviceToHost), cudaSuccess);
  } else {
    std::vector<uint16_t> bits(n);
    EXPECT_EQ(cudaMemcpy(bits.data(), data, n * 2, cudaMemcpyDeviceToHost), cudaSuccess);
    for (size_t i = 0; i < n; ++i) {
      values[i] = type == DType::bf16 ? kernels::cpu::bf16_to_float(bits[i])
                                      : kernels::cpu::f16_to_float(bits[i]);
    }
  }
  return values;
}

inline std::vector<float> download(const DeviceBuffer& buffer, std::size_t n, DType type) {
  return download(buffer.get(), n, type);
}

// fp32 against the CPU backend: per-tensor relative error |a - b| / |b| (tests/README.md).
inline constexpr double kCudaFp32Tolerance = 1e-4;

inline void expect_matches_cpu(const std::vector<float>& gpu, const std::vector<float>& cpu,
                               const std::string& what) {
  ASSERT_EQ(gpu.size(), cpu.size()) << what;
  const double error = relative_error(gpu, to_double(cpu));
  EXPECT_LE(error, kCudaFp32Tolerance) << what << ": relative error against the CPU backend";
}

inline constexpr double kFloorError = 1e-6;

inline double relative_error(const std::vector<double>& a, const std::vector<double>& b) {
  double diff = 0.0, norm = 0.0;
  for (size_t i = 0; i < b.size(); ++i) {
    diff += (a[i] - b[i]) * (a[i] - b[i]);
    norm += b[i] * b[i];
  }
  return std::sqrt(diff) / std::max(std::sqrt(norm), 1e-300);
}

// Low precision against float64: error(gpu) <= 2 error(emulated PyTorch) + floor.
inline void expect_within_twice_emulated(const std::vector<float>& gpu,
                                         const std::vector<double>& emulated,
                                         const std::vector<double>& reference,
                                         const std::string& what) {
  ASSERT_EQ(gpu.size(), reference.size()) << what;
  ASSERT_EQ(emulated.size(), reference.size()) << what;
  const double gpu_error = relative_error(gpu, reference);
  const double emulated_error = relative_error(emulated, reference);
  EXPECT_LE(gpu_error, 2.0 * emulated_error + kFloorError)
      << what << ": GPU error " << gpu_error << ", emulated PyTorch error " << emulated_error;
}

inline const char* type_label(DType type) {
  return type == DType::bf16 ? "bf16" : type == DType::f16 ? "fp16" : "fp32";
}

inline void expect_ok(const Status& status) {
  EXPECT_TRUE(status.is_ok()) << status.message();
}

}  // namespace strata::testing
