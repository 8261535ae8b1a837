"""The controls dock: model, prompt, cache, decoding and view options.

Inputs are range-limited widgets; what ranges cannot express (a policy parameter against the cache's
capacity, KV heads dividing query heads, ...) is checked by building the real configuration objects and
shown inline as the ConfigError's message. Two signals tell the window what changed:
`session_changed(reason)` for anything that needs a new session (and cache), `view_changed()` for
options that only change what is drawn.
"""

from __future__ import annotations

import importlib.resources
from contextlib import contextmanager
from pathlib import Path

from PySide6.QtCore import Qt, QTimer, Signal
from PySide6.QtGui import QKeySequence, QShortcut
from PySide6.QtWidgets import (
    QCheckBox,
    QFormLayout,
    QGroupBox,
    QHBoxLayout,
    QLabel,
    QPlainTextEdit,
    QPushButton,
    QScrollArea,
    QSpinBox,
    QVBoxLayout,
    QWidget,
)

from pagevis import settings
from pagevis.engine import ModelSpec, SessionConfig
from pagevis.kvcache import POLICIES, ConfigError, policy_params
from pagevis.kvcache.quant import has_residual
from pagevis.presets import PRESETS, Preset, default_prompt
from pagevis.gui.session.controls_state import SPEC_INPUTS, ControlsState
from pagevis.gui.session.runner import validate
from pagevis.gui.widgets.setting_inputs import combo as _combo
from pagevis.gui.widgets.setting_inputs import read_input, setting_input
from pagevis.gui.widgets.setting_inputs import spin as _spin
from pagevis.viewmodel.timeline import head_label

DEFAULT_PROMPT = default_prompt()
MODEL_CHOICES = (("smollm2", "SmolLM2-135M-Instruct"), ("synthetic", "Synthetic (random)"))


def sample_prompts() -> dict[str, str]:
    """name → text of the prompts shipped in pagevis.resources/prompts."""
    try:
        folder = importlib.resources.files("pagevis.resources") / "prompts"
        return {Path(item.name).stem: item.read_text(encoding="utf-8").strip()
                for item in sorted(folder.iterdir(), key=lambda i: i.name) if item.name.endswith(".txt")}
    except (ModuleNotFoundError, FileNotFoundError, OSError):
        return {}


