"""Log-probabilities from pagevis serve in vLLM's shapes: echo scores the prompt through the request's own
cache (a float64-softmax dense forward is the reference for a full cache; `pagevis compare`'s rows for sinks,
h2o and int4), token-id prompts and lists of prompts, chat logprobs, the tokenizer endpoints, and hostile
input answered with a 4xx naming the field."""

from __future__ import annotations

import concurrent.futures
import json
import math

import numpy as np
import pytest
from model_fixtures import smollm2  # noqa: F401  (fixture)
from serve_fixtures import SYNTH, running_server

from pagevis.engine.sampling import log_softmax
from pagevis.model import DenseAttention


@pytest.fixture(scope="module")
def server():
    with running_server() as running:
        yield running


def dense_logprobs(model, ids: list[int]) -> np.ndarray:
    """log p(ids[p + 1] | ids[:p + 1]) for every p, from one dense forward (no pages, no engine)."""
    logits = model.forward(np.array(ids), np.arange(len(ids)), DenseAttention(model.config), all_logits=True)
    return np.array([log_softmax(logits[p])[ids[p + 1]] for p in range(len(ids) - 1)])


def complete(server, **body) -> dict:
    answer = server.client.post("/v1/completions", json={"model": "synthetic", "temperature": 0, **body})
    assert answer.status_code == 200, answer.text
    return answer.json()


def test_echo_scores_the_prompt_as_a_dense_forward(server):
    ids = server.client.post("/tokenize", json={"prompt": "The cache holds pages"}).json()["tokens"]
    choice = complete(server, prompt="The cache holds pages", max_tokens=0, echo=True, logprobs=3,
                      pagevis={"page_size": 4, "max_pages": 8, "policy": "none", "dtype": "float32"})["choices"][0]
    lp = choice["logprobs"]
    assert choice["text"] == "The cache holds pages" and len(lp["tokens"]) == len(ids)
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    np.testing.assert_allclose(lp["token_logprobs"][1:], dense_logprobs(SYNTH.load(), ids), atol=2e-5)
    assert lp["text_offset"] == [0, *np.cumsum([len(t) for t in lp["tokens"]])[:-1].tolist()]
    for chosen, top in zip(lp["token_logprobs"][1:], lp["top_logprobs"][1:], strict=True):
        assert 3 <= len(top) <= 4 and chosen in top.values()  # the token that came, and the top 3
        assert max(top.values()) >= chosen


def test_generated_logprobs_follow_the_greedy_tokens(server):
    prompt = "abc"
    answer = complete(server, prompt=prompt, max_tokens=5, logprobs=2, echo=True, pagevis={"dtype": "float32"})
    lp = answer["choices"][0]["logprobs"]
    ids = server.client.post("/tokenize", json={"prompt": answer["choices"][0]["text"]}).json()["tokens"]
    assert len(lp["tokens"]) == len(ids) == 3 + 5 and answer["usage"]["completion_tokens"] == 5
    np.testing.assert_allclose(lp["token_logprobs"][1:], dense_logprobs(SYNTH.load(), ids), atol=2e-5)
    for chosen, top in zip(lp["token_logprobs"][3:], lp["top_logprobs"][3:], strict=True):
        assert chosen == max(top.values())  # greedy: the chosen token is the most likely


def test_token_ids_and_lists_of_prompts(server):
    texts = ["pages fill", "then the oldest go"]
    ids = [server.client.post("/tokenize", json={"prompt": t}).json()["tokens"] for t in texts]
    alone = [complete(server, prompt=t, max_tokens=3, logprobs=1, echo=True)["choices"][0] for t in texts]
    by_ids = complete(server, prompt=ids, max_tokens=3, logprobs=1, echo=True)
    assert [c["index"] for c in by_ids["choices"]] == [0, 1]
    for single, batched in zip(alone, by_ids["choices"], strict=True):
        assert single["text"] == batched["text"]
        np.testing.assert_allclose(single["logprobs"]["token_logprobs"][1:],
                                   batched["logprobs"]["token_logprobs"][1:], atol=2e-5)  # batched rows round apart
    assert by_ids["usage"]["prompt_tokens"] == sum(len(i) for i in ids)
    one = complete(server, prompt=ids[0], max_tokens=3)["choices"][0]["text"]
    assert one == alone[0]["text"][len(texts[0]):]


