"""The sequences window: many sequences over one shared pool, stepped with continuous batching.

Start N parallel samples of the prompt (seeds seed .. seed+N-1), add more sequences, step or run, and
fork any sequence from any recorded step with another seed: the child shares the parent's pages (a
running parent directly, a finished one through the prefix cache). Step and Run go through the one run loop
in a worker thread (superqt), as the main window's runner does (gui/session/runner.py `worker_steps`): a
step, or steps until paused or done, each one batched forward; nothing else touches the engine while the
worker runs. The view renders the step's BatchRecord.
"""

from __future__ import annotations

from dataclasses import replace

from PySide6.QtCore import Qt
from superqt.utils import create_worker
from PySide6.QtWidgets import (QComboBox, QHBoxLayout, QLabel, QPushButton, QSlider, QSpinBox, QVBoxLayout,
                               QWidget)

from pagevis.engine import Engine, RunControl, SamplingConfig
from pagevis.engine.session_config import encode_prompt
from pagevis.engine.batch import BatchConfig
from pagevis.kvcache import CacheFullError, ConfigError, EventKind
from pagevis.gui.session.runner import WorkerFailure, run_control, worker_steps
from pagevis.gui.widgets.setting_inputs import setting_input
from pagevis.gui.sequences.view import SequencesView
from pagevis.viewmodel.sequences_step import SequencesStep, peak_rows
from pagevis.gui.widgets.windows import add_close_keys

SHORT_NAMES = {EventKind.COPY_ON_WRITE: "cow"}  # the status line is narrow

MAX_RECORDS = 5000  # recorded steps kept for the step slider (each holds a few small arrays)
NEW_TOKENS = 128  # the window's default new tokens per sequence: a budget most answers stop short of (at EOS)


