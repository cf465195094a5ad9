"""Number formats, markdown table rows and the output files every suite writes."""
import json
from pathlib import Path


def fmt(v, digits=3):
    return "-" if v is None else f"{v:.{digits}f}"


def ratio(a, b):
    return None if a is None or b is None or b == 0 else a / b


def row(cells):
    """One markdown table row."""
    return "| " + " | ".join(cells) + " |"


def header(head, first="---:|"):
    """A markdown table's head and rule: the first column `first`, the others right-aligned."""
    return [row(head), "|" + first + "---:|" * (len(head) - 1)]


def write(out_dir, data, md, log=None):
    """out_dir/results.json (data), table.md (md) and, when given, run.log (log, as it is)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(data, indent=1) + "\n")
    (out / "table.md").write_text(md)
    if log is not None:
        (out / "run.log").write_text(log)
