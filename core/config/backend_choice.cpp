#include "core/config/backend_choice.h"

#include <fmt/format.h>

namespace strata {

const char* backend_name(kernels::BackendKind kind) {
  return kind == kernels::BackendKind::cuda ? "cuda" : "cpu";
}

Result<BackendChoice> choose_backend(std::string_view requested) {
  BackendChoice choice;
  if (requested == "cpu") return choice;
  if (requested != "auto" && requested != "cuda") {
    return Status::error(fmt::format("--backend: expected cpu, cuda or auto, got '{}'", requested));
  }
  kernels::GpuQuery gpus = kernels::query_gpus();
  if (!gpus.devices.empty()) {
    choice.kind = kernels::BackendKind::cuda;
    return choice;
  }
  if (requested == "cuda") {
    return Status::error(fmt::format(
        "--backend cuda: {}; run with --backend cpu or on a machine with a GPU", gpus.why_none));
  }
  choice.notice = fmt::format("strata: {}; using the CPU backend", gpus.why_none);
  return choice;
}

}  // namespace strata
