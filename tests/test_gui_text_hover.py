"""The text view's tooltips: hovering a token says its position, whether the selected layer still holds it and the
attention it gets (looked up on hover: the HTML carries no tooltip per token)."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("pytestqt")
from PySide6.QtCore import QEvent, QPoint  # noqa: E402
from PySide6.QtGui import QHelpEvent, QTextCursor  # noqa: E402
from PySide6.QtWidgets import QApplication, QToolTip  # noqa: E402

from gui_helpers import step  # noqa: E402


def test_token_starts_follow_the_shown_text():
    from pagevis.gui.widgets.text import token_starts

    # a line break shows as '↵' and a new line, an empty token as '∅'; a character the document dropped ('\r')
    # leaves the next token found where it is
    plain = "ab↵\ncd∅ e"
    assert token_starts(plain, ["a", "b\n", "cd", "", " e"]).tolist() == [0, 1, 4, 6, 7]
    assert token_starts("xy z", ["x", "y\r", " z"]).tolist() == [0, 1, 2]
    assert token_starts("… 3 … ab", ["a", "b"], start=6).tolist() == [6, 7]


def test_hovering_a_token_says_its_position_residency_and_attention(qtbot, window):
    step(qtbot, window, 6)  # 4 x 4 slots: the prompt's 17 tokens did not fit, so some are evicted
    window.redraw()
    text = window.text
    assert text.tints and not all(t.resident for t in text.tints)
    browser = text.browser
    at = 0
    for index, tint in enumerate(text.tints):
        shown = tint.text.replace("\n", "↵\n") or "∅"
        cursor = QTextCursor(browser.document())
        cursor.setPosition(at)
        rect = browser.cursorRect(cursor)  # the caret before the token's first character, in the viewport
        point = QPoint(rect.right() + 2, rect.center().y())
        expected = (f"position {tint.position}: {'resident' if tint.resident else 'evicted'}, "
                    f"attention {tint.attention:.3g}")
        assert text.token_at(point) == index and text.tooltip_at(point) == expected, (index, tint)
        at += len(shown)
    # the viewport's tooltip event shows it (the last token's)
    viewport = browser.viewport()
    QApplication.sendEvent(viewport, QHelpEvent(QEvent.ToolTip, point, viewport.mapToGlobal(point)))
    assert QToolTip.text() == expected
    below = browser.viewport().rect().bottomLeft() - QPoint(-2, 2)
    assert text.tooltip_at(below) == ""  # under the last line: no token
    assert "title=" not in browser.toHtml() and np.all(np.diff(text._starts) > 0)
