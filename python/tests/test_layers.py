"""scripts/check_layers.py: the real tree passes, and a fake tree with one violation of each rule
fails, each violation named by file:line and rule. No commux import, no ranks."""
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CHECK = os.path.join(REPO, "scripts", "check_layers.py")

# A tree that follows every rule (allowed uses of each kind of header) ...
CLEAN = {
    "src/core/engine.hpp": "#pragma once\n#include <ucp/api/ucp.h>\n#include \"channel.hpp\"\n",
    "src/core/channel.hpp": "#pragma once\n#include <cstddef>\n",
    "src/collectives/algo/ring.cpp": (
        '#include "../../core/channel.hpp"\n#include "commux/communicator.hpp"\n'
        '#include "../exchange.hpp"\n'),
    "src/collectives/select.cpp": '#include "core/channel.hpp"\n#include <vector>\n',
    "src/collectives/algo.hpp": '#include "../core/log.hpp"\n',
    "src/c10d/work.hpp": "#include <ATen/ATen.h>\n#include <torch/csrc/distributed/c10d/Work.hpp>\n",
    "src/bindings/python.cpp": "#include <pybind11/pybind11.h>\n#include <torch/csrc/utils/pybind.h>\n",
    "include/commux/process_group_ucx.hpp": "#include <torch/csrc/distributed/c10d/Backend.hpp>\n",
    "include/commux/communicator.hpp": "// mentions <ucp/api/ucp.h> in a comment only\n",
    "tests/test_x.cpp": "/*\n#include <ucp/api/ucp.h>\n*/\n#include \"commux/communicator.hpp\"\n",
}

# ... and one violation of each rule: (path, text, line, rule).
VIOLATIONS = [
    ("src/collectives/allreduce.cpp", "#include <vector>\n#include <ucs/type/status.h>\n", 2, "ucx"),
    ("include/commux/store.hpp", "#pragma once\n#include <ucp/api/ucp.h>\n", 2, "ucx"),
    ("src/core/tag.cpp", "#include <c10/util/Exception.h>\n", 1, "torch"),
    ("src/collectives/reduce.cpp", "#include <string>\n\n#include <ATen/ATen.h>\n", 3, "torch"),
    ("include/commux/collectives.hpp", "#include <torch/version.h>\n", 1, "torch"),
    ("src/collectives/broadcast.cpp", '#include "../core/engine.hpp"\n', 1, "core-private"),
    ("src/collectives/algo/gather.cpp", '#include "../../core/status.hpp"\n', 1, "core-private"),
    ("src/c10d/device.cpp", "#include <ATen/ATen.h>\n#include <pybind11/stl.h>\n", 2, "pybind11"),
    ("tests/test_y.cpp", "#include <torch/extension.h>\n", 1, "pybind11"),
]


def run_check(root):
    return subprocess.run([sys.executable, CHECK, str(root)], capture_output=True, text=True,
                          timeout=60)


def write_tree(root, files):
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_the_real_tree_follows_the_layering_rules():
    r = run_check(REPO)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "files follow the layering rules" in r.stdout


def test_a_clean_fake_tree_passes(tmp_path):
    write_tree(tmp_path, CLEAN)
    r = run_check(tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize("path,text,line,rule", VIOLATIONS, ids=[f"{v[3]}:{v[0]}" for v in VIOLATIONS])
def test_each_violation_alone_fails_naming_file_line_and_rule(tmp_path, path, text, line, rule):
    write_tree(tmp_path, {**CLEAN, path: text})
    r = run_check(tmp_path)
    assert r.returncode == 1, r.stdout + r.stderr
    assert f"{path}:{line}: [{rule}]" in r.stdout, r.stdout


def test_all_violations_together_are_all_reported(tmp_path):
    write_tree(tmp_path, {**CLEAN, **{p: t for p, t, _, _ in VIOLATIONS}})
    r = run_check(tmp_path)
    assert r.returncode == 1
    for path, _, line, rule in VIOLATIONS:
        assert f"{path}:{line}: [{rule}]" in r.stdout, r.stdout
    # pybind11 in src/c10d is only a pybind11 violation (torch is at home there); nothing else.
    assert len(r.stdout.splitlines()) == len(VIOLATIONS), r.stdout


def test_an_empty_tree_does_not_pass(tmp_path):
    assert run_check(tmp_path).returncode == 2
