#!/usr/bin/env bash
# tests/run_driver_cuda.sh [BUILD_DIR | TEST_COMMUX]: the C++ driver's CUDA mode (UCXPG_DEVICE=cuda)
# on 2 ranks of this machine.
#
# Without an argument it first configures and builds a minimal tree, build-gpu in the repository
# root (only the test_commux target; UCX from the libucx wheel of $PYTHON; GoogleTest not needed):
#   PYTHON=python3 bash tests/run_driver_cuda.sh   (scripts/gpu_check.sh passes its Python)
# With a build directory it runs that tree's tests/test_commux without building; with the
# test_commux binary itself (what ctest's driver.cuda_2_ranks passes) it runs that.
#
# Exit status: the driver's -- 0 passed, 77 skipped (no CUDA runtime, no GPU, or a UCX without
# CUDA memory; each rank says what is missing), anything else failed.
#
# Environment:
#   PYTHON              the Python whose libucx wheel provides UCX (default python3)
#   COMMUX_CUDART       the CUDA runtime (a libcudart.so.N path); when unset, one in $PYTHON's nvidia
#                       wheels (as torch installs them) is used if there is one; the driver also
#                       tries libcudart.so.13/.12/.so by name
#   COMMUX_DRIVER_PORT  port of rank 0's store (default: 29600 + pid % 300)
#   UCX_NET_DEVICES     default lo
#   CMAKE, NINJA        the tools (default: on PATH, else next to $PYTHON)
#   COMMUX_WERROR       ON to make warnings errors in that build (default OFF)
set -u
here=$(cd "$(dirname "$0")" && pwd)
root=$(dirname "$here")
py=${PYTHON:-python3}
pybin=$(command -v "$py" 2>/dev/null || true)
say() { echo "run_driver_cuda.sh: $*"; }

tool() {  # tool NAME OVERRIDE: the program's path, or nothing
  if [[ -n $2 ]]; then echo "$2"; return; fi
  if command -v "$1" >/dev/null 2>&1; then command -v "$1"; return; fi
  if [[ -n $pybin && -x $(dirname "$pybin")/$1 ]]; then echo "$(dirname "$pybin")/$1"; fi
}

if (($# >= 1)) && [[ -f $1 && -x $1 ]]; then
  bin=$1
elif (($# >= 1)); then
  bin=$1/tests/test_commux
else
  build=$root/build-gpu
  [[ -n $pybin ]] || { say "no Python '$py' (set PYTHON to the one with the libucx wheel)"; exit 1; }
  cmake=$(tool cmake "${CMAKE:-}")
  [[ -n $cmake ]] || { say "no cmake on PATH or next to $pybin (set CMAKE)"; exit 1; }
  ninja=$(tool ninja "${NINJA:-}")
  gen=(-G Ninja -DCMAKE_MAKE_PROGRAM="$ninja")
  if [[ -z $ninja ]]; then
    say "no ninja on PATH or next to $pybin: using CMake's default generator"
    gen=()
  fi
  say "configuring $build (UCX from the libucx wheel of $pybin)"
  # Warnings are not errors here: another machine's compiler may warn where ours does not, and this
  # checks behaviour (scripts/build.sh keeps -Werror for development).
  "$cmake" -S "$root" -B "$build" ${gen[@]+"${gen[@]}"} -DCOMMUX_BUILD_TESTS=ON -DCOMMUX_GTEST=OFF -DCOMMUX_BUILD_BENCH=OFF \
    -DCOMMUX_BUILD_EXAMPLES=OFF -DCOMMUX_UCX_PROVIDER=wheel -DCOMMUX_PYTHON="$pybin" \
    -DCOMMUX_WERROR="${COMMUX_WERROR:-OFF}" ||
    { say "configuring failed"; exit 1; }
  "$cmake" --build "$build" --target test_commux -j "$(nproc 2>/dev/null || echo 4)" ||
    { say "building test_commux failed"; exit 1; }
  bin=$build/tests/test_commux
fi
[[ -x $bin ]] || { say "no test_commux at $bin"; exit 1; }

# The CUDA runtime: torch's wheels carry one (nvidia/cu13/lib, nvidia/cuda_runtime/lib) that the
# dynamic loader does not find by name.
if [[ -z ${COMMUX_CUDART:-} && -n $pybin ]]; then
  found=$("$pybin" - 2>/dev/null <<'EOF'
import glob, os, site, sys
roots = [p for p in sys.path if p and os.path.isdir(p)]
try:
    roots += site.getsitepackages() + [site.getusersitepackages()]
except Exception:
    pass
for r in dict.fromkeys(roots):
    for pat in ("nvidia/cu13/lib/libcudart.so.13*", "nvidia/cuda_runtime/lib/libcudart.so.1[0-9]*",
                "nvidia/*/lib/libcudart.so.[0-9]*"):
        hits = sorted(glob.glob(os.path.join(r, pat)))
        if hits:
            print(hits[0])
            sys.exit(0)
EOF
  )
  if [[ -n $found ]]; then
    export COMMUX_CUDART=$found
    say "COMMUX_CUDART=$found (from the wheels of $pybin)"
  fi
fi

port=${COMMUX_DRIVER_PORT:-$((29600 + $$ % 300))}
export UCXPG_DEVICE=cuda UCX_NET_DEVICES=${UCX_NET_DEVICES:-lo}
say "$bin on 2 ranks, UCXPG_DEVICE=cuda, store 127.0.0.1:$port"
bash "$here/run_driver.sh" "$bin" 2 127.0.0.1 "$port"
rc=$?
case $rc in
  0) say "passed" ;;
  77) say "skipped (exit 77): the CUDA checks cannot run here (the ranks say why above)" ;;
  *) say "FAILED (exit $rc)" ;;
esac
exit $rc
