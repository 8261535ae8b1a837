"""The one table of user-facing settings. Each is declared once here — name, type, default, bounds or
choices, help text, command-line flag — and every front end is made from this table:

- the config dataclasses (engine's CacheSettings; decoding's SessionConfig, SamplingConfig, BatchConfig)
  declare each field as `name: type = field_for("name")`, which takes the default from here and tags the
  field with its Setting; they validate with `check(config, ...)`;
- `pagevis run`, `compare`, `serve` and the app's command line get their flags from `add_flags()` (one
  argparse flag per Setting with a `flag`), and build their configuration with `apply()`;
- the server's request models are built field by field from it (`serve/requests.py`), and a request's
  values become a configuration through the same `apply()` the command line uses;
- the app's controls take their ranges, defaults, labels and tooltips from it (`gui/setting_inputs.py`),
  and its saved settings (QSettings) are `to_dict(config)`;
- a trace's header holds `to_dict(config)`, read back with `from_dict()` and type-checked from the table;
- `pagevis serve`'s limits (ServeSettings) and the Server window's scheduler (ServerConfig) are settings too.

Where front ends need different defaults, a setting says so (`front_ends`): the app and `pagevis run` show a
first-time user the demo cache, `pagevis serve` (FRONT_ENDS "serve") serves whole requests with no eviction,
the app's Server window ("server") runs its own small scheduler. A front end's dataclass declares such a field
with `field_for(name, front_end)`, and its --help shows that front end's default (`add_flags(front_end=...)`).

This module imports nothing of pagevis but `errors`, so the engine can import it (the one exception: the
policy names, which the engine's policy registry owns, are read from it when a front end asks).
The plain defaults are what the app shows a first-time user: on SmolLM2 the default prompt (54 tokens with the chat
template) fills 12 pages of 8 within the first ~40 generated tokens, and 192 new tokens leave ~150 steps
of eviction. Presets (pagevis/presets.py) are named overrides of these.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from pagevis.errors import ConfigError, check_int

MAX_PAGE_SIZE = 4096
MAX_PAGES = 1 << 20
MAX_NEW_TOKENS = 100_000
MAX_SEQUENCES = 256
MAX_SEED = 2**32 - 1
STORAGE_DTYPES = ("float32", "float16", "int8", "int4", "int2")
MAX_RESIDUAL = 1 << 20
SELECT_MODES = ("all", "quest")
SAMPLING_MODES = ("greedy", "sample")
INT8_ROWS = ("none", "batched", "prompts", "all")  # BatchConfig.int8_rows

# Which dataclass holds a setting: the cache (CacheSettings, which SessionConfig extends), the session's own
# fields (SessionConfig), sampling (SamplingConfig, held by SessionConfig.sampling) and many sequences
# (BatchConfig). A group that another config holds in a field is NESTED under that field's name.
GROUPS = ("cache", "session", "sampling", "batch", "serve")
NESTED = {"sampling": "sampling"}
# Headings of the command line's --help and of the app's panels, by section.
SECTIONS = {"cache": "KV cache", "tiers": "disk tier and page selection (docs/memory.md)", "prompt": "prompt",
            "decoding": "decoding", "batch": "many sequences", "scheduler": "scheduling (continuous batching)",
            "network": "network", "limits": "limits", "kv_events": "KV events (vLLM's format: docs/serving.md)"}
# The front ends whose defaults may differ: the app's windows, `pagevis run` / compare / bench, `pagevis serve`,
# and the app's Server window (a simulated server). A setting without an entry for one uses its `default`.
FRONT_ENDS = ("app", "run", "serve", "server")


def policy_names() -> tuple[str, ...]:
    """The eviction policies, from the engine's registry (read when asked: the engine imports this table)."""
    from pagevis.kvcache.policies import POLICIES

    return tuple(POLICIES)


