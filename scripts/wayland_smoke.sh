#!/usr/bin/env bash
# Wayland smoke test (see scripts/wayland_smoke.py), run by hand, not by CI: the app with Qt's wayland
# plugin on a headless weston (pixman renderer, --debug for its screenshooter), on SmolLM2.
# Needs weston (Debian: apt-get install --no-install-recommends weston, about 50 packages) and the
# project's .venv. Exit status 0 when it passed, 1 when it failed, 0 with a printed reason when skipped.
set -uo pipefail
cd "$(dirname "$0")/.."

PY=${PY:-.venv/bin/python}
OUT=${OUT:-build/wayland-smoke}
SMOKE_TIMEOUT=${SMOKE_TIMEOUT:-300}

skip() { echo "wayland smoke: SKIPPED: $*"; exit 0; }
[ -x "$PY" ] || skip "no $PY (run make install first)"
command -v weston >/dev/null && command -v weston-screenshooter >/dev/null || skip "no weston (apt-get install weston)"

runtime=$(mktemp -d)  # weston's XDG_RUNTIME_DIR: its socket lives here, owned by us, mode 0700
chmod 700 "$runtime"
export XDG_RUNTIME_DIR=$runtime WAYLAND_DISPLAY=pagevis-smoke
mkdir -p "$OUT"
timeout "$SMOKE_TIMEOUT" weston --backend=headless-backend.so --use-pixman --debug --idle-time=0 \
  --socket="$WAYLAND_DISPLAY" --width=1600 --height=1000 >"$OUT/weston.log" 2>&1 &
weston_pid=$!
for _ in $(seq 50); do [ -S "$runtime/$WAYLAND_DISPLAY" ] && break; sleep 0.2; done
[ -S "$runtime/$WAYLAND_DISPLAY" ] || { kill "$weston_pid" 2>/dev/null; rm -rf "$runtime"; skip "weston did not start (see $OUT/weston.log)"; }
sleep 1  # its shell draws the desktop first

timeout "$SMOKE_TIMEOUT" "$PY" scripts/wayland_smoke.py "$OUT"
status=$?
kill "$weston_pid" 2>/dev/null
wait "$weston_pid" 2>/dev/null
rm -rf "$runtime"
exit $(( status != 0 ))
