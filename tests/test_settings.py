"""The settings table: each setting declared once, and every front end made from it agrees with it."""

from __future__ import annotations

import argparse
import dataclasses
import json

import pytest

from pagevis import settings
from pagevis.cli import options
from pagevis.engine import SamplingConfig, SessionConfig
from pagevis.engine.batch import MAX_CHUNK, BatchConfig
from pagevis.kvcache import CacheSettings, ConfigError
from pagevis.presets import DEFAULT_CONFIG, PRESETS
from pagevis.serve.requests import CacheSettings as CacheRequest
from pagevis.serve.requests import SessionRequest
from pagevis.serve.sessions import session_config as request_config
from pagevis.serve.settings import ServeSettings
from pagevis.simserver.run import ServerConfig

CONFIGS = (CacheSettings, SessionConfig, SamplingConfig, BatchConfig, ServeSettings)
OWN = {CacheSettings: "cache", SessionConfig: "session", SamplingConfig: "sampling", BatchConfig: "batch",
       ServeSettings: "serve"}
# Fields of the front ends' own dataclasses that are not user settings (the model, the request defaults, ...).
NOT_SETTINGS = {ServeSettings: {"model_spec", "defaults", "full_cache", "expiry_interval"},
                ServerConfig: {"reservation", "step_seconds", "realtime", "label"}}


def run_args(*flags: str) -> argparse.Namespace:
    parser = options.ArgumentParser(prog="pagevis run")
    options.add_session_options(parser)
    return parser.parse_args(list(flags))


def test_each_config_field_is_one_setting_of_the_table():
    """Every field of the config dataclasses (but the nested sampling and the front ends' own fields) is tagged
    with its setting, its default is the table's default for that dataclass's front end, each setting is
    owned by the dataclass of its group, and every setting of the table is some dataclass's field."""
    owners, held = {}, set()
    for config in (*CONFIGS, ServerConfig):
        for f in dataclasses.fields(config):
            if f.name in settings.NESTED.values() or f.name in NOT_SETTINGS.get(config, ()):
                continue
            assert "setting" in f.metadata, f"{config.__name__}.{f.name} is not declared with field_for()"
            s, front_end = f.metadata["setting"], f.metadata["front_end"]
            assert f.name == s.name, f"{config.__name__}.{f.name} holds the setting {s.name}"
            default = f.default_factory() if f.default is dataclasses.MISSING else f.default
            assert default == s.default_for(front_end), f"{config.__name__}.{f.name}"
            held.add(s.name)
            if OWN.get(config) == s.group:
                owners[s.name] = config
    assert held == set(settings.SETTINGS) == set(owners), "a setting of the table is the field of no config"


def test_front_end_defaults_are_the_tables_and_the_duplicates_are_gone():
    """The batching settings once declared three times agree now: each front end's default is the table's."""
    server, served, batch = ServerConfig(), ServeSettings(), BatchConfig()
    for name in ("max_seqs", "token_budget", "pool_pages", "max_chunk"):
        s = settings.setting(name)
        assert getattr(server, name) == s.default_for("server") and getattr(served, name) == s.default_for("serve")
        if hasattr(batch, name):
            assert getattr(batch, name) == s.default
    assert MAX_CHUNK == settings.setting("max_chunk").default
    assert (server.max_seqs, server.token_budget, server.max_chunk, server.pool_pages) == (8, 512, 256, 256)
    assert (served.max_seqs, served.token_budget, served.max_chunk, served.pool_pages) == (16, 256, 512, None)
    assert set(settings.FRONT_ENDS) >= {f for s in settings.SETTINGS.values() for f in (*s.front_ends, *s.derived)}
    # the Server window's requests: its table defaults (policy none, sampled, pages of 16), its preset's capacity
    from pagevis.presets import SERVER_PRESETS

    for preset in SERVER_PRESETS:
        config = preset.session_config()
        assert (config.policy, config.sampling.mode, config.page_size) == ("none", "sample", 16)
        assert config.capacity >= preset.capacity and config.max_new_tokens == preset.workload.max_new_tokens