def sequence_config(config, prompt_tokens: int, new_tokens: int):
    """The window's own cache per sequence: policy none and room for the prompt and `new_tokens`, so that
    nothing is evicted. Under an evicting policy a full cache copies the shared pages it evicts from (and a
    per-sequence cap makes the paged sequences as large as contiguous reservations): the comparison would
    show 48 / 48 / 48 pages instead of what sharing and paging save."""
    pages = -(-(prompt_tokens + new_tokens) // config.page_size)
    return replace(config, policy="none", policy_params={}, max_new_tokens=new_tokens, max_pages=pages)


class SequencesWindow(QWidget):
    def __init__(self, model, config, prompt: str, parent=None):
        super().__init__(parent, Qt.Window)
        self.setWindowTitle("pagevis — sequences sharing one pool")
        self.model, self.prompt = model, prompt
        self.config = config if config.sampling.mode == "sample" else replace(
            config, sampling=replace(config.sampling, mode="sample"))
        self.prompt_tokens = len(encode_prompt(model, prompt, config.chat, config.special))
        self.records: list = []
        self.lengths: list[dict[int, int]] = []  # per record: generated tokens of every sequence
        self.peaks: list[list[tuple[str, int]]] = []  # per record: the memory rows' peaks up to it
        self.batch: Engine | None = None
        self.worker = None  # the steps running in a worker thread, if any
        self.control: RunControl | None = None  # the worker's (Run's toggle stops it between steps)
        self.view = SequencesView()
        self.n = _spin(1, 16, 4, "parallel samples of the prompt")
        self.seed = _spin(0, 2**31 - 1, config.sampling.seed, "seed of the first sample (the others: +1, +2…)")
        self.new_tokens = _spin(1, 2048, NEW_TOKENS, "new tokens per sequence: each sequence's cache holds its "
                                "prompt and these, and evicts nothing (policy none), so its prompt pages stay shared")
        per_sequence = sequence_config(self.config, self.prompt_tokens, NEW_TOKENS).max_pages
        self.pool_pages = setting_input("pool_pages", value=4 * per_sequence)
        self.start_button = QPushButton("Start")
        self.add_button = QPushButton("Add sequence")
        self.step_button = QPushButton("Step")
        self.run_button = QPushButton("Run")
        self.run_button.setCheckable(True)
        self.fork_seq = QComboBox()
        self.fork_seq.setToolTip("the sequence to fork")
        self.fork_seed = _spin(0, 2**31 - 1, 1000, "seed of the fork")
        self.fork_button = QPushButton("Fork at step")
        self.slider = QSlider(Qt.Horizontal)
        self.slider.setRange(0, 0)
        self.status = QLabel("Start runs N samples of the prompt; shared pages are amber with their ref count.")
        self.status.setWordWrap(True)
        top = QHBoxLayout()
        for label, widget in (("n", self.n), ("new tokens", self.new_tokens), ("seed", self.seed),
                              ("pool pages", self.pool_pages)):
            top.addWidget(QLabel(label))
            top.addWidget(widget)
        for button in (self.start_button, self.add_button, self.step_button, self.run_button):
            top.addWidget(button)
        top.addStretch(1)
        fork = QHBoxLayout()
        fork.addWidget(QLabel("step"))
        fork.addWidget(self.slider, 1)
        fork.addWidget(QLabel("fork sequence"))
        fork.addWidget(self.fork_seq)
        fork.addWidget(QLabel("with seed"))
        fork.addWidget(self.fork_seed)
        fork.addWidget(self.fork_button)
        layout = QVBoxLayout(self)
        layout.addLayout(top)
        layout.addLayout(fork)
        layout.addWidget(self.view, 1)
        layout.addWidget(self.status)
        self.start_button.clicked.connect(self.start)
        self.add_button.clicked.connect(self.add_sequence)
        self.step_button.clicked.connect(self.step)
        self.run_button.toggled.connect(self._run_toggled)
        self.fork_button.clicked.connect(lambda: self.fork(self.fork_seq.currentData(), self.slider.value(),
                                                           self.fork_seed.value()))
        self.slider.valueChanged.connect(self.show_step)
        add_close_keys(self)
        self.resize(1200, 800)

    # --- actions -----------------------------------------------------------------------------------------
    @property
    def busy(self) -> bool:
        return self.worker is not None

    def start(self) -> bool:
        if self._busy_says_so():
            return False
        self.run_button.setChecked(False)
        config = sequence_config(self.config, self.prompt_tokens, self.new_tokens.value())
        try:
            self.batch = Engine(self.model, config, BatchConfig(pool_pages=self.pool_pages.value()))
            sampling = replace(self.config.sampling, seed=self.seed.value())
            self.batch.submit_parallel(self.batch.encode(self.prompt), self.n.value(), sampling)
        except ConfigError as error:
            return self._fail(str(error))
        self.records, self.lengths, self.peaks = [], [], []
        self.status.setText(f"{self.n.value()} samples of a {self.prompt_tokens}-token prompt, up to "
                            f"{config.max_new_tokens} new tokens each, in {config.max_pages} pages of "
                            f"{config.page_size} per sequence (policy none: nothing evicted)")
        return True

    def add_sequence(self) -> None:
        if self._busy_says_so() or self.batch is None and not self.start():
            return
        seed = self.seed.value() + len(self.batch.requests)
        seq_id = self.batch.submit(self.batch.encode(self.prompt), replace(self.config.sampling, seed=seed))
        self.status.setText(f"sequence {seq_id} (seed {seed}) waits for its first step; its prompt's full pages "
                            f"come from the prefix cache")

    def step(self) -> None:
        """Run one batched step in the worker thread (a no-op while the worker runs)."""
        self.run_steps(1)

    def _run_toggled(self, on: bool) -> None:
        if on:
            self.run_steps(None)
        elif self.control is not None:
            self.control.stop = True

    def run_steps(self, budget: int | None) -> None:
        """Step in the worker thread through the run loop: `budget` steps, or until paused or done."""
        if self.busy or self.batch is None and not self.start():
            return
        if self.batch.done:
            self._stop_running()
            self.status.setText("every sequence has finished; fork one from a recorded step, or Start again")
            return
        self.control = run_control(budget)
        self.worker = create_worker(worker_steps, _LengthsStepper(self.batch), self.control, _start_thread=False,
                                    _ignore_errors=True)
        self.worker.yielded.connect(self._received)
        self.worker.finished.connect(self._worker_done)
        self.worker.start()

    def _received(self, item) -> None:
        if isinstance(item, WorkerFailure):
            self._step_failed(item.error)
            return
        for record, lengths in item:
            self.records.append(record)
            self.lengths.append(lengths)
            self.peaks.append(peak_rows(self.peaks[-1] if self.peaks else [], record, self.config.page_size))
        del self.records[:-MAX_RECORDS], self.lengths[:-MAX_RECORDS], self.peaks[:-MAX_RECORDS]
        self._stepped(item[-1][0])

    def _worker_done(self) -> None:
        self.worker, self.control = None, None
        if self.run_button.isChecked() and self.batch is not None and self.batch.done:
            self._stop_running()
            self.status.setText("every sequence has finished; fork one from a recorded step, or Start again")

    def _step_failed(self, error: Exception) -> None:
        self._stop_running()
        if isinstance(error, (CacheFullError, ConfigError)):
            self._fail(str(error))
        else:
            self._fail(f"step failed: {type(error).__name__}: {error}")

    def _stop_running(self) -> None:
        self.run_button.setChecked(False)

    def _stepped(self, record) -> None:
        self.slider.setRange(0, len(self.records) - 1)
        self.slider.setValue(len(self.records) - 1)
        self.show_step(len(self.records) - 1)
        kinds = sorted({e.kind for e in record.events} - {EventKind.ALLOCATE})
        events = ", ".join(f"{sum(e.kind is k for e in record.events)} {SHORT_NAMES.get(k, k.value)}" for k in kinds)
        self.status.setText(f"step {record.step}: {len(record.seqs)} sequences stepped, {record.pages_used} pages "
                            f"used ({record.pages_unshared} without sharing)"
                            + (f"; {events} (events over all layers)" if events else ""))

    def _busy_says_so(self) -> bool:
        if self.busy:
            self.status.setText("a step is running; try again when it has finished")
        return self.busy

    def fork(self, seq_id: int | None, index: int, seed: int) -> int | None:
        """Fork seq_id as it was after recorded step `index`, sampling with `seed`."""
        if self._busy_says_so():
            return None
        if self.batch is None or seq_id is None or not 0 <= index < len(self.records):
            return self._fail("decode some steps first, then choose a step and a sequence to fork")
        record = self.records[index]
        n_tokens = record.n_cached.get(seq_id)
        if n_tokens is None:
            parent = self.batch.requests[seq_id]
            n_tokens = len(parent.prompt_ids) + self.lengths[index].get(seq_id, 0)
        sampling = SamplingConfig(mode="sample", temperature=self.config.sampling.temperature,
                                  top_k=self.config.sampling.top_k, top_p=self.config.sampling.top_p, seed=seed)
        try:
            child = self.batch.fork(seq_id, min(n_tokens, len(self.batch.requests[seq_id].tokens)), sampling)
        except ConfigError as error:
            return self._fail(str(error))
        self.status.setText(f"sequence {child} forks sequence {seq_id} after step {record.step} "
                            f"({n_tokens} tokens shared) with seed {seed}")
        return child

    def show_step(self, index: int) -> None:
        if not 0 <= index < len(self.records):
            return
        lengths = self.lengths[index]
        texts = []
        for seq_id, n in lengths.items():
            ids = self.batch.requests[seq_id].generated[:n]
            texts.append((seq_id, self.model.tokenizer.decode(ids) if self.model.tokenizer else " ".join(map(str, ids))))
        self.view.show_state(SequencesStep(self.records[index], self.config.page_size, tuple(texts),
                                          tuple(self.peaks[index])))
        current = self.fork_seq.currentData()
        self.fork_seq.clear()
        for seq_id in lengths:
            self.fork_seq.addItem(f"{seq_id}", seq_id)
        if current is not None and current in lengths:
            self.fork_seq.setCurrentIndex(list(lengths).index(current))

    def _fail(self, message: str) -> None:
        self.status.setText(message.splitlines()[0])

    def closeEvent(self, event) -> None:
        if self.control is not None:  # the step under way finishes: the engine is never left half-stepped
            self.control.stop = True
        super().closeEvent(event)


class _LengthsStepper:
    """The engine as the run loop's stepper, each record paired with every sequence's generated length after
    it (read on the worker's thread, between steps: the fork control and the texts need them per record)."""

    def __init__(self, engine: Engine):
        self.engine = engine

    @property
    def done(self) -> bool:
        return self.engine.done

    def step(self) -> tuple:
        record = self.engine.step()
        return record, {s: len(state.generated) for s, state in self.engine.requests.items()}


def _spin(low: int, high: int, value: int, tip: str) -> QSpinBox:
    spin = QSpinBox()
    spin.setRange(low, high)
    spin.setValue(min(max(value, low), high))
    spin.setToolTip(tip)
    return spin
