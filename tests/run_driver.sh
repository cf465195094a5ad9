#!/usr/bin/env bash
# run_driver.sh TEST_COMMUX SIZE HOST PORT: starts SIZE ranks of the driver and fails if any fails.
set -u
bin=$1 size=$2 host=$3 port=$4
pids=()
for ((r = 0; r < size; r++)); do
  timeout -s KILL 100 "$bin" "$r" "$size" "$host" "$port" &
  pids+=($!)
done
rc=0
for p in "${pids[@]}"; do wait "$p" || rc=1; done
exit $rc
