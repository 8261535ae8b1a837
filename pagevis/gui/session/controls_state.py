"""The controls' configuration in and out (a part of ControlsPanel, by job): show a configuration (launch's
arguments, a preset, the saved settings) without restarting anything, and the dictionary the app saves."""

from __future__ import annotations

from pagevis import settings
from pagevis.engine import ModelSpec, SessionConfig
from pagevis.kvcache import ConfigError
from pagevis.gui.session.runner import validate
from pagevis.gui.widgets.setting_inputs import write_input
from pagevis.presets import default_prompt

# The synthetic model's shape inputs: (the panel's input, which is also its key in the saved dictionary; the
# ModelSpec field it shows).
SPEC_INPUTS = (("layers", "n_layers"), ("heads", "n_heads"), ("kv_heads", "n_kv_heads"), ("head_dim", "head_dim"),
               ("model_seed", "seed"), ("sliding_window", "sliding_window"), ("global_every", "global_every"))


class ControlsState:
    """ControlsPanel's persistence (a mixin over the panel's inputs)."""

    def set_configuration(self, spec: ModelSpec | None = None, prompt: str | None = None,
                          config: SessionConfig | None = None) -> None:
        """Show a configuration (from launch() arguments or saved settings) without emitting anything."""
        self._loading = True
        try:
            if spec is not None:
                if spec.kind == "gguf":
                    self.set_gguf(spec.path)  # while loading: showing the file restarts nothing
                else:
                    self.model.setCurrentIndex(self.model.findData(spec.kind))
                for name, field in SPEC_INPUTS:
                    getattr(self, name).setValue(getattr(spec, field))
            if prompt is not None:
                self.prompt_edit.setPlainText(prompt)
            if config is not None:
                self._param_values[config.policy] = dict(config.policy_params)
                values = settings.values(config)
                for name, widget in self._inputs.items():
                    write_input(widget, values[name])
                self._rebuild_params()
                self._swap_dir = config.swap_dir
        finally:
            self._loading = False
        self._update_model_rows()
        self._update_sampling_rows()
        self._update_capacity()
        self.check()

    def take_saved_layer(self) -> int | None:
        """The layer the restored settings showed, once (the first session shows it), then None."""
        layer, self._saved_layer = getattr(self, "_saved_layer", None), None
        return layer

    def to_dict(self) -> dict:
        """What the app saves (QSettings): the model, the prompt, the settings the controls show (the settings
        table's JSON form, as a trace header holds it) and the view options."""
        spec = self.model_spec() if self.model.currentData() != "gguf" else ModelSpec()
        return {
            "model": spec.kind, "gguf": self._gguf_path or "",
            **{name: getattr(spec, field) for name, field in SPEC_INPUTS},
            "prompt": self.prompt(), **settings.to_dict(self.session_config(), where=lambda s: s.app),
            **{f"view_{k}": v for k, v in self.view_options().items()},
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
        self._loading = True
        try:
            self.shade.setCurrentIndex(max(0, self.shade.findData(data.get("view_shade", "age"))))
            self.scale.setCurrentText("log" if data.get("view_log_scale") else "linear")
            self._saved_layer = int(data.get("view_layer", 0))
        finally:
            self._loading = False