@pytest.mark.parametrize("command, front_end", [("run", "run"), ("serve", "serve")])
def test_help_shows_each_front_ends_defaults(command, front_end):
    """What `pagevis serve --help` says a default is, the table says, and the server starts from it."""
    from pagevis.cli.main import command_parser

    parser = command_parser()
    sub = parser._subparsers._group_actions[0].choices[command]
    shown = {a.dest: a.help for a in sub._actions}
    for s in settings.SETTINGS.values():
        if s.dest in shown and s.flag and s.switch is None and s.kind in ("int", "float", "str"):
            value = s.shown_default(front_end)
            if value not in (None, "") and "default" not in s.help:
                assert f"default{':' if front_end in s.derived else ''} {value})" in " ".join(shown[s.dest].split()), \
                    (command, s.name, shown[s.dest])
    if command == "serve":  # every setting of the server has its flag there, not given unless typed
        for s in settings.in_group("serve"):
            assert s.dest in shown and sub._option_string_actions[s.flag].default is None, s.name
        assert "eviction policy (default none)" in shown["policy"] and "(default 16)" in shown["page_size"]
        assert "(default 256)" in shown["token_budget"] and "--max-cache-tokens" in shown["max_pages"]


def test_the_table_is_complete_and_unambiguous():
    table = list(settings.SETTINGS.values())
    flags = [s.flag for s in table if s.flag]
    dests = [s.dest for s in table]
    assert len(set(flags)) == len(flags) and len(set(dests)) == len(dests)
    for s in table:
        assert s.help and s.group in settings.GROUPS and s.section in settings.SECTIONS, s.name
        assert s.kind in ("int", "float", "str", "bool", "params", "layers"), s.name
        if s.kind in ("int", "float"):
            assert s.low <= (s.default if s.default is not None else s.low) <= s.high, s.name
        if s.app:
            assert s.label, f"{s.name} is a control of the app: it needs a label"
        s.check(s.default)


def test_one_set_of_defaults_and_presets_override_it():
    assert SessionConfig() == DEFAULT_CONFIG == PRESETS[0].a
    assert (DEFAULT_CONFIG.page_size, DEFAULT_CONFIG.max_pages, DEFAULT_CONFIG.max_new_tokens) == (8, 12, 192)
    assert options.session_config(run_args()) == DEFAULT_CONFIG
    # the server's requests: a full cache of --max-cache-tokens (4096) in pages of 16, nothing evicted
    served = request_config(ServeSettings(), {})
    assert (served.policy, served.page_size, served.max_pages) == ("none", 16, 256)
    assert served == dataclasses.replace(DEFAULT_CONFIG, policy="none", page_size=16, max_pages=256)
    for preset in PRESETS:
        for config in (preset.a, preset.b):
            if config is not None:
                changed = {k for k, v in settings.values(config).items() if v != settings.values(DEFAULT_CONFIG)[k]}
                # chat: Gemma 3 270M's preset feeds a base model its passage as plain text; policy_params: a
                # preset's policy with its own parameters (the page-level presets' compress_every and n_sink)
                allowed = {"policy", "policy_params", "page_size", "max_pages", "oracle", "chat"}
                assert changed <= allowed, (preset.name, changed)


@pytest.mark.parametrize("name, value, words", [
    ("page_size", 0, "page_size = 0 is not allowed: an integer from 1 to 4096"),
    ("dtype", "int3", "dtype = 'int3' is not allowed: one of float32, float16, int8, int4, int2"),
    ("temperature", 0.0, "sampling.temperature = 0.0 is not allowed: a number in (0, 10]"),
    ("top_p", 1.5, "sampling.top_p = 1.5 is not allowed: a number in (0, 1]"),
    ("mode", "beam", "sampling.mode = 'beam' is not allowed: one of greedy, sample"),
    ("swap_dir", "", "swap_dir = '' is not allowed: a folder path"),
    ("max_seqs", 257, "max_seqs = 257 is not allowed: an integer from 1 to 256"),
])
def test_a_bad_value_names_the_field_the_value_and_what_is_allowed(name, value, words):
    with pytest.raises(ConfigError) as caught:
        settings.setting(name).check(value)
    assert str(caught.value) == words
    assert caught.value.field == settings.setting(name).path


