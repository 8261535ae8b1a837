"""What `pagevis eval` prints and draws: compare's kind of table (a row per configuration, the full cache
first, each task's metric and the K/V bytes per token) and the plots (plots.py, imported only
when drawing: it loads Qt)."""

from __future__ import annotations

from pagevis.eval.run import FULL as FULL_LABEL
from pagevis.eval.tasks import NEEDLE, PRIMARY


def primary(task: str, metrics: dict[str, float]) -> tuple[str, float | None]:
    """The metric a task is shown by: the shipped tasks' own, else acc, else the first one lm-eval gave."""
    name = PRIMARY.get(task, ("acc", True))[0]
    if name not in metrics:
        name = next(iter(metrics), name)
    return name, metrics.get(name)


def format_table(rows, tasks) -> str:
    names = {task: primary(task, rows[0].metrics.get(task, {}))[0] for task in tasks}
    columns = [f"{task} {names[task]}" for task in tasks]
    widths = [max(len(c), 9) for c in columns]
    header = f"{'policy':<18} {'dtype':<7} {'budget':>6} {'KiB/tok':>7} " + " ".join(
        f"{c:>{w}}" for c, w in zip(columns, widths, strict=True)) + f" {'seconds':>7}"
    lines = [header, "-" * len(header)]
    for row in rows:
        values = [primary(task, row.metrics.get(task, {}))[1] for task in tasks]
        cells = " ".join(f"{'-' if v is None else f'{v:.4g}':>{w}}" for v, w in zip(values, widths, strict=True))
        lines.append(f"{row.policy:<18} {row.dtype:<7} {row.budget:>6} {row.kv_bytes_per_token / 1024:>7.2f} "
                     f"{cells} {row.seconds:>7.0f}")
    lines.append("budget: tokens per layer the cache holds (the full cache: every token of the longest request). "
                 "KiB/tok: K/V bytes per token, all layers. acc: share of documents whose answer had the highest "
                 "log-likelihood; word_perplexity: lm-eval's, over rolling windows of --max-length tokens.")
    return "\n".join(lines)


def write_plots(prefix: str, rows, plan, model: str) -> list[str]:
    """A line plot per task (its metric vs budget, a line per policy and dtype, the full cache dashed) and
    the needle's heatmaps; the paths written."""
    from pagevis.plots import heatmap_grid, line_plot

    paths = []
    full, others = rows[0], rows[1:]
    for task in plan.tasks:
        name, _ = primary(task, full.metrics.get(task, {}))
        series: dict[str, tuple[list, list]] = {}
        for row in others:
            xs, ys = series.setdefault(f"{row.policy} {row.dtype}", ([], []))
            xs.append(row.budget)
            ys.append(primary(task, row.metrics.get(task, {}))[1])
        budgets = sorted({row.budget for row in others}) or [full.budget]
        series[FULL_LABEL] = (budgets, [primary(task, full.metrics.get(task, {}))[1]] * len(budgets))
        path = f"{prefix}-{task}.png"
        paths.append(line_plot(path, series, title=f"{task}: {name} vs cache budget ({model})",
                               x_label="cache budget (tokens per layer)", y_label=name, log_x=True,
                               dashed={FULL_LABEL}, x_ticks=budgets))
    if NEEDLE in plan.tasks:
        lengths, depths = list(plan.needle.lengths), list(plan.needle.depths)
        panels = {f"{row.policy} @ {row.budget} {row.dtype}" if row is not full else FULL_LABEL:
                  [[row.needle.get((length, depth)) for length in lengths] for depth in depths] for row in rows}
        paths.append(heatmap_grid(f"{prefix}-needle.png", panels, title=f"needle accuracy by depth and length "
                                                                        f"({model})",
                                  x_labels=[str(n) for n in lengths], y_labels=[f"{d:g}" for d in depths],
                                  x_label="prompt length (tokens)", y_label="depth of the code"))
    return paths

