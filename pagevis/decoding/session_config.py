"""What a decoding session is configured with (the cache settings plus how to decode), and the few uses
of the model's tokenizer every front end shares."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..engine import CacheConfig, CacheSettings
from ..errors import check_int
from .sampling import SamplingConfig

MAX_NEW_TOKENS = 100_000


@dataclass(frozen=True)
class SessionConfig(CacheSettings):
    """The cache settings (inherited, declared once in CacheSettings) plus how to decode."""

    max_new_tokens: int = 64
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    oracle: bool = False
    chat: bool = True  # wrap the prompt in the model's chat template
    special: bool = False  # without chat: parse control-token text in the prompt as control tokens (opt-in)
    record_layers: tuple[int, ...] | None = None  # layers whose attention records keep; None = all

    def __post_init__(self) -> None:
        super().__post_init__()
        check_int("max_new_tokens", self.max_new_tokens, 1, MAX_NEW_TOKENS)

    def cache_config(self, model_config) -> CacheConfig:
        return CacheConfig.for_model(self, model_config)


# The tokenizer is the model package's; these keep the session's few uses of it in one place.
def encode_prompt(model, prompt: str, chat: bool, special: bool = False) -> list[int]:
    """The prompt's ids: in the chat template (the prompt stays text), or raw (control tokens only if `special`)."""
    tokenizer = model.tokenizer
    if chat:
        return list(tokenizer.encode_chat([{"role": "user", "content": prompt}]))
    return list(tokenizer.encode(prompt, special=special))


def decode_ids(model, ids) -> str:
    return model.tokenizer.decode(list(ids))


def token_text(model, token_id: int) -> str:
    return model.tokenizer.token_text(int(token_id))
