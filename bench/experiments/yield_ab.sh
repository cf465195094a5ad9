#!/bin/bash
# COMMUX_YIELD=off (waits that never yield) against auto, alternating, same build, 2 ranks:
# what yielding costs where nothing is oversubscribed. Prints auto/off per (op, size); every
# result is checked (a wrong element fails the script).
#   bench/experiments/yield_ab.sh [build dir, default build]
set -euo pipefail
export UCX_NET_DEVICES=${UCX_NET_DEVICES:-lo} OMP_NUM_THREADS=1
bin=${1:-build}/bench/commux_coll_bench
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
for rep in 1 2 3; do
  for y in off auto; do
    COMMUX_YIELD=$y timeout 200 "$bin" --np 2 --ops p2p,allreduce,broadcast,allgather \
      --sizes 8,4096,67108864 --reps 5 --min-reps 3 --rep-bytes 33554432 --min-iters 1 \
      --max-iters 2000 --budget-ms 200 --salt "$rep" --timeout 190 \
      --json "$out/${y}_${rep}.json" >"$out/${y}_${rep}.log" 2>&1 ||
      { tail -5 "$out/${y}_${rep}.log" >&2; exit 1; }
  done
done
python3 - "$out" <<'PY'
import json, statistics, sys
rows = {}
for y in ("off", "auto"):
    for rep in (1, 2, 3):
        d = json.load(open(f"{sys.argv[1]}/{y}_{rep}.json"))
        for r in d["rows"]:
            if r["wrong"]:
                sys.exit(f"{y} round {rep}: {r['op']} {r['bytes']} B: {r['wrong']} wrong")
            rows.setdefault((r["op"], r["bytes"]), {}).setdefault(y, []).append(
                statistics.median(r["times_us"]))
print("| op | bytes | off µs | auto µs | auto/off |")
print("|---|---:|---:|---:|---:|")
for (op, nb), v in rows.items():
    off, auto = statistics.median(v["off"]), statistics.median(v["auto"])
    print(f"| {op} | {nb} | {off:.2f} | {auto:.2f} | {auto / off:.2f} |")
PY