@dataclass(frozen=True)
class Setting:
    """One user-facing setting. `kind` is int, float, str, bool, or two shapes of their own: "params" (a
    policy's parameters, name -> number, string or None) and "layers" (record_layers: a tuple of layer
    numbers, or None for all)."""

    name: str  # the config field, and its key in a trace header and in the app's saved settings
    kind: str
    default: Any
    help: str  # one phrase, used by --help, the app's tooltips and the server's API docs
    group: str  # one of GROUPS
    section: str  # one of SECTIONS
    label: str = ""  # the app's label for its control
    low: float | None = None  # bounds, inclusive (int, float)
    high: float | None = None
    open_low: bool = False  # `low` itself is not allowed (temperature > 0)
    choices: tuple[str, ...] | Callable[[], tuple[str, ...]] = ()  # allowed strings (a callable: read when asked)
    allowed: str = ""  # what a ConfigError says is allowed, when the bounds or choices do not say it
    nullable: bool = False  # None is a value too (swap_dir: the system's temporary folder)
    flag: str = ""  # the command-line flag ("" = none)
    metavar: str = ""
    switch: Any = None  # the flag takes no argument and sets this value (--oracle, --no-chat, --sample)
    key: str = ""  # the flag's dest and the request field, when not `name` (--max-tokens sets max_new_tokens)
    implies: tuple[str, Any] | None = None  # giving this also sets that setting (a temperature implies sampling)
    resets: tuple[str, ...] = ()  # giving this resets those to their defaults unless they are given too
    request: bool = True  # a field of the server's session requests
    app: bool = True  # a control of the app (and kept in its saved settings)
    app_range: tuple[float, float] | None = None  # the app's control range where narrower than the bounds
    app_step: float = 1
    front_ends: Mapping[str, Any] = dataclasses.field(default_factory=dict)  # front end -> its own default
    derived: Mapping[str, str] = dataclasses.field(default_factory=dict)  # front end -> how it computes the default
    off: Any = None  # a flag's value that means None ("--token-budget 0": no limit)
    blank: bool = False  # a str setting that may be empty (a topic)

    def default_for(self, front_end: str | None = None) -> Any:
        """This front end's default (the plain `default` where it sets none of its own)."""
        return self.front_ends.get(front_end, self.default)

    def shown_default(self, front_end: str | None = None) -> Any:
        """What --help gives as this front end's default: its value, or how the front end computes it."""
        return self.derived.get(front_end, self.default_for(front_end))

    @property
    def path(self) -> str:
        """The name a ConfigError gives: `sampling.temperature` for a nested group's setting."""
        return f"{NESTED[self.group]}.{self.name}" if self.group in NESTED else self.name

    @property
    def dest(self) -> str:
        """The name of a flag's value and of a request's field."""
        return self.key or self.name

    def choice_list(self) -> tuple[str, ...]:
        return self.choices() if callable(self.choices) else self.choices

    def allowed_text(self) -> str:
        if self.allowed:
            return self.allowed
        if self.kind == "int":
            return f"an integer from {int(self.low)} to {int(self.high)}"
        if self.kind == "float":
            return f"a number in {'(' if self.open_low else '['}{self.low:g}, {self.high:g}]"
        if self.choices:
            return f"one of {', '.join(self.choice_list())}"
        return {"bool": "true or false", "str": "a string"}.get(self.kind, "")

    def check(self, value: Any) -> None:
        """ConfigError naming this setting, the value and what is allowed, unless the value is allowed.
        Policy names and parameters are the engine's to check (make_policy), record layers the session's
        (they depend on the model)."""
        if (value is None and self.nullable) or self.kind in ("params", "layers") or callable(self.choices):
            return
        if self.kind == "int":
            check_int(self.path, value, int(self.low), int(self.high), self.allowed or None)
            return
        if self.kind == "float":
            number = isinstance(value, (int, float)) and not isinstance(value, bool)
            if not (number and (self.low < value if self.open_low else self.low <= value) and value <= self.high):
                raise ConfigError(self.path, value, self.allowed_text())
            return
        if self.kind == "bool":
            ok = isinstance(value, bool)
        elif self.choices:
            ok = value in self.choice_list()
        else:
            ok = isinstance(value, str) and (bool(value) or self.blank)
        if not ok:
            raise ConfigError(self.path, value, self.allowed_text())

    def from_front_end(self, value: Any) -> Any:
        """A flag's or request's value as this setting's value: a switch of a string setting is a bool
        (--sample, `"sample": true`), a list of layers is a tuple, "all"/"none" layers are None/()."""
        if self.off is not None and value == self.off:
            return None
        if self.kind == "str" and self.switch is not None and isinstance(value, bool):
            return self.switch if value else self.default
        if self.kind == "layers":
            if value == "all":
                return None
            return () if value == "none" else tuple(value)
        if self.kind == "params":
            return dict(value)
        return value


