"""`python -m pdserve.tools.bench {serve,sweep,compare} ...`: the harness without the `pdserve` entry point."""

import sys

from pdserve.tools.bench.cli import main

sys.exit(main())
