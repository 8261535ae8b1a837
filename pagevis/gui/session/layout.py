"""Where the main window's docks go: the default layout (drawn for 1600 × 1000, kept in proportion at any
size), the window's first size on a screen, and the presentation layout (View ▸ Presentation, F5,
`--present`; chosen by itself on a real display at most 1366 px wide), in which the page grid fills most of
the window, the text sits beside it, the narration line is large and every other view is a tab away."""

from __future__ import annotations

from PySide6.QtCore import QRect, QSize, Qt
from PySide6.QtGui import QGuiApplication
from PySide6.QtWidgets import QTabWidget, QWidget

from pagevis.gui.widgets.windows import set_frame_geometry

COMPACT_WIDTH = 1680  # windows this narrow tab the metrics behind the events (see size_docks): at 1440-1600 px
# three docks in the bottom row clipped the events table and the metrics titles
SMALL_WIDTH = 1366
SMALL_HEIGHT = 800  # a first window on a screen this low (or at most 1366 px wide) takes all of it
QWIDGETSIZE_MAX = (1 << 24) - 1
FIRST_SCREEN_SHARE = 0.85  # until the user's own geometry is saved, the window takes this share of the screen
GRID_SHARE = 0.64  # the presentation layout: the page grid's share of the width (the text takes the rest)
BEHIND_GRID = ("Attention", "Heads", "Weights", "Eviction events", "Metrics")  # presentation: tabs behind the grid
NARRATION_STYLE = "QLabel#narration { font-size: 13px; padding: 2px 8px; }"
PRESENTATION_NARRATION_STYLE = "QLabel#narration { font-size: 19px; padding: 2px 8px; }"


def wants_presentation(app, screen) -> bool:
    """The layout a window on this screen opens in when nothing was saved: presentation on a real display at
    most SMALL_WIDTH wide (a projector, a small laptop); never under the offscreen platform (800 × 600), where
    tests choose the layout themselves."""
    if app is None or screen is None or app.platformName() in ("offscreen", "minimal"):
        return False
    return screen.availableGeometry().width() <= SMALL_WIDTH


