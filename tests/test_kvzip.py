"""KVzip: the (layer, KV head, position) entries the engine keeps equal a brute force in float64 that shares no
code with the engine (its own attention over its own K/V lists, its own reconstruction prompt, its own global
top-k and decode rule); the refusals; a CLI run; a trace round trip."""

import json

import numpy as np
import pytest

from pagevis.__main__ import main
from pagevis.engine import DecodeSession, ModelSpec, SessionConfig
from pagevis.kvcache import ConfigError, EventKind
from pagevis.trace import read_trace, record_differences, write_trace

SPEC = ModelSpec(kind="synthetic", n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, seed=3)
TEXT = "It is a truth universally acknowledged, that a single man in possession of a good fortune."
N_SINK = 4


@pytest.fixture(scope="module")
def model():
    return SPEC.load()


class DenseF64:
    """Every layer's K/V in float64 lists; queries read them causally (prefill), or beside a chunk's own K/V
    that are never stored (the reconstruction), recording each context key's largest weight per KV head."""

    def __init__(self, config):
        self.n_kv, self.group = config.n_kv_heads, config.n_heads // config.n_kv_heads
        self.keys = [np.zeros((0, self.n_kv, config.head_dim)) for _ in range(config.n_layers)]
        self.values = [np.zeros((0, self.n_kv, config.head_dim)) for _ in range(config.n_layers)]
        self.own = {}
        self.scores = None  # (layers, n_kv, context) once reconstructing
        self.storing = True

    def __call__(self, layer, q, k, v, positions):
        k, v, q = k.astype(np.float64), v.astype(np.float64), q.astype(np.float64)
        if self.storing:
            self.keys[layer] = np.concatenate([self.keys[layer], k])
            self.values[layer] = np.concatenate([self.values[layer], v])
            keys, values, key_pos = self.keys[layer], self.values[layer], np.arange(len(self.keys[layer]))
        else:
            old = self.own.get(layer, (np.zeros((0, *k.shape[1:])),) * 2 + (np.zeros(0, dtype=int),))
            self.own[layer] = (np.concatenate([old[0], k]), np.concatenate([old[1], v]),
                               np.concatenate([old[2], positions]))
            keys = np.concatenate([self.keys[layer], self.own[layer][0]])
            values = np.concatenate([self.values[layer], self.own[layer][1]])
            key_pos = np.concatenate([np.arange(len(self.keys[layer])), self.own[layer][2]])
        out = np.zeros(q.shape)
        context = len(self.keys[layer])
        for i, p in enumerate(positions):
            for head in range(q.shape[1]):
                kv = head // self.group
                logits = keys[:, kv] @ q[i, head] / np.sqrt(q.shape[2])
                logits[key_pos > p] = -np.inf
                weights = np.exp(logits - logits.max())
                weights /= weights.sum()
                out[i, head] = weights @ values[:, kv]
                if not self.storing:
                    row = self.scores[layer, kv]
                    np.maximum(row, weights[:context], out=row)
        return out.astype(np.float32)


def brute_force_scores(model, prompt, chunk):
    """Each (layer, KV head, context position)'s largest attention from the reconstruction (KVzip's prompts)."""
    dense = DenseF64(model.config)
    model.forward(np.array(prompt), np.arange(len(prompt)), dense)
    dense.storing = False
    dense.scores = np.zeros((model.config.n_layers, model.config.n_kv_heads, len(prompt)))
    pieces = [prompt[i: i + chunk] for i in range(0, len(prompt), chunk)]
    fed = 0
    for i, piece in enumerate(pieces):
        head = (list(b"\n\nRepeat the previous context exactly.") if i == 0 else
                list(b"\n\nRepeat the part of the previous context exactly, starting with") + pieces[i - 1][-8:])
        ids = head + list(b"\n") + piece
        dense.own = {}
        model.forward(np.array(ids), np.arange(len(prompt), len(prompt) + len(ids)), dense)
        fed += len(ids)
    dense.scores[:, :, :N_SINK] = 1.0
    return dense.scores, fed


def global_keep(scores, budget):
    """The budget x layers x KV heads best entries (ties: the older goes); and the margin at the threshold."""
    n_layers, n_heads, n = scores.shape
    entries = sorted(((scores[layer, head, p], p, head, layer) for layer in range(n_layers)
                      for head in range(n_heads) for p in range(n)), reverse=True)
    k = budget * n_layers * n_heads
    kept = {(e[3], e[2], e[1]) for e in entries[:k]}
    margin = entries[k - 1][0] - entries[k][0] if k < len(entries) else np.inf
    return kept, margin


