"""Command-line options shared by the app and `pagevis run`: model, prompt, cache, policy, sampling.

The cache, decoding and sampling flags are made from the settings table (pagevis/settings.py): one flag per
setting, its type, bounds, choices and help from there. Every option defaults to None so that the app can
tell what the user asked for from what it should take from its own settings; `model_spec()`,
`prompt_text()` and `session_config()` fill in the defaults.
"""

from __future__ import annotations

import argparse
import os

from pagevis import settings
from pagevis.engine import ModelSpec, SessionConfig
from pagevis.kvcache import POLICIES, ConfigError
from pagevis.presets import DEFAULT_CONFIG, Preset, find_preset, preset_names

MODEL_NAMES = ("smollm2", "gemma3-270m", "synthetic")
MAX_TEXT_BYTES = 4 << 20  # a prompt or compare text; ~1M tokens, more than any cache here holds
SYNTHETIC_FLAGS = {"layers": "n_layers", "heads": "n_heads", "kv_heads": "n_kv_heads", "head_dim": "head_dim",
                   "model_seed": "seed", "sliding_window": "sliding_window", "global_every": "global_every"}
WINDOW_LIMITS = {"sliding_window": (0, 1 << 20), "global_every": (0, 1024)}


class UsageError(ValueError):
    """A bad command line: printed as one line, exit status 2."""


PATH_METAVARS = ("FILE", "DIR", "PATH")


class ArgumentParser(argparse.ArgumentParser):
    """argparse, but errors raise UsageError instead of printing usage and exiting, and a flag is only ever
    its whole name: with abbreviations `--record` would be read as `--record-layers`, and each flag added
    later would change what an old command line means."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs["allow_abbrev"] = False
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        raise UsageError(f"{message} (see {self.prog} --help)")

    def parse_known_args(self, args=None, namespace=None):
        """As argparse's, and a FILE or DIR given as "" is refused: `--html ""` is a mistake, not "no page"."""
        parsed, extras = super().parse_known_args(args, namespace)
        for action in self._actions:
            if action.metavar in PATH_METAVARS and getattr(parsed, action.dest, None) == "":
                name = "/".join(action.option_strings) or action.metavar
                self.error(f"{name}: an empty path; give a file or folder name")
        return parsed, extras


def add_model_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("model")
    group.add_argument("--model", metavar="MODEL",
                       help="smollm2 (the shipped SmolLM2-135M-Instruct, default), gemma3-270m (Gemma 3 270M, "
                            "the pagevis[gemma] extra), synthetic (seeded random weights, fast), or the path of a "
                            ".gguf file (llama, qwen2, qwen3, gemma3)")
    group.add_argument("--layers", type=int, metavar="N", help="synthetic model: layers (default 4)")
    group.add_argument("--heads", type=int, metavar="N", help="synthetic model: query heads (default 8)")
    group.add_argument("--kv-heads", type=int, metavar="N", help="synthetic model: KV heads, a divisor of --heads (default 2)")
    group.add_argument("--head-dim", type=int, metavar="N", help="synthetic model: head dimension, even (default 32)")
    group.add_argument("--model-seed", type=int, metavar="N", help="synthetic model: weight seed (default 0)")
    group.add_argument("--sliding-window", type=int, metavar="W",
                       help="synthetic model: local layers attend to the last W positions and free older pages "
                            "(a hybrid cache, as Gemma 3's; default 0, none)")
    group.add_argument("--global-every", type=int, metavar="K",
                       help="synthetic model with --sliding-window: every K-th layer keeps every token (Gemma 3: "
                            "6); default 0, every layer local")


def add_prompt_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(settings.SECTIONS["prompt"])
    source = group.add_mutually_exclusive_group()
    source.add_argument("--prompt", metavar="TEXT", help="the prompt (default: a sample prompt about paging)")
    source.add_argument("--prompt-file", metavar="FILE", help="read the prompt from a UTF-8 text file")
    settings.add_flags(group, "prompt")


def add_cache_options(parser: argparse.ArgumentParser, front_end: str | None = None) -> None:
    for section in ("cache", "tiers"):
        settings.add_flags(parser.add_argument_group(settings.SECTIONS[section]), section, front_end=front_end)


def add_decoding_options(parser: argparse.ArgumentParser, front_end: str | None = None) -> None:
    settings.add_flags(parser.add_argument_group(settings.SECTIONS["decoding"]), "decoding", front_end=front_end)


def add_report_options(parser: argparse.ArgumentParser, files: str, progress: str) -> None:
    """--no-files, --json and --quiet, as the commands that write files and print a table (compare, eval) name them."""
    parser.add_argument("--no-files", action="store_true", help=f"write {files}")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    parser.add_argument("--quiet", action="store_true", help=progress)


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

def model_name(args: argparse.Namespace) -> str | None:
    """--model, else the model the --preset runs on (Gemma's preset), else None (the default model)."""
    chosen = preset(args)
    return getattr(args, "model", None) or (chosen.model if chosen is not None else None)


