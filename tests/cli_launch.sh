#!/usr/bin/env bash
# `strata launch` end to end: every rank's variables, a failing rank stops the
# others and its status propagates, SIGTERM and SIGINT reach the children, bad
# input is a one-line error with exit status 2. Every rank below gives up by
# itself after about two minutes, so that a broken launch leaves nothing behind.
# Usage: cli_launch.sh STRATA_BINARY REPO_ROOT
set -uo pipefail
strata="$1"
source "$(dirname "$0")/check_support.sh"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
guard() { timeout -s KILL 120 "$@"; }  # a hang fails the check instead of the whole run

# Waits (up to a generous bound) until every file named exists.
wait_for_files() {
  for _ in $(seq 1 1200); do
    local all=1
    for file in "$@"; do [ -e "$file" ] || all=0; done
    [ $all -eq 1 ] && return 0
    sleep 0.05
  done
  return 1
}

# Every rank's variables. Values inherited from the caller's environment are replaced.
n=$((RANDOM % 4 + 2))
out=$(RANK=77 WORLD_SIZE=99 guard "$strata" launch -n $n -- \
      sh -c 'echo "$RANK $WORLD_SIZE $LOCAL_RANK $LOCAL_WORLD_SIZE $MASTER_ADDR $MASTER_PORT"')
check "launch -n $n exits 0" $?
[ "$(echo "$out" | wc -l)" -eq $n ]; check "one line per rank" $?
ranks=$(echo "$out" | awk '{print $1}' | sort -n | tr '\n' ' ')
[ "$ranks" = "$(seq 0 $((n - 1)) | tr '\n' ' ')" ]; check "RANK is 0..$((n - 1)) ($ranks)" $?
echo "$out" | awk -v n=$n '$2 != n || $3 != $1 || $4 != n { bad = 1 } END { exit bad }'
check "WORLD_SIZE and LOCAL_WORLD_SIZE are $n, LOCAL_RANK is RANK" $?
echo "$out" | awk '$5 != "127.0.0.1" { bad = 1 } END { exit bad }'; check "MASTER_ADDR defaults to 127.0.0.1" $?
ports=$(echo "$out" | awk '{print $6}' | sort -u)
[ "$(echo "$ports" | wc -l)" -eq 1 ] && [ "$ports" -ge 1 ] && [ "$ports" -le 65535 ]
check "every rank has the same free MASTER_PORT ($ports)" $?

port=$((RANDOM % 20000 + 20000))
out=$(guard "$strata" launch -n 2 --master-addr node-a --master-port $port -- sh -c 'echo "$MASTER_ADDR:$MASTER_PORT"' | sort -u)
[ "$out" = "node-a:$port" ]; check "--master-addr and --master-port are passed on" $?

# The command's own arguments, flags included, after --.
out=$(guard "$strata" launch -n 1 -- sh -c 'echo "$#:$1:$2"' sh -n --x)
[ "$out" = "2:-n:--x" ]; check "arguments after -- belong to the command" $?

