"""`python -m tokamax_pass`: the `tokamax-pass` command line (`tokamax_pass.cli`)."""

import sys

from tokamax_pass.cli import main

if __name__ == "__main__":
    sys.exit(main())