def test_a_scored_prompt_skips_the_prefix_cache(server):
    body = {"prompt": "a prompt long enough to fill whole pages of the cache", "max_tokens": 0, "echo": True,
            "logprobs": 0, "pagevis": {"page_size": 4, "max_pages": 32, "policy": "none"}}
    first, again = complete(server, **body), complete(server, **body)
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    scored, rescored = first["choices"][0]["logprobs"], again["choices"][0]["logprobs"]
    assert scored["tokens"] == rescored["tokens"]
    assert [None if top is None else list(top) for top in scored["top_logprobs"]] == [
        None if top is None else list(top) for top in rescored["top_logprobs"]]
    # within float32 rounding, not bit for bit: the second request's pages lie elsewhere in the pool, and
    # OpenBLAS's Haswell sgemm rounds by the shape around a row (measured 1.4e-6 apart)
    np.testing.assert_allclose(scored["token_logprobs"][1:], rescored["token_logprobs"][1:], rtol=0, atol=1e-5)
    assert all(len(top) == 1 for top in first["choices"][0]["logprobs"]["top_logprobs"][1:])  # logprobs 0


def streamed(server, path: str, body: dict) -> list[dict]:
    with server.client.stream("POST", path, json=body) as answer:
        lines = [line[6:] for line in answer.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_streamed_logprobs_equal_the_plain_ones(server):
    body = {"model": "synthetic", "prompt": "stream me", "max_tokens": 6, "temperature": 0, "logprobs": 2}
    plain = complete(server, **{k: v for k, v in body.items() if k != "model"})["choices"][0]["logprobs"]
    chunks = [c["choices"][0]["logprobs"] for c in streamed(server, "/v1/completions", {**body, "stream": True})]
    joined = {key: [v for c in chunks if c for v in c[key]] for key in plain}
    # the second request reads the first one's pages from the prefix cache: the same tokens, rounded apart
    assert joined["tokens"] == plain["tokens"] and joined["text_offset"] == plain["text_offset"]
    np.testing.assert_allclose(joined["token_logprobs"], plain["token_logprobs"], atol=2e-5)
    for got, want in zip(joined["top_logprobs"], plain["top_logprobs"], strict=True):
        assert got.keys() == want.keys()
        np.testing.assert_allclose(list(got.values()), list(want.values()), atol=2e-5)
    nothing = streamed(server, "/v1/completions", {**body, "max_tokens": 0, "stream": True,
                                                  "stream_options": {"include_usage": True}})
    assert "".join(c["choices"][0]["text"] for c in nothing if c["choices"]) == ""
    assert nothing[-1]["usage"]["completion_tokens"] == 0
    chat = {"model": "synthetic", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
            "temperature": 0, "logprobs": True, "top_logprobs": 1}
    plain = server.client.post("/v1/chat/completions", json=chat).json()["choices"][0]["logprobs"]["content"]
    chunks = streamed(server, "/v1/chat/completions", {**chat, "stream": True})
    tokens = [t for c in chunks if c["choices"][0]["logprobs"] for t in c["choices"][0]["logprobs"]["content"]]
    assert [t["token"] for t in tokens] == [t["token"] for t in plain]
    np.testing.assert_allclose([t["logprob"] for t in tokens], [t["logprob"] for t in plain], atol=2e-5)


def test_chat_logprobs(server):
    answer = server.client.post("/v1/chat/completions", json={
        "model": "synthetic", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0,
        "logprobs": True, "top_logprobs": 2}).json()
    content = answer["choices"][0]["logprobs"]["content"]
    assert len(content) == 4 and "".join(c["token"] for c in content) == answer["choices"][0]["message"]["content"]
    for item in content:
        assert len(item["top_logprobs"]) == 2 and item["logprob"] == item["top_logprobs"][0]["logprob"]
        assert bytes(item["bytes"]).decode("utf-8", "replace") == item["token"]


def test_tokenize_detokenize_and_tokenizer_info(server):
    client = server.client
    tokens = client.post("/tokenize", json={"prompt": "héllo", "return_token_strs": True}).json()
    assert tokens["count"] == len(tokens["tokens"]) == len("héllo".encode()) and tokens["max_model_len"] == 2048
    assert client.post("/detokenize", json={"tokens": tokens["tokens"]}).json() == {"prompt": "héllo"}
    info = client.get("/tokenizer_info").json()
    assert {"eos_token", "bos_token", "pad_token", "model_max_length"} <= info.keys()


@pytest.mark.parametrize("path, body, status, words", [
    ("/v1/completions", {"prompt": "x", "logprobs": 21}, 422, "logprobs: Input should be less than or equal to 20"),
    ("/v1/completions", {"prompt": "x", "logprobs": -1}, 422, "logprobs: Input should be greater than or equal"),
    ("/v1/completions", {"prompt": [5, 300]}, 422, "prompt[1]: token id 300 is not in this model's vocabulary"),
    ("/v1/completions", {"prompt": [[5], [1, -2]]}, 422, "prompt[1][1]: token id -2"),
    ("/v1/completions", {"prompt": [7] * 100_000}, 422, "prompt = '100000 tokens' is not allowed: at most 2047"),
    ("/v1/completions", {"prompt": [[1]] * 33}, 422, "prompt: 33 prompts; at most 32"),
    ("/v1/completions", {"prompt": []}, 422, "prompt: an empty list"),
    ("/v1/completions", {"prompt": "x", "max_tokens": -1}, 422, "max_tokens"),
    ("/v1/completions", {"prompt": "x" * 40, "echo": True, "logprobs": 0,
                         "pagevis": {"page_size": 4, "max_pages": 8, "policy": "none"}}, 422,
     "max_pages = 8 is not allowed: at least 10 pages of 4 to score this 40-token prompt under policy 'none'"),
    ("/v1/completions", {"prompt": "x", "echo": True, "stream": True}, 422, "echo: echo is not streamed"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, 422,
     "top_logprobs: needs logprobs true"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": True,
                              "top_logprobs": 21}, 422, "top_logprobs"),
    ("/tokenize", {}, 422, "prompt: Field required"),
    ("/tokenize", {"prompt": 5}, 422, "prompt: Input should be a valid string"),
    ("/tokenize", {"prompt": "x", "extra": 1}, 422, "extra: Extra inputs are not permitted"),
    ("/tokenize", {"prompt": "x", "model": "gpt-4"}, 404, "not served here"),
    ("/tokenize", {"prompt": "x" * 200_001}, 422, "prompt: String should have at most 200000 characters"),
    ("/detokenize", {"tokens": ["a"]}, 422, "tokens[0]: Input should be a valid integer"),
    ("/detokenize", {"tokens": [1, 256]}, 422, "tokens[1]: token id 256 is not in this model's vocabulary"),
])
def test_hostile_input_names_the_field(server, path, body, status, words):
    if path.startswith("/v1"):
        body = {"model": "synthetic", **body}
    answer = server.client.post(path, json=body)
    assert answer.status_code == status, answer.text
    assert words in answer.json()["error"]["message"]


