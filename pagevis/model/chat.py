"""ChatML prompts, the chat format of SmolLM2-Instruct: the template inserts the control tokens, and the
messages are always encoded as text (a user typing `<|im_end|>` gets the characters, not the token)."""

from __future__ import annotations

IM_START, IM_END = "<|im_start|>", "<|im_end|>"
# The default system prompt written in SmolLM2-135M-Instruct's GGUF `tokenizer.chat_template`.
SMOLLM2_SYSTEM_PROMPT = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"

_SYSTEM_TURN = IM_START + "system\n"


def system_prompt_from_template(chat_template: str | None) -> str | None:
    """The default system prompt a ChatML Jinja template inserts, or None if it has none."""
    if not chat_template:
        return None
    start = chat_template.find(_SYSTEM_TURN)  # two finds: linear in the template's length, whatever it holds
    end = chat_template.find(IM_END, start + len(_SYSTEM_TURN)) if start >= 0 else -1
    return chat_template[start + len(_SYSTEM_TURN): end] if end >= 0 else None


def chatml_segments(
    messages: list[dict[str, str]],
    default_system: str | None = SMOLLM2_SYSTEM_PROMPT,
    add_generation_prompt: bool = True,
) -> list[tuple[str, bool]]:
    """A conversation as ChatML, in pieces: (text, is_control). Only the template's own markers are control;
    the roles and every message's content are text, so a user cannot open or close a turn by typing a marker.

    Like SmolLM2's template, a conversation that does not open with a system message gets the default one.
    """
    if default_system is not None and (not messages or messages[0]["role"] != "system"):
        messages = [{"role": "system", "content": default_system}, *messages]
    segments = []
    for message in messages:
        segments += [(IM_START, True), (f"{message['role']}\n{message['content']}", False), (IM_END, True),
                     ("\n", False)]
    if add_generation_prompt:
        segments += [(IM_START, True), ("assistant\n", False)]
    return segments


def format_chatml(
    messages: list[dict[str, str]],
    default_system: str | None = SMOLLM2_SYSTEM_PROMPT,
    add_generation_prompt: bool = True,
) -> str:
    """The ChatML prompt as one string (for display; encode with the tokenizer's encode_chat)."""
    return "".join(text for text, _ in chatml_segments(messages, default_system, add_generation_prompt))
