#!/usr/bin/env bash
# scripts/test.sh [STAGE...]: every test, from a fresh machine (no argument), or the named stages.
# Installs what is missing, then runs, in this order:
#
#   lint         ruff check (pyproject.toml), clang-format over the C/C++ files (scripts/format.sh
#                --check lists the files that differ), the layering rules (scripts/check_layers.py
#                and its self-test), shellcheck on the shell scripts
#   cpp          the C++ suites, UCX from the libucx-cu13 wheel (UCX 1.22), the torch adapter built too
#   cpp-system   the C++ suites, UCX from the system (Debian libucx-dev, UCX 1.13)
#   asan         the C++ suites under AddressSanitizer + UndefinedBehaviorSanitizer
#   tsan         the threaded C++ tests under ThreadSanitizer (threads-as-ranks collectives,
#                multithreaded point-to-point, shutdown racing waiters); any report fails
#   fuzz         libFuzzer (clang, ASan + UBSan) over the TcpStore request parser and the tag decoder,
#                30 s each from tests/fuzz/corpus/<target>/; any crash or report fails
#   bench        a smoke run of the C++ benchmark (correctness only; timings not judged)
#   python       the package (pip install . --no-build-isolation, torch 2.13 CPU) and its tests,
#                then the Work, collectives and DDP suites again with COMMUX_INFLIGHT=4 and
#                COMMUX_SCHEDULE=1 (async collectives as schedules), and the Work and DDP suites
#                with COMMUX_PROGRESS_RESUMES=1 (the progress thread resumes them)
#   wheel        the wheel as users install it (python/tests/wheel): `pip wheel .` (incremental, in
#                the python stage's build directory) and the bundled wheel (COMMUX_UCX_PROVIDER=
#                bundled), installed in turn into one fresh venv holding only torch: commux.info,
#                2 ranks, one UCX per process, relative RPATHs; C++ consumers of the installed wheel
#                (find_package, the original recipe) and of FetchContent; the build options' errors
#   cuda         the package against a CUDA build of torch 2.14 (.venv-cuda): it builds, imports and
#                passes the CUDA suite (its GPU tests skip on a machine without one)
#   torch        the package built against torch 2.11 and 2.12 (the oldest supported releases; 2.11
#                is the GPU machines' torch), the p2p / collectives / DDP / EP suites on 2.11, and
#                scripts/gpu_check.sh --cpu-smoke against 2.11 (the GPU check's build, here first)
#
# e.g. `scripts/test.sh python` while iterating; CI runs them all (.ci/run). An unknown stage is an
# error. A stage that finds no tests fails: nothing is skipped silently.
set -euo pipefail
cd "$(dirname "$0")/.."
export UCX_NET_DEVICES=${UCX_NET_DEVICES:-lo}

ALL_STAGES=(lint cpp cpp-system asan tsan fuzz bench python wheel cuda torch)
# The torch releases the package claims besides the two above (2.13 CPU in .venv, 2.14 CUDA in
# .venv-cuda); README "Supported torch" and pyproject.toml state the same range.
OLDER_TORCH=(2.11 2.12)
SUITE_TORCH=2.11   # the release the subset of the Python suite runs on as well
# The tsan stage's tests: ranks as threads (collectives), threads posting at once (p2p), shutdown
# racing waiters (test_threads).
TSAN_TESTS='^(Threads\.|P2P\.ManyThreadsPostAndWait$|HeldPosts\.|collectives\.WorldSizes/Threads\.EveryCollective/[2-58]$|collectives\.WorldSizes/Forced\.EveryAlgorithmOfEveryCollective/[34]$|collectives\.Collectives\.(ConcurrentCollectivesWithDistinctTags|SchedulesInFlightDrivenFromTwoThreads)$)'

run_ctest() {  # build dir [extra ctest args]
  local dir=$1
  shift
  (cd "$dir" && ../.venv/bin/ctest --output-on-failure --timeout 240 -j2 --no-tests=error "$@")
}

run_pytest() {  # python [pytest args]: a run that collects no test fails (pytest's exit 5)
  local py=$1
  shift
  "$py" -m pytest -q "$@"
}

