"""vLLM's tokenizer endpoints, in its shapes: `POST /tokenize`, `POST /detokenize`, `GET /tokenizer_info`
(lm-eval's `tokenizer_backend=remote` counts context lengths with them).

Text is encoded as Hugging Face tokenizers do: special-token strings in it become their ids (lm-eval finds
the end-of-text id by encoding the `eos_token` string); `add_special_tokens` adds what the tokenizer adds
in front of any text (a BOS token for models that want one; SmolLM2 adds none). `max_model_len` is this
server's --max-session-tokens: prompt and generated tokens of one request.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field

from pagevis.serve.errors import ApiError, CheckedRoute
from pagevis.serve.requests import MAX_PROMPT_CHARS
from pagevis.serve.worker import in_worker

router = APIRouter(tags=["tokenizer"], route_class=CheckedRoute)


class _TokenizerRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None


class TokenizeRequest(_TokenizerRequest):
    prompt: str = Field(max_length=MAX_PROMPT_CHARS)
    add_special_tokens: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(_TokenizerRequest):
    tokens: list[int] = Field(max_length=MAX_PROMPT_CHARS)


def _tokenizer(request: Request, body: _TokenizerRequest):
    state = request.app.state
    if body.model is not None and body.model != state.model_id:
        raise ApiError(404, f"model {body.model!r} is not served here; this server serves {state.model_id!r}",
                       param="model", code="model_not_found")
    if state.model.tokenizer is None:
        raise ApiError(400, "this model has no tokenizer", param="model")
    return state.model.tokenizer


def encode(tokenizer, text: str, add_special_tokens: bool) -> list[int]:
    ids = tokenizer.encode(text, special=True)
    if not add_special_tokens:
        added = tokenizer.encode("", special=True)  # what the tokenizer puts before any text
        if added and ids[: len(added)] == added:
            ids = ids[len(added):]
    return ids


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request) -> dict:
    tokenizer = _tokenizer(request, body)
    ids = await in_worker(request, encode, tokenizer, body.prompt, body.add_special_tokens)
    return {"count": len(ids), "max_model_len": request.app.state.settings.max_session_tokens, "tokens": ids,
            "token_strs": [tokenizer.token_text(t) for t in ids] if body.return_token_strs else None}


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request) -> dict:
    tokenizer = _tokenizer(request, body)
    vocab = request.app.state.model.config.vocab_size
    bad = next((i for i, t in enumerate(body.tokens) if not 0 <= t < vocab), None)
    if bad is not None:
        raise ApiError(422, f"tokens[{bad}]: token id {body.tokens[bad]} is not in this model's vocabulary "
                            f"(0 to {vocab - 1})", param="tokens", code="invalid_value")
    return {"prompt": await in_worker(request, tokenizer.decode, body.tokens)}


@router.get("/tokenizer_info")
async def tokenizer_info(request: Request) -> dict:
    state = request.app.state
    tokenizer = _tokenizer(request, _TokenizerRequest())
    config = state.model.config

    def text(token_id: int | None) -> str | None:
        return None if token_id is None else tokenizer.token_bytes(token_id).decode("utf-8", "replace")

    eos = text(config.eos_ids[0]) if config.eos_ids else None
    # no pad token of its own: lm-eval pads with the end-of-text token, as Hugging Face's loaders do
    return {"tokenizer_class": type(tokenizer).__name__, "vocab_size": tokenizer.vocab_size,
            "model_max_length": state.settings.max_session_tokens, "bos_token": text(config.bos_id),
            "eos_token": eos, "pad_token": eos, "add_bos_token": bool(tokenizer.encode("", special=True)),
            "chat_template": None}
