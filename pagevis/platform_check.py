"""Before Qt starts: can the Qt platform plugin this desktop needs load here, and if not, what to install.

The PySide6 wheel ships Qt's xcb (X11) and wayland plugins but not the system libraries they link to; on a
minimal Debian/Ubuntu some are missing (libxcb-cursor0, libxcb-icccm4, libxcb-keysyms1 …) and Qt aborts
with "no Qt platform plugin could be initialized". This module runs `ldd` on the plugin the app will use,
maps each missing library to the package that provides it, and says exactly what to install. It never
imports Qt (it finds PySide6 with importlib.util.find_spec), so it can run before QApplication exists.

`python -m pagevis.platform_check` prints the verdict; `--missing-packages debian` (or `fedora`) prints
only the packages to install; `--install` installs them where it can — as root or with password-less sudo,
with apt-get or dnf, printing each command before it runs — and elsewhere says what to install (what
`make run`, `make test` and `make deps` do; PAGEVIS_NO_SYSTEM_INSTALL=1 keeps them from installing).
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import socket
import subprocess
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

SKIP_VARIABLE = "PAGEVIS_SKIP_PLATFORM_CHECK"  # set to 1 to let Qt try anyway
NO_INSTALL_VARIABLE = "PAGEVIS_NO_SYSTEM_INSTALL"  # set to 1: `make run` says what to install, installs nothing
EXIT_STATUS = 3  # pagevis's status for "the desktop cannot open here" (2 is a usage error)

# What `ldd` checks per platform: the plugin and the Qt integration library it loads (its own
# dependencies are in the plugin's ldd listing too, since ldd resolves the whole tree).
PLATFORM_FILES = {
    "xcb": ("plugins/platforms/libqxcb.so", "lib/libQt6XcbQpa.so.6"),
    "wayland": ("plugins/platforms/libqwayland.so", "lib/libQt6WaylandClient.so.6"),
}

# soname -> (Debian/Ubuntu package, Fedora package). The Debian names of every library the xcb and
# wayland plugins of the wheel resolve to were checked against `dpkg -S` on Debian 12 (a test repeats
# that where dpkg exists); the Fedora names are those of Fedora's xcb-util-*, libglvnd and mesa packages.
PACKAGES: dict[str, tuple[str, str]] = {
    "libxcb-cursor.so.0": ("libxcb-cursor0", "xcb-util-cursor"),
    "libxcb-icccm.so.4": ("libxcb-icccm4", "xcb-util-wm"),
    "libxcb-keysyms.so.1": ("libxcb-keysyms1", "xcb-util-keysyms"),
    "libxcb-image.so.0": ("libxcb-image0", "xcb-util-image"),
    "libxcb-render-util.so.0": ("libxcb-render-util0", "xcb-util-renderutil"),
    "libxcb-util.so.1": ("libxcb-util1", "xcb-util"),
    "libxcb-randr.so.0": ("libxcb-randr0", "libxcb"),
    "libxcb-render.so.0": ("libxcb-render0", "libxcb"),
    "libxcb-shape.so.0": ("libxcb-shape0", "libxcb"),
    "libxcb-shm.so.0": ("libxcb-shm0", "libxcb"),
    "libxcb-sync.so.1": ("libxcb-sync1", "libxcb"),
    "libxcb-xfixes.so.0": ("libxcb-xfixes0", "libxcb"),
    "libxcb-xinerama.so.0": ("libxcb-xinerama0", "libxcb"),
    "libxcb-xinput.so.0": ("libxcb-xinput0", "libxcb"),
    "libxcb-xkb.so.1": ("libxcb-xkb1", "libxcb"),
    "libxcb-glx.so.0": ("libxcb-glx0", "libxcb"),
    "libxcb.so.1": ("libxcb1", "libxcb"),
    "libX11-xcb.so.1": ("libx11-xcb1", "libX11-xcb"),
    "libX11.so.6": ("libx11-6", "libX11"),
    "libXau.so.6": ("libxau6", "libXau"),
    "libXdmcp.so.6": ("libxdmcp6", "libXdmcp"),
    "libSM.so.6": ("libsm6", "libSM"),
    "libICE.so.6": ("libice6", "libICE"),
    "libxkbcommon.so.0": ("libxkbcommon0", "libxkbcommon"),
    "libxkbcommon-x11.so.0": ("libxkbcommon-x11-0", "libxkbcommon-x11"),
    "libEGL.so.1": ("libegl1", "libglvnd-egl"),
    "libGL.so.1": ("libgl1", "libglvnd-glx"),
    "libGLX.so.0": ("libglx0", "libglvnd-glx"),
    "libOpenGL.so.0": ("libopengl0", "libglvnd-opengl"),
    "libGLdispatch.so.0": ("libglvnd0", "libglvnd"),
    "libfontconfig.so.1": ("libfontconfig1", "fontconfig"),
    "libfreetype.so.6": ("libfreetype6", "freetype"),
    "libglib-2.0.so.0": ("libglib2.0-0", "glib2"),
    "libgthread-2.0.so.0": ("libglib2.0-0", "glib2"),
    "libdbus-1.so.3": ("libdbus-1-3", "dbus-libs"),
    "libwayland-client.so.0": ("libwayland-client0", "libwayland-client"),
    "libwayland-cursor.so.0": ("libwayland-cursor0", "libwayland-cursor"),
    "libwayland-egl.so.1": ("libwayland-egl1", "libwayland-egl"),
    "libpng16.so.16": ("libpng16-16", "libpng"),
    "libzstd.so.1": ("libzstd1", "libzstd"),
    "libz.so.1": ("zlib1g", "zlib"),
}

_NOT_FOUND = re.compile(r"^\s*(\S+)\s+=>\s+not found\s*$")  # glibc: "\tlibxcb-icccm.so.4 => not found"
_MUSL_MISSING = re.compile(r"Error loading shared library (\S+?):? No such file")  # musl's ldd
_VERSION_MISSING = re.compile(r"version `[^']+' not found")  # glibc: a library too old for the wheel


@dataclass(frozen=True)
class LddResult:
    missing: tuple[str, ...] = ()  # sonames that do not resolve, in ldd's order, without repeats
    problems: tuple[str, ...] = ()  # other lines that stop loading (symbol versions), as ldd wrote them


def parse_ldd(text: str) -> LddResult:
    """The sonames `ldd` could not resolve, and version errors, from its output (glibc or musl)."""
    missing: dict[str, None] = {}
    problems: dict[str, None] = {}
    for line in text.splitlines():
        match = _NOT_FOUND.match(line) or _MUSL_MISSING.search(line)
        if match:
            missing[match.group(1)] = None
        elif _VERSION_MISSING.search(line):
            problems[line.strip()] = None
    return LddResult(tuple(missing), tuple(problems))


def pyside_qt_dir() -> Path | None:
    """PySide6's bundled Qt directory (holding plugins/ and lib/), found without importing PySide6."""
    spec = importlib.util.find_spec("PySide6")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations))) / "Qt"


