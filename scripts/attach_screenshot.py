"""docs/attach.md's picture of the attach window: `python scripts/attach_screenshot.py [OUT.png] [--tokenizer FILE]`.

Opens the window on the recording made from vLLM 0.34.0's own publisher code (tests/data/kv_events), scrubs to
its last message (one message before it first, so the marks show what the last one changed), clicks block B
(the details pane) and saves the window. Offscreen unless QT_QPA_PLATFORM says otherwise; under
`xvfb-run -a` with QT_QPA_PLATFORM=xcb the picture is read back from the X server.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data" / "kv_events"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("out", nargs="?", default=str(ROOT / "docs" / "attach-window.png"))
    parser.add_argument("--recording", default="vllm-0.34.0")
    parser.add_argument("--tokenizer", help="tokenizer.json or .gguf for block text (e.g. SmolLM2's GGUF)")
    parser.add_argument("--position", type=int)
    parser.add_argument("--size", default="1600x1000")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    from pagevis.attach.playback import Playback
    from pagevis.attach.recording import read_recording
    from pagevis.gui.attach.window import screenshot

    detokenizer = None
    if args.tokenizer:
        from pagevis.attach.tokens import load_detokenizer

        detokenizer = load_detokenizer(args.tokenizer)
    expected = json.loads((DATA / f"{args.recording}.expected.json").read_text())
    b = next(r for r in expected["final"]["GPU"] if r["label"] == "B")
    width, height = (int(v) for v in args.size.split("x"))
    ok = screenshot(args.out, Playback(read_recording(DATA / f"{args.recording}.kvev")), detokenizer,
                    position=args.position, size=(width, height), select=("GPU", None, b["hash"]))
    print(f"{'wrote' if ok else 'could not write'} {args.out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
