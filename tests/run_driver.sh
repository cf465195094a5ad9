#!/usr/bin/env bash
# run_driver.sh TEST_COMMUX SIZE HOST PORT: starts SIZE ranks of the driver and fails if any fails.
# Exits 0 when every rank passed, 77 when every rank skipped (e.g. UCXPG_DEVICE=cuda without a GPU),
# 1 otherwise. Each rank is killed after RUN_DRIVER_KILL_S seconds (default 100).
set -u
bin=$1 size=$2 host=$3 port=$4
pids=()
for ((r = 0; r < size; r++)); do
  timeout -s KILL "${RUN_DRIVER_KILL_S:-100}" "$bin" "$r" "$size" "$host" "$port" &
  pids+=($!)
done
passed=0 skipped=0
for p in "${pids[@]}"; do
  wait "$p"
  case $? in
    0) passed=$((passed + 1)) ;;
    77) skipped=$((skipped + 1)) ;;
  esac
done
if ((passed == size)); then exit 0; fi
if ((skipped == size)); then exit 77; fi
if ((skipped > 0)); then echo "run_driver.sh: $skipped of $size ranks skipped, $passed passed: the ranks disagree" >&2; fi
exit 1
