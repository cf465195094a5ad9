#!/usr/bin/env bash
# scripts/install.sh: builds and installs the commux Python package (the torch backend "ucx")
# into .venv against the torch installed there (pip install . --no-build-isolation). The CMake
# build directory build-py/ is kept, so a rebuild after a change is incremental. Warnings are
# errors here (COMMUX_WERROR=ON), as in CI; a plain `pip install .` leaves them warnings.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
.venv/bin/pip install -q --disable-pip-version-check --no-build-isolation \
  -C cmake.define.COMMUX_WERROR=ON .
(cd /tmp && "$OLDPWD/.venv/bin/python" -c "import commux; print('install: commux', commux.__version__, 'for torch', commux._BUILT_WITH_TORCH)")
