"""Command-line options shared by the app and `pagevis run`: model, prompt, cache, policy, sampling.

Every option defaults to None so that the app can tell what the user asked for from what it should take
from its own settings; `model_spec()`, `prompt_text()` and `session_config()` fill in the defaults.
"""

from __future__ import annotations

import argparse
import os

from ..decoding import ModelSpec, SamplingConfig, SessionConfig
from ..engine import POLICIES, ConfigError
from ..presets import DEFAULT_CONFIG, Preset, find_preset, preset_names

MODEL_NAMES = ("smollm2", "synthetic")
MAX_TEXT_BYTES = 4 << 20  # a prompt or compare text; ~1M tokens, more than any cache here holds
SYNTHETIC_FLAGS = {"layers": "n_layers", "heads": "n_heads", "kv_heads": "n_kv_heads", "head_dim": "head_dim",
                   "model_seed": "seed"}
# Engine field names -> the flag that sets them, so a ConfigError can name what the user typed.
FLAG_OF_FIELD = {
    "page_size": "--page-size", "max_pages": "--max-pages", "dtype": "--dtype", "policy": "--policy",
    "max_new_tokens": "--max-tokens", "sampling.temperature": "--temperature", "sampling.top_k": "--top-k",
    "sampling.top_p": "--top-p", "sampling.seed": "--seed", "record_layers": "--record-layers",
    "n_layers": "--layers", "n_heads": "--heads", "n_kv_heads": "--kv-heads", "head_dim": "--head-dim",
    "disk_pages": "--disk-pages", "swap_dir": "--swap-dir", "select": "--select", "select_pages": "--select-pages",
}


class UsageError(ValueError):
    """A bad command line: printed as one line, exit status 2."""


class ArgumentParser(argparse.ArgumentParser):
    """argparse, but errors raise UsageError instead of printing usage and exiting."""

    def error(self, message: str):
        raise UsageError(f"{self.prog}: {message} (see {self.prog} --help)")


def add_model_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("model")
    group.add_argument("--model", metavar="MODEL",
                       help="smollm2 (the shipped SmolLM2-135M-Instruct, default), synthetic (seeded random "
                            "weights, fast), or the path of a Llama-family .gguf file")
    group.add_argument("--layers", type=int, metavar="N", help="synthetic model: layers (default 4)")
    group.add_argument("--heads", type=int, metavar="N", help="synthetic model: query heads (default 8)")
    group.add_argument("--kv-heads", type=int, metavar="N", help="synthetic model: KV heads, a divisor of --heads (default 2)")
    group.add_argument("--head-dim", type=int, metavar="N", help="synthetic model: head dimension, even (default 32)")
    group.add_argument("--model-seed", type=int, metavar="N", help="synthetic model: weight seed (default 0)")


def add_prompt_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("prompt")
    source = group.add_mutually_exclusive_group()
    source.add_argument("--prompt", metavar="TEXT", help="the prompt (default: a sample prompt about paging)")
    source.add_argument("--prompt-file", metavar="FILE", help="read the prompt from a UTF-8 text file")
    group.add_argument("--no-chat", dest="chat", action="store_const", const=False,
                       help="feed the prompt as raw text instead of wrapping it in the model's chat template")
    group.add_argument("--special", action="store_const", const=True,
                       help="with --no-chat: control-token text in the prompt (e.g. <|im_end|>) becomes the control "
                            "token, like llama.cpp's --special (default: the prompt is always plain text)")


