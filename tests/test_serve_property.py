"""Every endpoint of the app's own OpenAPI schema driven with generated JSON (hypothesis): values of the
schema's types and junk beside them (lone surrogates, huge numbers, NaN, wrong types, missing fields). No
answer may be a 5xx, and /healthz answers afterwards. Bounded: a fixed number of examples, derandomized."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from serve_fixtures import running_server

EXAMPLES = 200
STRINGS = st.one_of(st.text(max_size=12), st.sampled_from(["", "a\ud800b", "\udc80", "<|im_start|>", "x" * 3000,
                                                             "synthetic", "hi", "sinks", "all"]))
NUMBERS = st.one_of(st.integers(-3, 40), st.sampled_from([0, 1, 2**31, -(2**63), 10**30]),
                    st.floats(allow_nan=True, allow_infinity=True))
JUNK = st.recursive(st.one_of(st.none(), st.booleans(), NUMBERS, STRINGS),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(STRINGS, inner, max_size=3),
                    max_leaves=6)


def value_of(schema: dict, defs: dict, depth: int = 0):
    """A strategy for values of `schema` (OpenAPI / JSON schema), with junk now and then."""
    typed = typed_value(schema, defs, depth)
    return typed if typed is JUNK else st.one_of(typed, typed, typed, typed, typed, JUNK)


def typed_value(schema: dict, defs: dict, depth: int):
    if "$ref" in schema:
        return value_of(defs[schema["$ref"].rsplit("/", 1)[1]], defs, depth)
    if depth > 4:
        return JUNK
    options = schema.get("anyOf") or schema.get("oneOf")
    if options:
        return st.one_of([value_of(option, defs, depth + 1) for option in options])
    if "enum" in schema or "const" in schema:
        return st.sampled_from(schema.get("enum") or [schema["const"]])
    kind = schema.get("type")
    if kind == "integer":
        low, high = schema.get("minimum", -3), schema.get("maximum", 70)
        return st.one_of(st.integers(low, min(high, low + 40)), st.sampled_from([low - 1, high, high + 1]))
    if kind == "number":
        return st.one_of(st.floats(-4, 4), st.floats(0, 1), NUMBERS)
    if kind == "string":
        return STRINGS
    if kind == "boolean":
        return st.booleans()
    if kind == "array":
        return st.lists(value_of(schema.get("items", {}), defs, depth + 1), max_size=4)
    if kind == "object" and schema.get("properties"):
        required = set(schema.get("required", ()))
        fields = {name: value_of(sub, defs, depth + 1) for name, sub in schema["properties"].items()}
        if "model" in fields:  # mostly the served model, so that requests get past the first check
            fields["model"] = st.one_of(st.just("synthetic"), st.just("synthetic"), fields["model"])
        return st.fixed_dictionaries({k: v for k, v in fields.items() if k in required},
                                     optional={k: v for k, v in fields.items() if k not in required})
    return JUNK


@pytest.fixture(scope="module")
def served():
    with running_server(max_session_tokens=128, max_sessions=4) as running:
        session = running.client.post("/v1/sessions", json={"prompt": "hi", "max_tokens": 4, "chat": False}).json()["id"]
        yield running, session


def operations(schema: dict) -> list[tuple[str, str, dict]]:
    return [(method, path, operation) for path, methods in schema["paths"].items()
            for method, operation in methods.items()]


def test_generated_requests_get_no_5xx_and_the_server_lives(served):
    server, session = served
    schema = server.app.openapi()
    defs = schema["components"]["schemas"]
    requests = []
    for method, path, operation in operations(schema):
        body = operation.get("requestBody", {}).get("content", {}).get("application/json", {}).get("schema")
        body_strategy = value_of(body, defs) if body else st.none()
        ident = st.one_of(st.just(session), st.text("abcdef0123456789-_.%", max_size=12))
        requests.append(st.tuples(st.just(method), st.just(path), ident, body_strategy))
    answers = []

    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(st.one_of(requests))
    @example(("post", "/v1/chat/completions", session, {"model": "synthetic", "max_tokens": 3, "stream": True,
                                                        "messages": [{"role": "user", "content": "hi"}]}))
    @example(("post", "/v1/completions", session, {"model": "synthetic", "prompt": ["ab", "cd"], "max_tokens": 2,
                                                   "stop": ["q", "zz"], "logprobs": 2, "echo": True, "n": 2}))
    @example(("post", "/tokenize", session, {"prompt": "hi", "return_token_strs": True}))
    def one(request):
        method, path, ident, body = request
        url = path.replace("{session_id}", ident or "x")
        content = None if body is None and method == "get" else json.dumps(body)
        answer = server.client.request(method.upper(), url, content=content,
                                       headers={"content-type": "application/json"})
        answers.append((path, answer.status_code))
        assert answer.status_code < 500, (method, url, content and content[:300], answer.text[:500])

    one()
    assert server.client.get("/healthz").json()["status"] == "ok"
    assert len(answers) > EXAMPLES
    assert {path for path, code in answers if code == 200} >= {"/v1/completions", "/v1/chat/completions", "/tokenize"}
