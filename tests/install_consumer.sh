#!/usr/bin/env bash
# install_consumer.sh BUILD_DIR CMAKE: installs commux from BUILD_DIR into a temporary prefix,
# builds tests/consumer against it with find_package(commux CONFIG), and runs it on 2 ranks.
set -euo pipefail
build=$1 cmake=$2
here=$(cd "$(dirname "$0")" && pwd)
tmp=$(mktemp -d /tmp/commux-install-XXXXXX)
trap 'rm -rf "$tmp"' EXIT
"$cmake" --install "$build" --prefix "$tmp/prefix" >/dev/null
"$cmake" -S "$here/consumer" -B "$tmp/build" -DCMAKE_PREFIX_PATH="$tmp/prefix" >/dev/null
"$cmake" --build "$tmp/build" >/dev/null
pids=()
for r in 0 1; do
  timeout 120 "$tmp/build/consumer" "$r" 2 "$tmp/store" > "$tmp/rank$r.log" 2>&1 &
  pids+=($!)
done
rc=0
for r in 0 1; do
  wait "${pids[$r]}" || { rc=1; echo "rank $r failed:"; cat "$tmp/rank$r.log"; }
done
cat "$tmp"/rank*.log
exit $rc