def _table(*settings: Setting) -> dict[str, Setting]:
    return {s.name: s for s in settings}


_SERVER = {"request": False, "app": False}  # a server's own settings: not a request's, not the app's

# The table, in the order --help and the app list them.
SETTINGS: dict[str, Setting] = _table(
    # --- the cache: CacheSettings ------------------------------------------------------------------
    Setting("page_size", "int", 8, "tokens per page", "cache", "cache", label="Page size", low=1,
            high=MAX_PAGE_SIZE, flag="--page-size", metavar="N", app_range=(1, 256),
            front_ends={"serve": 16, "server": 16}),  # vLLM's block size: fewer pages per request to walk
    Setting("max_pages", "int", 12, "pages per layer (RAM frames); capacity = pages x page size", "cache", "cache",
            label="Max pages", low=1, high=MAX_PAGES, flag="--max-pages", metavar="N", app_range=(1, 512),
            derived={"serve": "a full cache: --max-cache-tokens within the pool, in the request's page size; a "
                              "session's, its prompt + max tokens"}),
    Setting("dtype", "str", "float32", "K/V storage: float32, float16, int8 (a scale per token and KV head), int4 "
            "or int2 (KIVI: keys per channel, values per token, groups of 32, a full-precision residual window; "
            "docs/quantization.md)", "cache", "cache", label="Storage", choices=STORAGE_DTYPES, flag="--dtype"),
    Setting("residual", "int", 128, "int4 / int2: the newest tokens kept in float32 (KIVI's residual window; the "
            "oldest 32 beyond it are quantized together once they have all arrived)", "cache", "cache",
            label="Residual window", low=0, high=MAX_RESIDUAL, flag="--residual", metavar="N", app_range=(0, 4096)),
    Setting("policy", "str", "sinks", "eviction policy", "cache", "cache", label="Policy", choices=policy_names,
            flag="--policy", resets=("policy_params",), front_ends={"serve": "none", "server": "none"}),
    Setting("policy_params", "params", {}, "the policy's parameters, e.g. n_sink=4 (sinks), recent=32 (h2o), "
            "seed=1 (random), and for every token policy rerotate=1 (contiguous RoPE positions after eviction) or "
            "compress_every=N (evict N at once when full); the policy's defaults for those not given", "cache", "cache",
            label="Policy parameters", flag="--policy-param", metavar="KEY=VALUE"),
    Setting("key_channels", "float", 0.0, "ThinK: the share of key channels pruned (zeroed) per layer and KV head, "
            "the lowest by mean square of the last 32 queries times that of the keys, chosen once the prompt is "
            "prefilled or the cache is full; values untouched (0 = off; float32 / float16, no disk tier or quest; "
            "docs/policies.md)", "cache", "cache", label="Pruned key channels", low=0, high=0.95,
            flag="--key-channels", metavar="R", app_range=(0, 0.95), app_step=0.05),
    Setting("disk_pages", "int", 0, "pages per layer on disk (0 = no disk tier): capacity = disk pages x page "
            "size, and the RAM frames cache pages (least recently read leaves), written to disk once", "cache",
            "tiers", label="Disk pages", low=0, high=MAX_PAGES, flag="--disk-pages", metavar="N", request=False,
            app_range=(0, 65536)),
    Setting("swap_dir", "str", None, "folder for the swap files (default: the system's temporary folder); a "
            "private subfolder is created there and removed on exit, error or Ctrl-C", "cache", "tiers",
            allowed="a folder path", nullable=True, flag="--swap-dir", metavar="DIR", request=False, app=False),
    Setting("select", "str", "all", "pages a decode step reads: all (exact: disk pages in batches, merged by "
            "log-sum-exp) or quest (only the K pages whose key bounds score highest; K = select pages)", "cache", "tiers",
            label="Read pages", choices=SELECT_MODES, flag="--select", request=False),
    Setting("select_pages", "int", 4, "quest: pages read per step, the newest always among them", "cache", "tiers",
            label="Quest pages", low=1, high=MAX_PAGES, flag="--select-pages", metavar="K", request=False,
            app_range=(1, 65536)),
    # --- the prompt and decoding: SessionConfig ----------------------------------------------------
    Setting("chat", "bool", True, "wrap the prompt in the model's chat template (ChatML for SmolLM2)", "session",
            "prompt", label="Chat template", flag="--no-chat", switch=False),
    Setting("special", "bool", False, "without the chat template: control-token text in the prompt (e.g. "
            "<|im_end|>) becomes the control token, like llama.cpp's --special (default: the prompt is always "
            "plain text)", "session", "prompt", flag="--special", switch=True, request=False, app=False),
    Setting("max_new_tokens", "int", 192, "stop after this many generated tokens", "session", "decoding",
            label="Max new tokens", low=1, high=MAX_NEW_TOKENS, flag="--max-tokens", metavar="N",
            key="max_tokens"),
    # --- sampling: SamplingConfig, held by SessionConfig.sampling ----------------------------------------
    Setting("mode", "str", "greedy", "sample instead of greedy decoding (implied by a temperature, top-k or "
            "top-p)", "sampling", "decoding", label="Sampling", choices=SAMPLING_MODES, flag="--sample",
            switch="sample", key="sample", front_ends={"server": "sample"}),  # the window's users vary
    Setting("temperature", "float", 0.7, "sampling temperature", "sampling", "decoding", label="Temperature",
            low=0, high=10, open_low=True, flag="--temperature", metavar="T", implies=("mode", "sample"),
            app_range=(0.05, 5.0), app_step=0.05),
    Setting("top_k", "int", 0, "keep the k most likely tokens (0 = all)", "sampling", "decoding", label="Top-k",
            low=0, high=1 << 20, flag="--top-k", metavar="N", implies=("mode", "sample"), app_range=(0, 1000)),
    Setting("top_p", "float", 1.0, "nucleus sampling threshold (1 = off)", "sampling", "decoding", label="Top-p",
            low=0, high=1, open_low=True, flag="--top-p", metavar="P", implies=("mode", "sample"),
            app_range=(0.05, 1.0), app_step=0.05),
    Setting("seed", "int", 0, "sampling seed", "sampling", "decoding", label="Seed", low=0, high=MAX_SEED,
            flag="--seed", metavar="N", app_range=(0, 2**31 - 1)),
    # --- what a session records: SessionConfig ----------------------------------------------------------
    Setting("oracle", "bool", False, "also run a full cache alongside and report KL, top-1 agreement and lost "
            "attention (about twice the work per step)", "session", "decoding",
            label="Compare with a full cache (oracle)", flag="--oracle", switch=True),
    Setting("record_layers", "layers", None, "layers whose attention the records keep: all (default), none, or "
            "e.g. 0,15,29", "session", "decoding", flag="--record-layers", metavar="LIST", app=False),
    # --- many sequences over one shared pool: BatchConfig --------------------------------------------------
    Setting("pool_pages", "int", None, "pages per layer in the shared pool; a smaller pool preempts the newest "
            "sequence and recomputes it later", "batch", "batch", low=1, high=MAX_PAGES, nullable=True,
            flag="--pool-pages", metavar="N", request=False, app=False, front_ends={"server": 256},
            derived={"run": "sequences x max pages", "serve": "--max-cache-tokens in the request's page size"}),
    Setting("max_seqs", "int", 16, "requests running in one step (each step feeds them all)", "batch", "scheduler",
            low=1, high=MAX_SEQUENCES, flag="--max-running", metavar="N", key="max_running", request=False,
            app=False, front_ends={"server": 8}),
    Setting("prefix_caching", "bool", True, "keep finished sequences' full pages for reuse by a later prompt with "
            "the same prefix", "batch", "batch", request=False, app=False),
    Setting("token_budget", "int", None, "tokens one step feeds over all requests: a long prompt is prefilled in "
            "chunks between the others' decode steps; 0 = no limit", "batch", "scheduler", low=1, high=1 << 20,
            nullable=True, allowed="an integer from 1 to 1048576, or 0 (no limit)", off=0, flag="--token-budget",
            metavar="N", request=False, app=False, front_ends={"serve": 256, "server": 512}),
    Setting("ignore_eos", "bool", False, "decode max_new_tokens whatever is sampled (benchmarks of a fixed "
            "shape, as vLLM's)", "batch", "batch", request=False, app=False),
    Setting("int8_rows", "str", "batched", "which rows multiply the quantised weights as int8 activations with "
            "integer dot products (llama.cpp's arithmetic; AVX-512 VNNI, where the CPU has it: elsewhere every row "
            "stays exact) instead of exact float32: none; batched (decode rows of several sequences decoding "
            "together); prompts (those and every prompt row); all (every row, a lone sequence's too). Prompt "
            "scoring (logprobs of the prompt, echo) is always exact", "batch", "batch", choices=INT8_ROWS,
            flag="--int8-rows", request=False, app=False, front_ends={"serve": "all"}),  # docs/serving.md: measured
    # --- pagevis serve: ServeSettings (and the Server window's ServerConfig: max_chunk) -------------------------
    Setting("max_chunk", "int", 512, "prompt tokens one request feeds per step (bounds a step's activations)",
            "serve", "scheduler", low=1, high=1 << 20, flag="--max-chunk", metavar="N", front_ends={"server": 256},
            **_SERVER),
    Setting("host", "str", "127.0.0.1", "address to bind; one other than loopback needs --allow-remote", "serve",
            "network", allowed="an address", flag="--host", metavar="HOST", **_SERVER),
    Setting("port", "int", 8000, "port (0 picks a free one)", "serve", "network", low=0, high=65535, flag="--port",
            metavar="PORT", allowed="a port number from 0 to 65535", **_SERVER),
    Setting("allow_remote", "bool", False, "allow a --host other than loopback: anyone who reaches it can use the "
            "server, which has no authentication", "serve", "network", flag="--allow-remote", switch=True, **_SERVER),
    Setting("max_body", "int", 8 << 20, "bytes of the largest request body; bigger ones get 413 unread", "serve",
            "limits", low=1024, high=1 << 30, flag="--max-body", metavar="BYTES", **_SERVER),
    Setting("max_sessions", "int", 8, "live /v1/sessions sessions at once", "serve", "limits", low=1, high=1024,
            flag="--max-sessions", metavar="N", **_SERVER),
    Setting("max_waiting", "int", 64, "completions waiting beyond --max-running (over all engines); more get 429",
            "serve", "limits", low=0, high=1 << 16, flag="--max-waiting", metavar="N", **_SERVER),
    Setting("max_pools", "int", 4, "engines at once, one per cache layout (page size, dtype) requests ask for",
            "serve", "limits", low=1, high=64, flag="--max-pools", metavar="N", **_SERVER),
    Setting("drain_seconds", "float", 10.0, "on SIGTERM or Ctrl-C: how long requests in flight may go on before "
            "they end with finish_reason \"abort\"", "serve", "limits", low=0, high=3600, flag="--drain-seconds",
            metavar="SECONDS", **_SERVER),
    Setting("max_session_tokens", "int", 2048, "prompt + generated tokens of one session or completion", "serve",
            "limits", low=2, high=1 << 20, flag="--max-session-tokens", metavar="N", **_SERVER),
    Setting("max_cache_tokens", "int", 4096, "page size x max pages of one request's cache (per layer)", "serve",
            "limits", low=1, high=1 << 20, flag="--max-cache-tokens", metavar="N", **_SERVER),
    Setting("max_session_mib", "int", 256, "memory of one session's KV caches and step snapshots (checked before "
            "it starts)", "serve", "limits", low=1, high=1 << 20, flag="--max-session-mib", metavar="MIB", **_SERVER),
    Setting("idle_timeout", "float", 600.0, "delete sessions unused this long (seconds)", "serve", "limits", low=0,
            high=7 * 86400, open_low=True, flag="--idle-timeout", metavar="SECONDS", **_SERVER),
    Setting("workers", "int", 2, "worker threads for /v1/attention, prompt encoding and answers", "serve", "limits",
            low=1, high=64, flag="--workers", metavar="N", **_SERVER),
    Setting("kv_events_endpoint", "str", None, "publish the engines' prefix caches as vLLM KV events on this ZMQ "
            "PUB endpoint, e.g. tcp://*:5557 (bound) or tcp://HOST:PORT (connected); `pagevis attach` reads them",
            "serve", "kv_events", allowed="a ZMQ endpoint", nullable=True, flag="--kv-events-endpoint",
            metavar="ENDPOINT", **_SERVER),
    Setting("kv_events_replay", "str", None, "answer replay requests (ZMQ ROUTER) here, e.g. tcp://*:5558", "serve",
            "kv_events", allowed="a ZMQ endpoint", nullable=True, flag="--kv-events-replay", metavar="ENDPOINT",
            **_SERVER),
    Setting("kv_events_topic", "str", "", "the topic of every KV event message", "serve", "kv_events",
            allowed="a string", blank=True, flag="--kv-events-topic", metavar="TOPIC", **_SERVER),
    Setting("request_log", "str", None, "append each completion's arrival time, prompt token ids and cached tokens "
            "to this file, a JSON object a line (`pagevis attach --play REC --explain-log FILE`)", "serve",
            "kv_events", allowed="a file path", nullable=True, flag="--request-log", metavar="FILE", **_SERVER),
)


