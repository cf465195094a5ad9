#!/usr/bin/env python3
"""scripts/check_layers.py [ROOT]: the layering rules of commux, checked on every #include.

  ucx           a UCX header (ucp/ ucs/ uct/ ucm/) is included only in src/core/ (so never from
                include/commux/, whose headers users compile against without UCX)
  torch         torch (torch/ ATen/ c10/) and pybind11 stay out of src/core/, src/collectives/ and
                every include/commux/ header except include/commux/process_group_ucx.hpp
  core-private  src/collectives/ uses src/core only through its public headers (include/commux/),
                the internal channel header src/core/channel.hpp and the debug log's
                src/core/log.hpp (torch- and UCX-free): no other src/core header
  pybind11      pybind11 (also through torch's pybind headers) is included only in src/bindings/

Prints one line per violation, "file:line: [rule] what", and exits 1 if there is any (2 when
ROOT holds no C/C++ file at all, so a wrong ROOT cannot pass). Only the standard library is
used; python/tests/test_layers.py checks the checker on a fake tree with one violation per rule.
"""
from __future__ import annotations

import os
import re
import sys

SOURCE_DIRS = ("src", "include", "tests", "bench", "examples", "tools", "python")
SUFFIXES = (".c", ".cc", ".cpp", ".cxx", ".h", ".hh", ".hpp", ".cu", ".cuh")
SKIP_DIRS = {".git", "__pycache__"}

INCLUDE = re.compile(r'^\s*#\s*include\s*([<"])([^>"]+)[>"]')
UCX = re.compile(r"^(ucp|ucs|uct|ucm)/")
TORCH = re.compile(r"^(torch|ATen|c10)/")
# torch's headers that bring pybind11 in with them.
PYBIND = re.compile(r"^(pybind11/|torch/(extension\.h|python\.h|csrc/utils/pybind\.h))")

TORCH_HEADER_ALLOWED = "include/commux/process_group_ucx.hpp"
CORE_HEADERS_FOR_COLLECTIVES = ("src/core/channel.hpp", "src/core/log.hpp")


def sources(root: str):
    for top in SOURCE_DIRS:
        base = os.path.join(root, top)
        for d, dirs, files in os.walk(base):
            dirs[:] = sorted(x for x in dirs if x not in SKIP_DIRS and not x.startswith("build"))
            for f in sorted(files):
                if f.endswith(SUFFIXES):
                    yield os.path.relpath(os.path.join(d, f), root).replace(os.sep, "/")


def core_target(rel: str, inc: str) -> str | None:
    """The src/core file a quoted include of `rel` names, if it names one."""
    here = os.path.dirname(rel)
    for cand in (os.path.join(here, inc), os.path.join("src", inc)):
        path = os.path.normpath(cand).replace(os.sep, "/")
        if path.startswith("src/core/"):
            return path
    return None


def check_file(rel: str, text: str):
    in_core = rel.startswith("src/core/")
    in_coll = rel.startswith("src/collectives/")
    in_public = rel.startswith("include/commux/")
    in_bindings = rel.startswith("src/bindings/")
    in_comment = False
    for n, line in enumerate(text.splitlines(), 1):
        # Skip /* ... */ blocks that span lines (an #include inside one is not an include).
        if in_comment:
            if "*/" in line:
                in_comment = False
            continue
        stripped = line.strip()
        if stripped.startswith("/*") and "*/" not in stripped:
            in_comment = True
            continue
        m = INCLUDE.match(line)
        if not m:
            continue
        quote, inc = m.groups()
        where = f"{rel}:{n}"
        if UCX.match(inc) and not in_core:
            what = "a public header" if in_public else "outside src/core/"
            yield f"{where}: [ucx] UCX header <{inc}> included {what}"
        if (TORCH.match(inc) or PYBIND.match(inc)) and (
            in_core or in_coll or (in_public and rel != TORCH_HEADER_ALLOWED)
        ):
            layer = "/".join(rel.split("/")[:2]) + "/"
            yield (f"{where}: [torch] <{inc}> included in {layer} (torch and pybind11 belong to "
                   f"src/c10d, src/bindings and {TORCH_HEADER_ALLOWED})")
        if in_coll and quote == '"':
            target = core_target(rel, inc)
            if target is not None and target not in CORE_HEADERS_FOR_COLLECTIVES:
                yield (f"{where}: [core-private] \"{inc}\" is src/core's private {target}; "
                       f"src/collectives/ may include only {' and '.join(CORE_HEADERS_FOR_COLLECTIVES)} "
                       "of src/core")
        if PYBIND.match(inc) and not in_bindings:
            yield f"{where}: [pybind11] <{inc}> included outside src/bindings/"


def check_tree(root: str) -> tuple[list[str], int]:
    problems, count = [], 0
    for rel in sources(root):
        count += 1
        with open(os.path.join(root, rel), encoding="utf-8", errors="replace") as f:
            problems.extend(check_file(rel, f.read()))
    return problems, count


def main(argv: list[str]) -> int:
    root = argv[1] if len(argv) > 1 else os.path.join(os.path.dirname(__file__), "..")
    problems, count = check_tree(root)
    if count == 0:
        print(f"check_layers: no C/C++ files under {root}", file=sys.stderr)
        return 2
    for p in problems:
        print(p)
    if problems:
        print(f"check_layers: {len(problems)} layering violation(s) in {count} files", file=sys.stderr)
        return 1
    print(f"check_layers: {count} files follow the layering rules")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
