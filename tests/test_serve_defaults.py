"""pagevis serve's defaults serve (#29): a request that names no cache keeps its whole prompt (policy none, a full
cache), clients sharing a system prompt get its full pages from the prefix cache, and a request that asks for
eviction gets it. A real server on a free loopback port (serve_fixtures), the synthetic model (a byte
tokenizer: one token per byte), references decoded by a DecodeSession of their own."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from serve_fixtures import SYNTH, running_server
from test_serve_load import scrape, value

from pagevis.engine import DecodeSession, SessionConfig
from pagevis.errors import ConfigError
from pagevis.serve.settings import ServeSettings

PAGE = 16  # serve's default page size
SYSTEM = ("You answer questions about paged key-value caches, briefly and exactly, citing the page table "
          "and the pool when it helps. ") * 2  # 226 byte tokens, shared by every request below
QUESTIONS = ("Why pages?", "How big is one?", "What is evicted first?", "Does a prefix hit copy?",
             "Explain preemption.", "Kinds of policies?", "Quick: what is a block table?", "Name the pool's job.")


def messages(question: str) -> list[dict]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]


def chat(url: str, question: str, max_tokens: int = 6, **cache) -> dict:
    body = {"model": "synthetic", "messages": messages(question), "max_tokens": max_tokens, "temperature": 0}
    if cache:
        body["pagevis"] = cache
    with httpx.Client(base_url=url, timeout=120) as client:
        answer = client.post("/v1/chat/completions", json=body)
    assert answer.status_code == 200, answer.text
    return answer.json()


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def test_a_long_prompt_is_kept_whole_by_default():
    """250 prompt tokens and 20 new ones: nothing evicted, the answer is the full-cache decode's (the demo
    defaults, 12 pages of 8 with sinks, would have evicted from token 97 on)."""
    prompt = ("Pages of keys and values fill one after another; " * 6)[:250]
    model = SYNTH.load()
    reference = DecodeSession(model, prompt, SessionConfig(policy="none", page_size=PAGE, max_pages=100, chat=False,
                                                           max_new_tokens=20))
    list(reference.run())
    with running_server() as running:
        answer = running.client.post("/v1/completions", json={"model": "synthetic", "prompt": prompt,
                                                               "max_tokens": 20, "temperature": 0}).json()
        samples = scrape(running.metrics_text())
    assert answer["usage"]["prompt_tokens"] == 250 and answer["choices"][0]["finish_reason"] == "length"
    assert answer["choices"][0]["text"] == reference.text()
    assert value(samples, "pagevis_cache_events_total", kind="evict") == 0


def test_clients_sharing_a_system_prompt_hit_its_full_pages():
    """One request, then seven at once: each of the seven finds every full page of the shared prefix (system
    prompt and template) in the prefix cache. The hit rate over all eight is measured and printed."""
    tokenizer = SYNTH.load().tokenizer
    ids = [list(tokenizer.encode_chat(messages(q))) for q in QUESTIONS]
    shared = min(common_prefix(ids[0], other) for other in ids[1:])
    assert shared >= 200 and all(common_prefix(a, b) == shared for a in ids[1:] for b in ids[1:] if a is not b)
    with running_server() as running:
        first = chat(running.url, QUESTIONS[0])
        with ThreadPoolExecutor(7) as pool:
            rest = list(pool.map(lambda q: chat(running.url, q), QUESTIONS[1:]))
        samples = scrape(running.metrics_text())
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    for answer, prompt in zip(rest, ids[1:]):
        assert answer["usage"]["prompt_tokens"] == len(prompt)
        assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == shared // PAGE * PAGE
    cached = sum(a["usage"]["prompt_tokens_details"]["cached_tokens"] for a in [first, *rest])
    rate = cached / sum(map(len, ids))
    print(f"prefix cache: {cached} of {sum(map(len, ids))} prompt tokens ({100 * rate:.0f}%), a shared prefix "
          f"of {shared} tokens")
    assert cached >= 0.98 * 7 * shared  # all but a partly filled last page (the demo defaults: 36% on SmolLM2)
    assert value(samples, "pagevis_prefix_cache_hits_total") == cached
    assert value(samples, "pagevis_cache_events_total", kind="evict") == 0


def test_eviction_when_a_request_asks_for_it():
    """A request naming a policy and a budget evicts exactly as a session of its own with them would; one
    naming only a policy still gets the full cache (nothing to evict)."""
    prompt, cache = "Evict the oldest tokens, keep the sinks.", {"policy": "sinks", "page_size": 4, "max_pages": 8}
    reference = DecodeSession(SYNTH.load(), prompt, SessionConfig(**cache, chat=False, max_new_tokens=12))
    list(reference.run())

    def complete(client, **asked) -> dict:
        return client.post("/v1/completions", json={"model": "synthetic", "prompt": prompt, "max_tokens": 12,
                                                    "temperature": 0, "pagevis": asked}).json()

    with running_server() as running:
        evicting = complete(running.client, **cache)
        after_budget = scrape(running.metrics_text())
        complete(running.client, policy="sinks")
        after_policy = scrape(running.metrics_text())
    assert evicting["choices"][0]["text"] == reference.text()
    evicted = value(after_budget, "pagevis_evictions_total", policy="sinks")
    assert evicted == reference.records[-1].evictions_total > 0
    assert value(after_policy, "pagevis_evictions_total", policy="sinks") == evicted


def test_a_session_gets_a_cache_of_its_request():
    """/v1/sessions without a cache: room for its prompt and max_tokens in whole pages, policy none (its step
    snapshots are as large as its cache); with the server's --max-pages, that budget instead."""
    with running_server() as running:
        made = running.client.post("/v1/sessions", json={"prompt": "A session of its own.", "max_tokens": 30,
                                                         "chat": False}).json()
    assert made["prompt_tokens"] == 21 and made["config"]["policy"] == "none"
    assert made["capacity"] == -(-(21 + 30) // PAGE) * PAGE
    fixed = ServeSettings(model_spec=SYNTH, full_cache=False)
    with running_server(fixed) as running:
        made = running.client.post("/v1/sessions", json={"prompt": "A session of its own.", "max_tokens": 30,
                                                         "chat": False}).json()
    assert made["capacity"] == fixed.defaults.capacity == 12 * PAGE


def test_the_servers_int8_rows_setting_reaches_its_engines():
    """`pagevis serve` gives its engines BatchConfig.int8_rows from --int8-rows (serve's default from the settings
    table; `run` and the app keep "batched"); a value not among the four is one line naming them."""
    import dataclasses

    from pagevis import settings as table
    from pagevis.cli.main import command_parser
    from pagevis.cli.serve import settings_from_args
    from pagevis.engine.batch import BatchConfig

    def settings(*flags):
        return settings_from_args(command_parser().parse_args(["serve", "--model", "synthetic", *flags]))

    assert settings().int8_rows == table.setting("int8_rows").default_for("serve")
    assert BatchConfig().int8_rows == "batched"
    for mode in ("none", "all"):
        with running_server(dataclasses.replace(settings("--int8-rows", mode), model_spec=SYNTH)) as running:
            running.client.post("/v1/completions", json={"model": "synthetic", "prompt": "pages", "max_tokens": 2}
                                ).raise_for_status()
            assert [core.engine.batch.int8_rows for core in running.app.state.engines.cores.values()] == [mode]
    with pytest.raises(ConfigError, match="int8_rows.*one of none, batched, prompts, all"):
        BatchConfig(int8_rows="some")
