"""pagevis.bench.gui: benchmarks of the windows themselves (frames, UI time per token, record cost) and the PNG
plots of every bench. The only part of pagevis.bench that imports Qt."""
