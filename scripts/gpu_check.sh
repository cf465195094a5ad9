#!/usr/bin/env bash
# scripts/gpu_check.sh [--cpu-smoke]: the GPU check of commux ("CUDA tensors end to end"), for a
# machine with one NVIDIA GPU, torch installed and no registry access. Run from anywhere; it works
# in the repository root. In under 9 minutes on 16 cores it:
#
#   1. env        prints the machine, python, torch/CUDA and nvidia-smi
#   2. install    installs the carried UCX wheel(s) from .whl/ and builds commux against the
#                 installed torch (pip --no-index --no-build-isolation --no-deps) into a private
#                 site directory, imports it, and checks that its libraries load the shared
#                 libstdc++.so.6 (not a static copy)
#   3. info       python -m commux.info (UCX version, transports, memory types, settings)
#   4. cuda-tests python/tests/test_cuda.py (2 and 3 ranks on the one GPU), per-test timeout
#   5. ep-tests   python/tests/test_ep.py: commux.ep (DeepEP's Buffer) on CUDA tensors, 2 and 3 ranks
#                 on the one GPU, checked bitwise against the reference
#   6. bench      bench/cuda_bench.py: p2p bandwidth 1 MiB .. 1 GiB against a device-to-device
#                 copy, allreduce 1 .. 256 MiB against Gloo, every result checked
#   7. latency    bench/experiments/device_latency.py: a small device transfer's time in raw UCX
#                 (ucx_perftest tag_lat, host and cuda memory) beside commux's p2p and all_reduce
#                 (sleeping waits, then polling ones), and the protocols UCX chose for device
#                 memory (results in $OUT/latency/)
#   8. ep-bench   bench/ep on CUDA tensors, 2 ranks, the small workload (every result checked by the
#                 harness's oracle; results in $OUT/ep/)
#   9. driver     tests/run_driver_cuda.sh (the C++ driver's CUDA checks), when the file exists
#  10. cpu-p2p    python/tests/test_p2p.py, a CPU sanity check of the same build
#  11. cpu-async  host tensors on a machine with spare cores: 8 async all_reduces against 8
#                 blocking ones, and schedules against the pool thread (bench/experiments/
#                 async_overlap.py and schedule_ab.py; every result checked)
#
# and ends with a summary: every step ok / FAILED / skipped with its time, and the two target
# ratios (p2p 256 MiB >= 0.7 x D2D copy; allreduce 64 MiB gloo/ucx >= 5). Exit status 1 when a
# step failed (a missed target is reported, not a failure).
#
# Outputs under ${OUT:-results/gpu}: logs/<step>.log, nvidia-smi.txt, cuda_bench/ (results.json,
# table.md), summary.md. Each step runs under `timeout`, bounded by its own cap and by what is
# left of the whole budget (GPU_CHECK_BUDGET_S, default 520 s); a step that no longer fits is
# skipped, so the summary always comes.
#
# Preflight, on a machine without a GPU, against the GPU machine's torch (2.11): CI runs
# `GPU_CHECK_PYTHON=.venv-torch2.11/bin/python scripts/gpu_check.sh --cpu-smoke` (scripts/test.sh
# torch), so a compile error against that torch is found before a GPU run is spent on it. When the
# build fails here or there, the install step fails at once, every later step is skipped, and the
# summary names the compiler's first error.
#
# On the device machine (see docs/gpu.md): first, where pip reaches PyPI,
# `scripts/fetch_gpu_wheels.sh` (fills .whl/), then the device tool's run with
# command `bash scripts/gpu_check.sh`, carry [".whl"], timeout_s 580.
#
# Why no virtual environment: the GPU image's python3 is itself a venv (/opt/torch/.venv), and a
# venv made from a venv with --system-site-packages sees the base interpreter's packages, not
# torch. So the UCX wheel and commux go into a site directory (pip --target) on PYTHONPATH, in
# front of the image's packages; the build runs in /tmp, nothing in the checkout is written
# except under $OUT.
#
# Settings (environment):
#   GPU_CHECK_PYTHON    the Python with torch (default python3)
#   GPU_CHECK_DIR       work directory: site/ (emptied first) and build/ (default /tmp/cx)
#   GPU_CHECK_BUDGET_S  the whole run's budget in seconds (default 520; 1800 with --cpu-smoke)
#   GPU_CHECK_BENCH_ARGS  extra arguments for bench/cuda_bench.py (e.g. "--quick")
#   GPU_CHECK_LATENCY_ARGS  extra arguments for the latency step's device_latency.py (e.g.
#                       "--variant noipc:UCX_TLS=^cuda_ipc": one more commux run with those settings)
#   GPU_CHECK_STEPS     only these steps (comma-separated, e.g. "ep-tests,ep-bench" to rerun what
#                       failed); env and install always run, the others are recorded as skipped
#   OUT                 where outputs go (default results/gpu)
# --cpu-smoke: a dry run on a machine without a GPU (e.g. GPU_CHECK_PYTHON=.venv/bin/python
#   scripts/gpu_check.sh --cpu-smoke): the same install and info, the bench with --device cpu
#   --quick, test_cuda.py (its CUDA tests skip themselves without a GPU) and the CPU tests; the
#   C++ driver's CUDA checks are skipped.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD

