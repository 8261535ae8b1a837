#!/usr/bin/env bash
# Real-display smoke test (see scripts/xvfb_smoke.py): the app on a real X server (Xvfb) with Qt's xcb
# platform, on SmolLM2, checked against the X server's own screen capture; then a presenter's rehearsal
# (presets, quit, relaunch: the defaults, no banner).
#
# Sets up what it needs where it can: Xvfb, xauth and xwd, and the system libraries the PySide6 wheel's xcb
# plugin lacks (found by ldd: python -m pagevis.platform_check), from Debian/Ubuntu packages with apt-get.
# Exit status: 0 when the smoke test passed or was skipped (the reason is printed: no apt-get, no root or
# sudo, no network, no Linux); 1 when it ran and failed. Needs the project's .venv (make install).
set -uo pipefail
cd "$(dirname "$0")/.."

PY=${PY:-.venv/bin/python}
SCREEN=${SCREEN:-1600x1000}
OUT=${OUT:-build/xvfb-smoke}
APT_TIMEOUT=${APT_TIMEOUT:-300}   # seconds for apt-get update, then for apt-get install
SMOKE_TIMEOUT=${SMOKE_TIMEOUT:-300}  # seconds for the whole run under Xvfb (five app runs on SmolLM2: two screenshots, a rehearsal of three launches)

skip() { echo "xvfb smoke: SKIPPED: $*"; exit 0; }

[ "$(uname -s)" = Linux ] || skip "not Linux (Xvfb and Qt's xcb plugin are tested on Linux)"
[ -x "$PY" ] || skip "no $PY (run make install first)"

missing_tools() {
  local tool
  for tool in Xvfb xvfb-run xauth xwd; do command -v "$tool" >/dev/null || echo "$tool"; done
}
libraries=$("$PY" -m pagevis.platform_check --missing-packages debian) || skip "the platform check failed to run"
if [ -n "$(missing_tools)" ] || [ -n "$libraries" ]; then
  command -v apt-get >/dev/null || skip "no apt-get to install xvfb, xauth, x11-apps $libraries"
  sudo=""
  if [ "$(id -u)" != 0 ]; then
    sudo -n true 2>/dev/null || skip "not root and no password-less sudo to install xvfb, xauth, x11-apps $libraries"
    sudo="sudo -n"
  fi
  echo "xvfb smoke: installing xvfb xauth x11-apps $libraries"
  timeout "$APT_TIMEOUT" $sudo apt-get update -qq >/dev/null 2>&1 \
    || skip "apt-get update failed or took over ${APT_TIMEOUT}s (no network?)"
  # shellcheck disable=SC2086 - the package list is meant to split
  timeout "$APT_TIMEOUT" $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
    xvfb xauth x11-apps $libraries >/dev/null 2>&1 \
    || skip "apt-get install xvfb xauth x11-apps $libraries failed or took over ${APT_TIMEOUT}s"
  [ -z "$(missing_tools)" ] || skip "still missing after the install: $(missing_tools)"
fi

mkdir -p "$OUT"
echo "xvfb smoke: Xvfb ${SCREEN}x24, QT_QPA_PLATFORM=xcb, pictures in $OUT"
# -br: a black root window, so that in the X server's own capture the window is the box of non-black pixels
timeout "$SMOKE_TIMEOUT" xvfb-run -a -s "-screen 0 ${SCREEN}x24 -br -nolisten tcp" \
  "$PY" scripts/xvfb_smoke.py "$OUT" "$SCREEN"
status=$?
[ $status = 124 ] && echo "xvfb smoke: FAILED: over ${SMOKE_TIMEOUT}s"
exit $(( status != 0 ))
