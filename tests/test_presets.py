"""Every preset states its point in one line (the proofs that each shows it: test_preset_proofs.py)."""

from __future__ import annotations

from pagevis.presets import PRESETS, find_preset, shipped_text



def test_every_preset_states_its_point_in_one_line_and_reads_a_shipped_text():
    for preset in PRESETS:
        assert preset.point and "\n" not in preset.point and len(preset.point) <= 140, preset.name
        if preset.text is not None:
            assert preset.b is not None and shipped_text(preset.text)
    assert find_preset("streaming").text is not None  # the StreamingLLM figure is teacher-forced
