"""The Qt-free check run before QApplication: ldd's output parsed, missing libraries mapped to packages,
and the whole path run for real (ldd on the wheel's plugin, the `pagevis` entry point exiting with 3)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pagevis import platform_check
from pagevis.platform_check import PACKAGES, Verdict, candidate_platforms, check, parse_ldd

# glibc's ldd on PySide6 6.11's libqxcb.so on a Debian 12 without libxcb-icccm4 and libxcb-keysyms1
# (abridged; the real listing repeats a missing library once per library that needs it)
GLIBC_LDD = """\
\tlinux-vdso.so.1 (0x00007f47d4816000)
\tlibQt6XcbQpa.so.6 => /venv/PySide6/Qt/plugins/platforms/../../lib/libQt6XcbQpa.so.6 (0x00007f47d4748000)
\tlibGL.so.1 => /lib/x86_64-linux-gnu/libGL.so.1 (0x00007f47d3b79000)
\tlibxkbcommon-x11.so.0 => /lib/x86_64-linux-gnu/libxkbcommon-x11.so.0 (0x00007f47d4732000)
\tlibxcb-cursor.so.0 => /lib/x86_64-linux-gnu/libxcb-cursor.so.0 (0x00007f47d472b000)
\tlibxcb-icccm.so.4 => not found
\tlibxcb-util.so.1 => /lib/x86_64-linux-gnu/libxcb-util.so.1 (0x00007f47d4723000)
\tlibxcb-keysyms.so.1 => not found
\tlibxcb-icccm.so.4 => not found
\tlibxcb-keysyms.so.1 => not found
\t/lib64/ld-linux-x86-64.so.2 (0x00007f47d4818000)
"""

# the fresh-machine case of the issue, with two files given to ldd (it prints a header per file)
GLIBC_LDD_TWO_FILES = """\
/venv/PySide6/Qt/plugins/platforms/libqxcb.so:
\tlibxcb-cursor.so.0 => not found
\tlibxcb-icccm.so.4 => not found
\tlibEGL.so.1 => not found
/venv/PySide6/Qt/lib/libQt6XcbQpa.so.6:
\tlibxcb-cursor.so.0 => not found
\tlibfontconfig.so.1 => not found
\tlibxcb-xinerama.so.0 => not found
"""

MUSL_LDD = """\
\t/lib/ld-musl-x86_64.so.1 (0x7f2b0c5a1000)
Error loading shared library libxcb-cursor.so.0: No such file or directory (needed by /venv/libqxcb.so)
Error loading shared library libxkbcommon-x11.so.0: No such file or directory (needed by /venv/libqxcb.so)
\tlibxcb.so.1 => /usr/lib/libxcb.so.1 (0x7f2b0c4f0000)
"""

GLIBC_TOO_OLD = """\
/venv/libqxcb.so: /lib/x86_64-linux-gnu/libc.so.6: version `GLIBC_2.34' not found (required by /venv/libQt6Core.so.6)
\tlibc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x00007f0000000000)
"""


def test_parse_ldd_lists_each_missing_soname_once_in_order():
    assert parse_ldd(GLIBC_LDD).missing == ("libxcb-icccm.so.4", "libxcb-keysyms.so.1")
    assert parse_ldd(GLIBC_LDD).problems == ()
    assert parse_ldd(GLIBC_LDD_TWO_FILES).missing == (
        "libxcb-cursor.so.0", "libxcb-icccm.so.4", "libEGL.so.1", "libfontconfig.so.1", "libxcb-xinerama.so.0")
    assert parse_ldd(MUSL_LDD).missing == ("libxcb-cursor.so.0", "libxkbcommon-x11.so.0")
    assert parse_ldd("\tstatically linked\n").missing == ()
    assert parse_ldd("").missing == ()


def test_parse_ldd_keeps_symbol_version_errors_as_written():
    result = parse_ldd(GLIBC_TOO_OLD)
    assert result.missing == ()
    assert len(result.problems) == 1 and "GLIBC_2.34' not found" in result.problems[0]
    verdict = Verdict("xcb", problems=result.problems)
    assert not verdict.ok and "GLIBC_2.34" in verdict.message(root=False)


def test_the_issue_s_three_libraries_give_the_exact_install_lines():
    verdict = Verdict("xcb", ("libxcb-cursor.so.0", "libxcb-icccm.so.4", "libxcb-keysyms.so.1"))
    text = verdict.message(root=False)
    assert "sudo apt-get install libxcb-cursor0 libxcb-icccm4 libxcb-keysyms1\n" in text
    assert "sudo dnf install xcb-util-cursor xcb-util-wm xcb-util-keysyms\n" in text
    assert "'xcb'" in text and "libxcb-icccm.so.4" in text
    assert "apt-get install libxcb-cursor0" in verdict.message(root=True)
    assert "sudo" not in verdict.message(root=True).split("\n")[1]


def test_packages_are_listed_once_and_unknown_sonames_as_they_are():
    verdict = Verdict("xcb", ("libglib-2.0.so.0", "libgthread-2.0.so.0", "libxcb-randr.so.0",
                              "libxcb-shape.so.0", "libweird-thing.so.7"))
    assert verdict.debian_packages() == ["libglib2.0-0", "libxcb-randr0", "libxcb-shape0"]
    assert verdict.fedora_packages() == ["glib2", "libxcb"]
    assert verdict.unknown() == ["libweird-thing.so.7"]
    text = verdict.message(root=False)
    assert "libweird-thing.so.7" in text.split("\n")[3]
    only_unknown = Verdict("xcb", ("libweird-thing.so.7",)).message(root=False)
    assert "apt-get" not in only_unknown and "libweird-thing.so.7" in only_unknown


@pytest.mark.parametrize("soname, debian, fedora", [
    ("libxcb-cursor.so.0", "libxcb-cursor0", "xcb-util-cursor"),
    ("libxcb-icccm.so.4", "libxcb-icccm4", "xcb-util-wm"),
    ("libxcb-keysyms.so.1", "libxcb-keysyms1", "xcb-util-keysyms"),
    ("libxkbcommon-x11.so.0", "libxkbcommon-x11-0", "libxkbcommon-x11"),
    ("libxcb-xinerama.so.0", "libxcb-xinerama0", "libxcb"),
    ("libxcb-render-util.so.0", "libxcb-render-util0", "xcb-util-renderutil"),
    ("libxcb-image.so.0", "libxcb-image0", "xcb-util-image"),
    ("libEGL.so.1", "libegl1", "libglvnd-egl"),
    ("libGL.so.1", "libgl1", "libglvnd-glx"),
    ("libfontconfig.so.1", "libfontconfig1", "fontconfig"),
    ("libwayland-cursor.so.0", "libwayland-cursor0", "libwayland-cursor"),
])
def test_package_names(soname, debian, fedora):
    assert PACKAGES[soname] == (debian, fedora)


@pytest.mark.parametrize("environ, expected", [
    ({}, None),
    ({"DISPLAY": ":0"}, ["xcb"]),
    ({"DISPLAY": ":0", "QT_QPA_PLATFORM": "xcb"}, ["xcb"]),
    ({"QT_QPA_PLATFORM": "xcb:display=:1"}, ["xcb"]),
    ({"QT_QPA_PLATFORM": "offscreen"}, []),
    ({"QT_QPA_PLATFORM": "wayland;offscreen"}, []),  # a fallback this check cannot test: Qt decides
    ({"WAYLAND_DISPLAY": "wayland-0"}, ["wayland"]),
    ({"WAYLAND_DISPLAY": "wayland-0", "DISPLAY": ":0", "XDG_SESSION_TYPE": "wayland"}, ["wayland", "xcb"]),
    ({"WAYLAND_DISPLAY": "wayland-0", "DISPLAY": ":0"}, ["xcb"]),
    ({"QT_QPA_PLATFORM": "wayland;xcb"}, ["wayland", "xcb"]),
])
def test_which_platforms_are_checked(environ, expected):
    assert candidate_platforms(environ) == expected


def test_no_display_says_how_to_run_anyway():
    verdict = check({})
    assert verdict.no_display and not verdict.ok
    assert "xvfb-run" in verdict.message() and "QT_QPA_PLATFORM=offscreen" in verdict.message()
    assert check({"QT_QPA_PLATFORM": "offscreen"}).ok
    assert check({}, system="darwin").ok and check({}, system="win32").ok  # Cocoa, Windows: no DISPLAY there
    assert check({platform_check.SKIP_VARIABLE: "1"}).ok
    forced = check({"QT_QPA_PLATFORM": "xcb"})  # the X11 plugin asked for, with no X display
    assert not forced.ok and (forced.no_display or forced.missing)


# --- for real: ldd on the wheel's plugin ---------------------------------------------------------------

needs_ldd = pytest.mark.skipif(shutil.which("ldd") is None or platform_check.pyside_qt_dir() is None
                               or not (platform_check.pyside_qt_dir() / "plugins/platforms/libqxcb.so").is_file(),
                               reason="needs ldd and PySide6's xcb plugin (Linux)")


def _ldd_listing(path: Path) -> str:
    return subprocess.run(["ldd", str(path)], capture_output=True, text=True, check=True).stdout


@needs_ldd
def test_real_ldd_on_the_installed_plugin_agrees_and_every_system_library_is_mapped():
    qt = platform_check.pyside_qt_dir()
    verdict = platform_check.check_platform("xcb")
    listing = _ldd_listing(qt / "plugins/platforms/libqxcb.so")
    not_found = {line.split()[0] for line in listing.splitlines() if line.strip().endswith("=> not found")}
    assert set(verdict.missing) == not_found
    # every library of the plugin's tree that comes from the system has a package name, so that on a
    # machine lacking it the message names the package
    system = {}
    for line in listing.splitlines():
        parts = line.split()
        if len(parts) >= 3 and parts[1] == "=>" and parts[2].startswith("/") and str(qt) not in parts[2]:
            system[parts[0]] = parts[2]
    unmapped_x = sorted(s for s in system if s not in PACKAGES and any(
        key in s for key in ("xcb", "X11", "xkb", "GL", "EGL", "fontconfig", "freetype", "wayland")))
    assert not unmapped_x
    if shutil.which("dpkg") is None:
        return
    # one dpkg query for every file, under both prefixes (merged /usr: dpkg knows each under one of them)
    paths = {}
    for soname, path in system.items():
        real = os.path.realpath(path)
        other = real[4:] if real.startswith("/usr/") else "/usr" + real
        paths[real] = paths[other] = soname
    owners = subprocess.run(["dpkg", "-S", *paths], capture_output=True, text=True, check=False).stdout
    checked = 0
    for line in owners.splitlines():
        package, _, path = line.partition(": ")
        soname = paths.get(path.strip())
        if soname in PACKAGES and "," not in package:
            assert PACKAGES[soname][0] == package.split(":")[0], soname
            checked += 1
    assert checked or not any(soname in PACKAGES for soname in system)  # the check did run


@needs_ldd
def test_a_plugin_needing_an_absent_library_is_reported(tmp_path):
    """A copy of the real plugin whose dependency on libxcb-cursor.so.0 is renamed to a library no machine
    has (same length, so the ELF stays valid): ldd reports it, and check() names it as it is."""
    qt = platform_check.pyside_qt_dir()
    data = (qt / "plugins/platforms/libqxcb.so").read_bytes()
    assert data.count(b"libxcb-cursor.so.0\0") == 1
    fake = tmp_path / "Qt"
    (fake / "plugins/platforms").mkdir(parents=True)
    (fake / "lib").symlink_to(qt / "lib")  # the plugin finds its Qt libraries through $ORIGIN/../../lib
    plugin = fake / "plugins/platforms/libqxcb.so"
    plugin.write_bytes(data.replace(b"libxcb-cursor.so.0\0", b"libpagevis-zz.so.0\0"))
    plugin.chmod(0o755)
    verdict = check({"DISPLAY": ":99"}, qt_dir=fake)
    assert "libpagevis-zz.so.0" in verdict.missing and "libpagevis-zz.so.0" in verdict.unknown()
    assert "libpagevis-zz.so.0" in verdict.message()


def test_the_check_and_the_gui_entry_import_no_qt_and_exit_3_without_a_display():
    """`pagevis` with no display: exit status 3 and the advice, printed before Qt is imported (Qt would
    abort the process instead)."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("DISPLAY", "WAYLAND_DISPLAY", "QT_QPA_PLATFORM", platform_check.SKIP_VARIABLE)}
    code = ("import sys; from pagevis.cli.main import main; status = main(['--prompt', 'hi']); "
            "qt = [m for m in sys.modules if m.split('.')[0] in ('PySide6', 'shiboken6', 'pyqtgraph')]; "
            "print('QT:' + ','.join(qt)); sys.exit(status)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120,
                          check=False)
    assert done.returncode == 3, done.stderr
    assert "QT:\n" in done.stdout or done.stdout.strip().endswith("QT:")
    assert "no display" in done.stderr and "xvfb-run" in done.stderr


def _unused_display_number() -> int:
    taken = {name[1:] for name in os.listdir("/tmp/.X11-unix")} if os.path.isdir("/tmp/.X11-unix") else set()
    return next(n for n in range(4700, 4800) if str(n) not in taken)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux abstract sockets")
def test_a_display_where_no_x_server_listens_is_reported_and_one_that_listens_is_not():
    import socket

    number = _unused_display_number()
    assert platform_check.x_server_reachable(f":{number}") is False
    verdict = check({"DISPLAY": f":{number}"})
    if verdict.platform == "xcb" and not verdict.missing:  # (a machine lacking the libraries says that first)
        assert verdict.unreachable == f"DISPLAY=:{number}" and not verdict.ok
        assert f"DISPLAY=:{number}" in verdict.message() and "xvfb-run" in verdict.message()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as server:  # where an X server would listen
        server.bind(f"\0/tmp/.X11-unix/X{number}")
        server.listen(4)
        assert platform_check.x_server_reachable(f":{number}") is True
        assert platform_check.x_server_reachable(f"unix:{number}.0") is True
        assert not check({"DISPLAY": f":{number}"}).unreachable
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as server:  # ssh -X style: TCP 6000 + N
        server.bind(("127.0.0.1", 0))
        server.listen(4)
        port = server.getsockname()[1]
        if port > 6000:
            assert platform_check.x_server_reachable(f"127.0.0.1:{port - 6000}.0") is True
    assert platform_check.x_server_reachable("/private/tmp/launchd-1/org.xquartz:0") is None


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Unix sockets")
def test_a_wayland_display_needs_a_compositor_on_its_socket(tmp_path):
    import socket

    environ = {"WAYLAND_DISPLAY": "pagevis-test", "XDG_RUNTIME_DIR": str(tmp_path)}
    verdict = check(environ)
    if verdict.platform == "wayland" and not verdict.missing:  # (a machine lacking libwayland says that first)
        assert verdict.unreachable == "WAYLAND_DISPLAY=pagevis-test"
        assert "WAYLAND_DISPLAY=pagevis-test" in verdict.message()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as compositor:
        compositor.bind(str(tmp_path / "pagevis-test"))
        compositor.listen(4)
        assert not check(environ).unreachable
        assert not check({"WAYLAND_DISPLAY": str(tmp_path / "pagevis-test")}).unreachable  # an absolute path


# --- installing what is missing: the decision, on machines of the test's own making ---------------------

MISSING = {"debian": ["libxcb-icccm4", "libxcb-keysyms1"], "fedora": ["xcb-util-wm", "xcb-util-keysyms"]}
APT = frozenset({"apt-get"})


def machine(root=False, sudo=False, tools=APT, refused=False):
    return platform_check.Machine(root, sudo, tools, refused)


@pytest.mark.parametrize("state, expected", [
    (machine(root=True), [["apt-get", "update", "-qq"], ["env", "DEBIAN_FRONTEND=noninteractive", "apt-get",
                                                         "install", "-y", "-qq", "--no-install-recommends",
                                                         "libxcb-icccm4", "libxcb-keysyms1"]]),
    (machine(sudo=True), [["sudo", "-n", "apt-get", "update", "-qq"],
                          ["sudo", "-n", "env", "DEBIAN_FRONTEND=noninteractive", "apt-get", "install", "-y", "-qq",
                           "--no-install-recommends", "libxcb-icccm4", "libxcb-keysyms1"]]),
    (machine(sudo=True, tools=frozenset({"dnf"})), [["sudo", "-n", "dnf", "install", "-y", "-q", "xcb-util-wm",
                                                     "xcb-util-keysyms"]]),
    (machine(root=True, tools=frozenset({"apt-get", "dnf"})), "apt-get"),  # Debian names first where both are
])
def test_root_or_passwordless_sudo_with_apt_or_dnf_installs(state, expected):
    commands, why = platform_check.install_commands(MISSING, state)
    assert why == ""
    if isinstance(expected, str):
        assert commands[-1][2] == expected and commands[-1][-2:] == MISSING["debian"]
    else:
        assert commands == expected


@pytest.mark.parametrize("state, why", [
    (machine(), "this is not root and sudo needs a password"),
    (machine(root=True, tools=frozenset()), "there is no apt-get or dnf here"),
    (machine(root=True, refused=True), "PAGEVIS_NO_SYSTEM_INSTALL is set"),
])
def test_elsewhere_nothing_runs_and_the_reason_is_given(state, why):
    assert platform_check.install_commands(MISSING, state) == ([], why)


def finder(*answers):
    """A `find` that answers MISSING's lists for the first len(answers) looks, by distribution, then these."""
    looks = iter(answers)
    current = {}

    def find(name):
        if name == "debian":
            current.update(next(looks))
        return current[name]
    return find


NONE_MISSING = {"debian": [], "fedora": []}


def test_install_prints_each_command_before_it_runs_and_says_what_to_do_when_it_cannot():
    events = []
    ran = lambda command, check: events.append(("run", command)) or subprocess.CompletedProcess(command, 0)
    say = lambda text: events.append(("say", text))
    assert platform_check.install_missing(machine(root=True), ran, say, finder(MISSING, NONE_MISSING)) == 0
    assert [kind for kind, _ in events] == ["say", "run", "say", "run"]
    assert events[0][1].endswith("apt-get update -qq") and events[2][1].endswith("libxcb-icccm4 libxcb-keysyms1")
    # a failing command stops there, and the manual lines follow (today's message)
    events.clear()
    failing = lambda command, check: events.append(("run", command)) or subprocess.CompletedProcess(command, 100)
    assert platform_check.install_missing(machine(root=True), failing, say, finder(MISSING)) == 1
    assert [kind for kind, _ in events] == ["say", "run", "say"]
    assert "`apt-get update -qq` failed with status 100" in events[-1][1]
    assert "sudo apt-get install libxcb-icccm4 libxcb-keysyms1" in events[-1][1]
    assert "sudo dnf install xcb-util-wm xcb-util-keysyms" in events[-1][1]
    events.clear()
    assert platform_check.install_missing(machine(), failing, say, finder(MISSING)) == 1
    assert [kind for kind, _ in events] == ["say"] and "sudo needs a password" in events[0][1]
    events.clear()
    assert platform_check.install_missing(machine(), failing, say, finder(NONE_MISSING)) == 0
    assert events == []  # nothing missing: nothing said, nothing run


def test_libraries_still_missing_after_the_install_are_reported():
    """apt-get succeeded, but ldd still finds no libxcb-keysyms (a package installed already, its file gone)."""
    events = []
    ran = lambda command, check: events.append(("run", command)) or subprocess.CompletedProcess(command, 0)
    still = {"debian": ["libxcb-keysyms1"], "fedora": ["xcb-util-keysyms"]}
    assert platform_check.install_missing(machine(root=True), ran, events.append, finder(MISSING, still)) == 1
    assert "still missing after the install" in events[-1] and "apt-get install libxcb-keysyms1\n" in events[-1]


def test_the_install_entry_point_reads_the_missing_list_and_the_machine(monkeypatch, capsys):
    monkeypatch.setattr(platform_check, "missing_packages", lambda name: MISSING[name])
    monkeypatch.setenv(platform_check.NO_INSTALL_VARIABLE, "1")
    assert platform_check.main(["--install"]) == 1
    out = capsys.readouterr().out
    assert "PAGEVIS_NO_SYSTEM_INSTALL is set" in out and "apt-get install libxcb-icccm4 libxcb-keysyms1" in out
