"""`pagevis.compare`: `pagevis compare` from Python — teacher-forced perplexity and the oracle metrics per policy
and cache budget on a text, measured by the command's own code (pagevis.cli.compare.measure_rows), returned as a
table that shows itself inline (its rows and the plot of perplexity vs budget, as inline SVG)."""

from __future__ import annotations

import argparse
import html
from collections.abc import Iterable

from pagevis.errors import ConfigError
from pagevis.notebook import arguments, records

SHOWN = (("policy", "policy", None), ("budget", "budget", None), ("ppl", "ppl", 3), ("ppl evict", "ppl_evicting", 3),
         ("full", "full_ppl_evicting", 3), ("vs opt", "gap_to_optimal", "%"), ("mean KL", "mean_kl", 4),
         ("top-1", "top1_agreement", 3), ("lost attn", "lost_attention", 4), ("evictions", "evictions", None))


STYLE = ("<style>.pagevis-comparison table { border-collapse: collapse; font-variant-numeric: tabular-nums; }"
         ".pagevis-comparison th, .pagevis-comparison td { padding: 2px 10px; text-align: right; "
         "border-bottom: 1px solid #ddd; } .pagevis-comparison td:first-child, .pagevis-comparison th:first-child "
         "{ text-align: left; }</style>")


class Comparison:
    """The rows of a comparison: `rows` (pagevis.quality.measure.Row, the full cache's first), `table` (a
    DataFrame with pandas, else a dict of NumPy arrays: compare's CSV columns), `result` (its JSON object)."""

    def __init__(self, result: dict, rows: list, note: str | None = None):
        self.result, self.rows, self.note = result, rows, note

    @property
    def full_cache_ppl(self) -> float:
        return self.result["full_cache_ppl"]

    @property
    def table(self):
        import numpy as np

        from pagevis.cli.compare import COLUMNS

        dicts = [row.as_dict() for row in self.rows]
        columns = {name: np.array([d[name] for d in dicts], dtype=object) for name in COLUMNS}
        for name in ("budget", "evictions", "evicting_tokens", "page_size"):
            columns[name] = columns[name].astype(np.int64)
        for name in ("ppl", "ppl_evicting", "full_ppl_evicting", "mean_kl", "top1_agreement", "lost_attention",
                     "gap_to_optimal", "seconds"):
            columns[name] = np.array([np.nan if v is None else v for v in columns[name]], dtype=np.float64)
        return records.frame(columns)

    def ppl(self, policy: str, budget: int, over: str = "ppl") -> float | None:
        """A row's perplexity (`over`="ppl_evicting": over the tokens predicted once the cache was full)."""
        for row in self.rows[1:]:
            if row.policy == policy and row.budget == budget:
                return getattr(row, over)
        policies = sorted({r.policy for r in self.rows[1:]})
        budgets = sorted({r.budget for r in self.rows[1:]})
        raise KeyError(f"no row {policy!r} at {budget}: the policies are {', '.join(policies)}, the budgets "
                       f"{', '.join(map(str, budgets))}")

    def plot(self) -> str:
        """The plot of perplexity vs budget as SVG (the PNG `pagevis compare --plot` writes, drawn inline)."""
        from pagevis.cli.compare import plot_series
        from pagevis.notebook.plot import svg_line_plot

        series, layout = plot_series(self.rows, self.result)
        return svg_line_plot(series, **layout)

    def __str__(self) -> str:
        from pagevis.cli.compare import format_table

        return format_table(self.rows)

    def __repr__(self) -> str:
        r = self.result
        return f"pagevis comparison: {r['model']}, {r['tokens']} tokens, {len(self.rows) - 1} rows\n{self}"

    def _repr_html_(self) -> str:
        r = self.result
        head = "".join(f"<th>{html.escape(name)}</th>" for name, _, _ in SHOWN)
        body = "".join("<tr>" + "".join(f"<td>{_cell(getattr(row, attribute), digits)}</td>"
                                        for _, attribute, digits in SHOWN) + "</tr>" for row in self.rows)
        caption = (f"{html.escape(r['model'])}, {r['tokens']} tokens of {html.escape(r['text'])}, page size "
                   f"{r['page_size']}: full cache perplexity {self.full_cache_ppl:.3f}")
        return (f'<div class="pagevis-comparison" style="font: 13px system-ui, sans-serif">{STYLE}'
                f'<div style="margin: 4px 0">{caption}</div>'
                f'<table>'
                f'<thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'
                f'<div style="margin: 4px 0; color: #666; max-width: 680px">ppl evict, full, mean KL, top-1, lost attn:'
                f' the tokens predicted once the cache was full (full: the full cache on the same tokens); vs opt: '
                f'ppl evict over the clairvoyant optimal\'s at the same budget, minus 1.</div>{self.plot()}</div>')


def _cell(value, digits) -> str:
    if value is None:
        return "–"
    if digits == "%":
        return f"{value:+.1%}"
    return f"{value:.{digits}f}" if digits is not None else html.escape(str(value))


def compare(text: str | None = None, policies: Iterable[str] | str = ("sinks", "oldest", "h2o"),
            budgets: Iterable[int] | str = (64, 128), tokens: int = 512, page_size: int = 16,
            dtype: str = "float32", model: str | None = None, optimal: bool = True,
            progress: bool = False) -> Comparison:
    """Teacher-forced perplexity, KL, top-1 agreement and lost attention of each policy at each budget on
    `text` (a text, or a shipped text's name; default chapter 1 of Pride and Prejudice), against the full cache.
    policies: names, each optionally with parameters as in `pagevis compare --policies` ("sinks:n_sink=1");
    budgets: tokens per layer, multiples of page_size. The clairvoyant `optimal` row is added unless
    optimal=False. A bad argument raises pagevis.ConfigError with the command's words."""
    from pagevis.cli import compare as command
    from pagevis.notebook.session import read_text

    argv = ["compare", "--policies", _joined(policies, "policies"), "--budgets", _joined(budgets, "budgets"),
            "--tokens", str(tokens), "--page-size", str(page_size), "--dtype", str(dtype), "--no-files",
            *([] if progress else ["--quiet"]), *([] if optimal else ["--no-optimal"]),
            *([] if model is None else ["--model", str(model)])]
    with arguments.usage_errors("compare", argv[1:]):
        args = _parser().parse_args(argv)
        args.quiet = not progress
        label = "pagevis.resources/" + command.DEFAULT_TEXT if text is None else _label(text)
        result, rows, note = command.measure_rows(args, None if text is None else read_text(text, "text"))
    result["text"] = label
    return Comparison(result, rows, note)


def _joined(values, name: str) -> str:
    if isinstance(values, str):
        return values
    if isinstance(values, (int, float)):
        values = [values]
    try:
        return ",".join(str(v) for v in values)
    except TypeError:
        raise ConfigError(name, values, "a list (or a comma-separated string)") from None


def _label(text: str) -> str:
    from pagevis.presets import shipped_texts

    if isinstance(text, str) and text in shipped_texts():
        return text
    return f"a text of {len(text)} characters" if isinstance(text, str) else repr(text)


def _parser() -> argparse.ArgumentParser:
    from pagevis.cli import compare as command
    from pagevis.cli.options import ArgumentParser

    parser = ArgumentParser(prog="pagevis")
    command.add_parser(parser.add_subparsers())
    return parser
