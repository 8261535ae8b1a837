"""The attach window's Explain tab on the recorded vLLM 0.34.0 stream: a pasted prompt is explained against the
pool, the ranking table filled, the matched blocks outlined and the divergence marked; scrubbing re-explains;
a JSONL file of requests opens into the selector; a bad prompt is a sentence, not an exception."""

import json

from test_attach_window import DATA, goto, open_recording, windows  # noqa: F401 - the fixture
from test_explain import tokens_of

from pagevis.attach.tokens import PromptTokenizer

PATH = DATA / "vllm-0.34.0.kvev"


def explain_text(window, text):
    window.explain_pane.prompt.setPlainText(text)
    window.explain_pane.button.click()
    return window.explain_pane.result


def test_a_prompt_is_explained_ranked_and_outlined(qtbot, windows):  # noqa: F811
    window = open_recording(qtbot, windows, PATH)
    goto(window, 7)
    result = explain_text(window, " ".join(map(str, tokens_of("A", "B", "C", extra=[1]))))
    assert result["engines"][0]["hit_tokens"] == 12 and result["engines"][0]["path"]
    pane, overlay = window.explain_pane, window.overlay
    assert pane.table.rowCount() == 1 and pane.table.item(0, 2).text() == "12"
    assert pane.table.item(0, 4).text() == "partial block at token 12" and "12 tokens cached" in pane.detail.text()
    assert len(overlay.matched) == 3 and overlay.line is not None and overlay.label.toPlainText() == "partial_block"
    changed = tokens_of("A", "B", extra=[1])
    changed[6] = 5
    result = explain_text(window, json.dumps(changed))
    assert result["engines"][0]["first_miss"]["reason"] == "token_differs"
    assert len(overlay.matched) == 1 and len(overlay.missed) == 1 and overlay.line[0] == 6.0
    goto(window, 1)  # before B was stored: the same prompt, re-explained against the pool then
    qtbot.waitUntil(lambda: pane.result["engines"][0]["first_miss"]["reason"] == "never_stored", timeout=10_000)
    assert not overlay.matched
    assert explain_text(window, "plain words") is None  # no tokenizer: a sentence in the pane
    assert "needs --tokenizer" in pane.summary.text()
    assert window.stop()


def test_text_with_a_tokenizer_and_a_jsonl_file(qtbot, windows, tmp_path):  # noqa: F811
    tokenizer = PromptTokenizer(decode=lambda ids: " ".join(map(str, ids)),
                                encode=lambda text: tokens_of(*text.split()), encode_chat=None)
    window = open_recording(qtbot, windows, PATH, tokenizer=tokenizer)
    goto(window, 7)
    assert explain_text(window, "A B C")["engines"][0]["first_miss"]["reason"] == "capped"
    requests = tmp_path / "requests.jsonl"
    requests.write_text(json.dumps({"prompt_token_ids": tokens_of("A", "B", "E", extra=[2])}) + "\n"
                        + json.dumps({"prompt": "A B F", "lora_name": "ad"}) + "\nnot json\n")
    window.explain_pane.load(str(requests))
    pane = window.explain_pane
    assert pane.request_box.count() == 3 and pane.result["engines"][0]["hit_tokens"] == 12
    pane.request_box.setCurrentIndex(1)
    assert pane.lora.text() == "ad" and pane.result["engines"][0]["first_miss"]["reason"] == "extra_keys"
    assert window.stop()
