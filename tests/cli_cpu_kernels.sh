#!/usr/bin/env bash
# What the CPU backend's products run, as a user sees it: `strata --version`,
# `strata topo` and the training banner name the GEMM class (the best the
# CPU's flags in /proc/cpuinfo allow, unless forced), its threads and the
# AdamW SIMD path; --gemm and STRATA_GEMM force a class; a bad value or a
# class the CPU lacks is refused in one line with exit status 2.
# Usage: cli_cpu_kernels.sh STRATA_BINARY REPO_ROOT
set -uo pipefail
strata="$1"
source "$(dirname "$0")/check_support.sh"
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
unset STRATA_GEMM

# The best class from the kernel's own report of the CPU's flags.
flags=$(grep -m1 '^flags' /proc/cpuinfo)
has() { for f in "$@"; do [[ " $flags " == *" $f "* ]] || return 1; done; }
best=baseline
has avx && best=avx
has avx2 fma && best=avx2
has avx512f avx512dq avx512bw avx512vl && best=avx512

version=$("$strata" --version)
if [ -n "${OPENBLAS_CORETYPE:-}" ]; then
  grep -q "CPU kernels: gemm .*chosen by OPENBLAS_CORETYPE=$OPENBLAS_CORETYPE" <<<"$version"
else
  grep -q "CPU kernels: gemm $best (OpenBLAS .*, chosen by the CPU's features), [0-9]* thread.*; adamw simd " <<<"$version"
fi
check "strata --version names the GEMM class ($best here), threads and SIMD path" $?

"$strata" topo --nvme-path "$dir" >"$dir/topo" 2>&1
grep -q "^CPU kernels: gemm " "$dir/topo"; check "strata topo names the CPU kernels" $?
"$strata" topo --nvme-path "$dir" --json >"$dir/topo.json" 2>/dev/null
python3 - "$dir/topo.json" <<'PY'
import json, sys
k = json.load(open(sys.argv[1]))["cpu_kernels"]
assert k["gemm"] in ("avx512", "avx2", "avx", "baseline") and k["gemm_threads"] >= 1, k
assert k["gemm_library"].startswith("OpenBLAS") and k["adamw_simd"] in ("scalar", "avx2", "avx512"), k
PY
check "strata topo --json has the CPU kernels" $?

"$strata" demo-data --out "$dir/data" --tokens 20000 --val-tokens 2000 >/dev/null
run=(train --model tiny --backend cpu --seq-len 16 --micro-batch 2 --data "$dir/data/train.bin"
     --steps 2)
"$strata" "${run[@]}" --gemm baseline >"$dir/out" 2>&1
grep -q "^cpu kernels: gemm baseline (OpenBLAS .* Prescott kernels, chosen by --gemm baseline)" "$dir/out"
check "--gemm baseline runs OpenBLAS's Prescott kernels and the banner says so" $?

STRATA_GEMM=reference "$strata" "${run[@]}" >"$dir/out" 2>&1
grep -q "^cpu kernels: gemm reference (strata's, the same bits on every x86-64; chosen by STRATA_GEMM=reference)" "$dir/out"
check "STRATA_GEMM=reference runs the reference path and the banner says so" $?

STRATA_GEMM=fastest "$strata" "${run[@]}" >"$dir/out" 2>"$dir/err"
status=$?
[ $status -eq 2 ] && [ "$(wc -l <"$dir/err")" -eq 1 ] &&
  grep -q "^strata train: STRATA_GEMM=fastest is not one of auto, avx512, avx2, avx, baseline or reference$" "$dir/err"
check "a bad STRATA_GEMM is refused in one line, exit 2" $?

"$strata" "${run[@]}" --gemm fastest >"$dir/out" 2>"$dir/err"
[ $? -eq 2 ] && [ "$(wc -l <"$dir/err")" -eq 1 ]; check "a bad --gemm is refused in one line, exit 2" $?

if [ "$best" != avx512 ]; then
  "$strata" "${run[@]}" --gemm avx512 >"$dir/out" 2>"$dir/err"
  [ $? -eq 2 ] && grep -q "cannot run the avx512 kernels (its best class is $best)" "$dir/err"
  check "a class this CPU lacks is refused, naming the best it has" $?
fi

finish_checks
