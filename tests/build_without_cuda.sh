#!/usr/bin/env bash
# Configures and builds the `strata` command with -DSTRATA_CUDA=OFF and checks
# that it runs and says it is CPU-only. Usage: build_without_cuda.sh REPO_ROOT BUILD_DIR
set -euo pipefail
root="$1"
build="$2"
cmake -S "$root" -B "$build" -DSTRATA_CUDA=OFF -DSTRATA_BUILD_TESTS=OFF -DSTRATA_BUILD_BENCHES=OFF >"$build.log" 2>&1 ||
  { cat "$build.log"; exit 1; }
grep -q "CUDA backend OFF" "$build.log"
cmake --build "$build" --target strata -j"$(nproc)" >>"$build.log" 2>&1 || { tail -50 "$build.log"; exit 1; }
"$build/tools/strata" --version | tee /dev/stderr | grep -q "CUDA backend: not built (CPU-only)"
"$build/tools/strata" plan --model tiny --json >/dev/null
# It cannot size a GPU's buffers, and says so.
! "$build/tools/strata" plan --model tiny --ops --backend cuda --stage 3 --offload-param cpu \
  --offload-optimizer cpu >/dev/null 2>"$build.err"
grep -q "built without CUDA" "$build.err"
echo "1 passed, 0 failed"