mode=gpu
for a in "$@"; do
  case "$a" in
    --cpu-smoke) mode=cpu ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "gpu_check: unknown argument '$a' (use --cpu-smoke or --help)" >&2; exit 2 ;;
  esac
done

PY=${GPU_CHECK_PYTHON:-python3}
if ! PY=$(command -v "$PY"); then
  echo "gpu_check: no python: '${GPU_CHECK_PYTHON:-python3}' not found (set GPU_CHECK_PYTHON)" >&2
  exit 2
fi
case "$PY" in /*) ;; *) PY="$PWD/$PY" ;; esac   # the steps run in other directories
OUT=${OUT:-results/gpu}
mkdir -p "$OUT/logs"
OUT=$(cd "$OUT" && pwd)
WORK=${GPU_CHECK_DIR:-/tmp/cx}
case "$WORK" in
  /tmp/?*|/var/tmp/?*) ;;
  *) echo "gpu_check: GPU_CHECK_DIR=$WORK: its site/ is emptied first, so it must lie under /tmp or /var/tmp" >&2
     exit 2 ;;
esac
SITE=$WORK/site
if [ $mode = cpu ]; then budget=${GPU_CHECK_BUDGET_S:-1800}; else budget=${GPU_CHECK_BUDGET_S:-520}; fi
NPROC=$(nproc 2>/dev/null || echo 4)
export PY REPO OUT WORK SITE mode NPROC
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
PATH="$(dirname "$PY"):$PATH"   # the cmake / ninja / pytest of that Python's environment
export PATH
export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$NPROC}
export PYTHONUNBUFFERED=1
export PYTHONDONTWRITEBYTECODE=1       # no __pycache__ in the checkout
start=$SECONDS
deadline=$((SECONDS + budget))
reserve=15                             # kept for the summary

names=() states=() secs=() notes=()
record() {  # name state seconds note
  names+=("$1"); states+=("$2"); secs+=("$3"); notes+=("$4")
  printf -- '-- [%s] %s in %s s%s (at %s s)\n' "$1" "$2" "$3" "${4:+: $4}" "$((SECONDS - start))"
}
state_of() {  # the recorded state of a step, or "none"
  local i
  for i in "${!names[@]}"; do [ "${names[$i]}" = "$1" ] && { echo "${states[$i]}"; return; }; done
  echo none
}

# step NAME CAP SHOW FUNCTION: runs the exported FUNCTION under timeout (the smaller of CAP and
# what the budget has left), its output in logs/NAME.log, also on the terminal when SHOW=1 (else
# the last lines of the log when it fails). Records ok / FAILED / skipped.
step() {
  local name=$1 cap=$2 show=$3 fn=$4 left limit rc t0 log
  if [ -n "${GPU_CHECK_STEPS:-}" ] && [[ ",$GPU_CHECK_STEPS,env,install," != *",$name,"* ]]; then
    record "$name" skipped 0 "not in GPU_CHECK_STEPS"
    return 0
  fi
  left=$((deadline - SECONDS - reserve))
  limit=$((cap < left ? cap : left))
  if [ "$limit" -lt 20 ]; then
    record "$name" skipped 0 "no time left in the ${budget} s budget"
    return 0
  fi
  log="$OUT/logs/$name.log"
  echo
  echo "== [$name] (limit ${limit} s, at $((SECONDS - start)) s)"
  t0=$SECONDS
  set +e
  if [ "$show" = 1 ]; then
    STEP_LIMIT=$limit timeout -k 10 "$limit" bash -c "$fn" 2>&1 | tee "$log"
    rc=${PIPESTATUS[0]}
  else
    STEP_LIMIT=$limit timeout -k 10 "$limit" bash -c "$fn" >"$log" 2>&1
    rc=$?
  fi
  set -e
  if [ "$rc" = 0 ]; then
    record "$name" ok $((SECONDS - t0)) ""
  elif [ "$rc" = 77 ]; then   # the step's own "not applicable here"
    record "$name" skipped $((SECONDS - t0)) "$(tail -n 1 "$log")"
  else
    [ "$show" = 1 ] || { echo "   last lines of $log:"; tail -n 40 "$log" | sed 's/^/   | /'; }
    local why="exit status $rc" first
    if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then why="timed out after ${limit} s"; fi
    # A build that fails says why in the summary: the first compiler or CMake error of its log.
    first=$(grep -m 1 -E ': (fatal )?error: |CMake Error|^ERROR: ' "$log" | sed 's/^ *//' | cut -c 1-300 || true)
    if [ -n "$first" ]; then
      why="$why; first error: ${first//|/\\|}"
      echo "   first error: $first"
    fi
    record "$name" FAILED $((SECONDS - t0)) "$why (log: logs/$name.log)"
  fi
}