def add_cache_options(parser: argparse.ArgumentParser) -> None:
    defaults = DEFAULT_CONFIG
    group = parser.add_argument_group("KV cache")
    group.add_argument("--page-size", type=int, metavar="N", help=f"tokens per page (default {defaults.page_size})")
    group.add_argument("--max-pages", type=int, metavar="N",
                       help=f"pages per layer; capacity = pages x page size (default {defaults.max_pages})")
    group.add_argument("--dtype", choices=("float32", "float16"), help=f"K/V storage (default {defaults.dtype})")
    group.add_argument("--policy", choices=tuple(POLICIES), help=f"eviction policy (default {defaults.policy})")
    group.add_argument("--policy-param", action="append", metavar="KEY=VALUE", default=None,
                       help="a policy parameter, e.g. n_sink=4 (sinks), recent=32 (h2o), seed=1 (random); "
                            "repeat for several")
    tiers = parser.add_argument_group("disk tier and page selection (docs/memory.md)")
    tiers.add_argument("--disk-pages", type=int, metavar="N",
                       help="pages per layer on disk (0 = no disk tier, default): capacity = N x page size, and the "
                            "--max-pages RAM frames cache pages (least recently read leaves), written to disk once")
    tiers.add_argument("--swap-dir", metavar="DIR",
                       help="folder for the swap files (default: the system's temporary folder); a private "
                            "subfolder is created there and removed on exit, error or Ctrl-C")
    tiers.add_argument("--select", choices=("all", "quest"),
                       help="pages a decode step reads: all (exact: disk pages in batches, merged by log-sum-exp; "
                            "default) or quest (the --select-pages pages with the highest key bounds)")
    tiers.add_argument("--select-pages", type=int, metavar="K",
                       help=f"quest: pages read per step, the newest always among them (default {defaults.select_pages})")


def add_decoding_options(parser: argparse.ArgumentParser) -> None:
    defaults = DEFAULT_CONFIG
    group = parser.add_argument_group("decoding")
    group.add_argument("--max-tokens", type=int, metavar="N",
                       help=f"stop after N generated tokens (default {defaults.max_new_tokens})")
    group.add_argument("--sample", action="store_const", const=True,
                       help="sample instead of greedy decoding (implied by --temperature, --top-k, --top-p)")
    group.add_argument("--temperature", type=float, metavar="T", help=f"sampling temperature (default {defaults.sampling.temperature})")
    group.add_argument("--top-k", type=int, metavar="N", help="keep the k most likely tokens (0 = all, default)")
    group.add_argument("--top-p", type=float, metavar="P", help="nucleus sampling threshold (1 = off, default)")
    group.add_argument("--seed", type=int, metavar="N", help="sampling seed (default 0)")
    group.add_argument("--oracle", action="store_const", const=True,
                       help="also run a full cache alongside and report KL, top-1 agreement and lost attention")
    group.add_argument("--record-layers", metavar="LIST",
                       help="layers whose attention the records keep: all (default), none, or e.g. 0,15,29")


def add_preset_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", metavar="NAME",
                        help="start from a named demo preset (prompt, cache, policy); flags given too override it. "
                             "Presets: " + "; ".join(preset_names()))


def add_session_options(parser: argparse.ArgumentParser) -> None:
    add_preset_option(parser)
    add_model_options(parser)
    add_prompt_options(parser)
    add_cache_options(parser)
    add_decoding_options(parser)


# --- turning options into objects ------------------------------------------------------------------

def model_spec(args: argparse.Namespace) -> ModelSpec:
    name = args.model or "smollm2"
    layout = {field: getattr(args, flag) for flag, field in SYNTHETIC_FLAGS.items() if getattr(args, flag) is not None}
    if name == "synthetic":
        return synthetic_spec(layout)
    if layout:
        flags = ", ".join("--" + f.replace("_", "-") for f in SYNTHETIC_FLAGS if getattr(args, f) is not None)
        raise UsageError(f"{flags} only apply to --model synthetic")
    if name == "smollm2":
        return ModelSpec(kind="smollm2")
    if not os.path.isfile(name):
        raise UsageError(f"--model {name}: no such file (use smollm2, synthetic, or the path of a .gguf file)")
    return ModelSpec(kind="gguf", path=os.path.abspath(name))


def synthetic_spec(layout: dict[str, int]) -> ModelSpec:
    """The synthetic model's spec; UsageError naming the flag if a size is out of range or the weights would
    not fit in the memory available now."""
    from ..model.config import LIMITS
    from ..model.synthetic import synthetic_config
    from ..system_memory import available_bytes, fits, gib

    for flag, field in SYNTHETIC_FLAGS.items():
        low, high = (0, 2**32 - 1) if field == "seed" else (1, LIMITS[field])
        if field in layout:
            check_range(f"--{flag.replace('_', '-')}", layout[field], low, high)
    spec = ModelSpec(kind="synthetic", **layout)
    try:
        config = synthetic_config(spec.n_layers, spec.n_heads, spec.n_kv_heads, spec.head_dim, None, 256, None,
                                  10000.0, 1e-5, 2048)
    except ConfigError as error:
        flag = FLAG_OF_FIELD.get(error.field, "--heads x --head-dim" if error.field in ("d_model", "d_ff") else "")
        raise UsageError(f"{flag}: {error}" if flag else str(error)) from None
    if not fits(config.weight_bytes()):
        raise UsageError(f"--layers {spec.n_layers} --heads {spec.n_heads} --head-dim {spec.head_dim}: the synthetic "
                         f"model's weights would take {gib(config.weight_bytes())}, more than the memory available "
                         f"now ({gib(available_bytes() or 0)})")
    return spec