class ControlsPanel(QScrollArea):
    session_changed = Signal(str)  # a human-readable reason: "page size changed"
    view_changed = Signal()
    preset_chosen = Signal(object)  # a Preset: the window applies it (one session, or A/B)

    def __init__(self, parent=None):
        super().__init__(parent)
        self.setWidgetResizable(True)
        self.setHorizontalScrollBarPolicy(Qt.ScrollBarAlwaysOff)
        self.state = ControlsState(self)  # the configuration in and out, and what no input shows
        self.inputs: dict[str, QWidget] = {}  # setting name -> its widget (made from the settings table)
        self._param_widgets: dict[str, QSpinBox] = {}
        self._reason = ""
        self._debounce = QTimer(self, singleShot=True, interval=150)
        self._debounce.timeout.connect(lambda: self.session_changed.emit(self._reason))
        self._loading = False

        body = QWidget()
        column = QVBoxLayout(body)
        column.setContentsMargins(6, 6, 6, 6)
        column.addWidget(self._demo_group())
        column.addWidget(self._view_group())  # at the top: a hybrid model's layers compared without scrolling
        column.addWidget(self._model_group())
        column.addWidget(self._prompt_group())
        column.addWidget(self._cache_group())
        column.addWidget(self._decoding_group())
        column.addStretch(1)
        self.setWidget(body)
        self.setMinimumWidth(300)
        self.rebuild_params()
        self.refresh()

    # --- construction ----------------------------------------------------------------------------
    def _demo_group(self) -> QGroupBox:
        box = QGroupBox("Demo")
        layout = QVBoxLayout(box)
        self.presets = _combo()
        self.presets.addItem("Presets…", None)
        for preset in PRESETS:
            self.presets.addItem(preset.name + (" (A/B)" if preset.b is not None else ""), preset)
            self.presets.setItemData(self.presets.count() - 1, preset.description, Qt.ToolTipRole)
        self.presets.setToolTip("one click sets prompt, cache and policy (A/B presets open two sessions)")
        self.presets.activated.connect(self._preset_chosen)
        layout.addWidget(self.presets)
        return box

    def _preset_chosen(self, index: int) -> None:
        preset = self.presets.itemData(index)
        self.presets.setCurrentIndex(0)
        if isinstance(preset, Preset):
            self.preset_chosen.emit(preset)

    def _model_group(self) -> QGroupBox:
        box = QGroupBox("Model")
        form = QFormLayout(box)
        self.model = _combo()
        for kind, label in MODEL_CHOICES:
            self.model.addItem(label, kind)
        self.model.setToolTip("File ▸ Open GGUF… adds any Llama-family model file")
        self.layers = _spin(1, 32, 4, "layers of the synthetic model")
        self.heads = _spin(1, 32, 8, "query heads of the synthetic model")
        self.kv_heads = _spin(1, 32, 2, "key/value heads (grouped-query attention): must divide the query heads")
        self.head_dim = _spin(2, 256, 32, "dimension of each head (even: RoPE rotates pairs)", step=2)
        self.model_seed = _spin(0, 2**31 - 1, 0, "seed of the synthetic weights")
        self.sliding_window = _spin(0, 1 << 20, 0, "local layers attend to the last W positions and free older "
                                    "pages, as Gemma 3's 512 (0: no sliding window)")
        self.global_every = _spin(0, 32, 0, "with a sliding window: every K-th layer keeps every token (Gemma 3: "
                                  "6; 0: every layer local)")
        form.addRow("Model", self.model)
        self._synthetic_rows = []
        for label, widget in (("Layers", self.layers), ("Query heads", self.heads), ("KV heads", self.kv_heads),
                              ("Head dim", self.head_dim), ("Weights seed", self.model_seed),
                              ("Sliding window", self.sliding_window), ("Global every", self.global_every)):
            form.addRow(label, widget)
            self._synthetic_rows.append((form, widget))
            widget.valueChanged.connect(lambda *_: self._session("model changed"))
        self.model_error = QLabel()  # a head-layout problem, shown next to the head fields
        self.model_error.setObjectName("inlineError")
        self.model_error.setWordWrap(True)
        self.model_error.hide()
        form.addRow(self.model_error)
        self.model.currentIndexChanged.connect(self._model_changed)
        return box

    def _prompt_group(self) -> QGroupBox:
        box = QGroupBox("Prompt")
        layout = QVBoxLayout(box)
        self.prompt_edit = QPlainTextEdit(DEFAULT_PROMPT)
        self.prompt_edit.setFixedHeight(96)
        self.prompt_edit.setTabChangesFocus(True)
        self.chat = self._input("chat")
        self.samples = _combo()
        self.samples.addItem("Sample prompts…", "")
        for name, text in sample_prompts().items():
            self.samples.addItem(name.replace("-", " "), text)
        self.samples.activated.connect(self._sample_chosen)
        self.apply_prompt = QPushButton("Restart with prompt")
        self.apply_prompt.setToolTip("Ctrl+Return")
        self.apply_prompt.clicked.connect(lambda: self._session("prompt changed", now=True))
        QShortcut(QKeySequence("Ctrl+Return"), self.prompt_edit,
                  activated=lambda: self._session("prompt changed", now=True))
        self.chat.toggled.connect(lambda *_: self._session("chat template toggled"))
        row = QHBoxLayout()
        row.addWidget(self.chat)
        row.addWidget(self.samples, 1)
        layout.addWidget(self.prompt_edit)
        layout.addLayout(row)
        layout.addWidget(self.apply_prompt)
        return box

    def _input(self, name: str) -> QWidget:
        """The widget of a setting (range, default and tooltip from the settings table), registered so that
        session_config() reads it and set_configuration() writes it."""
        self.inputs[name] = setting_input(name)
        return self.inputs[name]

    def _add_rows(self, form: QFormLayout, *names: str) -> None:
        for name in names:
            form.addRow(settings.setting(name).label, self.inputs[name])

    def _cache_group(self) -> QGroupBox:
        box = QGroupBox("Paged KV cache")
        form = QFormLayout(box)
        self.page_size = self._input("page_size")
        self.max_pages = self._input("max_pages")
        self.dtype = self._input("dtype")
        self.residual = self._input("residual")
        self.key_channels = self._input("key_channels")
        self.policy = self._input("policy")
        for index, cls in enumerate(POLICIES.values()):
            self.policy.setItemData(index, f"{cls.__doc__}\n{cls.citation}", Qt.ToolTipRole)
        self.params_form = QFormLayout()
        self.disk_pages = self._input("disk_pages")
        self.disk_pages.setSpecialValueText("off")
        self.select = self._input("select")
        self.select_pages = self._input("select_pages")
        self.capacity = QLabel()
        self.capacity.setWordWrap(True)
        self.error = QLabel()
        self.error.setObjectName("inlineError")
        self.error.setWordWrap(True)
        self.error.hide()
        self._add_rows(form, "page_size", "max_pages", "dtype", "residual", "key_channels", "policy")
        form.addRow(self.params_form)
        self._add_rows(form, "disk_pages", "select", "select_pages")
        form.addRow(self.capacity)
        form.addRow(self.error)
        self.page_size.valueChanged.connect(lambda *_: self._session("page size changed"))
        self.max_pages.valueChanged.connect(lambda *_: self._session("max pages changed"))
        self.dtype.currentIndexChanged.connect(lambda *_: self._session("storage dtype changed"))
        self.dtype.currentIndexChanged.connect(self._storage_changed)
        self.residual.valueChanged.connect(lambda *_: self._session("residual window changed"))
        self.key_channels.valueChanged.connect(lambda *_: self._session("pruned key channels changed"))
        self._storage_changed()
        self.policy.currentIndexChanged.connect(self._policy_changed)
        self.disk_pages.valueChanged.connect(lambda *_: self._session("disk pages changed"))
        self.select.currentIndexChanged.connect(lambda *_: self._session("page selection changed"))
        self.select_pages.valueChanged.connect(lambda *_: self._session("quest pages changed"))
        return box

    def _decoding_group(self) -> QGroupBox:
        box = QGroupBox("Decoding")
        form = QFormLayout(box)
        self.sampling = self._input("mode")
        self.temperature = self._input("temperature")
        self.top_k = self._input("top_k")
        self.top_p = self._input("top_p")
        self.sample_seed = self._input("seed")
        self.max_new = self._input("max_new_tokens")
        self.oracle = self._input("oracle")
        self._add_rows(form, "mode")
        self._sampling_rows = []
        for name in ("temperature", "top_k", "top_p", "seed"):
            widget = self.inputs[name]
            self._add_rows(form, name)
            self._sampling_rows.append((form, widget))
            widget.valueChanged.connect(lambda *_: self._session("sampling changed"))
        self._add_rows(form, "max_new_tokens")
        form.addRow(self.oracle)
        self.sampling.currentIndexChanged.connect(self._sampling_changed)
        self.max_new.valueChanged.connect(lambda *_: self._session("max new tokens changed"))
        self.oracle.toggled.connect(lambda *_: self._session("oracle toggled"))
        return box

    def _view_group(self) -> QGroupBox:
        box = QGroupBox("View")
        form = QFormLayout(box)
        self.layer = _spin(0, 0, 0, "the layer every view shows")
        self.head = _combo()
        self.head.setToolTip("the attention head the heatmap and text show, or the mean over heads")
        self.head.addItem("mean of heads", None)
        self.shade = _combo()
        self.shade.addItem("age (newer = brighter)", "age")
        self.shade.addItem("policy score (higher = brighter)", "score")
        self.shade.addItem("none", "none")
        self.scale = _combo()
        self.scale.addItems(["linear", "log"])
        self.fixed_scale = QCheckBox("Fix the colour scale")
        self.fixed_scale.setToolTip("keep the attention colour scale from step to step, so colours compare "
                                    "across steps (linear scale; log is always fixed)")
        form.addRow("Layer", self.layer)
        self._layer_kinds: list[str] | None = None
        self.layer.valueChanged.connect(lambda *_: self._show_layer_kind())
        form.addRow("Head", self.head)
        form.addRow("Grid shading", self.shade)
        form.addRow("Attention scale", self.scale)
        form.addRow(self.fixed_scale)
        for signal in (self.layer.valueChanged, self.head.currentIndexChanged, self.shade.currentIndexChanged,
                       self.scale.currentIndexChanged, self.fixed_scale.toggled):
            signal.connect(lambda *_: None if self._loading else self.view_changed.emit())
        return box

    # --- reactions -------------------------------------------------------------------------------
    def _session(self, reason: str, now: bool = False) -> None:
        if self._loading:
            return
        self._update_capacity()
        if not self.check():
            return
        self._reason = reason
        if now:
            self._debounce.stop()
            self.session_changed.emit(reason)
        else:
            self._debounce.start()

    def _model_changed(self) -> None:
        self._update_model_rows()
        self._swap_default_prompt()
        self._session("model changed")

    def _swap_default_prompt(self) -> None:
        """The synthetic model's byte tokens make SmolLM2's default prompt longer than the default cache:
        a default prompt follows the model; a prompt the user wrote stays."""
        kind = self.model.currentData()
        defaults = {default_prompt("smollm2"), default_prompt("synthetic")}
        if self.prompt().strip() in defaults:
            self.prompt_edit.setPlainText(default_prompt(kind))

    def _update_model_rows(self) -> None:
        _show_rows(self._synthetic_rows, self.model.currentData() == "synthetic")

    def _sampling_changed(self) -> None:
        self._update_sampling_rows()
        self._session("sampling changed")

    def _update_sampling_rows(self) -> None:
        _show_rows(self._sampling_rows, self.sampling.currentText() == "sample")

    def _storage_changed(self) -> None:
        """The residual window applies to int4 / int2 (KIVI) only."""
        self.residual.setEnabled(has_residual(self.dtype.currentData()))

    def _policy_changed(self) -> None:
        self.rebuild_params()
        self._session("policy changed")

    def _sample_chosen(self, index: int) -> None:
        text = self.samples.itemData(index)
        if text:
            self.prompt_edit.setPlainText(text)
            self.samples.setCurrentIndex(0)
            self._session("prompt changed", now=True)

    def rebuild_params(self) -> None:
        """One input per parameter of the chosen policy, each showing its remembered value or default."""
        while self.params_form.rowCount():
            self.params_form.removeRow(0)
        self._param_widgets = {}
        name = self.policy.currentData()
        remembered = self.state.param_values.setdefault(name, {})
        for param, default in policy_params(name).items():
            value = remembered.get(param, default)
            box = _spin(-1 if default is None else 0, 2**31 - 1, -1 if value is None else int(value),
                        f"{name}.{param} (default {'auto' if default is None else default})")
            if default is None:
                box.setSpecialValueText("auto")
            box.valueChanged.connect(lambda *_, p=param: self._param_edited(p))
            self._param_widgets[param] = box
            self.params_form.addRow(param.replace("_", " "), box)
        self._update_capacity()

    def _param_edited(self, param: str) -> None:
        self.state.param_values[self.policy.currentData()] = self.policy_parameters()
        self._session(f"{param.replace('_', ' ')} changed")

    def _update_capacity(self) -> None:
        capacity = self.page_size.value() * (self.disk_pages.value() or self.max_pages.value())
        for param in ("n_sink", "recent"):
            if param in self._param_widgets:
                self._param_widgets[param].setMaximum(max(capacity - 1, 0))
        where = (f"{self.disk_pages.value()} disk pages × {self.page_size.value()}, {self.max_pages.value()} RAM "
                 "frames" if self.disk_pages.value() else f"{self.max_pages.value()} × {self.page_size.value()}")
        self.capacity.setText(f"<span style='color:#8a919c'>{capacity} tokens per layer ({where})</span>")

    # --- the configuration -----------------------------------------------------------------------
    def policy_parameters(self) -> dict[str, object]:
        return {param: (None if box.specialValueText() and box.value() == box.minimum() else box.value())
                for param, box in self._param_widgets.items()}

    def model_spec(self) -> ModelSpec:
        kind = self.model.currentData()
        if kind == "gguf":
            return ModelSpec(kind="gguf", path=self.state.gguf_path)
        if kind == "synthetic":
            return ModelSpec(kind="synthetic", **{field: getattr(self, name).value() for name, field in SPEC_INPUTS})
        return ModelSpec()

    def prompt(self) -> str:
        return self.prompt_edit.toPlainText()

    def session_config(self) -> SessionConfig:
        """The configuration the controls describe; ConfigError if it is not valid."""
        values = {name: read_input(widget) for name, widget in self.inputs.items()}
        values["policy_params"] = {k: v for k, v in self.policy_parameters().items() if v is not None}
        return settings.with_values(SessionConfig(swap_dir=self.state.swap_dir), values)

    def check(self) -> bool:
        """Validate the configuration; show the first problem inline. True when it is valid."""
        if self.model.currentData() == "synthetic" and self.heads.value() % self.kv_heads.value():
            self.model_error.setText(str(ConfigError("KV heads", self.kv_heads.value(),
                                                     f"a divisor of the query heads ({self.heads.value()})")))
            self.model_error.show()
            self.error.hide()
            return False
        self.model_error.hide()
        try:
            validate(self.session_config())
            if not self.prompt().strip():
                raise ConfigError("prompt", "", "some text")
        except (ConfigError, ValueError) as error:
            self.error.setText(str(error))
            self.error.show()
            return False
        self.error.hide()
        return True

    def view_options(self) -> dict:
        return {"layer": self.layer.value(), "head": self.head.currentData(),
                "shade": self.shade.currentData(), "log_scale": self.scale.currentText() == "log",
                "fixed_scale": self.fixed_scale.isChecked()}

    def set_model_shape(self, n_layers: int, n_heads: int, n_kv_heads: int = 0,
                        layer_kinds: list[str] | None = None) -> None:
        """Fit the layer and head selectors to the loaded model, keeping the selection when it exists;
        `layer_kinds` ('global', 'local W=512' per layer) for a hybrid cache: the layer box says which."""
        with self.quiet():
            self._layer_kinds = layer_kinds
            self.layer.setMaximum(n_layers - 1)
            self._show_layer_kind()
            head = self.head.currentData()
            self.head.clear()
            self.head.addItem("mean of heads", None)
            for h in range(n_heads):
                self.head.addItem(head_label(h, n_heads, n_kv_heads), h)
            self.head.setCurrentIndex(0 if head is None or head >= n_heads else head + 1)

    def _show_layer_kind(self) -> None:
        kinds = self._layer_kinds
        self.layer.setSuffix(f"  ({kinds[self.layer.value()]})" if kinds and self.layer.value() < len(kinds) else "")

    # --- the state's (pagevis.gui.session.controls_state), called on the panel by the window and presets --------
    def set_configuration(self, spec: ModelSpec | None = None, prompt: str | None = None,
                          config: SessionConfig | None = None) -> None:
        self.state.set_configuration(spec, prompt, config)

    def to_dict(self) -> dict:
        return self.state.to_dict()

    def from_dict(self, data: dict) -> None:
        self.state.from_dict(data)

    @contextmanager
    def quiet(self):
        """Set inputs without emitting session_changed or view_changed (a configuration being shown)."""
        self._loading = True
        try:
            yield
        finally:
            self._loading = False

    def refresh(self) -> None:
        """The rows, the capacity and the inline check, after inputs were set quietly."""
        self._update_model_rows()
        self._update_sampling_rows()
        self._update_capacity()
        self.check()

def _show_rows(rows, visible: bool) -> None:
    """Show or hide form rows given as (form, widget) pairs."""
    for form, widget in rows:
        form.setRowVisible(widget, visible)