# --------------------------------------------------------------------------------------------
# The steps (each runs in its own bash under timeout; exit 77 = skipped, with a last-line reason)

step_env() {
  set -uo pipefail
  echo "date      $(date -Is)"
  echo "host      $(uname -nmr), $NPROC CPUs, mode $mode"
  echo "python    $PY ($("$PY" -c 'import sys; print(sys.version.split()[0])'))"
  echo "gcc       $(g++ --version 2>/dev/null | head -n 1 || echo 'g++ not found')"
  echo "cmake     $(cmake --version 2>/dev/null | head -n 1 || echo 'not on PATH')"
  echo "nvcc      $(nvcc --version 2>/dev/null | tail -n 1 || echo 'not on PATH (not needed)')"
  # How the C++ runtime would be linked (cmake/CommuxLibstdcxx.cmake keeps it shared)
  echo "libstdc++ to link: $(g++ -print-file-name=libstdc++.so 2>/dev/null); LDFLAGS='${LDFLAGS:-}' CXXFLAGS='${CXXFLAGS:-}'"
  echo "PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-}  CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-}"
  env | grep -E '^(UCX|COMMUX)_' | sed 's/^/env       /' || true
  "$PY" - <<'EOF' || exit 1
import torch
print(f"torch     {torch.__version__} (CUDA {torch.version.cuda}), "
      f"cuda available: {torch.cuda.is_available()}, devices: {torch.cuda.device_count()}")
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print(f"device 0  {p.name}, {p.total_memory / 2**30:.0f} GiB, {p.multi_processor_count} SMs")
EOF
  if command -v nvidia-smi >/dev/null; then
    timeout 30 nvidia-smi 2>&1 | tee "$OUT/nvidia-smi.txt"
  else
    echo "nvidia-smi: not present"
  fi
  if [ "$mode" = gpu ] && ! "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    echo "gpu_check: torch sees no CUDA device: the GPU steps cannot run (--cpu-smoke for a dry run)"
    exit 1
  fi
}

