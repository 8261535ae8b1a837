"""Execute every notebook in examples/ top to bottom, as a user would (`make notebooks`; CI runs it after
`make test-all`): each in a fresh kernel with examples/ as its working folder, failing on the first cell that
raises (the notebooks assert what they show). The executed notebooks and their HTML export (nbconvert) go to
OUT (default build/notebooks/), ready to open in a browser; the time each took is printed.

    python scripts/run_notebooks.py [OUT] [--only NAME]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
CELL_SECONDS = 600  # one cell's bound: a hung kernel fails the run instead of holding CI


def run(path: Path, out: Path) -> float:
    import nbformat
    from nbclient import NotebookClient
    from nbconvert import HTMLExporter

    notebook = nbformat.read(path, as_version=4)
    started = time.perf_counter()
    # without the widgets' state the HTML export shows a widget's static view (its text/html), as GitHub does;
    # with it, the export would need the widget manager from a CDN
    NotebookClient(notebook, timeout=CELL_SECONDS, kernel_name="python3", store_widget_state=False,
                   resources={"metadata": {"path": str(EXAMPLES)}}).execute()
    seconds = time.perf_counter() - started
    nbformat.write(notebook, out / path.name)
    body, _ = HTMLExporter().from_notebook_node(notebook)
    (out / path.with_suffix(".html").name).write_text(body, encoding="utf-8")
    return seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", nargs="?", default=str(ROOT / "build" / "notebooks"))
    parser.add_argument("--only", help="run only the notebooks whose name contains this")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    failed = 0
    for path in sorted(EXAMPLES.glob("*.ipynb")):
        if args.only and args.only not in path.name:
            continue
        try:
            seconds = run(path, out)
        except Exception as error:  # nbclient's CellExecutionError names the cell and its traceback
            print(f"notebooks: {path.name} FAILED\n{error}", file=sys.stderr)
            failed += 1
            continue
        print(f"notebooks: {path.name} ran in {seconds:.0f} s -> {out / path.with_suffix('.html').name}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
