"""`python -m tensorhub.settings`: print the settings table, or write it into a README."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tensorhub.settings import markdown_table, with_table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tensorhub.settings",
                                     description="Print TensorHub's settings as a markdown table.")
    parser.add_argument("--write", metavar="README", type=Path,
                        help="replace the table between the markers in this file instead")
    args = parser.parse_args(argv)
    if args.write is None:
        print(markdown_table())
        return 0
    args.write.write_text(with_table(args.write.read_text()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
