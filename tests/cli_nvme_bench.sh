#!/usr/bin/env bash
# `strata nvme-bench` end to end: a small run, --json, --sweep, the errors a
# user can cause, and cleanup on Ctrl-C. $1 = strata binary, $2 = repo root.
set -u
strata="$1"
work="$(mktemp -d "${TMPDIR:-/tmp}/strata-cli-nvme-bench-XXXXXX")"
trap 'rm -rf "$work"' EXIT
failures=0
fail() { echo "FAIL: $*"; failures=$((failures + 1)); }
no_files_left() { [ -z "$(ls -A "$1")" ] || fail "files left in $1: $(ls -A "$1")"; }

mkdir -p "$work/a" "$work/b"

# A small run prints both directions and leaves nothing behind.
out="$("$strata" nvme-bench --path "$work/a" --size 16M --block-size 1M --queue-depth 8 2>&1)" \
  || fail "small run exited $?: $out"
grep -q "write .*GB/s.*incl. fdatasync" <<<"$out" || fail "no write line: $out"
grep -q "read .*GB/s.*p99" <<<"$out" || fail "no read line: $out"
no_files_left "$work/a"

# --json, striped over two paths: one object; the kernel accounts exactly the bytes
# read, and the bytes written plus at most a few filesystem metadata blocks (the
# inode's mtime) per file.
"$strata" nvme-bench --path "$work/a" --path "$work/b" --size 8M --block-size 256K --json >"$work/run.json" \
  || fail "--json exited $?"
python3 - "$work/run.json" <<'PY' || fail "--json output: $(cat "$work/run.json")"
import json, sys
run = json.load(open(sys.argv[1]))
assert run["size_bytes"] == 8 << 20 and len(run["paths"]) == 2, run
for phase in ("write", "read"):
    assert run[phase]["bytes"] == 8 << 20, run[phase]
    assert run[phase]["gb_per_s"] > 0 and run[phase]["latency_us"]["p99"] > 0, run[phase]
    extra = run[phase]["kernel_bytes"] - (8 << 20)
    assert extra == 0 if phase == "read" else 0 <= extra <= 2 * 16384, (phase, run[phase]["kernel_bytes"])
PY
no_files_left "$work/a"; no_files_left "$work/b"

# --sweep prints a table and the best setting as an aio block that parses as JSON.
out="$("$strata" nvme-bench --path "$work/a" --size 4M --sweep --sweep-block-sizes 256K,1M \
        --sweep-queue-depths 4,8 --sweep-threads 1,2 2>&1)" || fail "--sweep exited $?: $out"
[ "$(grep -cE '^ +(256K|1M) ' <<<"$out")" -eq 8 ] || fail "sweep table should have 8 rows: $out"
python3 -c 'import json,sys; t=sys.stdin.read(); a=json.loads(t[t.index("\"aio\": ")+7:]); assert {"block_size","queue_depth","intra_op_parallelism"} <= a.keys()' \
  <<<"$out" || fail "no parsable aio block: $out"

# Read mode reads only what it wrote first.
"$strata" nvme-bench --path "$work/a" --size 4M --mode read >/dev/null 2>&1 || fail "--mode read failed"

# Errors: one line, exit status 1, naming the problem.
expect_error() {  # pattern, then the arguments
  local pattern="$1"; shift
  local out status
  out="$("$strata" nvme-bench "$@" 2>&1)"; status=$?
  [ "$status" -eq 1 ] || fail "expected exit 1 for $*, got $status: $out"
  grep -q "$pattern" <<<"$out" || fail "expected '$pattern' for $*: $out"
}
expect_error "does not exist" --path "$work/missing" --size 4M
touch "$work/plain-file"
expect_error "is not a directory" --path "$work/plain-file" --size 4M
expect_error "not enough free space.*--size" --path "$work/a" --size 1000T
expect_error "given twice" --path "$work/a" --path "$work/a/../a" --size 4M
if [ "$(id -u)" -ne 0 ]; then
  mkdir -p "$work/readonly" && chmod 555 "$work/readonly"
  expect_error "not writable" --path "$work/readonly" --size 4M
fi

# Ctrl-C: stops, removes the file, exits 130 (a slow setting, so it is still running).
"$strata" nvme-bench --path "$work/a" --size 1G --block-size 4K --queue-depth 1 --io-backend posix \
  >"$work/interrupted.txt" 2>&1 &
pid=$!
for _ in $(seq 50); do [ -n "$(ls -A "$work/a")" ] && break; sleep 0.1; done
sleep 0.3
kill -INT "$pid"
wait "$pid"; status=$?
[ "$status" -eq 130 ] || fail "Ctrl-C: expected exit 130, got $status: $(cat "$work/interrupted.txt")"
grep -q "interrupted" "$work/interrupted.txt" || fail "Ctrl-C: no message: $(cat "$work/interrupted.txt")"
no_files_left "$work/a"

[ "$failures" -eq 0 ] && echo "cli_nvme_bench: all checks passed"
exit "$failures"
