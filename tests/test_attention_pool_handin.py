"""Batched decode attention shares its sequences with the spin pool only where the weights started it (a packed
model on two threads): an engine on a float32 model decodes several sequences on two weight threads without
importing the spin pool's kernels, which would compile the weights' whole family on a cold install
(kernel_loader.FAMILIES) for a model that multiplies none of them."""

import subprocess
import sys

from pagevis.model import quantized, weight_threads

SYNTHETIC_BATCH = """
import sys
from pagevis.model.weight_threads import set_weight_threads
set_weight_threads(2)
from pagevis.engine import Engine, run
from pagevis.engine.batch import BatchConfig
from pagevis.engine import ModelSpec, SessionConfig
model = ModelSpec(kind="synthetic", n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, seed=1).load()
engine = Engine(model, SessionConfig(page_size=4, max_pages=8, max_new_tokens=6, chat=False), BatchConfig(max_seqs=3))
for prompt in ("one sequence", "another one", "and a third"):
    engine.submit(engine.encode(prompt))
widths = []
run(engine, on_step=lambda record: widths.append(sum(s.kind == "decode" for s in record.seqs)))
assert max(widths) == 3, widths  # three sequences decoded in one step: the batched attention ran
assert "pagevis.model.spin_pool" not in sys.modules, "the spin pool's kernels were imported"
"""


def test_a_float32_models_batches_never_import_the_spin_pool():
    done = subprocess.run([sys.executable, "-c", SYNTHETIC_BATCH], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_the_running_pool_is_the_weights_one_on_two_threads_only(monkeypatch):
    sentinel = object()
    monkeypatch.setattr(quantized, "_POOL", None)
    before = weight_threads.weight_threads()
    weight_threads.set_weight_threads(2)
    try:
        assert quantized.running_spin_pool() is None  # not started: not started by asking
        assert quantized._POOL is None
        monkeypatch.setattr(quantized, "_POOL", sentinel)
        assert quantized.running_spin_pool() is sentinel
        weight_threads.set_weight_threads(1)
        assert quantized.running_spin_pool() is None
    finally:
        weight_threads.set_weight_threads(before)
