"""`python -m pdserve.bench {serve,sweep,compare} ...`: the harness without the `pdserve` entry point."""

import sys

from pdserve.bench.cli import main

sys.exit(main())
