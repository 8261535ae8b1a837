import os

# Tests never need a screen; `make test` sets this too, this covers a bare `pytest`.
os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
