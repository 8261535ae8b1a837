"""lm-eval against `pagevis serve`, one cache configuration at a time.

Each configuration (policy, budget, dtype; the full cache first) gets a server of its own in this process —
the real uvicorn app on a free loopback port, sharing the one loaded model — whose default cache is that
configuration, so every request lm-eval sends is scored through it. lm-eval talks to it as to vLLM:
`local-completions` with `tokenizer_backend=remote` (token-id prompts, /tokenize for context lengths),
`num_concurrent` requests at once, which the server batches into its engine steps.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import math
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from pagevis.quality import measure
from pagevis.engine import SessionConfig
from pagevis.eval.tasks import NEEDLE, SHIPPED, Needle, task_config
from pagevis.serve.app import model_id
from pagevis.serve.background import serving
from pagevis.serve.settings import ServeSettings

FULL = "full cache"
PROMPT_ROOM = 16  # tokens a request may hold beyond --max-length (lm-eval asks for one generated token)
# A step's tokens over all requests: every request's prompt in one step where the logits of its rows (a
# scored prompt keeps all of them: rows x vocab float32) stay within this (1,365 SmolLM2 rows).
MAX_STEP_LOGIT_BYTES = 256 << 20


@dataclass(frozen=True)
class Configuration:
    """One row: a policy (None: the full cache) at a budget in tokens per layer, in a dtype."""

    policy: str | None
    budget: int
    dtype: str = "float32"
    params: dict = field(default_factory=dict)

    @property
    def label(self) -> str:
        if self.policy is None:
            return FULL
        return self.policy + (f"({','.join(f'{k}={v}' for k, v in self.params.items())})" if self.params else "")


@dataclass
class EvalRow:
    policy: str
    budget: int
    dtype: str
    kv_bytes_per_token: float
    metrics: dict[str, dict[str, float]]  # task -> metric -> value
    needle: dict[tuple[int, float], float]  # (length, depth) -> accuracy
    seconds: float

    def as_dict(self) -> dict:
        row = dataclasses.asdict(self)
        row["needle"] = [{"length": k[0], "depth": k[1], "acc": v} for k, v in sorted(self.needle.items())]
        return row


@dataclass(frozen=True)
class Plan:
    """What to evaluate: tasks, the configurations, and how lm-eval runs them."""

    tasks: tuple[str, ...]
    configurations: tuple[Configuration, ...]
    page_size: int = 16
    max_length: int = 512
    limit: int | None = None
    concurrency: int = 8
    residual: int = 32
    needle: Needle = Needle()


def full_cache(plan: Plan) -> Configuration:
    """The reference row: every token of the longest request kept, in float32."""
    return Configuration(None, math.ceil((plan.max_length + PROMPT_ROOM) / plan.page_size) * plan.page_size)


class UnknownTask(ValueError):
    """A task name neither shipped nor in lm-eval's registry."""


def task_manager(names):
    """lm-eval's TaskManager: its own registry indexed only when a task is named from it (that takes
    10-30 s); UnknownTask for a name it does not have."""
    from lm_eval.tasks import TaskManager

    others = [name for name in names if name not in SHIPPED]
    manager = TaskManager(include_defaults=bool(others))
    for name in others:
        if name not in manager.all_tasks:
            close = difflib.get_close_matches(name, manager.all_tasks, n=3)
            raise UnknownTask(f"lm-eval has no task {name!r}" + (f" (did you mean {', '.join(close)}?)" if close
                                                                  else "") + f"; pagevis ships {', '.join(SHIPPED)}")
    return manager


