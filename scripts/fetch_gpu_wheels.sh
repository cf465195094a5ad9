#!/usr/bin/env bash
# scripts/fetch_gpu_wheels.sh: run on a machine WITH registry access (this one) before a GPU check.
# Downloads into .whl/ (ignored by git, carried to the GPU machine with carry [".whl"]) the wheels
# that scripts/gpu_check.sh installs there with `pip install --no-index`: the libucx-cu13 wheel
# that pyproject.toml asks for (libucx-cu13>=1.22,<1.23), for CPython 3.12 on x86-64 (the GPU
# machine's /opt/torch/.venv/bin/python3). The wheel has no Requires-Dist entries, so nothing else
# is needed: the GPU image already holds torch, cmake, ninja, pybind11, scikit-build-core, pytest
# and pytest-timeout (see /work/.library/device/KINDS.md); the script checks this and fails if a
# fetched wheel ever names a dependency.
#
#   scripts/fetch_gpu_wheels.sh            # uses .venv/bin/python (or $PYTHON) to run pip
#
# The total size is printed; the device tool carries at most 64 MiB (working tree included).
set -euo pipefail
cd "$(dirname "$0")/.."

python=${PYTHON:-}
if [ -z "$python" ]; then
  if [ -x .venv/bin/python ]; then python=.venv/bin/python; else python=python3; fi
fi
requirement=${COMMUX_UCX_WHEEL:-"libucx-cu13>=1.22,<1.23"}
dest=.whl

mkdir -p "$dest"
# Keep exactly one version: two libucx wheels would stop the `pip install` on the GPU machine.
rm -f "$dest"/libucx_cu13-*.whl "$dest"/libucx-cu13-*.whl
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 \
         manylinux1_x86_64; do
  platforms+=(--platform "$p")
done
echo "fetch_gpu_wheels: $requirement for CPython 3.12, x86-64 -> $dest/"
"$python" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
  --python-version 3.12 --implementation cp "${platforms[@]}" -d "$dest" "$requirement"

shopt -s nullglob
wheels=("$dest"/*.whl)
if [ ${#wheels[@]} -eq 0 ]; then
  echo "fetch_gpu_wheels: no wheel was downloaded" >&2
  exit 1
fi
status=0
for w in "${wheels[@]}"; do
  deps=$("$python" - "$w" <<'EOF'
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    for line in z.read(meta).decode().splitlines():
        if line.startswith("Requires-Dist:") and "extra ==" not in line:
            print(line.split(":", 1)[1].strip())
EOF
)
  if [ -n "$deps" ]; then
    echo "fetch_gpu_wheels: $w requires (fetch these too, or check the GPU image has them):" >&2
    echo "$deps" | sed 's/^/  /' >&2
    status=1
  fi
done
ls -l "$dest"
total=$(du -cb "${wheels[@]}" | tail -n 1 | cut -f1)
echo "fetch_gpu_wheels: ${#wheels[@]} wheel(s), $((total / 1024 / 1024)) MiB ($total bytes) in $dest/" \
     "(the device tool carries at most 64 MiB with the working tree)"
if [ "$total" -gt $((48 * 1024 * 1024)) ]; then
  echo "fetch_gpu_wheels: warning: over 48 MiB; the working tree must fit in what is left" >&2
fi
exit $status
