#!/usr/bin/env bash
# scripts/demo.sh [RANKS]: the main job. Installs what is missing, builds and installs commux, and
# runs examples/halo_exchange.py: a 2-D Jacobi stencil over RANKS (default 4) local ranks whose
# halos travel as tagged isend/irecv posted in a shuffled order, the residual all-reduced, the
# result checked against a single-process solve, and the time per iteration printed for "ucx" and
# "gloo" side by side.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install.sh
UCX_NET_DEVICES=${UCX_NET_DEVICES:-lo} .venv/bin/python examples/halo_exchange.py --nprocs "${1:-4}"
