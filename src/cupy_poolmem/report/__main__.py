"""``python -m cupy_poolmem.report LOG ...``: the report's command line."""

import sys

from ._cli import main

sys.exit(main())