step_install() {
  set -euo pipefail
  cd "$REPO"
  shopt -s nullglob
  local wheels=(.whl/*.whl) missing=() m
  for m in torch pybind11 scikit_build_core; do
    "$PY" -c "import $m" 2>/dev/null || missing+=("the python module $m")
  done
  command -v cmake >/dev/null || "$PY" -c "import cmake" 2>/dev/null || missing+=("cmake")
  command -v ninja >/dev/null || command -v make >/dev/null || missing+=("ninja or make")
  command -v g++ >/dev/null || missing+=("g++")
  if [ ${#wheels[@]} -eq 0 ] && ! "$PY" -c "import libucx" 2>/dev/null; then
    missing+=("the libucx-cu13 wheel in .whl/ (run scripts/fetch_gpu_wheels.sh where pip reaches PyPI, then carry .whl)")
  fi
  if [ ${#missing[@]} -gt 0 ]; then
    echo "install: cannot build here; missing:"
    printf '  - %s\n' "${missing[@]}"
    exit 3
  fi
  rm -rf "$SITE"   # the build directory stays: a rerun on the same machine is incremental
  mkdir -p "$SITE"
  local pip=("$PY" -m pip install --no-index --no-deps --no-cache-dir --disable-pip-version-check
             --target "$SITE")
  if [ ${#wheels[@]} -gt 0 ]; then
    echo "install: wheels from .whl/: ${wheels[*]}"
    "${pip[@]}" -q --no-compile "${wheels[@]}"
  else
    echo "install: no .whl/; using the libucx the python already has"
  fi
  echo "install: building commux against $("$PY" -c 'import torch; print(torch.__version__)')" \
       "(CMAKE_BUILD_PARALLEL_LEVEL=$CMAKE_BUILD_PARALLEL_LEVEL, build dir $WORK/build)"
  "${pip[@]}" --no-build-isolation -v \
    --config-settings=build-dir="$WORK/build" \
    --config-settings=cmake.define.COMMUX_UCX_PROVIDER=wheel \
    --config-settings=cmake.define.COMMUX_WERROR=OFF .
  echo "install: compiler warnings in the build: $(grep -c 'warning:' "$OUT/logs/install.log" || true)"
  cd /tmp
  "$PY" -c "
import commux, libucx, os
print('install: commux', commux.__version__, 'from', os.path.dirname(commux.__file__),
      'built for torch', commux._BUILT_WITH_TORCH, '; libucx', libucx.__version__,
      'from', os.path.dirname(libucx.__file__))
assert commux.__file__.startswith(os.environ['SITE']), 'a different commux was imported'"
  # The shared C++ runtime, as torch's (a static copy crashed COMMUX_DEBUG logging on a GPU
  # machine; python/tests/test_package.py checks the same on CPU builds).
  local f bad=0
  for f in "$SITE"/commux/lib/libcommux.so.0 "$SITE"/commux/lib/libcommux_c10d.so.0 "$SITE"/commux/_C*.so; do
    if ! readelf -d "$f" | grep -q 'NEEDED.*\[libstdc++\.so\.6\]'; then
      echo "install: $f does not load libstdc++.so.6: it carries a static copy of the C++ runtime"
      bad=1
    fi
  done
  [ "$bad" = 0 ] || exit 4
  echo "install: the libraries load the shared libstdc++.so.6"
}

step_info() {
  set -euo pipefail
  cd /tmp
  "$PY" -m commux.info
}

step_cuda_tests() {
  set -euo pipefail
  cd "$REPO"
  if [ ! -f python/tests/test_cuda.py ]; then echo "python/tests/test_cuda.py does not exist yet"; exit 77; fi
  local to=()
  "$PY" -c "import pytest_timeout" 2>/dev/null && to=(--timeout 120)
  # Without a GPU (--cpu-smoke) the file's CUDA tests skip themselves; it still must collect.
  # No -x: device time is scarce, so one run reports every failure, each bounded by its timeout.
  "$PY" -m pytest -q -rs ${to[@]+"${to[@]}"} python/tests/test_cuda.py
}

step_bench() {
  set -euo pipefail
  cd "$REPO"
  local args=(--out "$OUT/cuda_bench")
  # Each of the bench's two launches must end before the step's own limit.
  args+=(--launch-timeout $(( (STEP_LIMIT - 20) / 2 > 30 ? (STEP_LIMIT - 20) / 2 : 30 )))
  if [ "$mode" = cpu ]; then args+=(--device cpu --quick); else args+=(--device cuda:0); fi
  # shellcheck disable=SC2086  # GPU_CHECK_BENCH_ARGS is a list of words on purpose
  "$PY" bench/cuda_bench.py "${args[@]}" ${GPU_CHECK_BENCH_ARGS:-}
}

step_ep_tests() {
  set -euo pipefail
  cd "$REPO"
  local to=()
  "$PY" -c "import pytest_timeout" 2>/dev/null && to=(--timeout 120)
  # Without a GPU (--cpu-smoke) only the host paths run: the CUDA cases skip themselves.
  if [ "$mode" = cpu ]; then
    UCX_NET_DEVICES=${UCX_NET_DEVICES:-lo} "$PY" -m pytest -q -rs ${to[@]+"${to[@]}"} python/tests/test_ep.py -k "device_path"
  else
    UCX_NET_DEVICES=${UCX_NET_DEVICES:-lo} "$PY" -m pytest -q -rs ${to[@]+"${to[@]}"} python/tests/test_ep.py -k "cuda"
  fi
}

step_ep_bench() {
  set -euo pipefail
  cd "$REPO"
  local mem=cuda
  [ "$mode" = cpu ] && mem=cpu
  UCX_NET_DEVICES=${UCX_NET_DEVICES:-lo} "$PY" -m bench.ep --worlds 2 --workloads small --memtypes "$mem" \
    --tokens 1,8,32,128 --iters 10 --warmup 3 --case-timeout $(( STEP_LIMIT > 60 ? STEP_LIMIT / 3 : 20 )) \
    --out "$OUT/ep"
}

step_latency() {
  set -euo pipefail
  cd "$REPO"
  local dev=cuda:0
  [ "$mode" = cpu ] && dev=cpu
  # shellcheck disable=SC2086  # GPU_CHECK_LATENCY_ARGS is a list of words on purpose
  "$PY" bench/experiments/device_latency.py --device "$dev" --sizes 8,64K,1M --reps 10 \
    --budget $(( STEP_LIMIT - 10 )) --out "$OUT/latency" ${GPU_CHECK_LATENCY_ARGS:-}
}

step_driver() {
  set -euo pipefail
  cd "$REPO"
  if [ "$mode" = cpu ]; then echo "--cpu-smoke: GPU step"; exit 77; fi
  if [ ! -f tests/run_driver_cuda.sh ]; then echo "tests/run_driver_cuda.sh does not exist yet"; exit 77; fi
  [ -x tests/run_driver_cuda.sh ] || echo "note: tests/run_driver_cuda.sh is not executable; running it with bash"
  # It builds test_commux in build-gpu/ (UCX from the libucx of $PYTHON, found through PYTHONPATH)
  # and runs its CUDA mode on 2 ranks; exit 77 = it cannot run here (recorded as skipped).
  PYTHON="$PY" bash tests/run_driver_cuda.sh
}

step_cpu_p2p() {
  set -euo pipefail
  cd "$REPO"
  local to=()
  "$PY" -c "import pytest_timeout" 2>/dev/null && to=(--timeout 60)
  UCX_NET_DEVICES=${UCX_NET_DEVICES:-lo} "$PY" -m pytest -x -q ${to[@]+"${to[@]}"} python/tests/test_p2p.py
}

step_cpu_async() {
  set -euo pipefail
  cd "$REPO"
  export UCX_NET_DEVICES=${UCX_NET_DEVICES:-lo} OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
  local k
  for k in 64 1024; do
    "$PY" bench/experiments/async_overlap.py --inflight auto --schedule on,off --rounds 20 \
      --passes 5 --kib "$k"
  done
  for k in 64 1024; do  # each variant in launches of its own (where the pool/progress figures differ)
    "$PY" bench/experiments/schedule_ab.py --kib "$k" --rounds 10 --passes 5 --launches 1
  done
}

export -f step_env step_install step_info step_cuda_tests step_bench step_ep_tests step_ep_bench step_driver \
  step_cpu_p2p step_latency step_cpu_async

echo "gpu_check: mode $mode, python $PY, outputs in $OUT, budget ${budget} s"
step env 60 1 step_env
step install 300 0 step_install
gpu_steps=(cuda-tests bench ep-tests latency ep-bench driver)
if [ "$(state_of install)" != ok ]; then
  for s in info cuda-tests bench ep-tests latency ep-bench driver cpu-p2p cpu-async; do record "$s" skipped 0 "install did not succeed"; done
else
  step info 60 1 step_info
  if [ $mode = gpu ] && [ "$(state_of env)" != ok ]; then
    for s in "${gpu_steps[@]}"; do record "$s" skipped 0 "no usable GPU (see the env step)"; done
  else
    step cuda-tests 240 1 step_cuda_tests
    step ep-tests 120 1 step_ep_tests
    step bench 240 1 step_bench
    step latency 110 1 step_latency
    step ep-bench 120 1 step_ep_bench
    step driver 150 0 step_driver
  fi
  step cpu-p2p 120 1 step_cpu_p2p
  step cpu-async 90 1 step_cpu_async
fi

# --------------------------------------------------------------------------------------------
# The summary

failed=0
for st in "${states[@]}"; do if [ "$st" = FAILED ]; then failed=1; fi; done
{
  echo "# gpu_check summary ($mode mode, $(date -Is), $((SECONDS - start)) s of a ${budget} s budget)"
  echo
  echo "| step | result | seconds | note |"
  echo "|---|---|---:|---|"
  for i in "${!names[@]}"; do
    echo "| ${names[$i]} | ${states[$i]} | ${secs[$i]} | ${notes[$i]} |"
  done
  echo
  if [ -f "$OUT/cuda_bench/results.json" ]; then
    "$PY" - "$OUT/cuda_bench/results.json" <<'EOF' || echo "(could not read the bench results)"
import json, sys
d = json.load(open(sys.argv[1]))
t = d.get("targets", {})
def ratio(x):
    return "not measured" if x is None or x.get("ratio") is None else (
        f"{x['ratio']:.2f} (target >= {x['min_ratio']:g}: {'met' if x['met'] else 'MISSED'})")
note = " [CPU smoke run: informational]" if d.get("kind") == "cpu" else ""
p, a = t.get("p2p"), t.get("allreduce")
print(f"Targets{note}:")
print()
print(f"* p2p 256 MiB, p2p / {'memcpy' if d.get('kind') == 'cpu' else 'D2D copy'}: {ratio(p)}"
      + (f"; {p['p2p_gbps']:.1f} vs {p['copy_gbps']:.1f} GB/s" if p and p.get("ratio") else ""))
print(f"* allreduce 64 MiB, gloo / ucx time: {ratio(a)}"
      + (f"; ucx {a['ucx_ms']:.3f} ms, gloo {a['gloo_ms']:.3f} ms" if a and a.get("ratio") else ""))
print(f"* bench correctness: {d.get('wrong_total')} wrong; errors: {len(d.get('errors', []))}")
EOF
  else
    echo "Targets: no bench results ($OUT/cuda_bench/results.json missing)"
  fi
  echo
  if [ $failed = 0 ]; then echo "gpu_check: all steps that ran passed"; else echo "gpu_check: FAILED (see the table)"; fi
} | tee "$OUT/summary.md"
echo "gpu_check: outputs in $OUT (summary.md, logs/, cuda_bench/)"
exit $failed
