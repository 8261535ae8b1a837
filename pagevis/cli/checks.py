"""Checks `run` makes before decoding, with one sequence or many (`--n`): a clear refusal, never a half run."""

from __future__ import annotations

from pagevis.cli import options


def check_cache_memory(config, model_config) -> None:
    """The K/V cache (twice with the oracle's full cache) must fit in the memory available now."""
    from pagevis.kvcache import CacheConfig
    from pagevis.system_memory import available_bytes, fits, gib

    need = CacheConfig.for_model(config, model_config).total_bytes() * (2 if config.oracle else 1)
    if not fits(need):
        raise options.UsageError(f"--max-pages {config.max_pages} x --page-size {config.page_size}: the K/V cache "
                                 f"would take {gib(need)} with this model, more than the memory available now "
                                 f"({gib(available_bytes() or 0)})")


def check_prompt_fits(config, prompt_ids, model_config=None) -> None:
    """Policy 'none' never evicts: a prompt longer than the cache can never be fed, so say so before decoding
    (unless every layer of the model keeps a sliding window: its pages slide out and the cache never fills)."""
    windows = model_config.local_windows if model_config is not None else None
    if windows is not None and None not in windows:
        return
    if config.policy == "none" and len(prompt_ids) > config.capacity:
        raise options.UsageError(
            f"--policy none: the prompt is {len(prompt_ids)} tokens but the cache holds {config.capacity} "
            f"({config.max_pages} pages x {config.page_size} tokens) and policy none never evicts; raise --max-pages "
            "or --page-size, or choose an evicting policy")
