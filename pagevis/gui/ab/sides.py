"""The A/B window's runner (two sessions in lockstep, free-running or teacher-forced) and one side's controls."""

from __future__ import annotations

from dataclasses import replace

from PySide6.QtWidgets import QCheckBox, QHBoxLayout, QLabel, QVBoxLayout, QWidget

from pagevis.engine import SessionConfig
from pagevis.engine.logits_tap import LogitsTap
from pagevis.gui.session.runner import SessionRunner, new_session
from pagevis.gui.widgets.setting_inputs import setting_input
from pagevis.viewmodel.ab_session import MAX_FORCED_TOKENS, ABConfig, ABTimeline, ForcedPair, LockstepPair


class ABRunner(SessionRunner):
    """A SessionRunner whose session is a LockstepPair (or, teacher-forced, a ForcedPair reading the runner's
    prompt as the text) and whose timeline is an ABTimeline. Its config is (ABConfig, forced)."""

    def _new_session(self):
        configs, forced = self.config
        if forced:
            return self._new_forced(configs)
        taps = LogitsTap(self.model), LogitsTap(self.model)
        a, timeline_a = new_session(taps[0], self.spec, self.prompt, configs.a)
        b, timeline_b = new_session(taps[1], self.spec, self.prompt, configs.b)
        return LockstepPair(a, b, *taps), ABTimeline(timeline_a, timeline_b)

    def _new_forced(self, configs: ABConfig):
        ids = self.model.tokenizer.encode(self.prompt)[:MAX_FORCED_TOKENS]
        if len(ids) < 2:
            raise ValueError("the text is too short to read: it must encode to at least 2 tokens")
        pair = ForcedPair.build(self.model, ids, configs)
        timelines = [new_session(self.model, self.spec, self.prompt, side.session.config, session=side.session)[1]
                     for side in (pair.a, pair.b)]
        return pair, ABTimeline(*timelines, forced=True)

    def _keep_current(self) -> None:
        """An A/B restart is a new comparison; the main window keeps the runs worth returning to."""


class SideControls(QWidget):
    """Policy, page size, max pages and oracle of one side."""

    def __init__(self, name: str, changed):
        super().__init__()
        self.name = name
        self.policy = setting_input("policy", f"{name}: ")
        self.page_size = setting_input("page_size", f"{name}: ")
        self.max_pages = setting_input("max_pages", f"{name}: ")
        self.oracle = QCheckBox("oracle")
        self.oracle.setToolTip(f"{name}: compare with a full cache every step (KL against it, and its "
                               f"log-probability of the tokens {name} chose; twice the work)")
        self.header = QLabel()
        self.header.setStyleSheet("font-weight: bold; font-size: 15px;")
        column = QVBoxLayout(self)  # the header above the inputs: beside them, two sides were 1394 px wide
        column.setContentsMargins(0, 0, 0, 0)
        column.addWidget(self.header)
        row = QHBoxLayout()
        column.addLayout(row)
        for label, widget in (("policy", self.policy), ("page size", self.page_size), ("pages", self.max_pages)):
            row.addWidget(QLabel(label))
            row.addWidget(widget)
        row.addWidget(self.oracle)
        row.addStretch(1)
        self._base = SessionConfig()
        for signal in (self.policy.currentIndexChanged, self.page_size.valueChanged, self.max_pages.valueChanged,
                       self.oracle.toggled):
            signal.connect(lambda *_: changed(f"{name} changed"))

    def set_config(self, config: SessionConfig) -> None:
        self._base = config
        for widget in (self.policy, self.page_size, self.max_pages, self.oracle):
            widget.blockSignals(True)
        try:
            self.policy.setCurrentIndex(self.policy.findData(config.policy))
            self.page_size.setValue(config.page_size)
            self.max_pages.setValue(config.max_pages)
            self.oracle.setChecked(config.oracle)
        finally:
            for widget in (self.policy, self.page_size, self.max_pages, self.oracle):
                widget.blockSignals(False)
        self.update_header()

    def config(self) -> SessionConfig:
        policy = self.policy.currentData()
        params = dict(self._base.policy_params) if policy == self._base.policy else {}
        return replace(self._base, policy=policy, policy_params=params, page_size=self.page_size.value(),
                       max_pages=self.max_pages.value(), oracle=self.oracle.isChecked())

    @property
    def label(self) -> str:
        """The side as the plots and the status line name it: "A oldest"."""
        return f"{self.name} {self.policy.currentData()}"

    def update_header(self) -> None:
        c = self.config()
        self.header.setText(f"{self.name} · {c.policy} · {c.max_pages} × {c.page_size} = "
                            f"{c.ram_tokens} tokens")
