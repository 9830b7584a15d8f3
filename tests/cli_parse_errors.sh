#!/usr/bin/env bash
# A command line that cannot be parsed, for every command and the top level:
# one line on stderr that starts with `strata <command>:` and names the
# mistake, nothing on stdout, exit status 2. --help and --version still exit 0.
# Usage: cli_parse_errors.sh STRATA_BINARY REPO_ROOT
set -uo pipefail
strata="$1"
source "$(dirname "$0")/check_support.sh"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# expect_usage_error PREFIX NAMED ARGS...: `strata ARGS...` fails as described
# above; PREFIX is what stderr starts with, NAMED a text the line must contain.
expect_usage_error() {
  local prefix="$1" named="$2"
  shift 2
  "$strata" "$@" >"$work/out" 2>"$work/err"
  local status=$?
  local err
  err=$(cat "$work/err")
  [ $status -eq 2 ]; check "strata $*: exit status 2 (got $status)" $?
  [ "$(wc -l <"$work/err")" -eq 1 ]; check "strata $*: one line on stderr ($err)" $?
  [[ "$err" == "$prefix "* ]]; check "strata $*: starts with '$prefix'" $?
  grep -qF -- "$named" "$work/err"; check "strata $*: names '$named'" $?
  [ ! -s "$work/out" ]; check "strata $*: nothing on stdout" $?
}

# Unknown flags and arguments.
expect_usage_error "strata train:" "--offload-everything" train --offload-everything
expect_usage_error "strata train:" "stray" train --model tiny stray
expect_usage_error "strata plan:" "--bogus" plan --bogus
expect_usage_error "strata topo:" "--bogus" topo --bogus
expect_usage_error "strata:" "--bogus" --bogus
# An unknown command names the commands there are.
expect_usage_error "strata:" "'nosuchcommand' is not a command" nosuchcommand
grep -q "train" "$work/err"; check "the unknown command's error lists train" $?

# Values that are not numbers, or not among the choices.
expect_usage_error "strata train:" "--steps" train --steps abc
expect_usage_error "strata plan:" "--world-size" plan --world-size two
expect_usage_error "strata launch:" "--nproc" launch -n x -- true
expect_usage_error "strata demo-data:" "--tokens" demo-data --out "$work/demo" --tokens many
[ ! -e "$work/demo" ]; check "demo-data with a bad number writes nothing" $?
expect_usage_error "strata nvme-bench:" "--queue-depth" nvme-bench --path "$work" --queue-depth 0
expect_usage_error "strata export:" "--dtype" export "$work" --out "$work/out" --dtype fp64

# A flag given twice.
expect_usage_error "strata train:" "--steps" train --steps 1 --steps 2
expect_usage_error "strata plan:" "--model" plan --model tiny --model small

# A flag without its value, a required flag or argument missing.
expect_usage_error "strata train:" "--model" train --model
expect_usage_error "strata launch:" "--grace-period" launch --grace-period
expect_usage_error "strata nvme-bench:" "--path" nvme-bench
expect_usage_error "strata export:" "checkpoint" export

# Asking for help or the version is not an error.
for args in "--help" "train --help" "plan -h" "launch --help" "--version"; do
  # shellcheck disable=SC2086  # split into the arguments on purpose
  "$strata" $args >"$work/out" 2>"$work/err"
  status=$?
  [ $status -eq 0 ] && [ -s "$work/out" ] && [ ! -s "$work/err" ]
  check "strata $args: exits 0 with its text on stdout (got $status)" $?
done
help=$("$strata" train --help)
grep -q -- "--offload-optimizer" <<<"$help"; check "train --help lists train's flags" $?

finish_checks