def check_range(flag: str, value, low: int, high: int) -> None:
    """UsageError naming the flag unless low <= value <= high."""
    if not low <= value <= high:
        raise UsageError(f"{flag} {value}: must be from {low} to {high}")


def check_writable(path: str, flag: str, suffix: str | None = None) -> None:
    """Refuse an output path that cannot be written, before any work starts (the file is not created)."""
    import tempfile

    if suffix and not path.lower().endswith(suffix):
        raise UsageError(f"{flag} {path}: the file is written as {suffix[1:].upper()}; give a name ending in {suffix}")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise UsageError(f"{flag} {path}: no such folder {folder}")
    if os.path.isdir(path):
        raise UsageError(f"{flag} {path}: is a folder")
    if os.path.exists(path) and not os.path.isfile(path):
        raise UsageError(f"{flag} {path}: not a regular file (pagevis writes a new file and renames it into place)")
    if os.path.exists(path) and not os.access(path, os.W_OK):
        raise UsageError(f"{flag} {path}: the file is not writable")
    try:
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".pagevis-probe-"):
            pass
    except OSError as error:
        raise UsageError(f"{flag} {path}: cannot write in {folder} ({error.strerror})") from None


def preset(args: argparse.Namespace) -> Preset | None:
    """The preset named by --preset, or None; UsageError naming the presets if there is no such one."""
    name = getattr(args, "preset", None)
    if name is None:
        return None
    try:
        return find_preset(name)
    except ConfigError as error:
        raise UsageError(f"--preset {name!r}: {error.allowed}") from None


def prompt_text(args: argparse.Namespace) -> str | None:
    """The prompt the user gave (or their preset's), or None. An empty prompt or file is a UsageError."""
    if getattr(args, "prompt_file", None):
        text = read_text_file(args.prompt_file, "--prompt-file")
        if not text.strip():
            raise UsageError(f"--prompt-file {args.prompt_file}: the file is empty; the prompt needs some text")
        return text
    if getattr(args, "prompt", None) is None and preset(args) is not None:
        return preset(args).prompt_text()
    text = getattr(args, "prompt", None)
    if text is not None:
        if not text.strip():
            raise UsageError("--prompt is empty: give some text (or leave --prompt out for the sample prompt)")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as error:  # undecodable bytes on the command line arrive as lone surrogates
            raise UsageError(f"--prompt: not valid UTF-8 text (byte {ord(text[error.start]) - 0xDC00:#04x} at "
                             f"character {error.start})") from None
    return text


def read_text_file(path: str, flag: str, max_bytes: int = MAX_TEXT_BYTES) -> str:
    """A UTF-8 text file (or a pipe such as /dev/stdin) of at most `max_bytes`, read no further: a device like
    /dev/zero never ends. UsageError if it cannot be read, is larger or is not UTF-8."""
    try:
        with open(path, "rb") as handle:
            raw = handle.read(max_bytes + 1)
    except FileNotFoundError:
        raise UsageError(f"{flag} {path}: no such file") from None
    except OSError as error:
        raise UsageError(f"{flag} {path}: {error.strerror}") from None
    if len(raw) > max_bytes:
        raise UsageError(f"{flag} {path}: larger than {max_bytes >> 20} MiB; give a shorter text")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise UsageError(f"{flag} {path}: not UTF-8 text (byte {raw[error.start]:#04x} at offset {error.start})") from None


def parse_param(text: str, flag: str = "--policy-param") -> tuple[str, object]:
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise UsageError(f"{flag} {text!r}: expected KEY=VALUE, e.g. n_sink=4")
    return key.strip(), parse_value(raw.strip())


def parse_value(raw: str) -> object:
    for convert in (int, float):
        try:
            return convert(raw)
        except ValueError:
            pass
    return None if raw.lower() in ("none", "null") else raw


