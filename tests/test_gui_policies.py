"""The new policies in the real window: their parameters become controls, they evict, and pyramidkv's
page grid and block table say how much each layer may hold."""

import dataclasses

import pytest

from gui_helpers import CONFIG, make_window, step


@pytest.mark.parametrize("policy, params", [("snapkv", ["window", "kernel"]), ("lru", ["threshold_pct"]),
                                            ("lfu", ["threshold_pct"]),
                                            ("pyramidkv", ["window", "kernel", "beta", "budget"])])
def test_new_policies_in_the_window(qtbot, tmp_path, policy, params):
    window = make_window(qtbot, tmp_path, config=dataclasses.replace(CONFIG, policy=policy))
    assert list(window.controls._param_widgets) == [*params, "rerotate", "compress_every"]  # own, then shared
    step(qtbot, window, 3)
    assert window.timeline.records[-1].evictions_total > 0
    assert window.page_grid.states.shape == (4, 4)


def test_pyramidkv_grid_shows_each_layers_capacity(qtbot, tmp_path):
    window = make_window(qtbot, tmp_path, config=dataclasses.replace(CONFIG, policy="pyramidkv"))
    step(qtbot, window, 4)
    grid = window.page_grid
    # 2 layers, pool 16, window 8: mean budget 12 -> layer 0 holds 16, layer 1 holds 9
    assert "holds at most" not in grid.plot.titleLabel.text and "tokens" not in grid.block_title.text()
    window.controls.layer.setValue(1)
    window.redraw()
    assert "holds at most 9" in grid.plot.titleLabel.text
    assert grid.block_title.text().endswith("layer 1: 9 tokens")
    assert int((window.timeline.records[-1].slot_maps[1] >= 0).sum()) == 9


def test_kvzip_in_the_window(qtbot, tmp_path):
    """kvzip's parameters become controls; the first step's narration names its reconstruction pass and what each
    KV head kept; decoding then drops entries per head."""
    window = make_window(qtbot, tmp_path, config=dataclasses.replace(CONFIG, policy="kvzip", max_pages=5))
    assert list(window.controls._param_widgets) == ["budget", "n_sink", "chunk", "context", "rerotate",
                                                    "compress_every"]
    step(qtbot, window, 3)
    window.scrub(0)
    window.redraw()
    assert "reconstruction pass" in window.narration.text() and "KV heads keep" in window.narration.text()
    assert window.timeline.records[-1].evictions_total > 0
