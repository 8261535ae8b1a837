"""What a decoding session is configured with (the cache settings plus how to decode), and the few uses
of the model's tokenizer every front end shares."""

from __future__ import annotations

from dataclasses import dataclass, field

from pagevis import settings
from pagevis.kvcache import CacheConfig, CacheSettings
from pagevis.settings import MAX_NEW_TOKENS, field_for
from pagevis.engine.sampling import SamplingConfig
from pagevis.model.config import ModelConfig

__all__ = ["MAX_NEW_TOKENS", "SessionConfig", "decode_ids", "encode_prompt", "token_text"]


@dataclass(frozen=True)
class SessionConfig(CacheSettings):
    """The cache settings (inherited from CacheSettings) plus how to decode; defaults, bounds and help in
    the settings table (pagevis/settings.py)."""

    max_new_tokens: int = field_for("max_new_tokens")
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    oracle: bool = field_for("oracle")
    chat: bool = field_for("chat")  # wrap the prompt in the model's chat template
    special: bool = field_for("special")  # without chat: control-token text becomes control tokens (opt-in)
    record_layers: tuple[int, ...] | None = field_for("record_layers")  # layers records keep; None = all

    def __post_init__(self) -> None:
        super().__post_init__()
        settings.check(self, ("max_new_tokens",))

    def cache_config(self, model_config: ModelConfig) -> CacheConfig:
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