def test_every_flag_comes_from_the_table():
    parser = options.ArgumentParser(prog="pagevis run")
    options.add_session_options(parser)
    actions = {a.dest: a for a in parser._actions}
    for s in settings.SETTINGS.values():
        if s.flag and s.group not in ("batch", "serve"):
            action = actions[s.dest]
            assert action.option_strings == [s.flag] and action.default is None
            assert s.help.removeprefix("do not ") in action.help or action.help.endswith(s.help)
            if s.choices and s.switch is None:
                assert tuple(action.choices) == s.choice_list()


def test_the_cli_and_a_request_build_the_same_configuration():
    flags = ["--page-size", "4", "--max-pages", "6", "--policy", "h2o", "--policy-param", "recent=8",
             "--temperature", "0.5", "--seed", "3", "--max-tokens", "20", "--no-chat", "--record-layers", "0,1",
             "--oracle", "--dtype", "int8"]
    request = {"page_size": 4, "max_pages": 6, "policy": "h2o", "policy_params": {"recent": 8}, "temperature": 0.5,
               "seed": 3, "max_tokens": 20, "chat": False, "record_layers": [0, 1], "oracle": True, "dtype": "int8"}
    from_flags = options.session_config(run_args(*flags))
    assert from_flags == request_config(ServeSettings(), request)
    assert from_flags.sampling.mode == "sample"  # a temperature implies sampling, in both
    # the server's flags are its requests' defaults; a request's policy starts its parameters afresh
    served = ServeSettings(defaults=from_flags, full_cache=False)
    assert request_config(served, {}) == from_flags
    assert dict(request_config(served, {"policy": "h2o"}).policy_params) == {}
    assert request_config(served, {"sample": False}).sampling.mode == "greedy"


def test_request_models_are_the_requestable_settings():
    requestable = {s.dest for s in settings.SETTINGS.values() if s.request}
    cache = {s.dest for s in settings.in_group("cache") if s.request}
    assert set(CacheRequest.model_fields) == cache
    assert set(SessionRequest.model_fields) == requestable | {"prompt"}
    assert SessionRequest.model_fields["max_tokens"].description.startswith(settings.setting("max_new_tokens").help)
    assert SessionRequest.model_fields["sample"].annotation == bool | None


def test_json_form_round_trips():
    config = dataclasses.replace(DEFAULT_CONFIG, policy="sinks", policy_params={"n_sink": 2}, record_layers=(0, 3),
                                 sampling=SamplingConfig(mode="sample", temperature=0.25, seed=9), swap_dir="/tmp")
    data = json.loads(json.dumps(settings.to_dict(config)))
    assert data["sampling"]["temperature"] == 0.25 and data["record_layers"] == [0, 3]
    assert settings.from_dict(data, SessionConfig()) == config
    app = settings.to_dict(config, where=lambda s: s.app)
    assert "swap_dir" not in app and "record_layers" not in app and app["sampling"]["seed"] == 9


def test_the_server_flags_are_its_requests_defaults():
    """`pagevis serve`'s cache and decoding flags (all of them, the disk tier's too) set what a request that
    does not set them gets."""
    from pagevis.cli.main import command_parser
    from pagevis.cli.serve import settings_from_args

    args = command_parser().parse_args(["serve", "--model", "synthetic", "--disk-pages", "16", "--max-pages", "4",
                                        "--select", "quest", "--max-tokens", "7", "--seed", "2"])
    served = settings_from_args(args)
    config = request_config(served, {"page_size": 4})
    assert (config.disk_pages, config.max_pages, config.select, config.page_size) == (16, 4, "quest", 4)
    assert (config.max_new_tokens, config.sampling.seed) == (7, 2)