def parse_int_list(text: str, flag: str, expected: str) -> list[int]:
    """Comma-separated integers, or UsageError naming the flag and what was `expected` (also when empty)."""
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        values = []
    if not values:
        raise UsageError(f"{flag} {text!r}: expected {expected}")
    return values


def parse_layers(text: str | None) -> tuple[int, ...] | None:
    if text is None or text.strip().lower() == "all":
        return None
    if text.strip().lower() == "none":
        return ()
    return tuple(parse_int_list(text, "--record-layers", "all, none, or layer numbers like 0,15,29"))


def session_config(args: argparse.Namespace, base: SessionConfig | None = None) -> SessionConfig:
    """A SessionConfig from the options; what was not given comes from `base`, else the --preset's (first)
    session, else the demo defaults (pagevis.presets, the same as the app's)."""
    chosen = preset(args)
    defaults = base or (chosen.a if chosen is not None else DEFAULT_CONFIG)
    sampling = defaults.sampling
    sampled = args.sample or any(getattr(args, f) is not None for f in ("temperature", "top_k", "top_p"))
    sampling = SamplingConfig(
        mode="sample" if sampled else "greedy",
        temperature=_given(args.temperature, sampling.temperature), top_k=_given(args.top_k, sampling.top_k),
        top_p=_given(args.top_p, sampling.top_p), seed=_given(args.seed, sampling.seed))
    if getattr(args, "special", None) and args.chat is not False:
        raise UsageError("--special only applies with --no-chat (in the chat template the prompt is always text)")
    params = dict(parse_param(p) for p in (args.policy_param or []))
    policy = _given(args.policy, defaults.policy)
    if args.policy is None and not params:
        params = dict(defaults.policy_params)
    config = SessionConfig(
        page_size=_given(args.page_size, defaults.page_size), max_pages=_given(args.max_pages, defaults.max_pages),
        dtype=_given(args.dtype, defaults.dtype), policy=policy, policy_params=params,
        max_new_tokens=_given(args.max_tokens, defaults.max_new_tokens), sampling=sampling,
        oracle=bool(_given(args.oracle, defaults.oracle)), chat=_given(args.chat, defaults.chat),
        special=bool(getattr(args, "special", None)),
        disk_pages=_given(getattr(args, "disk_pages", None), defaults.disk_pages),
        swap_dir=_given(getattr(args, "swap_dir", None), defaults.swap_dir),
        select=_given(getattr(args, "select", None), defaults.select),
        select_pages=_given(getattr(args, "select_pages", None), defaults.select_pages),
        record_layers=parse_layers(args.record_layers) if args.record_layers is not None else defaults.record_layers)
    check_cache(config)
    return config


def check_cache(config: SessionConfig) -> None:
    """Validate the cache settings and policy parameters now, before a model loads or a window opens
    (the head layout does not change what is valid here)."""
    config.check()


def session_options_given(args: argparse.Namespace) -> bool:
    """Did the user set any cache or decoding option (the app keeps its own settings otherwise)?"""
    names = ("preset", "page_size", "max_pages", "dtype", "policy", "policy_param", "max_tokens", "sample", "temperature",
             "top_k", "top_p", "seed", "oracle", "record_layers", "chat", "special", "disk_pages", "swap_dir",
             "select", "select_pages")
    return any(getattr(args, name, None) is not None for name in names)


def _given(value, default):
    return default if value is None else value


def describe_config_error(error: ConfigError, args: argparse.Namespace | None = None) -> str:
    """The error, prefixed with the flag that set the bad value, if this command has that flag and it was given
    (a value that came from a default or a preset is described without blaming a flag)."""
    flag = FLAG_OF_FIELD.get(error.field)
    policy_param = flag is None and "." in error.field and error.field.split(".")[0] in POLICIES
    if policy_param:
        flag = "--policy-param"
    dest = {"--policy-param": "policy_param"}.get(flag, (flag or "").lstrip("-").replace("-", "_"))
    if flag and args is not None and getattr(args, dest, None) is None:
        if policy_param:
            return (f"{error} (the policy's default; set it with --policy-param, or give the cache more room with "
                    f"--max-pages or --page-size)") if hasattr(args, "policy_param") else str(error)
        flag = None
    return f"{flag}: {error}" if flag else str(error)
