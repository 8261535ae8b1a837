"""Named presets and the default prompt, shared by the app and `pagevis run` (Qt-free).

The defaults themselves are the settings table's (pagevis/settings.py): what the app shows a first-time
user, and what `pagevis run`, `serve` and a bare SessionConfig() start from. The synthetic model's byte
tokenizer turns the SmolLM2 prompt into ~170 tokens, more than the default cache: it gets a short prompt of
its own that fits.

A preset sets prompt, cache and policy for a one-click demo as named overrides of the defaults; `b` is the
second session of an A/B comparison (same prompt, different settings), or None for a single session.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from importlib import resources

from pagevis import settings
from pagevis.engine import SessionConfig
from pagevis.settings import for_front_end, with_values
from pagevis.simserver.run import ServerConfig
from pagevis.simserver.workload import WorkloadConfig
from pagevis.errors import ConfigError

DEFAULT_CONFIG = SessionConfig()  # the settings table's defaults
SYNTHETIC_PROMPT = "Pages fill, then tokens leave."  # 80 byte tokens with the chat template, of 96 slots


def default_prompt(model_kind: str = "smollm2") -> str:
    """The prompt a fresh session starts from: one that fits the default cache and lets decoding evict."""
    if model_kind == "synthetic":
        return SYNTHETIC_PROMPT
    return prompt_resource("explain-paging")


def prompt_resource(name: str) -> str:
    return resources.files("pagevis.resources").joinpath(f"prompts/{name}.txt").read_text("utf-8").strip()


DEFAULT_TEXT = "pride-and-prejudice-ch1"  # what `compare` and the A/B's "same text" read unless told otherwise
HELD_OUT_TEXT = "the-ferry-timetable"  # written for pagevis: in no model's training data (resources/texts/SOURCES.md)


def shipped_text(name: str) -> str | None:
    """A text shipped in resources/texts/ by its name (without .txt), or None if there is none."""
    path = resources.files("pagevis.resources").joinpath("texts").joinpath(f"{name}.txt")
    return path.read_text("utf-8") if "/" not in name and path.is_file() else None


def shipped_texts() -> list[str]:
    folder = resources.files("pagevis.resources").joinpath("texts")
    return sorted(p.name[:-4] for p in folder.iterdir() if p.name.endswith(".txt"))


@dataclass(frozen=True)
class Preset:
    name: str
    description: str
    prompt: str  # a shipped prompt's name (resources/prompts/NAME.txt)
    a: SessionConfig
    b: SessionConfig | None = None  # the second session of an A/B demo
    model: str | None = None  # a model known by name (pagevis.model.locate.MODEL_NAMES); None: the one chosen
    point: str = ""  # what it shows, in one line (the windows show it when it is chosen)
    text: str | None = None  # an A/B that reads this shipped text on both sides ("same text", teacher-forced)

    def prompt_text(self) -> str:
        return prompt_resource(self.prompt)

    @property
    def title(self) -> str:
        """The preset's full title in the Demo menu (and its test's id)."""
        return self.name + (" (A/B)" if self.b is not None else "")


def _config(**changes) -> SessionConfig:
    return replace(DEFAULT_CONFIG, **changes)


def _versus(policy_a: str, policy_b: str, **shared) -> tuple[SessionConfig, SessionConfig]:
    """An A/B's two sides: the same settings (the same budget) but for the policy."""
    return _config(policy=policy_a, **shared), _config(policy=policy_b, **shared)


PRESETS: tuple[Preset, ...] = (
    Preset(f"Default: {DEFAULT_CONFIG.policy}, {DEFAULT_CONFIG.max_pages} × {DEFAULT_CONFIG.page_size}",
           f"The defaults ({DEFAULT_CONFIG.policy}: StreamingLLM's attention sinks plus the newest tokens, in "
           f"{DEFAULT_CONFIG.max_pages} pages of {DEFAULT_CONFIG.page_size}) on SmolLM2, the default model.",
           "explain-paging", DEFAULT_CONFIG, model=None,
           point=f"The cache fills its {DEFAULT_CONFIG.max_pages} pages, then each new token evicts an old one — never "
                 "the 4 sink tokens at the start."),
    Preset("StreamingLLM: window vs sinks",
           "Both sides read the same text (chapter 1 of Pride and Prejudice), one token a step, in 8 pages of 8 "
           "tokens, beside the full cache: A a plain sliding window (oldest), B the same window plus 4 sink "
           "tokens. The curves are each side's perplexity so far (pagevis compare's numbers).",
           "attention-sinks", *_versus("oldest", "sinks", page_size=8, max_pages=8), text=DEFAULT_TEXT,
           point="The window's perplexity leaves the full cache's at its first eviction; keeping the first 4 "
                 "tokens (sinks) holds it near."),
    Preset("H2O heavy hitters",
           "A: H2O keeps the most-attended tokens plus a recent window · B: sinks with the same budget.",
           "explain-paging", *_versus("h2o", "sinks", max_pages=8, oracle=True),
           point="H2O keeps the tokens attention returns to, wherever they are; sinks the first and the newest: "
                 "the grids hold different tokens."),
    Preset("vLLM page-level",
           "Both sides read the same text in 4 pages of 16 and keep their first page (16 sink tokens, so both "
           "read it well): A frees a whole page when the cache is full, as vLLM's block manager frees blocks; B "
           "one token a step (StreamingLLM), the same 64-token budget. The right-hand plot is the tokens each "
           "side holds, step by step.",
           "explain-paging", _config(policy="sinks", page_size=16, max_pages=4,
                                     policy_params={"n_sink": 16, "compress_every": 16}),
           _config(policy="sinks", page_size=16, max_pages=4, policy_params={"n_sink": 16}), text=DEFAULT_TEXT,
           point="vLLM frees whole pages: A drops 16 tokens at once and refills (49-64 held, a saw-tooth); B "
                 "drops one a step and stays at 64."),
    Preset("Page size 8 vs 32",
           "Both sides read the same text with the same policy (4 sinks, then the oldest) and the same 64-token "
           "budget, freeing a page's worth of tokens at a time: 8 pages of 8 against 2 pages of 32.",
           "explain-paging", _config(policy="sinks", page_size=8, max_pages=8, policy_params={"compress_every": 8}),
           _config(policy="sinks", page_size=32, max_pages=2, policy_params={"compress_every": 32}),
           text=DEFAULT_TEXT,
           point="Pages of 8 free 8 tokens at a time, pages of 32 half the cache: B holds ~48 tokens to A's ~60, "
                 "and reads the text worse."),
    Preset("TOVA: least attended leaves",
           "A: TOVA evicts the token the latest query attends to least · B: H2O (accumulated attention).",
           "explain-paging", *_versus("tova", "h2o", max_pages=8, oracle=True),
           point="TOVA asks only the newest query, H2O every query so far: they keep different tokens and their "
                 "texts part."),
    Preset("Gemma 3: sliding window vs global layers",
           "Gemma 3 270M (the pagevis[gemma] extra) on a 700-token passage, nothing evicted (policy none): its "
           "15 local layers keep a 512-token window and free each page that leaves it (a 'slide' event); layers "
           "5, 11 and 17 keep every token. Step the layer box between 0 and 5 to see both.",
           "sliding-window", _config(policy="none", page_size=16, max_pages=64, chat=False), model="gemma3-270m",
           point="Gemma 3's local layers (0-4) free the pages that leave their 512-token window; its global "
                 "layers (5, 11, 17) keep every token."),
)


