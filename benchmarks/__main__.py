"""``python -m benchmarks [--quick] [--json PATH] [--only CASES]``: see benchmarks/runner.py."""

import sys

from .runner import main

sys.exit(main())
