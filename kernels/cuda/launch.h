// Internal to kernels/cuda: the error texts every kernel launch returns, in one
// form: "kernel<type> (shape): what went wrong". Host-only, so both .cu and
// .cpp files of the backend use it.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <string>
#include <utility>

#include "io/base/status.h"
#include "kernels/cuda/ops.h"

namespace strata::kernels::cuda::detail {

// "N=8 C=2048" from names and values, for error messages.
std::string shape_text(std::initializer_list<std::pair<const char*, int64_t>> dims);

// OK, or "kernel<type> (shape): CUDA error text" for the last launch error
// (which it clears).
Status check_launch(const char* kernel, DType type, const std::string& shape);

// An argument error in the same form as a launch error.
Status argument_error(const char* kernel, DType type, const std::string& shape, const char* what);

}  // namespace strata::kernels::cuda::detail
