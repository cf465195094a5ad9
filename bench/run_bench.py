#!/usr/bin/env python3
"""The point-to-point benchmark session (bench/suites/p2p.py; --help for the options)."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.suites.p2p import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
