"""The A/B window of a preset at a projector's 1280 × 720, after N steps, as a PNG (offscreen, or on a real
display under xvfb-run): python scripts/ab_screenshot.py "StreamingLLM: window vs sinks" out.png --steps 110."""

from __future__ import annotations

import argparse
import sys


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("preset")
    parser.add_argument("path")
    parser.add_argument("--steps", type=int, default=110)
    parser.add_argument("--model", default="smollm2", choices=("smollm2", "synthetic"))
    parser.add_argument("--size", default="1280x720")
    args = parser.parse_args(argv)
    from pagevis.engine import ModelSpec
    from pagevis.gui import _application, save_screenshot
    from pagevis.gui.ab.window import ABWindow
    from pagevis.presets import find_preset

    app = _application()
    preset = find_preset(args.preset)
    if preset.b is None:
        print(f"{preset.name} is not an A/B preset", file=sys.stderr)
        return 2
    width, height = (int(v) for v in args.size.split("x"))
    window = ABWindow(ModelSpec(kind=args.model), preset.prompt_text(), preset.a, preset.b, title=preset.name)
    window.resize(width, height)
    window.show()
    app.processEvents()
    window.start(blocking=True)
    window.runner.step_blocking(args.steps)
    app.processEvents()
    window.redraw()
    app.processEvents()
    return save_screenshot(app, window, args.path)


if __name__ == "__main__":
    sys.exit(main())
