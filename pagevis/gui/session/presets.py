"""What choosing a demo preset does in the main window: its settings (and its own model, or the default one
back), its point in a banner under the narration line, and the session playing by itself once it is ready.
An A/B preset opens the A/B window on its two configurations instead."""

from __future__ import annotations

import html
from pathlib import Path

from PySide6.QtCore import Qt
from PySide6.QtWidgets import QLabel, QSizePolicy, QToolBar

from pagevis.engine import ModelSpec
from pagevis.presets import PRESETS, default_prompt
from pagevis.gui.widgets import theme

MODEL_TITLES = {"smollm2": "SmolLM2-135M-Instruct", "gemma3-270m": "Gemma 3 270M"}  # models known by name
FILE_TITLES = (("gemma-3-270m", "Gemma 3 270M"), ("smollm2-135m", "SmolLM2-135M-Instruct"))  # their files' names


def model_title(label: str, titles: dict[str, str] | None = None) -> str:
    """What the status bar calls a model: the name a preset gave its file, a known model's name from its file
    name, or a GGUF's file name — never a whole path (the tooltip has it)."""
    if titles and label in titles:
        return titles[label]
    if not label.lower().endswith(".gguf"):
        return label
    name = Path(label).name
    return next((title for prefix, title in FILE_TITLES if name.lower().startswith(prefix)), name)


def preset_point(preset) -> str:
    """The preset's point in one line: its own (`point`, where the preset states one), else its description's
    first sentence."""
    point = getattr(preset, "point", "") or ""
    return point or preset.description.split(". ")[0].rstrip(".") + "."


def is_default(preset) -> bool:
    return preset is PRESETS[0]


class PresetBanner(QToolBar):
    """One line under the narration: the chosen preset, its point and (when it says more) its description;
    hidden until a preset is chosen and again once the user changes a setting."""

    def __init__(self, parent=None):
        super().__init__("Preset", parent)
        self.setObjectName("preset_banner")
        self.setMovable(False)
        self.label = QLabel()
        self.label.setObjectName("preset_point")
        self.label.setWordWrap(True)
        self.label.setSizePolicy(QSizePolicy.Expanding, QSizePolicy.Fixed)
        self.label.setMinimumWidth(200)
        self.label.setStyleSheet(f"QLabel#preset_point {{ color: {theme.TEXT}; padding: 2px 8px; }}")
        self.label.setTextInteractionFlags(Qt.TextSelectableByMouse)
        self.addWidget(self.label)
        self.hide()

    def show_preset(self, preset, large: bool = False) -> None:
        point, description = preset_point(preset), preset.description.strip()
        rest = description[len(point.rstrip(".")):].lstrip(". ") if description.startswith(point.rstrip(".")) \
            else description  # the description's sentences after the point (the first), or all of it
        text = (f"<span style='color:{theme.ACCENT}'>&#9656; <b>{html.escape(preset.name)}</b></span>: "
                f"{html.escape(point)}")
        if rest:
            text += f" <span style='color:{theme.MUTED}'>{html.escape(rest)}</span>"
        self.label.setText(text)
        self.label.setToolTip(description)
        self.set_large(large)
        self.show()

    def set_large(self, large: bool) -> None:
        self.label.setStyleSheet(f"QLabel#preset_point {{ color: {theme.TEXT}; padding: 2px 8px; "
                                 f"font-size: {15 if large else 12}px; }}")
        self.fit()

    def fit(self) -> None:
        """The label's height for its text at the toolbar's width (a toolbar ignores height-for-width)."""
        window = self.parentWidget()
        width = max((window.width() if window is not None else self.width()) - 24, 200)
        self.label.ensurePolished()
        self.label.setFixedHeight(self.label.heightForWidth(width) if self.label.text() else 0)

    def resizeEvent(self, event) -> None:
        super().resizeEvent(event)
        self.fit()

    @property
    def text(self) -> str:
        return self.label.text()


class PresetPlayer:
    """Applies presets to a MainWindow (its controls, runner, banner and status bar)."""

    def __init__(self, window):
        self.window = window
        self.current = None  # the preset whose session is shown (None once a setting changed)
        self._pending = False  # the next session to start is the current preset's
        self.play_on_start = False  # the next session to start plays by itself
        self.model_from_preset = False  # the model was a preset's own (Gemma's): a later preset returns to ours
        self.titles: dict[str, str] = {}  # model label → the name a preset gave it
        self.banner = PresetBanner(window)

    def apply(self, preset) -> None:
        """Set the preset's prompt and cache (the synthetic model keeps a prompt that fits it) and restart,
        playing; an A/B preset opens the A/B window on both of its configurations instead. "Default" is
        every default: SmolLM2, its prompt, layer 0."""
        w = self.window
        controls = w.controls
        spec = None
        if preset.model is not None:  # a preset of its own model (Gemma 3's): that model, or why it cannot be
            from pagevis.model import ModelLoadError
            from pagevis.model.locate import named_model_path

            try:
                path = named_model_path(preset.model)
            except ModelLoadError as error:
                w.statusBar().showMessage(f"Preset {preset.name!r}: {error}", 15000)
                return
            spec = ModelSpec(kind="gguf", path=str(path))
            self.titles[spec.label] = MODEL_TITLES.get(preset.model, preset.model)
        elif is_default(preset) or self.model_from_preset:
            spec = ModelSpec()
        kind = spec.kind if spec is not None else controls.model.currentData()
        prompt = preset.prompt_text() if kind != "synthetic" or preset.model else default_prompt("synthetic")
        self.model_from_preset = preset.model is not None
        w.transport.use_presenter_pace()  # a preset plays at a pace an audience follows, never at max speed
        if preset.b is not None:  # the A/B window's session, its banner there: the main window's stays as it is
            if spec is not None:
                controls.set_configuration(spec)
            w.open_ab(preset.a, preset.b, prompt, title=preset.name, play=True)
            return
        self.announce(preset)
        controls.set_configuration(spec, prompt, preset.a)
        if is_default(preset):
            controls.layer.setValue(0)
        self.play_on_start = True
        w.restart(f"preset {preset.name!r}")

    def announce(self, preset) -> None:
        """The preset's point in the banner for the session about to start (also for a preset given on the
        command line). The session is the preset's: the window does not save its settings."""
        self.current = preset
        self._pending = True
        self.window.session_source = "preset"
        self.banner.show_preset(preset, large=self.window.presentation)

    def session_started(self, reason: str = "") -> None:
        """A new session is ready: the preset's own (play it if the preset asked to), the preset's restarted
        (Reset keeps the banner), or another one (a replay, the previous run): the banner goes with the
        preset's session."""
        if getattr(self, "_pending", False) or (self.current is not None and reason == "reset"):
            self._pending = False
            if self.play_on_start:
                self.play_on_start = False
                self.window.runner.play()
            return
        self.drop()

    def settings_changed(self) -> None:
        """The user changed a setting: the session is no longer the preset's."""
        self.drop()

    def drop(self) -> None:
        """No preset's session is shown: no banner (nor in an export of the window)."""
        self.current = None
        self._pending = False
        self.play_on_start = False
        self.banner.hide()