def run_ldd(paths: list[Path]) -> LddResult | None:
    """`ldd` over the files that exist; None where there is no ldd (then nothing can be said)."""
    ldd = shutil.which("ldd")
    files = [str(p) for p in paths if p.is_file()]
    if ldd is None or not files:
        return None
    try:
        done = subprocess.run([ldd, *files], capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return parse_ldd(done.stdout + "\n" + done.stderr)


@dataclass(frozen=True)
class Verdict:
    platform: str  # the Qt platform checked, or "" when there is no display to check
    missing: tuple[str, ...] = ()
    problems: tuple[str, ...] = ()
    no_display: bool = False
    unreachable: str = ""  # a display where no server answers: "DISPLAY=:1", "WAYLAND_DISPLAY=wayland-0"

    @property
    def ok(self) -> bool:
        return not (self.missing or self.problems or self.no_display or self.unreachable)

    def debian_packages(self) -> list[str]:
        return _unique(PACKAGES[s][0] for s in self.missing if s in PACKAGES)

    def fedora_packages(self) -> list[str]:
        return _unique(PACKAGES[s][1] for s in self.missing if s in PACKAGES)

    def unknown(self) -> list[str]:
        return [s for s in self.missing if s not in PACKAGES]

    def message(self, root: bool | None = None) -> str:
        """What to tell the user: what is missing and the exact command that installs it."""
        if self.ok:
            return ""
        if self.no_display:
            return ("pagevis: no display: DISPLAY (X11) or WAYLAND_DISPLAY is not set, so the window has nowhere "
                    "to open.\n  Run it on a desktop, or under a virtual X server:  xvfb-run -a pagevis\n"
                    "  or save a picture of the window without any screen:  "
                    "QT_QPA_PLATFORM=offscreen pagevis --screenshot window.png --steps 10\n"
                    "  (the headless commands need no display: pagevis run, compare, bench)")
        if self.unreachable:
            return (f"pagevis: no display server answers at {self.unreachable} (nothing listens on its socket), "
                    "so the window has nowhere to open.\n  Start one, connect over ssh with `ssh -X`, or run under "
                    "a virtual X server:  xvfb-run -a pagevis\n  or save a picture of the window without any screen:"
                    "  QT_QPA_PLATFORM=offscreen pagevis --screenshot window.png --steps 10")
        root = (os.geteuid() == 0) if root is None and hasattr(os, "geteuid") else bool(root)
        sudo = "" if root else "sudo "
        lacks = ", ".join(self.missing) if self.missing else "a compatible library"
        lines = [f"pagevis: Qt's {self.platform!r} platform plugin cannot load: the system lacks {lacks}."]
        if self.debian_packages():
            lines.append(f"  Debian/Ubuntu:  {sudo}apt-get install {' '.join(self.debian_packages())}")
            lines.append(f"  Fedora:         {sudo}dnf install {' '.join(self.fedora_packages())}")
        if self.unknown():
            lines.append(f"  also missing (install the package that provides each): {' '.join(self.unknown())}")
        lines.extend(f"  {problem}" for problem in self.problems)
        if self.debian_packages():
            lines.append("  (`make deps` runs it for you as root or with password-less sudo, with apt-get or dnf)")
        lines.append(f"  Or without a screen: QT_QPA_PLATFORM=offscreen pagevis --screenshot window.png. "
                     f"To let Qt try anyway: {SKIP_VARIABLE}=1.")
        return "\n".join(lines)


def _unique(items) -> list[str]:
    return list(dict.fromkeys(items))


def candidate_platforms(environ) -> list[str] | None:
    """The platform plugins Qt will try, in order, that this check knows how to test; [] when Qt will use
    one that needs no system display libraries (offscreen, minimal, vnc …); None when there is no display."""
    requested = environ.get("QT_QPA_PLATFORM", "").strip()
    if requested:
        names = [part.split(":", 1)[0].strip() for part in requested.split(";") if part.strip()]
        if not names or any(name not in PLATFORM_FILES for name in names):
            return []  # offscreen and friends; or a fallback this check cannot test: let Qt decide
        return names
    x11, wayland = bool(environ.get("DISPLAY")), bool(environ.get("WAYLAND_DISPLAY"))
    if not x11 and not wayland:
        return None
    if wayland and (environ.get("XDG_SESSION_TYPE") == "wayland" or not x11):
        return ["wayland", "xcb"] if x11 else ["wayland"]
    return ["xcb"]


def check_platform(platform: str, qt_dir: Path | None = None) -> Verdict:
    """Run ldd on the platform's plugin; an OK verdict where the check cannot run (no PySide6, no ldd)."""
    qt_dir = qt_dir if qt_dir is not None else pyside_qt_dir()
    if qt_dir is None:
        return Verdict(platform)
    result = run_ldd([qt_dir / relative for relative in PLATFORM_FILES[platform]])
    if result is None:
        return Verdict(platform)
    return Verdict(platform, result.missing, result.problems)


def check(environ=None, qt_dir: Path | None = None, system: str | None = None) -> Verdict:
    """The verdict for the platform Qt will use here. When Qt may fall back (wayland, then xcb), one
    candidate that can load is enough; otherwise the first candidate's verdict is reported. macOS and
    Windows have their own platform plugins, with no display variables: nothing to check there."""
    environ = os.environ if environ is None else environ
    system = sys.platform if system is None else system
    if environ.get(SKIP_VARIABLE) or system.startswith(("darwin", "win32", "cygwin")):
        return Verdict("")
    platforms = candidate_platforms(environ)
    if platforms is None:
        return Verdict("", no_display=True)
    verdicts = [check_platform(name, qt_dir) for name in platforms]
    verdicts = [_with_x_server(v, environ.get("DISPLAY", "")) for v in verdicts]
    verdicts = [_with_compositor(v, environ) for v in verdicts]
    return next((v for v in verdicts if v.ok), verdicts[0] if verdicts else Verdict(""))


def _with_x_server(verdict: Verdict, display: str) -> Verdict:
    """An xcb verdict whose libraries are fine still needs an X server (QT_QPA_PLATFORM=xcb may be set
    without DISPLAY)."""
    if verdict.platform != "xcb" or not verdict.ok:
        return verdict
    if not display:
        return Verdict("", no_display=True)
    return Verdict("xcb", unreachable=f"DISPLAY={display}") if x_server_reachable(display) is False else verdict


def _with_compositor(verdict: Verdict, environ) -> Verdict:
    """A wayland verdict whose libraries are fine still needs a compositor listening on its socket."""
    if verdict.platform != "wayland" or not verdict.ok:
        return verdict
    name = environ.get("WAYLAND_DISPLAY") or "wayland-0"  # Qt's default, like every Wayland client's
    path = name if name.startswith("/") else os.path.join(environ.get("XDG_RUNTIME_DIR", ""), name)
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as connection:
            connection.settimeout(2.0)
            connection.connect(path)
    except OSError:
        return Verdict("wayland", unreachable=f"WAYLAND_DISPLAY={name}")
    return verdict


def x_server_reachable(display: str, timeout: float = 2.0) -> bool | None:
    """Whether an X server accepts a connection at DISPLAY ("[host]:N[.screen]"): its local socket (Linux's
    abstract one, then the file) or TCP port 6000 + N (ssh -X forwards "localhost:10"). None for a value
    this check does not understand (then Qt decides)."""
    match = re.fullmatch(r"([^:/]*):(\d+)(?:\.\d+)?", display)
    if match is None:
        return None
    host, number = match.group(1), int(match.group(2))
    if host in ("", "unix"):
        for address in (f"\0/tmp/.X11-unix/X{number}", f"/tmp/.X11-unix/X{number}"):
            try:
                with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as connection:
                    connection.settimeout(timeout)
                    connection.connect(address)
                    return True
            except OSError:
                continue
        return False
    try:
        socket.create_connection((host, 6000 + number), timeout=timeout).close()
        return True
    except OSError:
        return False


def missing_packages(distribution: str) -> list[str]:
    """The packages ("debian" or "fedora" names) the X11 and Wayland plugins lack, whatever the current
    session: what `make deps` installs so that `make run` can open the window on either."""
    index = {"debian": 0, "fedora": 1}[distribution]
    return _unique(PACKAGES[soname][index] for name in PLATFORM_FILES
                   for soname in check_platform(name).missing if soname in PACKAGES)


# --- installing what is missing (make run, make test, make deps) -----------------------------------------

MANAGERS = {"apt-get": "debian", "dnf": "fedora"}  # package manager -> the distribution's package names


@dataclass(frozen=True)
class Machine:
    """What deciding how to install needs to know of this machine (tests pass machines of their own)."""

    root: bool
    passwordless_sudo: bool  # `sudo -n true` succeeds
    tools: frozenset[str]  # the package managers of MANAGERS on PATH
    refused: bool = False  # the user set NO_INSTALL_VARIABLE


def this_machine(environ=None) -> Machine:
    environ = os.environ if environ is None else environ
    root = hasattr(os, "geteuid") and os.geteuid() == 0
    sudo = not root and shutil.which("sudo") is not None and _succeeds(["sudo", "-n", "true"])
    return Machine(root, sudo, frozenset(tool for tool in MANAGERS if shutil.which(tool)),
                   refused=bool(environ.get(NO_INSTALL_VARIABLE)))


def _succeeds(command: list[str]) -> bool:
    try:
        return subprocess.run(command, capture_output=True, timeout=10, check=False).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def install_commands(missing: Mapping[str, list[str]], machine: Machine) -> tuple[list[list[str]], str]:
    """The commands that install the missing packages (by distribution: {"debian": [...], "fedora": [...]})
    on this machine, or none and why they cannot run here."""
    if machine.refused:
        return [], f"{NO_INSTALL_VARIABLE} is set"
    manager = next((tool for tool in MANAGERS if tool in machine.tools and missing.get(MANAGERS[tool])), None)
    if manager is None:
        return [], "there is no apt-get or dnf here"
    if not machine.root and not machine.passwordless_sudo:
        return [], "this is not root and sudo needs a password"
    sudo = [] if machine.root else ["sudo", "-n"]
    packages = list(missing[MANAGERS[manager]])
    if manager == "apt-get":
        return [[*sudo, "apt-get", "update", "-qq"],
                [*sudo, "env", "DEBIAN_FRONTEND=noninteractive", "apt-get", "install", "-y", "-qq",
                 "--no-install-recommends", *packages]], ""
    return [[*sudo, "dnf", "install", "-y", "-q", *packages]], ""


def install_missing(machine: Machine | None = None, run: Callable = subprocess.run,
                    say: Callable[[str], None] = print, find: Callable[[str], list[str]] | None = None) -> int:
    """Install the system libraries Qt's platform plugins lack (`find`: the missing packages by distribution),
    each command printed before it runs, and look again; where that cannot be done here, or they are still
    missing, say what to install. 0 when nothing is missing (any more), else 1."""
    find = find or missing_packages
    missing = {name: find(name) for name in MANAGERS.values()}
    if not any(missing.values()):
        return 0
    commands, why = install_commands(missing, machine or this_machine())
    for command in commands:
        say("pagevis: installing the system libraries Qt's window needs: " + " ".join(command))
        status = run(command, check=False).returncode
        if status:
            commands, why = [], f"`{' '.join(command)}` failed with status {status}"
            break
    if commands:
        still = {name: find(name) for name in MANAGERS.values()}
        if not any(still.values()):
            return 0
        missing, why = still, "they are still missing after the install"
    say(f"pagevis: Qt's window needs system libraries this machine lacks, and {why}. Install them:\n"
        f"  Debian/Ubuntu:  sudo apt-get install {' '.join(missing.get('debian', []))}\n"
        f"  Fedora:         sudo dnf install {' '.join(missing.get('fedora', []))}\n"
        "  (pagevis run, compare, bench and serve, and the tests with QT_QPA_PLATFORM=offscreen, work without)")
    return 1


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) == 2 and argv[0] == "--missing-packages" and argv[1] in ("debian", "fedora"):
        print(" ".join(missing_packages(argv[1])))
        return 0
    if argv == ["--install"]:
        return install_missing()
    if argv:
        print("usage: python -m pagevis.platform_check [--missing-packages debian|fedora | --install]",
              file=sys.stderr)
        return 2
    verdict = check()
    if verdict.ok:
        print("pagevis: the Qt platform plugin can load here")
        return 0
    print(verdict.message(), file=sys.stderr)
    return EXIT_STATUS


if __name__ == "__main__":
    sys.exit(main())
