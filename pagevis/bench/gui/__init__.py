"""pagevis.bench.gui: benchmarks of the windows themselves (frames, UI time per token, record cost, startup).
The only part of pagevis.bench that imports Qt (the PNG plots every command writes are pagevis.plots)."""