# A failing rank stops the others; launch exits with its status. The others wait
# for SIGTERM (recording it) and say when they are ready for it.
fail_rank=$((RANDOM % 3))
status_code=$((RANDOM % 100 + 3))
mkdir "$work/fail"
err=$(guard "$strata" launch -n 3 --grace-period 60 -- sh -c '
  dir=$1
  if [ "$RANK" = "$2" ]; then
    for r in 0 1 2; do [ "$r" = "$RANK" ] && continue; while [ ! -e "$dir/ready.$r" ]; do sleep 0.05; done; done
    exit "$3"
  fi
  trap "echo term > $dir/term.$RANK; exit 0" TERM
  touch "$dir/ready.$RANK"
  i=0; while [ $i -lt 1200 ]; do sleep 0.1; i=$((i + 1)); done' sh "$work/fail" $fail_rank $status_code 2>&1 >/dev/null)
status=$?
[ $status -eq $status_code ]; check "launch exits with the failed rank's status ($status, want $status_code)" $?
echo "$err" | grep -Eq "^strata launch: rank $fail_rank \(pid [0-9]+\) exited with status $status_code; stopping the others$"
check "one line names the failed rank, its pid and status" $?
# (The shells print "Terminated" for their stopped sleep; only launch's lines count.)
[ "$(echo "$err" | grep -c '^strata launch:')" -eq 1 ]; check "only the failed rank is reported" $?
others=$(ls "$work/fail" | grep -c '^term\.')
[ "$others" -eq 2 ]; check "the other two ranks got SIGTERM ($others)" $?

# A rank killed by a signal: 128 + the signal.
err=$(guard "$strata" launch -n 2 -- sh -c '[ "$RANK" = 1 ] && kill -KILL $$; exec sleep 60' 2>&1 >/dev/null)
status=$?
[ $status -eq 137 ]; check "a rank killed by SIGKILL makes launch exit 137 ($status)" $?
grep -q "rank 1 (pid [0-9]*) was killed by signal 9" <<<"$err"; check "the killed rank is named" $?

# A rank that ignores SIGTERM is killed after the grace period.
err=$(guard "$strata" launch -n 2 --grace-period 0.2 -- sh -c '
  if [ "$RANK" = 0 ]; then exit 1; fi
  trap "" TERM; i=0; while [ $i -lt 1200 ]; do sleep 0.1; i=$((i + 1)); done' 2>&1 >/dev/null)
[ $? -eq 1 ]; check "a rank ignoring SIGTERM is killed after --grace-period" $?

# Signals sent to launch reach every rank.
for signal in TERM INT; do
  dir="$work/signal-$signal"
  mkdir "$dir"
  n=$((RANDOM % 3 + 2))
  # A background job of a script ignores SIGINT; give launch the default action back.
  env --default-signal=INT "$strata" launch -n $n -- sh -c '
    trap "echo got > $1/got.$RANK; exit 0" TERM INT
    touch "$1/ready.$RANK"
    i=0; while [ $i -lt 1200 ]; do sleep 0.1; i=$((i + 1)); done' sh "$dir" &
  launch_pid=$!
  ready=()
  for r in $(seq 0 $((n - 1))); do ready+=("$dir/ready.$r"); done
  wait_for_files "${ready[@]}"; check "SIG$signal: all $n ranks started" $?
  kill -$signal $launch_pid
  wait $launch_pid
  status=$?
  want=$((128 + $(kill -l $signal)))
  [ $status -eq $want ]; check "SIG$signal: launch exits $want ($status)" $?
  got=$(ls "$dir" | grep -c '^got\.')
  [ "$got" -eq $n ]; check "SIG$signal: forwarded to all $n ranks ($got)" $?
done

# Ranks do not outlive a launch that is killed outright (SIGKILL cannot be forwarded).
dir="$work/orphans"
mkdir "$dir"
"$strata" launch -n 2 -- sh -c '
  trap "echo got > $1/got.$RANK; exit 0" TERM
  touch "$1/ready.$RANK"
  i=0; while [ $i -lt 1200 ]; do sleep 0.1; i=$((i + 1)); done' sh "$dir" &
launch_pid=$!
wait_for_files "$dir/ready.0" "$dir/ready.1"; check "SIGKILL: both ranks started" $?
kill -KILL $launch_pid
wait $launch_pid 2>/dev/null
wait_for_files "$dir/got.0" "$dir/got.1"; check "SIGKILL to launch: every rank gets SIGTERM" $?

# Bad input: one line, exit 2.
expect_bad_input() {  # expect_bad_input NAME PATTERN ARGS...
  local name="$1" pattern="$2"
  shift 2
  local err status
  err=$(guard "$strata" launch "$@" 2>&1 >/dev/null)
  status=$?
  [ $status -eq 2 ] && [ "$(echo "$err" | wc -l)" -eq 1 ] && grep -q -- "$pattern" <<<"$err"
  check "$name (status $status: $err)" $?
}
expect_bad_input "a missing command" "command 'no-such-command-here' not found" -n 2 -- no-such-command-here
expect_bad_input "a command path that does not exist" "not found" -n 1 -- "$work/nothing"
expect_bad_input "-n 0" "-n 0 must be at least 1" -n 0 -- true
expect_bad_input "no -n" "give the number of processes with -n" -- true
expect_bad_input "no command" "no command to run" -n 2
expect_bad_input "-n over --gpus-per-node" "more than --gpus-per-node 2" -n 3 --gpus-per-node 2 -- true
expect_bad_input "--master-port out of range" "not a TCP port" -n 1 --master-port 70000 -- true

finish_checks
