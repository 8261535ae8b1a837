"""The controls' configuration in and out (the ControlsState a ControlsPanel holds): show a configuration (launch's
arguments, a preset, the saved settings) without restarting anything, the dictionary the app saves, and what the
configuration holds that no input shows (the GGUF file, the swap folder, each policy's parameters, the restored
layer)."""

from __future__ import annotations

from pathlib import Path

from PySide6.QtCore import Qt

from pagevis import settings
from pagevis.engine import ModelSpec, SessionConfig
from pagevis.kvcache import ConfigError
from pagevis.gui.session.presets import model_title
from pagevis.gui.session.runner import validate
from pagevis.gui.widgets.setting_inputs import write_input
from pagevis.presets import default_prompt

# The synthetic model's shape inputs: (the panel's input, which is also its key in the saved dictionary; the
# ModelSpec field it shows).
SPEC_INPUTS = (("layers", "n_layers"), ("heads", "n_heads"), ("kv_heads", "n_kv_heads"), ("head_dim", "head_dim"),
               ("model_seed", "seed"), ("sliding_window", "sliding_window"), ("global_every", "global_every"))


class ControlsState:
    """A ControlsPanel's configuration in and out (`panel.state`): it writes the panel's inputs quietly (no
    session_changed, no view_changed) and reads them through the panel's model_spec, prompt, session_config and
    view_options; it holds the GGUF file shown (`gguf_path`), the swap folder (from --swap-dir: no input shows it),
    the parameters each policy had when last shown (`param_values`) and the layer the restored settings showed."""

    def __init__(self, panel):
        self.panel = panel
        self.gguf_path: str | None = None
        self.swap_dir: str | None = None
        self.param_values: dict[str, dict[str, object]] = {}  # policy name -> its parameters, kept across switches
        self._saved_layer: int | None = None

    def set_configuration(self, spec: ModelSpec | None = None, prompt: str | None = None,
                          config: SessionConfig | None = None) -> None:
        """Show a configuration (from launch() arguments or saved settings) without emitting anything."""
        panel = self.panel
        with panel.quiet():
            if spec is not None:
                if spec.kind == "gguf":
                    self.set_gguf(spec.path)  # while quiet: showing the file restarts nothing
                else:
                    panel.model.setCurrentIndex(panel.model.findData(spec.kind))
                for name, field in SPEC_INPUTS:
                    getattr(panel, name).setValue(getattr(spec, field))
            if prompt is not None:
                panel.prompt_edit.setPlainText(prompt)
            if config is not None:
                self.param_values[config.policy] = dict(config.policy_params)
                values = settings.values(config)
                for name, widget in panel.inputs.items():
                    write_input(widget, values[name])
                panel.rebuild_params()
                self.swap_dir = config.swap_dir
        panel.refresh()

    def set_gguf(self, path: str) -> None:
        """Show a GGUF file as the model (File ▸ Open GGUF model, --model FILE)."""
        self.gguf_path = path
        model = self.panel.model
        index = model.findData("gguf")
        if index < 0:
            model.addItem("", "gguf")
            index = model.count() - 1
        title = model_title(path)
        model.setItemText(index, title if title != Path(path).name else f"GGUF: {title}")
        model.setItemData(index, path, Qt.ToolTipRole)
        model.setCurrentIndex(index)

    def take_saved_layer(self) -> int | None:
        """The layer the restored settings showed, once (the first session shows it), then None."""
        layer, self._saved_layer = self._saved_layer, None
        return layer

    def to_dict(self) -> dict:
        """What the app saves (QSettings): the model, the prompt, the settings the controls show (the settings
        table's JSON form, as a trace header holds it) and the view options."""
        panel = self.panel
        spec = panel.model_spec() if panel.model.currentData() != "gguf" else ModelSpec()
        return {
            "model": spec.kind, "gguf": self.gguf_path or "",
            **{name: getattr(spec, field) for name, field in SPEC_INPUTS},
            "prompt": panel.prompt(), **settings.to_dict(panel.session_config(), where=lambda s: s.app),
            **{f"view_{k}": v for k, v in panel.view_options().items()},
        }

    def from_dict(self, data: dict) -> None:
        """Restore saved settings; anything missing or invalid keeps its default."""
        data = dict(data)
        if isinstance(data.get("sampling"), str):  # saved before the settings table: sampling keys at the top
            flat = {s.name: data[s.name] for s in settings.in_group("sampling") if s.name in data}
            data["sampling"] = {**flat, "mode": data["sampling"]}
        try:
            spec = ModelSpec(kind=data.get("model", "smollm2"), n_layers=int(data.get("layers", 4)),
                             n_heads=int(data.get("heads", 8)), n_kv_heads=int(data.get("kv_heads", 2)),
                             head_dim=int(data.get("head_dim", 32)), seed=int(data.get("model_seed", 0)),
                             sliding_window=int(data.get("sliding_window", 0)),
                             global_every=int(data.get("global_every", 0)))
            config = settings.from_dict(data, SessionConfig())
            validate(config)
        except (ConfigError, ValueError, TypeError):
            return
        self.set_configuration(spec, data.get("prompt") or default_prompt(spec.kind), config)
        panel = self.panel
        with panel.quiet():
            panel.shade.setCurrentIndex(max(0, panel.shade.findData(data.get("view_shade", "age"))))
            panel.scale.setCurrentText("log" if data.get("view_log_scale") else "linear")
            self._saved_layer = int(data.get("view_layer", 0))