def engine_kept(session):
    cache, seq_id = session.cache, session.seq_id
    kept = set()
    for layer, store in enumerate(cache.stores):
        keep = cache.head_keep(seq_id, layer)
        for flat in cache.flat_slots(seq_id, layer):
            position = int(store.positions[flat])
            if position >= 0:
                kept |= {(layer, head, position) for head in np.flatnonzero(keep[:, flat])}
    return kept


def kvzip_session(model, budget, chunk=2048, max_new_tokens=1, max_pages=40, context=0):
    config = SessionConfig(page_size=4, max_pages=max_pages, policy="kvzip", max_new_tokens=max_new_tokens,
                           chat=False, policy_params={"budget": budget, "n_sink": N_SINK, "chunk": chunk,
                                                      "context": context})
    return DecodeSession(model, TEXT, config)


@pytest.mark.parametrize("budget, chunk", [(12, 2048), (30, 2048), (20, 40)])
def test_kept_entries_equal_the_brute_force(model, budget, chunk):
    session = kvzip_session(model, budget, chunk)
    prompt = list(session.prompt_ids)
    record = session.step()
    scores, fed = brute_force_scores(model, prompt, chunk)
    expected, margin = global_keep(scores, budget)
    assert margin > 1e-5  # float32 (engine) and float64 (here) cannot disagree on the order at the threshold
    assert engine_kept(session) == expected
    policy = session.policy
    assert policy.head_budgets.sum() == budget * 2 * 2 and policy.context_length == len(prompt)
    assert policy.head_budgets.tolist() == [[sum(1 for e in expected if e[:2] == (layer, head)) for head in range(2)]
                                            for layer in range(2)]
    # the pass wrote nothing: one write per prompt token and layer; its tokens are named in the event
    assert len(record.events.of_kind(EventKind.WRITE)) == len(prompt) * 2
    (reconstruct,) = [e for e in record.events if e.kind is EventKind.RECONSTRUCT]
    assert reconstruct.detail == fed and "reconstruction pass" in reconstruct.reason
    assert "reconstruct" in record.timings
    assert session.cache.n_tokens(session.seq_id) == len(prompt)


def test_a_context_shorter_than_the_prompt_is_compressed_after_its_last_token(model):
    """compare's row: the first `context` tokens are prefilled and compressed; the rest comes one at a time."""
    session = kvzip_session(model, 8, context=40, max_pages=10)
    first = session.step()
    assert first.positions == tuple(range(40))
    expected, margin = global_keep(brute_force_scores(model, list(session.prompt_ids[:40]), 2048)[0], 8)
    assert margin > 1e-5 and engine_kept(session) == expected
    assert session.step().positions == (40,)


def test_decoding_keeps_each_heads_budget_by_the_stated_rule(model):
    """Each new token: a KV head at its budget drops its lowest entry (context by KVzip score, below every
    decoded token; decoded oldest first; sinks never)."""
    budget, steps = 12, 8
    session = kvzip_session(model, budget, max_new_tokens=steps)
    prompt = list(session.prompt_ids)
    scores, _ = brute_force_scores(model, prompt, 2048)
    kept, _ = global_keep(scores, budget)
    budgets = {(layer, head): sum(1 for e in kept if e[:2] == (layer, head)) for layer in range(2) for head in range(2)}
    held = {key: {e[2] for e in kept if e[:2] == key} for key in budgets}
    for step, record in enumerate(session.run()):
        if step == 0:
            continue
        position = record.positions[0]
        for (layer, head), positions in held.items():
            value = {p: scores[layer, head, p] if p < len(prompt) else 2.0 + p for p in positions}
            droppable = sorted((value[p], p) for p in positions if p >= N_SINK)
            over = len(positions) + 1 - budgets[layer, head]
            for _, p in droppable[: max(0, over)]:
                positions.discard(p)
            positions.add(position)
        assert engine_kept(session) == {(layer, head, p) for (layer, head), ps in held.items() for p in ps}
    assert sum(len(ps) for ps in held.values()) == budget * 4


def test_refuses_a_pool_that_cannot_hold_the_prompt(model):
    with pytest.raises(ConfigError, match="the prompt is 90 tokens while the cache holds 40"):
        kvzip_session(model, 8, max_pages=10)
    with pytest.raises(ConfigError, match="reconstruction pass reads float K/V"):
        DecodeSession(model, TEXT, SessionConfig(page_size=4, max_pages=40, policy="kvzip", dtype="int8", chat=False))