def preset_named(name: str) -> Preset | None:
    """The preset called exactly `name`, or None (the A/B window's title names its preset)."""
    return next((p for p in PRESETS if p.name == name), None)


def preset_names() -> list[str]:
    return [preset.name for preset in PRESETS]


def find_preset(name: str) -> Preset:
    """The preset called `name` (case and punctuation-insensitive prefix match), or ConfigError."""
    wanted = _key(name)
    matches = [p for p in PRESETS if _key(p.name) == wanted] or [p for p in PRESETS if _key(p.name).startswith(wanted)]
    if len(matches) != 1 or not wanted:
        raise ConfigError("preset", name, "one of: " + "; ".join(preset_names()))
    return matches[0]


def _key(name: str) -> str:
    return "".join(ch for ch in name.lower() if ch.isalnum())


@dataclass(frozen=True)
class ServerPreset:
    """A Server window demo: the workload, the server (pool, scheduler) and what its A/B compares. Requests
    never evict (policy none, a per-request capacity above any prompt + answer of the workload)."""

    name: str
    description: str
    workload: WorkloadConfig
    server: ServerConfig
    compare: str = ""  # a key of pagevis.simserver.run.COMPARES
    page_size: int = settings.setting("page_size").default_for("server")
    capacity: int = 2048  # tokens per request

    def session_config(self) -> SessionConfig:
        """The settings table's session defaults for the Server window (policy none, sampled), with this
        preset's page size, capacity and answer length."""
        return with_values(for_front_end(SessionConfig(), "server"), {
            "page_size": self.page_size, "max_pages": -(-self.capacity // self.page_size),
            "max_new_tokens": self.workload.max_new_tokens})


SERVER_PRESETS: tuple[ServerPreset, ...] = (
    ServerPreset("Server: shared system prompt, prefix caching on vs off",
                 "90 chat requests a minute, each opening with the same ~290-token passage: A computes it once and "
                 "shares its pages, B computes it for every request (more than B can serve on two cores).",
                 WorkloadConfig(kind="chat", rate_per_min=90, n_requests=60, max_new_tokens=48),
                 ServerConfig(pool_pages=256, max_seqs=8), compare="prefix"),
    ServerPreset("Server: long documents, preemption",
                 "Different 600-token passages to summarise into a 96-page pool: running requests outgrow it, the "
                 "newest is preempted and recomputed later.",
                 WorkloadConfig(kind="documents", rate_per_min=30, n_requests=24, max_new_tokens=64),
                 ServerConfig(pool_pages=96, max_seqs=6)),
    ServerPreset("Server: returning users",
                 "Users come back after a pause; each turn's prompt is the previous turn, prompt and answer, plus a "
                 "new message: the prefix cache holds the conversation so far.",
                 WorkloadConfig(kind="returning", rate_per_min=20, n_requests=12, max_new_tokens=48, turns=3),
                 ServerConfig(pool_pages=256, max_seqs=8)),
    ServerPreset("Server: paged vs contiguous reservation",
                 "The same chats with up to 256 new tokens: A takes pages as tokens come, B reserves prompt + 256 "
                 "tokens per request up front and so admits fewer at once.",
                 WorkloadConfig(kind="chat", rate_per_min=60, n_requests=30, max_new_tokens=256, system_words=60),
                 ServerConfig(pool_pages=160, max_seqs=16), compare="contiguous"),
)


def find_server_preset(name: str | None) -> ServerPreset:
    """The server preset called `name` (as find_preset matches; None: the first), or ConfigError."""
    if not name:
        return SERVER_PRESETS[0]
    wanted = _key(name)
    matches = [p for p in SERVER_PRESETS if wanted and wanted in _key(p.name)]
    if len(matches) != 1:
        raise ConfigError("server preset", name, "one of: " + "; ".join(p.name for p in SERVER_PRESETS))
    return matches[0]

