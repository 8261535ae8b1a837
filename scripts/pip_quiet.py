"""`python scripts/pip_quiet.py ARGS...`: `python -m pip --quiet ARGS...` without two notices that are not about
anything the user can or should change (the Makefile's installs use it):

- an index or find-links location in the machine's pip.conf with no folder for a package makes pip print
  "WARNING: Location '...' is ignored: it is neither a file nor a directory." once per package and location
  (about 60 lines on a first `make run` here);
- setuptools' editable install of a package whose folders are mapped (resources/ installs as
  pagevis.resources) prints a 10-line "BuildBackendWarning: Editable installation." box on every install.

Those lines are dropped; every other line (errors and other warnings) passes through, and pip's exit status
is this script's.
"""

from __future__ import annotations

import re
import subprocess
import sys

NOISE = re.compile(r"^WARNING: Location '[^']*' is ignored: it is neither a file nor a directory\.\s*$")
BOX = "BuildBackendWarning: Editable installation."  # its box: this line and the indented ones after it


def shown(lines):
    """The lines worth showing."""
    in_box = False
    for line in lines:
        in_box = BOX in line or (in_box and line.startswith(" "))
        if not in_box and not NOISE.match(line):
            yield line


def main(argv: list[str]) -> int:
    process = subprocess.Popen([sys.executable, "-m", "pip", "--quiet", *argv], stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, errors="replace")
    for line in shown(process.stdout):
        sys.stdout.write(line)
        sys.stdout.flush()
    return process.wait()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
