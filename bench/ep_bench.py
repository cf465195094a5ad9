#!/usr/bin/env python3
"""Thin entry point of the expert-parallel benchmark: `python bench/ep_bench.py [options]` is
`python -m bench.ep [options]` (bench/ep/run.py; docs/ep-bench.md)."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.ep.run import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