class DockLayout:
    """Arranges a MainWindow's docks (window.docks: title → QDockWidget) and sizes the window."""

    def __init__(self, window):
        self.window = window
        self.presentation = False

    # --- the default layout ---------------------------------------------------------------------
    def default(self) -> None:
        w, d = self.window, self.window.docks
        self._take_out_docks()
        w.setCentralWidget(None)
        w.addDockWidget(Qt.LeftDockWidgetArea, d["Controls"])
        w.addDockWidget(Qt.RightDockWidgetArea, d["Page grid"])
        w.splitDockWidget(d["Page grid"], d["Text"], Qt.Vertical)
        w.splitDockWidget(d["Page grid"], d["Attention"], Qt.Horizontal)
        w.splitDockWidget(d["Text"], d["Eviction events"], Qt.Horizontal)
        w.splitDockWidget(d["Eviction events"], d["Metrics"], Qt.Horizontal)
        w.tabifyDockWidget(d["Attention"], d["Heads"])  # heads per KV group: a tab behind the heatmap
        w.tabifyDockWidget(d["Attention"], d["Weights"])  # the step's weights as a histogram: another tab
        for view in w.views:  # a view with no place above: a tab behind the heatmap
            if w.dockWidgetArea(d[view.title]) == Qt.NoDockWidgetArea:
                w.tabifyDockWidget(d["Attention"], d[view.title])
        for title, dock in d.items():
            dock.setVisible(title != "Messages")
        d["Attention"].raise_()
        w.addDockWidget(Qt.BottomDockWidgetArea, d["Messages"])
        d["Messages"].hide()
        self.size_docks()

    def _take_out_docks(self) -> None:
        """Every dock out of its area and tab group before they are placed again: re-tabbed in place, Qt left
        the old groups' tab bars on the window."""
        for dock in self.window.docks.values():
            self.window.removeDockWidget(dock)
            dock.setFloating(False)

    def size_docks(self) -> None:
        """The default proportions (drawn for 1600 × 1000) at the window's size: absolute sizes would let Qt
        take the whole shortfall of a smaller window from the last docks, squeezing them to an ellipsis."""
        if self.presentation:
            self._size_presentation()
            return
        w, d = self.window, self.window.docks
        compact = w.width() <= COMPACT_WIDTH and w.isVisible()  # hidden, the size is not yet the real one
        if compact and d["Metrics"] not in w.tabifiedDockWidgets(d["Eviction events"]):
            # a projector (1280 × 720): metrics become a tab behind the eviction events, so that the text,
            # the events' columns and the metrics' legends get the width to show without clipping
            w.tabifyDockWidget(d["Eviction events"], d["Metrics"])
            d["Eviction events"].raise_()
        controls = max(d["Controls"].minimumSizeHint().width(), min(330, w.width() // 4))
        x = (w.width() - controls) / (1600 - 330)
        y = w.height() / 1000
        w.resizeDocks([d["Controls"]], [controls], Qt.Horizontal)
        rows = (500, 500) if compact else (540, 420)  # compact: the events' plot and the metrics get the height
        w.resizeDocks([d["Page grid"], d["Text"]], [int(rows[0] * y), int(rows[1] * y)], Qt.Vertical)
        top = (700, 570) if compact else (600, 660)  # compact: the grid keeps room beside its block table
        w.resizeDocks([d["Page grid"], d["Attention"]], [int(top[0] * x), int(top[1] * x)], Qt.Horizontal)
        bottom = [d["Text"], d["Eviction events"]] + ([] if compact else [d["Metrics"]])
        w.resizeDocks(bottom, [int(v * x) for v in ((560, 710) if compact else (380, 470, 420))], Qt.Horizontal)

    def fit_to_screen(self, share: float = FIRST_SCREEN_SHARE) -> None:
        """Take `share` of the screen's available area (at least the window's minimum, at most the area),
        centred, with the docks in their default proportions: the first window, before any saved geometry."""
        w = self.window
        screen = w.screen() or QGuiApplication.primaryScreen()
        if screen is None:
            return
        area = screen.availableGeometry()
        if area.width() <= SMALL_WIDTH or area.height() <= SMALL_HEIGHT:
            # a projector or small laptop: 85 % of 1280 × 720 squeezed the page grid to a line. Maximized,
            # the window manager fits the frame (the area itself as the inner geometry would overhang it)
            set_frame_geometry(w, area)
            w.setWindowState(w.windowState() | Qt.WindowMaximized)
            return
        size = QSize(int(area.width() * share), int(area.height() * share))
        size = size.expandedTo(w.minimumSizeHint()).boundedTo(area.size())
        rect = QRect(0, 0, size.width(), size.height())
        rect.moveCenter(area.center())
        set_frame_geometry(w, rect)

    # --- the presentation layout ----------------------------------------------------------------
    def set_presentation(self, on: bool, arrange: bool = True) -> None:
        """Switch layouts. `arrange=False`: the docks are already where they belong (a restored state)."""
        w = self.window
        if on == self.presentation and arrange:
            return
        self.presentation = on
        w.narration.setStyleSheet(PRESENTATION_NARRATION_STYLE if on else NARRATION_STYLE)
        w.narration.setWordWrap(on)  # two lines at the large size rather than a clipped one
        self.fit_narration()
        w.page_grid.set_presentation(on)
        w.text.set_presentation(on)
        w.setTabPosition(Qt.AllDockWidgetAreas, QTabWidget.North if on else QTabWidget.South)
        for dock in w.docks.values():  # the tabs name the docks: no title bars under them
            dock.setTitleBarWidget(QWidget(dock) if on else None)
        w.presentation_action.setChecked(on)
        if on:
            w.transport.use_presenter_pace()
        if w.presets.banner.isVisible():
            w.presets.banner.set_large(on)
        w.status_step.holder.setVisible(not on)
        w.lifecycle.fit_model_status()  # the transport says the step: the status bar's messages get the room
        if not arrange:
            return
        if on:
            self._arrange_presentation()
        else:
            self.default()
        w.renderer.request_render()

    def fit_narration(self) -> None:
        """Presentation: the narration line spans the window (an expanding widget in its toolbar) and holds two
        lines of its large font (a toolbar lays a wrapping label out at its size hint, a narrow column)."""
        label = self.window.narration  # a SteadyLabel: its holder spans the toolbar's row in both layouts
        if self.presentation:
            label.ensurePolished()
            label.setMinimumWidth(200)
            label.setFixedHeight(2 * label.fontMetrics().lineSpacing() + 6)
        else:
            label.setMinimumSize(0, 0)
            label.setMaximumSize(QWIDGETSIZE_MAX, QWIDGETSIZE_MAX)
        label.refit()

    def _arrange_presentation(self) -> None:
        """The page grid on the left, most of the width; the text beside it, the controls a tab behind it;
        every other view a tab behind the grid (one click away, at the grid's size)."""
        w, d = self.window, self.window.docks
        self._take_out_docks()
        w.addDockWidget(Qt.LeftDockWidgetArea, d["Page grid"])
        w.addDockWidget(Qt.RightDockWidgetArea, d["Text"])
        for title in BEHIND_GRID:
            w.tabifyDockWidget(d["Page grid"], d[title])
        for view in w.views:  # a view added later: behind the grid too
            if view.title not in BEHIND_GRID and view.title not in ("Page grid", "Text"):
                w.tabifyDockWidget(d["Page grid"], d[view.title])
        w.tabifyDockWidget(d["Text"], d["Controls"])
        for title, dock in d.items():
            dock.setVisible(title != "Messages")
        d["Page grid"].raise_()
        d["Text"].raise_()
        w.addDockWidget(Qt.BottomDockWidgetArea, d["Messages"])
        d["Messages"].hide()
        self._size_presentation()

    def _size_presentation(self) -> None:
        w, d = self.window, self.window.docks
        grid = int(w.width() * GRID_SHARE)
        w.resizeDocks([d["Page grid"], d["Text"]], [grid, w.width() - grid], Qt.Horizontal)
