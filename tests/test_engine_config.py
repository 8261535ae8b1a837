"""Every invalid configuration raises ConfigError naming the field, the value and what is allowed."""

import pytest

from pagevis.kvcache import CacheConfig, ConfigError, POLICIES, policy_params

BASE = dict(page_size=16, max_pages=8, n_layers=2, n_heads=6, n_kv_heads=3, head_dim=16)


@pytest.mark.parametrize(
    "change, field, allowed",
    [
        ({"page_size": 0}, "page_size", "integer from 1"),
        ({"page_size": -4}, "page_size", "integer from 1"),
        ({"page_size": 2.5}, "page_size", "an integer"),
        ({"page_size": "16"}, "page_size", "an integer"),
        ({"page_size": True}, "page_size", "an integer"),
        ({"page_size": 10**9}, "page_size", "to 4096"),
        ({"max_pages": 0}, "max_pages", "integer from 1"),
        ({"max_pages": 10**6, "page_size": 4096}, "max_pages", "fit in 8 GiB"),
        ({"n_heads": 7}, "n_heads", "multiple of n_kv_heads (3)"),
        ({"n_kv_heads": 0}, "n_kv_heads", "integer from 1"),
        ({"head_dim": 0}, "head_dim", "integer from 1"),
        ({"n_layers": -1}, "n_layers", "integer from 1"),
        ({"dtype": "int3"}, "dtype", "float32, float16, int8, int4, int2"),
        ({"dtype": "int4", "residual": -1}, "residual", "integer from 0"),
        ({"policy": "lru2"}, "policy",
         "one of oldest, oldest-page, sinks, h2o, tova, snapkv, pyramidkv, lru, lfu, random, none"),
        ({"policy": "sinks", "policy_params": {"n_sink": 200}}, "sinks.n_sink", "0 to 127 for a cache of 128"),
        ({"policy": "sinks", "policy_params": {"n_sink": -1}}, "sinks.n_sink", "0 to 127"),
        ({"policy": "sinks", "policy_params": {"n_sinks": 4}}, "sinks.n_sinks", "takes n_sink"),
        ({"policy": "h2o", "policy_params": {"recent": 128}}, "h2o.recent", "0 to 127"),
        ({"policy": "tova", "policy_params": {"x": 1}}, "tova.x", "takes no parameters"),
        ({"policy": "random", "policy_params": {"seed": -5}}, "random.seed", "integer from 0"),
    ],
)
def test_bad_values_name_field_value_and_allowed(change, field, allowed):
    with pytest.raises(ConfigError) as caught:
        CacheConfig(**{**BASE, **change})
    error = caught.value
    assert error.field == field
    assert allowed in str(error)
    bad = change.get("policy_params", change)
    assert repr(list(bad.values())[0]) in str(error) or repr(change[field]) in str(error)


def test_more_sinks_than_the_cache_holds():
    with pytest.raises(ConfigError, match=r"sinks.n_sink = 8 is not allowed.*cache of 8 tokens"):
        CacheConfig(page_size=4, max_pages=2, policy="sinks", policy_params={"n_sink": 8})


def test_valid_configuration_and_defaults():
    config = CacheConfig(**BASE, policy="h2o")
    assert config.capacity == 128 and config.n_heads // config.n_kv_heads == 2
    assert config.bytes_per_layer() == 2 * 128 * 3 * 16 * 4
    shared = {"rerotate": 0, "compress_every": 1}  # every token policy's options, after its own
    assert list(policy_params("sinks").items()) == [("n_sink", 4), *shared.items()]
    assert list(policy_params("h2o").items()) == [("recent", None), *shared.items()]
    for name, cls in POLICIES.items():
        assert cls.citation and cls.__doc__, f"{name} lacks a citation or a definition"
