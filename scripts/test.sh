#!/usr/bin/env bash
# scripts/test.sh: every test, from a fresh machine. Installs what is missing, then builds and runs
# the C++ suites against both UCX providers (the wheel's UCX 1.22 and Debian's UCX 1.13) and under
# ASan+UBSan, a smoke run of the benchmark (correctness only), the Python tests, and the package
# built against a CUDA build of torch with its CUDA suite (GPU tests skip without a GPU).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
export UCX_NET_DEVICES=${UCX_NET_DEVICES:-lo}

run_ctest() {  # build dir [extra ctest args]
  local dir=$1
  shift
  (cd "$dir" && ../.venv/bin/ctest --output-on-failure --timeout 240 -j2 "$@")
}

echo "== C++ tests, UCX from the libucx-cu13 wheel"
scripts/build.sh build -DCOMMUX_UCX_PROVIDER=wheel
run_ctest build

echo "== C++ tests, UCX from the system (Debian libucx-dev)"
scripts/build.sh build-system -DCOMMUX_UCX_PROVIDER=system -DCOMMUX_BUILD_BENCH=OFF
run_ctest build-system

echo "== C++ tests under AddressSanitizer + UndefinedBehaviorSanitizer"
# UCX's CMA transport and ASan clash (ASan crashes in process_vm_readv during wire-up): ^cma.
scripts/build.sh build-asan -DCOMMUX_SANITIZE=address,undefined -DCOMMUX_BUILD_BENCH=OFF \
  -DCOMMUX_BUILD_EXAMPLES=OFF
# (The install test is left out: an instrumented library needs an instrumented consumer.)
(export UCX_TLS=^cma UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 &&
  run_ctest build-asan -E install)

if [ -f bench/run_bench.py ]; then
  echo "== benchmark smoke run (correctness checked; timings not judged)"
  .venv/bin/python bench/run_bench.py build --quick --settle 0 --out results/p2p-smoke
fi

run_pytest() {  # python [pytest args]: pytest's "no tests collected" (5) is not a failure
  local py=$1
  shift
  set +e
  "$py" -m pytest -q "$@"
  local rc=$?
  set -e
  if [ $rc -eq 5 ]; then echo "pytest: no tests collected"; elif [ $rc -ne 0 ]; then exit $rc; fi
}

echo "== Python package (pip install . --no-build-isolation) and its tests"
scripts/install.sh
if [ -d python/tests ]; then
  run_pytest .venv/bin/python python/tests
fi

echo "== the package against a CUDA build of torch (.venv-cuda): it builds, imports and passes the"
echo "   CUDA suite (its GPU tests skip on a machine without one), the package and p2p tests"
scripts/setup.sh cuda
.venv-cuda/bin/pip install -q --disable-pip-version-check --no-build-isolation \
  -C build-dir='build-py-cuda/{wheel_tag}' .
(cd /tmp && "$OLDPWD/.venv-cuda/bin/python" -m commux.info)
run_pytest .venv-cuda/bin/python python/tests/test_cuda.py python/tests/test_package.py \
  python/tests/test_transports.py python/tests/test_p2p.py
echo "scripts/test.sh: all tests passed"
