"""The app's input widgets, and those of its settings made from the settings table (pagevis/settings.py): a
spin box's range, step and default, a combo box's choices, a check box's text and every tooltip come from
there, and `read_input` / `write_input` move values between a widget and its setting."""

from __future__ import annotations

from PySide6.QtCore import QEvent, Qt
from PySide6.QtWidgets import QCheckBox, QComboBox, QDoubleSpinBox, QSpinBox, QWidget

from pagevis import settings

MAX_SPIN = 2**31 - 1  # a QSpinBox holds a C int


class _WheelOnlyWhenFocused:
    """The wheel changes the value only once the box has focus (a click or Tab): over an unfocused box it
    scrolls the controls panel, as a user scrolling the panel expects, instead of silently restarting the
    session with a new page size."""

    def wheelEvent(self, event) -> None:
        if self.hasFocus():
            super().wheelEvent(event)
        else:
            event.ignore()  # the scroll area under the box gets it

    def event(self, event) -> bool:
        # a focused spin box claims Space (its line edit takes it as text, and refuses it): left unclaimed,
        # Space stays the window's play / pause, whichever box was clicked last
        if event.type() == QEvent.ShortcutOverride and event.key() == Qt.Key_Space and not event.modifiers():
            return False
        return super().event(event)


class ComboBox(_WheelOnlyWhenFocused, QComboBox):
    pass


class SpinBox(_WheelOnlyWhenFocused, QSpinBox):
    pass


class DoubleSpinBox(_WheelOnlyWhenFocused, QDoubleSpinBox):
    pass


def _no_wheel_focus(box):
    box.setFocusPolicy(Qt.StrongFocus)  # the wheel never gives focus (Qt's default WheelFocus would)
    return box


def combo() -> QComboBox:
    box = _no_wheel_focus(ComboBox())
    box.setSizeAdjustPolicy(QComboBox.AdjustToMinimumContentsLengthWithIcon)
    box.setMinimumContentsLength(8)
    return box


def spin(low: int, high: int, value: int, tip: str = "", step: int = 1) -> QSpinBox:
    box = _no_wheel_focus(SpinBox())
    box.setRange(low, high)
    box.setValue(value)
    box.setSingleStep(step)
    box.setToolTip(tip)
    box.setKeyboardTracking(False)  # typing "128" restarts once, not at "1", "12" and "128"
    return box


def dspin(low: float, high: float, value: float, step: float, decimals: int = 2) -> QDoubleSpinBox:
    box = _no_wheel_focus(DoubleSpinBox())
    box.setRange(low, high)
    box.setDecimals(decimals)
    box.setSingleStep(step)
    box.setValue(value)
    box.setKeyboardTracking(False)
    return box


def setting_input(name: str, tip_prefix: str = "", value=None) -> QWidget:
    """The widget for one setting: a check box (bool), a combo box of its choices (str), a spin box over the
    app's range of its bounds (int, float); showing `value`, else the setting's default."""
    s = settings.setting(name)
    value = s.default if value is None else value
    if s.kind == "bool":
        box = QCheckBox(s.label)
    elif s.kind == "str":
        box = combo()
        for choice in s.choice_list():
            box.addItem(choice, choice)
    elif s.kind in ("int", "float"):
        low, high = s.app_range or (s.low, s.high)
        if s.kind == "int":
            box = spin(int(low), int(min(high, MAX_SPIN)), int(low), step=int(s.app_step))
        else:
            box = dspin(low, high, low, s.app_step)
    else:
        raise ValueError(f"setting {name!r} ({s.kind}) has no input widget of its own")
    write_input(box, value)
    box.setToolTip(tip_prefix + s.help)
    box.setProperty("setting", name)
    return box


def read_input(box: QWidget):
    if isinstance(box, QCheckBox):
        return box.isChecked()
    if isinstance(box, QComboBox):
        return box.currentData()
    if isinstance(box, QDoubleSpinBox):
        return round(box.value(), 4)  # the box's binary value, as the decimals it shows
    return box.value()


def write_input(box: QWidget, value) -> None:
    if isinstance(box, QCheckBox):
        box.setChecked(bool(value))
    elif isinstance(box, QComboBox):
        box.setCurrentIndex(max(box.findData(value), 0))
    else:
        box.setValue(value)
