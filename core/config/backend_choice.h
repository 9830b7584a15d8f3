// Choosing the compute backend at run time.
//
// `auto` picks CUDA when this binary has it and a GPU is visible, else the CPU
// backend with a one-line notice saying why. Asking for `cuda` where there is
// none is an error that says what to do.
#pragma once

#include <string>
#include <string_view>

#include "io/base/status.h"
#include "kernels/backend.h"

namespace strata {

struct BackendChoice {
  kernels::BackendKind kind = kernels::BackendKind::cpu;
  std::string notice;  // one line for the user when the choice was a fallback; else empty
};

// requested: "auto", "cpu" or "cuda".
Result<BackendChoice> choose_backend(std::string_view requested);

const char* backend_name(kernels::BackendKind kind);

}  // namespace strata
