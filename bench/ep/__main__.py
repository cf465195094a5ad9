"""python -m bench.ep: see bench/ep/run.py (options: --help) and docs/ep-bench.md."""
import sys

from .run import main

sys.exit(main())
