"""`python -m benchmarks.models`: see `benchmarks.models.run`."""

import sys

from benchmarks.models.run import main

sys.exit(main())
