#!/usr/bin/env bash
# scripts/format.sh [--check]: applies .clang-format to every C/C++ source and header of the tree
# (src/ include/ tests/ bench/ examples/ tools/ python/tests/cpp/), with the pinned clang-format in
# .venv-tools (scripts/setup.sh installs it). --check changes nothing: it lists the files that
# differ from the format, with how many lines would change, and fails if any does (the lint stage
# of scripts/test.sh). Python is not reformatted (ruff check only; see pyproject.toml).
set -euo pipefail
cd "$(dirname "$0")/.."
clang_format=.venv-tools/bin/clang-format
[ -x "$clang_format" ] || scripts/setup.sh >/dev/null
check=0
case "${1:-}" in
  "") ;;
  --check) check=1 ;;
  *) echo "usage: scripts/format.sh [--check]" >&2; exit 2 ;;
esac

mapfile -d '' files < <(find src include tests bench examples tools python/tests/cpp -type f \
  \( -name '*.c' -o -name '*.cc' -o -name '*.cpp' -o -name '*.h' -o -name '*.hpp' -o -name '*.cu' \
     -o -name '*.cuh' \) -print0 | sort -z)
[ ${#files[@]} -gt 0 ] || { echo "format: no C/C++ files found" >&2; exit 1; }

if [ $check = 0 ]; then
  "$clang_format" -i --style=file "${files[@]}"
  echo "format: ${#files[@]} files formatted with $("$clang_format" --version)"
  exit 0
fi

differ=0
lines=0
for f in "${files[@]}"; do
  if ! "$clang_format" --style=file --dry-run --Werror "$f" 2>/dev/null; then
    n=$("$clang_format" --style=file "$f" | diff -- "$f" - | grep -c '^[<>]' || true)
    echo "  $f: $n lines differ"
    differ=$((differ + 1))
    lines=$((lines + n))
  fi
done
if [ $differ -gt 0 ]; then
  echo "format: $differ of ${#files[@]} files differ from .clang-format ($lines lines);" \
    "scripts/format.sh rewrites them" >&2
  exit 1
fi
echo "format: all ${#files[@]} C/C++ files match .clang-format"
