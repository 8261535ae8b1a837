"""pagevis: watch a real language model decode with its KV cache in fixed-size pages.

The Python API (docs/notebook.md), loaded on first use so that `import pagevis` stays light (no model, no Qt):

    pagevis.Session(policy="h2o", page_size=8, max_pages=12)    a decoding (or teacher-forced) session
    pagevis.compare(text, policies=[...], budgets=[...])        perplexity per policy and budget: a table
    pagevis.load_trace(path)                                    a trace file, with its records and its view
    pagevis.ConfigError                                         what a bad argument raises
"""

__version__ = "0.1.0"
__all__ = ["ConfigError", "Session", "compare", "load_trace"]

_EXPORTS = {"Session": "pagevis.notebook.session", "load_trace": "pagevis.notebook.session",
            "compare": "pagevis.notebook.comparison", "ConfigError": "pagevis.errors"}


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'pagevis' has no attribute {name!r}")
    from importlib import import_module

    value = getattr(import_module(_EXPORTS[name]), name)
    globals()[name] = value  # once: later lookups do not come here
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
