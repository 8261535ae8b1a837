"""ChatML prompts, the chat format of SmolLM2-Instruct."""

from __future__ import annotations

import regex

# The default system prompt written in SmolLM2-135M-Instruct's GGUF `tokenizer.chat_template`.
SMOLLM2_SYSTEM_PROMPT = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"

_TEMPLATE_SYSTEM = regex.compile(r"<\|im_start\|>system\n(.*?)<\|im_end\|>", regex.DOTALL)


def system_prompt_from_template(chat_template: str | None) -> str | None:
    """The default system prompt a ChatML Jinja template inserts, or None if it has none."""
    if not chat_template:
        return None
    found = _TEMPLATE_SYSTEM.search(chat_template)
    return found.group(1) if found else None


def format_chatml(
    messages: list[dict[str, str]],
    default_system: str | None = SMOLLM2_SYSTEM_PROMPT,
    add_generation_prompt: bool = True,
) -> str:
    """Render messages ({"role", "content"}) as ChatML, as SmolLM2's template does.

    Like the template, a conversation that does not open with a system message gets the default one.
    """
    parts = []
    if default_system is not None and (not messages or messages[0]["role"] != "system"):
        parts.append(f"<|im_start|>system\n{default_system}<|im_end|>\n")
    for message in messages:
        parts.append(f"<|im_start|>{message['role']}\n{message['content']}<|im_end|>\n")
    if add_generation_prompt:
        parts.append("<|im_start|>assistant\n")
    return "".join(parts)
