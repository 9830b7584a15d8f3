# Sourced by the tests/cli_*.sh scripts: `check NAME STATUS` records one
# check (status 0 passes) and prints it; `finish_checks` prints the tally and
# returns non-zero when any check failed.
failures=0
total=0
check() {
  total=$((total + 1))
  if [ "$2" -eq 0 ]; then echo "ok   $1"; else echo "FAIL $1"; failures=$((failures + 1)); fi
}
finish_checks() {
  echo "$((total - failures)) passed, $failures failed"
  [ $failures -eq 0 ]
}
