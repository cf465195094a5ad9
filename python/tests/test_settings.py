"""The settings table (src/core/settings.cpp, exposed as commux._C.settings_table()) is the one
declaration of commux's environment variables: the README's table must match it row for row, no
other code may read a commux variable from the environment, and commux.info prints every one."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
README = os.path.join(REPO, "README.md")

pytestmark = pytest.mark.ucx


def _c():
    from commux import _C

    return _C


def readme_rows() -> list[dict]:
    """The rows of the README's "Runtime settings" table, backticks removed."""
    with open(README, encoding="utf-8") as f:
        text = f.read()
    start = text.index("\n## Runtime settings\n")
    end = text.find("\n## ", start + 1)
    section = text[start:end if end >= 0 else len(text)]
    all_lines = section.splitlines()
    first = next((i for i, ln in enumerate(all_lines) if ln.startswith("|")), None)
    assert first is not None, "README.md: no table under '## Runtime settings'"
    lines = []
    for ln in all_lines[first:]:  # the first table of the section (the UCX defaults' follows)
        if not ln.startswith("|"):
            break
        lines.append(ln)
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    assert header == ["variable", "type", "default", "read", "meaning"], header
    rows = []
    for ln in lines[2:]:
        cells = [c.strip().replace("`", "") for c in ln.strip().strip("|").split("|")]
        assert len(cells) == len(header), f"README.md settings row with {len(cells)} cells: {ln}"
        rows.append(dict(zip(["name", "type", "default", "read", "meaning"], cells)))
    return rows


def test_readme_table_matches_the_code():
    code = _c().settings_table()
    readme = readme_rows()
    assert [r["name"] for r in readme] == [r["name"] for r in code], "names (in order)"
    for r, c in zip(readme, code):
        for key in ("type", "default", "read", "meaning"):
            assert r[key] == c[key], f"{c['name']}: README {key} {r[key]!r} != code {c[key]!r}"


def test_interface_names_are_settings():
    """The runtime variables of the interface commux promises (docs/interface.md) are declared."""
    names = {r["name"] for r in _c().settings_table()}
    for promised in ("COMMUX_COALESCE", "COMMUX_GROUP", "UCXPG_DEVICE", "COMMUX_BENCH", "COMMUX_BENCH_V"):
        assert promised in names, promised


# Code that may read the environment for commux's own variables: the parser alone.
_READERS = re.compile(r"""(getenv|environ(\.get)?|environ\[)\s*\(?\s*["'](COMMUX_|UCXPG_)""")
_SKIP_DIRS = {"tests", "bench", "examples", "scripts"}  # test suites and tools have their own variables


def test_no_other_code_reads_commux_variables():
    offenders = []
    for top in ("src", "tools", "include", os.path.join("python", "commux")):
        for root, _, files in os.walk(os.path.join(REPO, top)):
            for name in files:
                if not name.endswith((".cpp", ".hpp", ".h", ".py")):
                    continue
                path = os.path.join(root, name)
                rel = os.path.relpath(path, REPO)
                if rel == os.path.join("src", "core", "settings.cpp"):
                    continue
                with open(path, encoding="utf-8") as f:
                    for n, line in enumerate(f, 1):
                        if _READERS.search(line):
                            offenders.append(f"{rel}:{n}: {line.strip()}")
    for name in ("test_commux.cpp", "cuda_shim.cpp"):  # the driver's variables are in the table too
        with open(os.path.join(REPO, "tests", name), encoding="utf-8") as f:
            offenders += [f"tests/{name}:{n}: {ln.strip()}" for n, ln in enumerate(f, 1) if _READERS.search(ln)]
    assert not offenders, "read commux variables through commux::settings():\n" + "\n".join(offenders)


def _run(code: str, **env) -> subprocess.CompletedProcess:
    full = dict(os.environ, UCX_NET_DEVICES=os.environ.get("UCX_NET_DEVICES", "lo"))
    for k in [k for k in full if k.startswith("COMMUX_") and k not in ("COMMUX_TEST_BACKEND",)]:
        full.pop(k)
    full.update(env)
    return subprocess.run([sys.executable, "-c", code], env=full, capture_output=True, text=True, timeout=120)


def test_values_and_sources():
    r = _run("import json; from commux import _C; print(json.dumps(_C.settings()))",
             COMMUX_SPIN_US="7", COMMUX_GROUP="on", COMMUX_ALGO_REDUCE="binomial")
    assert r.returncode == 0, r.stderr
    import json

    v = json.loads(r.stdout.strip().splitlines()[-1])
    assert set(v) == {row["name"] for row in _c().settings_table()}
    assert v["COMMUX_SPIN_US"] == {"value": 7, "text": "7", "source": "environment"}
    assert v["COMMUX_GROUP"] == {"value": True, "text": "on", "source": "environment"}
    assert v["COMMUX_ALGO_REDUCE"] == {"value": "binomial", "text": "binomial", "source": "environment"}
    assert v["COMMUX_TIMEOUT_MS"] == {"value": 300000, "text": "300000", "source": "default"}
    assert v["COMMUX_COALESCE"] == {"value": False, "text": "off", "source": "default"}


def test_bad_value_is_an_error_naming_the_variable():
    r = _run("from commux import _C; _C.settings()", COMMUX_TIMEOUT_MS="soon")
    assert r.returncode != 0
    assert "commux settings: COMMUX_TIMEOUT_MS='soon' is not a non-negative integer" in r.stderr, r.stderr


def test_info_prints_every_setting():
    r = _run("import sys; from commux.info import main; sys.exit(main())", COMMUX_WAKEUP="off")
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    for row in _c().settings_table():
        found = [ln for ln in lines if ln.split()[:1] == [row["name"]]]
        assert found, f"commux.info does not print {row['name']}:\n{r.stdout}"
        source = "environment" if row["name"] == "COMMUX_WAKEUP" else "default"
        assert f"({source}; read {row['read']})" in found[0], found[0]
    assert [ln for ln in lines if ln.split()[:2] == ["COMMUX_WAKEUP", "off"]], r.stdout


def test_info_never_prints_the_store_token():
    r = _run("import sys; from commux.info import main; sys.exit(main())", COMMUX_STORE_TOKEN="hush-4711")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "hush-4711" not in r.stdout + r.stderr
    found = [ln for ln in r.stdout.splitlines() if ln.split()[:1] == ["COMMUX_STORE_TOKEN"]]
    assert found and found[0].split()[1] == "(set)", r.stdout


def test_inflight_is_auto_or_a_count():
    r = _run("import json; from commux import _C; print(json.dumps(_C.settings()['COMMUX_INFLIGHT']))")
    assert r.returncode == 0, r.stderr
    import json

    assert json.loads(r.stdout.strip().splitlines()[-1]) == {"value": "auto", "text": "auto", "source": "default"}
    for bad in ("0", "65", "two"):
        r = _run("from commux import _C; _C.settings()", COMMUX_INFLIGHT=bad)
        assert r.returncode != 0
        assert f"commux settings: COMMUX_INFLIGHT='{bad}' is not" in r.stderr, r.stderr
