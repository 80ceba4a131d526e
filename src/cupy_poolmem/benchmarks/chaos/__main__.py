"""``python -m cupy_poolmem.benchmarks.chaos``: the chaos run, one summary line."""

import sys

from .runner import main

sys.exit(main())
