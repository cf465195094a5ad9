#!/usr/bin/env bash
# scripts/build.sh [BUILD_DIR] [extra cmake args...]: configures and builds commux with its tests,
# benchmarks and examples (default BUILD_DIR=build, UCX provider auto = the wheel in .venv).
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:-build}
shift || true
.venv/bin/cmake -S . -B "$dir" -G Ninja -DCMAKE_MAKE_PROGRAM="$PWD/.venv/bin/ninja" \
  -DCOMMUX_BUILD_TESTS=ON -DCOMMUX_PYTHON="$PWD/.venv/bin/python" "$@" >/dev/null
.venv/bin/cmake --build "$dir"
