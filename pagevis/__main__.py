"""`pagevis` and `python -m pagevis`: see pagevis.cli.main."""

import sys

from pagevis.cli.main import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