def test_malformed_tokenize_body_is_a_422_not_a_500(server):
    answer = server.client.post("/tokenize", content=b"{not json", headers={"content-type": "application/json"})
    assert answer.status_code == 422


def scores_as_compare_does(model, model_id: str, settings=None) -> None:
    """Full cache: compare's full-cache reference token by token; sinks, h2o and int4 at a budget of half the
    prompt: compare's rows' perplexities (every token teacher-forced through the evicting cache). The four
    requests run at once, so sinks and h2o share one batch."""
    from pagevis.quality import measure
    from pagevis.cli.compare import load_text

    ids = model.tokenizer.encode(load_text(None))[:48]
    rows = {"full": ("none", "float32"), "sinks": ("sinks", "float32"), "h2o": ("h2o", "float32"),
            "int4": ("sinks", "int4")}
    with measure.full_reference(model, ids, page_size=8) as reference:
        expected = {name: measure.evaluate(model, reference, measure.PolicyChoice(policy), 24, 8, dtype).ppl
                    for name, (policy, dtype) in rows.items() if name != "full"}
        full = reference.true_logprobs.copy()
    with running_server(settings, model=model) as running:
        def score(name: str) -> list[float]:
            policy, dtype = rows[name]
            cache = {"page_size": 8, "max_pages": 6 if name == "full" else 3, "policy": policy, "dtype": dtype}
            answer = running.client.post("/v1/completions", json={
                "model": model_id, "prompt": ids, "max_tokens": 0, "echo": True, "logprobs": 1, "pagevis": cache})
            assert answer.status_code == 200, answer.text
            return answer.json()["choices"][0]["logprobs"]["token_logprobs"][1:]

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            served = dict(zip(rows, pool.map(score, rows), strict=True))
    np.testing.assert_allclose(served["full"], full, atol=2e-4)
    for name, ppl in expected.items():
        assert math.exp(-np.mean(served[name])) == pytest.approx(ppl, rel=1e-4), name
        assert abs(ppl - math.exp(-np.mean(full))) > 1e-3  # the evicting or quantized cache changed the numbers


def test_the_server_scores_a_prompt_as_compare_does():
    scores_as_compare_does(SYNTH.load(), "synthetic")


@pytest.mark.slow
def test_smollm2_scores_a_prompt_as_compare_does(smollm2):  # noqa: F811
    from pagevis.serve.settings import ServeSettings

    scores_as_compare_does(smollm2, "SmolLM2-135M-Instruct", ServeSettings())
