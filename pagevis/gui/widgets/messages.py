"""The Messages panel: one line per problem, the traceback (if any) behind a Details toggle."""

from __future__ import annotations

import time

from PySide6.QtWidgets import QHBoxLayout, QPlainTextEdit, QToolButton, QVBoxLayout, QWidget


class MessagesPanel(QWidget):
    """A log of one-line messages. A message may carry details (a traceback): they stay hidden until the user
    presses Details, which shows those of the latest message that has any."""

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.log = QPlainTextEdit(readOnly=True)
        self.log.setMaximumBlockCount(2000)  # a session that fails every step must not grow the log without end
        self.details = QPlainTextEdit(readOnly=True)
        self.details.setLineWrapMode(QPlainTextEdit.NoWrap)
        self.details.hide()
        self.toggle = QToolButton(text="Details", checkable=True, enabled=False)
        self.toggle.setToolTip("Show the traceback of the latest error (for a bug report)")
        self.toggle.toggled.connect(self.details.setVisible)
        bar = QHBoxLayout()
        bar.setContentsMargins(0, 0, 0, 0)
        bar.addStretch(1)
        bar.addWidget(self.toggle)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(2, 2, 2, 2)
        layout.addWidget(self.log, 1)
        layout.addWidget(self.details, 2)
        layout.addLayout(bar)

    def report(self, message: str, detail: str = "") -> str:
        """Add one line (the first line of `message`, time-stamped); keep `detail` behind the toggle. Returns the
        line as shown."""
        first, _, rest = message.strip().partition("\n")
        line = f"[{time.strftime('%H:%M:%S')}] {first}"
        self.log.appendPlainText(line)
        detail = "\n".join(part for part in (rest.strip(), detail.rstrip()) if part)
        if detail:
            self.details.setPlainText(f"{first}\n\n{detail}")
            self.toggle.setEnabled(True)
        return line

    def appendPlainText(self, text: str) -> None:  # noqa: N802 - the QPlainTextEdit name callers already use
        self.log.appendPlainText(text)

    def toPlainText(self) -> str:  # noqa: N802
        return self.log.toPlainText()

    def details_text(self) -> str:
        return self.details.toPlainText()

    def clear(self) -> None:
        self.log.clear()
        self.details.clear()
        self.toggle.setChecked(False)
        self.toggle.setEnabled(False)