def setting(name: str) -> Setting:
    return SETTINGS[name]


def in_group(*groups: str) -> list[Setting]:
    return [s for s in SETTINGS.values() if s.group in groups]


def by_path(path: str) -> Setting | None:
    """The setting a ConfigError's field names (`sampling.temperature`, `page_size`), or None."""
    return next((s for s in SETTINGS.values() if s.path == path), None)


# --- the dataclasses --------------------------------------------------------------------------------

def field_for(name: str, front_end: str | None = None):
    """A dataclass field with this setting's default (the front end's, if given), tagged with the Setting
    (`metadata["setting"]`) and the front end (`metadata["front_end"]`)."""
    s = SETTINGS[name]
    default, metadata = s.default_for(front_end), {"setting": s, "front_end": front_end}
    if isinstance(default, dict):
        return dataclasses.field(default_factory=lambda: dict(default), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def for_front_end(config, front_end: str):
    """`config` with this front end's own defaults (`front_ends`) for the settings it holds."""
    return with_values(config, {s.name: s.front_ends[front_end] for s in SETTINGS.values() if front_end in s.front_ends})


def settings_of(config_type) -> list[Setting]:
    """The table's settings among a config class's (or object's) fields, in field order."""
    return [f.metadata["setting"] for f in dataclasses.fields(config_type) if "setting" in f.metadata]


def check(config, names: Iterable[str] | None = None, of=None) -> None:
    """ConfigError for the first bad value among `names`, or among the settings of the class `of`
    (default: every setting among config's fields)."""
    chosen = [SETTINGS[n] for n in names] if names is not None else settings_of(of or config)
    for s in chosen:
        s.check(getattr(config, s.name))


# --- configurations as plain values ----------------------------------------------------------------------

def values(config) -> dict[str, Any]:
    """Every setting a config holds, by name (nested groups flattened), as plain Python values."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if "setting" in f.metadata:
            out[f.name] = _plain(f.metadata["setting"], value)
        elif f.name in NESTED.values():
            out.update(values(value))
    return out


def with_values(base, changes: Mapping[str, Any]):
    """`base` with settings changed by name (nested ones inside their group); names that are not settings of
    `base` are ignored. Construction validates what the dataclasses validate."""
    top = {name: value for name, value in changes.items() if _holds(base, name)}
    for group, attribute in NESTED.items():
        if hasattr(base, attribute):
            inner = {s.name: changes[s.name] for s in in_group(group) if s.name in changes}
            if inner:
                top[attribute] = dataclasses.replace(getattr(base, attribute), **inner)
    return dataclasses.replace(base, **top) if top else base


def to_dict(config, where: Callable[[Setting], bool] | None = None) -> dict[str, Any]:
    """JSON-ready settings (those `where` accepts, default all): nested groups as objects ({"page_size": 8,
    ..., "sampling": {"mode": ...}}). The format of a trace header's `config` and of the app's saved settings."""
    out = {}
    for f in dataclasses.fields(config):
        if "setting" in f.metadata and (where is None or where(f.metadata["setting"])):
            out[f.name] = _json(_plain(f.metadata["setting"], getattr(config, f.name)))
        elif f.name in NESTED.values():
            out[f.name] = to_dict(getattr(config, f.name), where)
    return out


def from_dict(data: Mapping[str, Any], base):
    """`base` with the settings `data` holds (to_dict's format); keys that are not settings are ignored."""
    flat = {}
    for key, value in data.items():
        if key in NESTED.values() and isinstance(value, Mapping):
            flat.update(value)
        elif key in SETTINGS and SETTINGS[key].group not in NESTED:
            flat[key] = _plain(SETTINGS[key], value)
    return with_values(base, flat)


def apply(base, given: Mapping[str, Any]):
    """`base` with the settings a command line or a request gives, by dest (flag and request names;
    None = not given). A switch of a string setting is a bool (--sample); giving a temperature implies
    sampling; giving a policy starts its parameters afresh. The command line and the server both build
    their configurations here, so one request means what the same flags mean."""
    changes: dict[str, Any] = {}
    for s in SETTINGS.values():
        value = given.get(s.dest)
        if value is not None and _holds_somewhere(base, s):
            changes[s.name] = s.from_front_end(value)
    for s in SETTINGS.values():
        if s.name in changes:
            if s.implies is not None:
                changes[s.implies[0]] = s.implies[1]
            for name in s.resets:
                changes.setdefault(name, SETTINGS[name].from_front_end(SETTINGS[name].default))
    return with_values(base, changes)


# --- command-line flags --------------------------------------------------------------------------------

def add_flags(parser, section: str | None = None, names: Iterable[str] | None = None, front_end: str | None = None,
              **defaults) -> None:
    """argparse flags for the settings of `section` (or the settings `names`) that have one: type, choices,
    metavar and help from the table, the help showing `front_end`'s default. Every flag defaults to None (not
    given: the caller's base configuration decides), except where a command passes its own default
    (compare's `page_size=16`)."""
    for s in SETTINGS.values():
        if s.flag and (s.name in names if names is not None else s.section == section):
            add_flag(parser, s, defaults.get(s.name), front_end)


def add_flag(parser, s: Setting, default=None, front_end: str | None = None) -> None:
    shown = s.shown_default(front_end) if default is None else default
    if s.switch is not None:  # no argument: the flag sets the setting (a string setting's switch is a bool)
        parser.add_argument(s.flag, dest=s.dest, action="store_const", const=s.switch if s.kind == "bool" else True,
                            help=s.help if s.switch is not False else f"do not {s.help}")
        return
    if s.kind == "params":
        parser.add_argument(s.flag, dest=s.dest, action="append", metavar=s.metavar, default=None,
                            help=f"{s.help}; repeat for several")
        return
    choices = s.choice_list() or None
    described = shown not in (None, "") and s.kind in ("int", "float", "str") and "default" not in s.help
    text = f"default: {shown}" if default is None and front_end in s.derived else f"default {shown}"
    parser.add_argument(s.flag, dest=s.dest, type={"int": int, "float": float}.get(s.kind), choices=choices,
                        default=default, metavar=None if choices else (s.metavar or None),
                        help=f"{s.help} ({text})" if described else s.help)


def _holds(config, name: str) -> bool:
    return name in SETTINGS and SETTINGS[name].group not in NESTED and any(
        f.name == name for f in dataclasses.fields(config))


def _holds_somewhere(config, s: Setting) -> bool:
    return hasattr(config, NESTED[s.group]) if s.group in NESTED else _holds(config, s.name)


def _plain(s: Setting, value: Any) -> Any:
    if s.kind == "params":
        return dict(value)
    if s.kind == "layers" and value is not None:
        return tuple(value)
    return value


def _json(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value
