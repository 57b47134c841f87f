"""Debian packages that some tests need (GlusterFS, Prometheus): installed on first use.

A test that needs a system program calls :func:`ensure_programs`.  Where a program is
missing and the tests run as root on a Debian-like system, its package is installed with
``apt-get`` (the same command a user would type); elsewhere the test skips, or fails under
``CI`` (``support.prerequisites``), naming the command that installs it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import threading

from support.prerequisites import missing_prerequisite

_INSTALL_LOCK = threading.Lock()
_APT_UPDATED = False
APT_TIMEOUT_S = 900


def ensure_programs(programs: dict[str, str]) -> dict[str, str]:
    """The path of each program in ``programs`` (program name -> Debian package that
    ships it), installing the missing packages first where this process may."""
    missing = {prog: pkg for prog, pkg in programs.items() if _which(prog) is None}
    if missing:
        _install(sorted(set(missing.values())))
    paths: dict[str, str] = {}
    for prog, pkg in programs.items():
        path = _which(prog)
        if path is None:
            missing_prerequisite(f"'{prog}' is not installed (Debian package {pkg}: "
                                 f"apt-get install -y {pkg})")
        paths[prog] = path
    return paths


def _which(program: str) -> str | None:
    # sbin directories hold daemons (glusterd) but are not on every user's PATH
    search = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])
    return shutil.which(program, path=search)


def _install(packages: list[str]) -> None:
    global _APT_UPDATED
    command = f"apt-get install -y {' '.join(packages)}"
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        missing_prerequisite(f"{', '.join(packages)} not installed and this process cannot "
                             f"install them (needs root and apt-get): run `{command}`")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    with _INSTALL_LOCK:
        if not _APT_UPDATED:
            subprocess.run(["apt-get", "update", "-q"], env=env, capture_output=True,
                           timeout=APT_TIMEOUT_S, check=False)
            _APT_UPDATED = True
        r = subprocess.run(["apt-get", "install", "-y", "-q", "--no-install-recommends",
                            *packages], env=env, capture_output=True, text=True,
                           timeout=APT_TIMEOUT_S, check=False)
    if r.returncode != 0:
        missing_prerequisite(f"`{command}` failed (exit {r.returncode}): "
                             f"{r.stderr.strip()[-500:]}")
