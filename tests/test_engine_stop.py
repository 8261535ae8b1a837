"""The engine ends a request at the first token whose text completes a stop string (a matcher per request fed
each token once), however the string falls across tokens, alone and as parallel samples."""

from __future__ import annotations

from pagevis.engine import Engine, SessionConfig
from pagevis.model.synthetic import SyntheticModel

MODEL = SyntheticModel(n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, seed=1)
CONFIG = SessionConfig(page_size=4, max_pages=32, max_new_tokens=40, chat=False)


def decode(stop: tuple[str, ...] = (), n: int = 1) -> list[list[int]]:
    engine = Engine(MODEL, CONFIG)
    if n == 1:
        ids = [engine.submit([5, 6, 7], max_new_tokens=40, stop=stop, ignore_eos=True)]
    else:
        ids = engine.submit_parallel([5, 6, 7], n, max_new_tokens=40, stop=stop, ignore_eos=True)
    list(engine.run())
    return [(engine.requests[i].generated, engine.requests[i].stop_reason) for i in ids]


def first_completion(tokens: list[int], stop: str) -> int:
    """How many tokens until the text first contains `stop` (brute force: decode every prefix)."""
    return next(k for k in range(1, len(tokens) + 1) if stop in MODEL.tokenizer.decode(tokens[:k]))


def test_a_stop_string_across_tokens_ends_the_request_at_its_last_token():
    (tokens, reason), = decode()
    assert reason == "max_new_tokens"
    text = MODEL.tokenizer.decode(tokens)
    stop = text[len(text) // 2: len(text) // 2 + 3]  # three characters from the middle of the text
    (stopped, reason), = decode((stop,))
    assert reason == "stop" and stopped == tokens[: first_completion(tokens, stop)]


def test_parallel_samples_each_stop_at_their_own_text():
    samples = decode(n=3)
    stop = MODEL.tokenizer.decode(samples[0][0])[10:12]
    for (tokens, _), (stopped, reason) in zip(samples, decode((stop,), n=3), strict=True):
        if stop in MODEL.tokenizer.decode(tokens):
            assert reason == "stop" and stopped == tokens[: first_completion(tokens, stop)]
        else:
            assert reason == "max_new_tokens" and stopped == tokens
