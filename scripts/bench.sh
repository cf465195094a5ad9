#!/usr/bin/env bash
# scripts/bench.sh [--quick] [--no-build] [coll_bench options...]: the collectives benchmark suite
# (bench/coll_bench.py: p2p, allreduce, broadcast, reduce, allgather, reduce_scatter, alltoall and
# barrier, 8 B .. 64 MiB, 2 and 4 ranks; commux through torch.distributed beside Gloo, Open MPI,
# commux's C++ API and the reference "noop" (torch's own cost per call), every result but noop's
# checked) and the V-tensor ping-pong (bench/vtensor_pingpong.py: plain, COMMUX_COALESCE=1,
# COMMUX_GROUP=1). Installs what is missing, builds and installs commux
# into .venv (scripts/install.sh) and the C++ benchmark binaries into build/ (scripts/build.sh),
# unless --no-build. Results: results/coll/ (results.json, table.md, coll_w<N>.png) and
# results/vtensor/ (results.json, table.md). --quick: the smoke run (under a minute); the full run
# about 11 minutes on a 2-core VM. Other options go to coll_bench.py (--ops, --worlds,
# --backends, --max-bytes, --rounds, --out; see .venv/bin/python bench/coll_bench.py --help).
# Exit status 1 when any result was wrong or a benchmark failed to run.
#
# scripts/bench.sh ep [--quick] [--build] [bench.ep options...]: the expert-parallel dispatch/combine
# harness instead (bench/ep, docs/ep-bench.md): commux.ep beside the all_to_all_single paths on
# "ucx" and gloo (and DeepEP / UCCL-EP where installed), 2, 3 and 4 ranks, normal and low-latency,
# bf16 and fp8, every result checked by one oracle. Results: results/ep/ (matrix.json,
# results.json, cases/, summary.md, ep_w<N>_<workload>_cpu.png). A few minutes; --quick (the smoke)
# about 15 s. Builds and installs commux only when .venv cannot import it, or with --build.
# Exit status 1 when any result was wrong or a case did not finish (missed targets do not count).
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "${1:-}" = ep ]; then
  shift
  ep_args=()
  ep_build=0
  for a in "$@"; do
    case "$a" in
      --build) ep_build=1 ;;
      --no-build) ;;
      *) ep_args+=("$a") ;;
    esac
  done
  if [ $ep_build = 1 ] || ! .venv/bin/python -c "import commux.ep" >/dev/null 2>&1; then
    scripts/install.sh                                 # scripts/setup.sh, then commux into .venv
  fi
  export UCX_NET_DEVICES=${UCX_NET_DEVICES:-lo}
  echo "== expert-parallel dispatch/combine: python -m bench.ep ${ep_args[*]:-}"
  rc=0
  .venv/bin/python -m bench.ep "${ep_args[@]}" || rc=$?
  if [ $rc = 0 ]; then
    echo "scripts/bench.sh ep: done; results in results/ep/"
  else
    echo "scripts/bench.sh ep: FAILED (a wrong result or a case that did not finish; see results/ep/summary.md)" >&2
  fi
  exit $rc
fi

build=1
quick=()
coll_args=()
for a in "$@"; do
  case "$a" in
    --no-build) build=0 ;;
    --quick) quick=(--quick); coll_args+=("$a") ;;
    *) coll_args+=("$a") ;;
  esac
done

if [ $build = 1 ]; then
  scripts/install.sh                                   # scripts/setup.sh, then commux into .venv
  scripts/build.sh build -DCOMMUX_UCX_PROVIDER=wheel   # bench/commux_coll_bench, mpi_coll, ...
fi
export UCX_NET_DEVICES=${UCX_NET_DEVICES:-lo}

rc=0
echo "== collectives: bench/coll_bench.py ${coll_args[*]:-}"
.venv/bin/python bench/coll_bench.py "${coll_args[@]}" || rc=1
echo "== V-tensor ping-pong: bench/vtensor_pingpong.py ${quick[*]:-}"
.venv/bin/python bench/vtensor_pingpong.py "${quick[@]}" || rc=1
if [ $rc = 0 ]; then
  echo "scripts/bench.sh: done; results in results/coll/ and results/vtensor/"
else
  echo "scripts/bench.sh: FAILED (a wrong result or a run that did not finish; see above)" >&2
fi
exit $rc
