#!/usr/bin/env bash
# scripts/demo.sh [RANKS]: the main job. Installs what is missing, builds commux, and runs the
# halo-exchange demo: a 2-D Jacobi stencil over RANKS (default 4) local ranks exchanging tagged
# halos out of order, checked against a single-process solve.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
scripts/build.sh build -DCOMMUX_UCX_PROVIDER=wheel
UCX_NET_DEVICES=${UCX_NET_DEVICES:-lo} build/examples/commux_halo_demo --ranks "${1:-4}"