def test_refusal_names_the_numbers(model):
    with pytest.raises(ConfigError) as error:
        kvzip_session(model, 8, max_pages=10)
    assert str(error.value) == ("max_pages = 10 is not allowed: at least 23 pages of 4: policy 'kvzip' prefills the "
                                "whole prompt before compressing it, and the prompt is 90 tokens while the cache "
                                "holds 40")


def test_compare_row_scores_the_tokens_after_its_context(tmp_path, capsys):
    from pagevis.quality import measure

    text = tmp_path / "text.txt"
    text.write_text(TEXT * 2)
    status = main(["compare", str(text), "--model", "synthetic", "--layers", "2", "--heads", "4", "--kv-heads", "2",
                   "--head-dim", "16", "--model-seed", "3", "--policies", "kvzip", "--budgets", "32",
                   "--page-size", "16", "--tokens", "120", "--json", "--no-files", "--quiet"])
    out, err = capsys.readouterr()
    assert status == 0, err
    rows = {r["policy"]: r for r in json.loads(out)["rows"]}
    kvzip, optimal = rows["kvzip"], rows["optimal"]
    assert kvzip["scored_from"] == 80 and kvzip["evicting_tokens"] == 120 - 1 - 80  # (120 - 32) // 16 * 16
    assert kvzip["gap_to_optimal"] == pytest.approx(kvzip["ppl_evicting"] / kvzip["optimal_ppl_scored"] - 1)
    assert kvzip["kv_bytes"] == optimal["kv_bytes"]  # the same K/V as 32 whole tokens, once compressed
    assert measure.session_pages(measure.PolicyChoice("kvzip"), 32, 16, None, 120) == (5, {"budget": 32, "context": 80})


def test_cli_run_json(capsys):
    status = main(["run", "--model", "synthetic", "--layers", "2", "--heads", "4", "--kv-heads", "2", "--head-dim", "16",
                   "--model-seed", "3", "--page-size", "4", "--max-pages", "30", "--policy", "kvzip",
                   "--policy-param", "budget=12", "--max-tokens", "4", "--prompt", TEXT, "--no-chat", "--json",
                   "--quiet"])
    out, err = capsys.readouterr()
    assert status == 0, err
    compression = json.loads(out)["compression"]
    assert compression["compressed"] and compression["context_tokens"] == 90
    assert compression["reconstruct_tokens"] == len("\n\nRepeat the previous context exactly.\n") + 90
    assert sum(map(sum, compression["head_budgets"])) == 12 * 2 * 2
    assert compression["kv_bytes_entries"] == 12 * 2 * 2 * (2 * 16 * 4)  # entries x (K + V) x head_dim x float32
    assert compression["kv_bytes_slots"] >= compression["kv_bytes_entries"]


def test_trace_round_trip(model, tmp_path):
    session = kvzip_session(model, 12, max_new_tokens=4)
    list(session.run())
    write_trace(tmp_path / "t", session)
    loaded = read_trace(tmp_path / "t")
    assert [record_differences(a, b) for a, b in zip(session.records, loaded.records)] == [[]] * len(session.records)
    assert any(e.kind is EventKind.RECONSTRUCT for e in loaded.records[0].events)


def test_two_sequences_in_one_engine_each_compress_alone(model):
    """Batched beside another request (the server's engine): each keeps exactly what it keeps alone, prompt
    chunks cut by the step's token budget included (the pass runs in the step that completes the prompt)."""
    from pagevis.engine.batch import BatchConfig
    from pagevis.engine.engine import Engine

    config = SessionConfig(page_size=4, max_pages=30, policy="kvzip", max_new_tokens=3, chat=False,
                           policy_params={"budget": 12})
    engine = Engine(model, config, BatchConfig(max_seqs=2, prefix_caching=False, token_budget=32),
                    hold_finished=True)
    prompts = [model.tokenizer.encode(TEXT), model.tokenizer.encode(TEXT[::-1])]
    ids = [engine.submit(prompt) for prompt in prompts]
    list(engine.run())
    for seq_id, prompt in zip(ids, prompts):
        alone = DecodeSession(model, "", config, prompt_ids=prompt)
        list(alone.run())
        policy = engine.cache.sequences[seq_id].policy
        assert policy.head_budgets.tolist() == alone.policy.head_budgets.tolist()
        assert engine.requests[seq_id].generated == alone.generated
        kept = {(layer, head, int(engine.cache.stores[layer].positions[flat]))
                for layer in range(2) for flat in engine.cache.flat_slots(seq_id, layer)
                for head in np.flatnonzero(engine.cache.head_keep(seq_id, layer)[:, flat])
                if engine.cache.stores[layer].positions[flat] >= 0}
        assert kept == engine_kept(alone)
