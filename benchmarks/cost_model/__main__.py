"""`python -m benchmarks.cost_model`: the command line (cli.py)."""

import sys

from benchmarks.cost_model.cli import main

sys.exit(main())