def model_spec(args: argparse.Namespace) -> ModelSpec:
    name = model_name(args) or "smollm2"
    layout = {field: getattr(args, flag) for flag, field in SYNTHETIC_FLAGS.items() if getattr(args, flag) is not None}
    if name == "synthetic":
        return synthetic_spec(layout)
    if layout:
        flags = ", ".join("--" + f.replace("_", "-") for f in SYNTHETIC_FLAGS if getattr(args, f) is not None)
        raise UsageError(f"{flags} only apply to --model synthetic")
    if name == "smollm2":
        return ModelSpec(kind="smollm2")
    if name == "gemma3-270m":
        from pagevis.model import ModelLoadError
        from pagevis.model.locate import named_model_path

        try:
            return ModelSpec(kind="gguf", path=str(named_model_path(name)))
        except ModelLoadError as error:
            raise UsageError(f"--model {name}: {error}") from None
    if not os.path.isfile(name):
        raise UsageError(f"--model {name}: no such file (use smollm2, gemma3-270m, synthetic, or the path of a "
                         ".gguf file)")
    from pathlib import Path

    from pagevis.model import ModelLoadError
    from pagevis.model.gguf_file import check_gguf_file

    try:  # before a window opens on it or a server starts
        check_gguf_file(Path(name))
    except ModelLoadError as error:
        raise UsageError(f"--model: {error}") from None
    return ModelSpec(kind="gguf", path=os.path.abspath(name))


def synthetic_spec(layout: dict[str, int]) -> ModelSpec:
    """The synthetic model's spec; UsageError naming the flag if a size is out of range or the weights would
    not fit in the memory available now."""
    from pagevis.model.config import LIMITS
    from pagevis.model.synthetic import synthetic_config
    from pagevis.system_memory import available_bytes, fits, gib

    for flag, field in SYNTHETIC_FLAGS.items():
        low, high = (0, 2**32 - 1) if field == "seed" else WINDOW_LIMITS.get(field) or (1, LIMITS[field])
        if field in layout:
            check_range(f"--{flag.replace('_', '-')}", layout[field], low, high)
    spec = ModelSpec(kind="synthetic", **layout)
    try:
        config = synthetic_config(spec.n_layers, spec.n_heads, spec.n_kv_heads, spec.head_dim, None, 256, None,
                                  10000.0, 1e-5, 2048)
    except ConfigError as error:
        flag = model_flag(error.field) or ("--heads x --head-dim" if error.field in ("d_model", "d_ff") else "")
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


def parse_policy_item(item: str, flag: str) -> tuple[str, dict[str, object]]:
    """`NAME` or `NAME:KEY=VALUE[:KEY=VALUE ...]` (a policy with some of its parameters set) as (name, params);
    UsageError naming the flag for a malformed KEY=VALUE (the name is the caller's to check)."""
    name, *params = item.strip().split(":")
    return name, dict(parse_param(p, flag) for p in params)


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


def parse_layers(text: str) -> str | tuple[int, ...]:
    """--record-layers: "all", "none", or layer numbers (the settings table turns "all"/"none" into None/())."""
    if text.strip().lower() in ("all", "none"):
        return text.strip().lower()
    return tuple(parse_int_list(text, "--record-layers", "all, none, or layer numbers like 0,15,29"))


def given_settings(args: argparse.Namespace) -> dict:
    """The settings the command line gives, by dest (None = not given), as the table's apply() takes them."""
    given = {s.dest: getattr(args, s.dest, None) for s in settings.SETTINGS.values() if s.flag}
    if given.get("policy_params") is not None:
        given["policy_params"] = dict(parse_param(p) for p in given["policy_params"])
    if given.get("record_layers") is not None:
        given["record_layers"] = parse_layers(given["record_layers"])
    return given


def session_config(args: argparse.Namespace, base: SessionConfig | None = None) -> SessionConfig:
    """A SessionConfig from the options; what was not given comes from `base`, else the --preset's (first)
    session, else the settings table's defaults (the same as the app's)."""
    chosen = preset(args)
    defaults = base or (chosen.a if chosen is not None else DEFAULT_CONFIG)
    if getattr(args, "special", None) and getattr(args, "chat", None) is not False:
        raise UsageError("--special only applies with --no-chat (in the chat template the prompt is always text)")
    config = settings.apply(defaults, given_settings(args))
    check_cache(config)
    return config


def check_cache(config: SessionConfig) -> None:
    """Validate the cache settings and policy parameters now, before a model loads or a window opens
    (the head layout does not change what is valid here)."""
    config.check()


def session_options_given(args: argparse.Namespace) -> bool:
    """Did the user set any cache or decoding option (the app keeps its own settings otherwise)?"""
    return getattr(args, "preset", None) is not None or any(v is not None for v in given_settings(args).values())


def describe_config_error(error: ConfigError, args: argparse.Namespace | None = None) -> str:
    """The error, prefixed with the flag that set the bad value, if this command has that flag and it was given
    (a value that came from a default or a preset is described without blaming a flag)."""
    s = settings.by_path(error.field)
    policy_param = s is None and "." in error.field and error.field.split(".")[0] in POLICIES
    if policy_param:
        s = settings.setting("policy_params")
    flag = (s.flag or None) if s is not None else model_flag(error.field)
    dest = s.dest if s is not None else (flag or "").lstrip("-").replace("-", "_")
    if flag and args is not None and getattr(args, dest, None) is None:
        if policy_param:
            return (f"{error} (the policy's default; set it with {flag}, or give the cache more room with "
                    f"--max-pages or --page-size)") if hasattr(args, dest) else str(error)
        flag = None
    return f"{flag}: {error}" if flag else str(error)


def model_flag(field: str) -> str | None:
    """The flag that sets a synthetic model's size a ConfigError names (`n_kv_heads` -> `--kv-heads`)."""
    flag = next((flag for flag, name in SYNTHETIC_FLAGS.items() if name == field), None)
    return "--" + flag.replace("_", "-") if flag else None
