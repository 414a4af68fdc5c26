"""`python -m tensorhub ...`: the `tensorhub` command, where its script is not on PATH."""

import sys

from tensorhub.tools.cli import main

if __name__ == "__main__":
    sys.exit(main())