def evaluate(model, spec, plan: Plan, log: Callable[[str], None] = lambda _: None) -> list[EvalRow]:
    """Run every task of the plan under the full cache and then each configuration; one row each."""
    logging.getLogger("lm_eval").setLevel(logging.WARNING)
    manager = task_manager(plan.tasks)
    rows = []
    with tempfile.TemporaryDirectory(prefix="pagevis-eval-") as folder:
        tasks = [task_config(name, Path(folder), model.tokenizer, plan.needle) for name in plan.tasks]
        for configuration in (full_cache(plan), *plan.configurations):
            started = time.perf_counter()
            results = _run_one(model, spec, plan, configuration, tasks, manager)
            rows.append(_row(model, plan, configuration, results, time.perf_counter() - started))
            log(f"eval: {configuration.label} @ {configuration.budget} {configuration.dtype}: "
                f"{_summary(rows[-1])} ({rows[-1].seconds:.0f} s)")
    return rows


def server_settings(model, spec, plan: Plan, configuration: Configuration) -> ServeSettings:
    """The in-process server of one row: its default cache is the row's, so every request lm-eval sends (which
    names no cache) gets it; room for --max-length tokens a request and --concurrency requests at once."""
    if configuration.policy is None:
        max_pages, policy, params = configuration.budget // plan.page_size, "none", {}
    else:
        choice = measure.PolicyChoice(configuration.policy, configuration.params)
        max_pages, params = measure.session_pages(choice, configuration.budget, plan.page_size, model.config)
        policy = configuration.policy
    defaults = dataclasses.replace(SessionConfig(), page_size=plan.page_size, max_pages=max_pages, policy=policy,
                                   policy_params=params, dtype=configuration.dtype, residual=plan.residual,
                                   oracle=False, record_layers=())
    defaults.check()
    token_budget = min(plan.concurrency * (plan.max_length + PROMPT_ROOM),
                       max(plan.max_length, MAX_STEP_LOGIT_BYTES // (4 * model.config.vocab_size)))
    # full_cache=False: a request naming no cache gets the row's (serve's own default is a full cache)
    return ServeSettings(model_spec=spec, defaults=defaults, max_seqs=plan.concurrency, full_cache=False,
                         max_waiting=plan.concurrency, token_budget=token_budget,
                         max_session_tokens=plan.max_length + PROMPT_ROOM,
                         max_cache_tokens=max(max_pages * plan.page_size, plan.max_length + PROMPT_ROOM))


def _run_one(model, spec, plan: Plan, configuration: Configuration, tasks: list, manager) -> dict:
    import lm_eval

    with serving(server_settings(model, spec, plan, configuration), model) as (url, _, _):
        model_args = {"base_url": f"{url}/v1/completions", "model": model_id(spec), "tokenizer_backend": "remote",
                      "tokenized_requests": True, "num_concurrent": plan.concurrency, "max_length": plan.max_length,
                      "max_retries": 1, "timeout": 3600}
        return lm_eval.simple_evaluate(model="local-completions", model_args=model_args, tasks=tasks,
                                       limit=plan.limit, log_samples=NEEDLE in plan.tasks, bootstrap_iters=0,
                                       verbosity="WARNING", task_manager=manager)


def _row(model, plan: Plan, configuration: Configuration, results: dict, seconds: float) -> EvalRow:
    metrics = {}
    for task, values in results["results"].items():
        metrics[task] = {key.split(",")[0]: value for key, value in values.items()
                         if "," in key and "_stderr" not in key and isinstance(value, (int, float))}
    needle: dict[tuple[int, float], list[float]] = {}
    for sample in results.get("samples", {}).get(NEEDLE, []):
        needle.setdefault((sample["doc"]["length"], sample["doc"]["depth"]), []).append(sample["acc"])
    kv = measure.cache_bytes(configuration.dtype, configuration.budget, plan.page_size, plan.residual,
                             model.config) / configuration.budget
    return EvalRow(configuration.label, configuration.budget, configuration.dtype, kv, metrics,
                   {cell: sum(v) / len(v) for cell, v in needle.items()}, seconds)


def _summary(row: EvalRow) -> str:
    return ", ".join(f"{task} {next(iter(values.values())):.3f}" for task, values in row.metrics.items() if values)