stage_lint() {
  echo "== lint: ruff check, clang-format, layering, shellcheck"
  local failed=() shells
  .venv-tools/bin/ruff check --no-cache || failed+=(ruff)
  scripts/format.sh --check || failed+=(clang-format)
  .venv-tools/bin/python scripts/check_layers.py || failed+=(layering)
  run_pytest .venv/bin/python -p no:cacheprovider python/tests/test_layers.py || failed+=(layering-self-test)
  mapfile -t shells < <(git ls-files '*.sh' .ci/run 2>/dev/null || find scripts tests -name '*.sh')
  .venv-tools/bin/shellcheck --severity=warning "${shells[@]}" || failed+=(shellcheck)
  if [ ${#failed[@]} -gt 0 ]; then
    echo "lint: failed: ${failed[*]}" >&2
    return 1
  fi
}

stage_cpp() {
  echo "== C++ tests, UCX from the libucx-cu13 wheel (with the torch adapter: its argument checks'"
  echo "   GoogleTest, test_tensor_checks and test_list_buffer, need it)"
  scripts/build.sh build -DCOMMUX_UCX_PROVIDER=wheel -DCOMMUX_BUILD_C10D=ON
  run_ctest build
}

stage_cpp-system() {
  echo "== C++ tests, UCX from the system (Debian libucx-dev)"
  scripts/build.sh build-system -DCOMMUX_UCX_PROVIDER=system -DCOMMUX_BUILD_BENCH=OFF
  run_ctest build-system
}

stage_asan() {
  echo "== C++ tests under AddressSanitizer + UndefinedBehaviorSanitizer"
  # UCX's CMA transport and ASan clash (ASan crashes in process_vm_readv during wire-up): ^cma.
  scripts/build.sh build-asan -DCOMMUX_SANITIZE=address,undefined -DCOMMUX_BUILD_BENCH=OFF \
    -DCOMMUX_BUILD_EXAMPLES=OFF
  # (The install test is left out: an instrumented library needs an instrumented consumer.)
  (export UCX_TLS=^cma UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 &&
    run_ctest build-asan -E install)
}

stage_tsan() {
  echo "== the threaded C++ tests under ThreadSanitizer"
  # Only the targets these tests live in, and only the threaded tests: TSan runs 5-15x slower.
  .venv/bin/cmake -S . -B build-tsan -G Ninja -DCMAKE_MAKE_PROGRAM="$PWD/.venv/bin/ninja" \
    -DCOMMUX_BUILD_TESTS=ON -DCOMMUX_PYTHON="$PWD/.venv/bin/python" -DCOMMUX_SANITIZE=thread \
    -DCOMMUX_BUILD_BENCH=OFF -DCOMMUX_BUILD_EXAMPLES=OFF >/dev/null
  .venv/bin/cmake --build build-tsan --target test_threads test_p2p test_collectives
  # UCX and libstdc++ are not instrumented: tests/tsan.supp says what is suppressed, and why.
  # Nothing in commux's own code is suppressed; a report exits 66 and fails the test.
  # UCX_MEM_EVENTS=no: UCX's memory hooks (UCM's mmap/brk patching) crash under TSan's own mmap
  # interception (SIGSEGV in the first test); commux does not need them on host memory.
  (export UCX_MEM_EVENTS=no \
      TSAN_OPTIONS="halt_on_error=1 exitcode=66 second_deadlock_stack=1 suppressions=$PWD/tests/tsan.supp" &&
    run_ctest build-tsan -R "$TSAN_TESTS")
}

stage_fuzz() {
  echo "== libFuzzer: the TcpStore request parser and the tag decoder (clang, 30 s each)"
  # COMMUX_FUZZ builds only tests/fuzz (no UCX, no torch). New inputs go to build-fuzz/corpus/;
  # the checked-in seeds (tests/fuzz/corpus/<target>/) are only read.
  CC=clang CXX=clang++ .venv/bin/cmake -S . -B build-fuzz -G Ninja \
    -DCMAKE_MAKE_PROGRAM="$PWD/.venv/bin/ninja" -DCOMMUX_FUZZ=ON >/dev/null
  .venv/bin/cmake --build build-fuzz
  local t
  for t in fuzz_store fuzz_tag; do
    [ -n "$(ls -A "tests/fuzz/corpus/$t" 2>/dev/null)" ] || {
      echo "fuzz: no seed corpus in tests/fuzz/corpus/$t" >&2
      return 1
    }
    mkdir -p "build-fuzz/corpus/$t" build-fuzz/artifacts
    # A crash, a sanitizer report or a check's abort() exits non-zero (its input is saved under
    # build-fuzz/artifacts/).
    "build-fuzz/tests/fuzz/$t" -max_total_time=30 -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 \
      -artifact_prefix=build-fuzz/artifacts/ "build-fuzz/corpus/$t" "tests/fuzz/corpus/$t"
  done
}

stage_bench() {
  echo "== benchmark smoke run (correctness checked; timings not judged)"
  [ -x build/bench/commux_bench ] || scripts/build.sh build -DCOMMUX_UCX_PROVIDER=wheel
  .venv/bin/python bench/run_bench.py build --quick --settle 0 --out results/p2p-smoke
}

stage_python() {
  echo "== Python package (pip install . --no-build-isolation) and its tests"
  scripts/install.sh
  # python/tests/test_bench_suite.py requires every collectives backend, the C++ and MPI ones too.
  [ -x build/bench/commux_coll_bench ] && [ -x build/bench/mpi_coll ] ||
    scripts/build.sh build -DCOMMUX_UCX_PROVIDER=wheel
  run_pytest .venv/bin/python python/tests
  # Again with up to four collectives of a group at once wherever the tests issue async ones (auto
  # gives 1 on this machine's 3- and 4-rank groups): the Work, collectives and DDP suites.
  COMMUX_INFLIGHT=4 COMMUX_SCHEDULE=1 run_pytest .venv/bin/python python/tests/test_work.py \
    python/tests/test_collectives.py python/tests/test_ddp.py python/tests/test_group_window.py
  # And with the progress thread resuming the schedules (off by default): the Work and DDP suites.
  COMMUX_SCHEDULE=1 COMMUX_PROGRESS_RESUMES=1 run_pytest .venv/bin/python \
    python/tests/test_work.py python/tests/test_ddp.py
}

stage_wheel() {
  echo "== the wheel in a fresh venv (plain and bundled), C++ consumers, the build options' errors"
  # The wheels are built in build-py/ (scripts/install.sh's): after the python stage, incremental.
  [ -d build-py ] || echo "wheel: no build-py/ yet (the python stage makes it): a full build first"
  run_pytest .venv/bin/python --durations=8 python/tests/wheel
}

stage_cuda() {
  echo "== the package against a CUDA build of torch (.venv-cuda): it builds, imports and passes the"
  echo "   CUDA suite (its GPU tests skip on a machine without one), the package and p2p tests"
  scripts/setup.sh cuda
  .venv-cuda/bin/pip install -q --disable-pip-version-check --no-build-isolation \
    -C build-dir='build-py-cuda/{wheel_tag}' -C cmake.define.COMMUX_WERROR=ON .
  (cd /tmp && "$OLDPWD/.venv-cuda/bin/python" -m commux.info)
  run_pytest .venv-cuda/bin/python python/tests/test_cuda.py python/tests/test_package.py \
    python/tests/test_transports.py python/tests/test_p2p.py
}

stage_torch() {
  local v venv
  for v in "${OLDER_TORCH[@]}"; do
    echo "== the package against torch $v (.venv-torch$v): pip install . --no-build-isolation"
    scripts/setup.sh torch "$v"
    venv=.venv-torch$v
    "$venv/bin/pip" install -q --disable-pip-version-check --no-build-isolation \
      -C build-dir="build-py-torch$v/{wheel_tag}" -C cmake.define.COMMUX_WERROR=ON .
    (cd /tmp && "$OLDPWD/$venv/bin/python" -c \
      "import commux, torch; print('torch', torch.__version__, '-> commux', commux.__version__, 'built for', commux._BUILT_WITH_TORCH)")
  done
  venv=.venv-torch$SUITE_TORCH
  echo "== on torch $SUITE_TORCH: tagged p2p, every collective against gloo, DDP, the package"
  run_pytest "$venv/bin/python" python/tests/test_p2p.py python/tests/test_collectives.py \
    python/tests/test_ddp.py python/tests/test_work.py python/tests/test_package.py python/tests/test_ep.py
  echo "== scripts/gpu_check.sh --cpu-smoke on torch $SUITE_TORCH: the GPU check's own build and steps"
  GPU_CHECK_PYTHON=$venv/bin/python OUT=results/gpu-smoke-torch$SUITE_TORCH \
    GPU_CHECK_DIR=/tmp/commux-gpu-smoke-torch$SUITE_TORCH scripts/gpu_check.sh --cpu-smoke
}

stages=("$@")
[ ${#stages[@]} -gt 0 ] || stages=("${ALL_STAGES[@]}")
for s in "${stages[@]}"; do
  case " ${ALL_STAGES[*]} " in
    *" $s "*) ;;
    *) echo "scripts/test.sh: unknown stage '$s' (stages: ${ALL_STAGES[*]})" >&2; exit 2 ;;
  esac
done
scripts/setup.sh
t0=$SECONDS
for s in "${stages[@]}"; do
  ts=$SECONDS
  "stage_$s"
  echo "== stage $s passed in $((SECONDS - ts)) s"
done
echo "scripts/test.sh: stages ${stages[*]} passed in $((SECONDS - t0)) s"
