"""The engine, model and decoding layers never import Qt (the GUI only renders their snapshots)."""

import subprocess
import sys

import pytest


@pytest.mark.parametrize("package", ["pagevis.engine", "pagevis.model", "pagevis.decoding"])
def test_core_packages_import_no_qt(package):
    code = (
        f"import sys, {package}; "
        "qt = sorted(m for m in sys.modules if m.split('.')[0] in "
        "('PySide6', 'PyQt5', 'PyQt6', 'shiboken6', 'pyqtgraph', 'superqt', 'qtpy') or m.startswith('pagevis.gui')); "
        "print(','.join(qt))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"{package} imported {out.stdout.strip()}"
