"""A GlusterFS volume on this machine, mounted twice: two "nodes" on one distributed
filesystem, for the shared-mode tests (tests/robustness/test_robustness_shared_budget.py).

Debian's ``glusterfs-server`` and ``glusterfs-client`` are installed on first use (root +
apt-get, ``support.system_packages``).  ``glusterd`` is started with a private working
directory unless one already runs; the volume has one brick, a directory of its own, and
is mounted through FUSE (``mount -t glusterfs``) at two mount points.  Everything started
is stopped by process id at the end: mounts unmounted, the volume stopped and deleted,
and the ``glusterd`` this module started ended.  Where a step is impossible (not root,
no FUSE) the test is skipped, or fails under ``CI``, saying why.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from support.prerequisites import missing_prerequisite
from support.system_packages import ensure_programs

PROGRAMS = {"glusterd": "glusterfs-server", "gluster": "glusterfs-server",
            "mount.glusterfs": "glusterfs-client"}
START_TIMEOUT_S = 60


@dataclass(frozen=True)
class GlusterVolume:
    """A started volume: its name, brick directory, its mount points, and the process id
    of its brick (``glusterfsd``: stopping it hangs the clients' calls)."""

    name: str
    brick: Path
    mounts: tuple[Path, ...]
    brick_pid: int | None = None

    def on_brick(self, path: Path) -> Path:
        """Where a path below the first mount lives on the brick (the real files)."""
        return self.brick / path.relative_to(self.mounts[0])


def _gluster(cli: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([cli, "--mode=script", *args], capture_output=True, text=True,
                          timeout=timeout)


def _glusterd_pids() -> list[int]:
    r = subprocess.run(["pgrep", "-x", "glusterd"], capture_output=True, text=True)
    return [int(p) for p in r.stdout.split()]


def _start_glusterd(glusterd: str, cli: str, workdir: Path) -> subprocess.Popen[bytes]:
    state = workdir / "glusterd"
    state.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen([glusterd, "-N", "--xlator-option",
                             f"management.working-directory={state}",
                             "-l", str(workdir / "glusterd.log")],
                            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + START_TIMEOUT_S
    while _gluster(cli, "volume", "list", timeout=30).returncode != 0:
        if proc.poll() is not None or time.monotonic() > deadline:
            _end(proc)
            log = (workdir / "glusterd.log")
            tail = log.read_text()[-1500:] if log.exists() else "no log"
            missing_prerequisite(f"glusterd did not start (exit {proc.poll()}): {tail}")
        time.sleep(0.3)
    return proc


def _end(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(15)


def _command_of(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def _brick_pid(name: str) -> int | None:
    for pid_file in Path("/var/run/gluster/vols", name).glob("*.pid"):
        with contextlib.suppress(OSError, ValueError):
            return int(pid_file.read_text().split()[0])
    return None


@contextlib.contextmanager
def gluster_volume(workdir: Path, mounts: int = 2,
                   brick_fs: str | None = None) -> Iterator[GlusterVolume]:
    """Yield a started volume mounted ``mounts`` times (see the module doc); with
    ``brick_fs`` (a size such as ``"1g"``) the brick is a tmpfs of its own, so that the
    bytes the volume holds can be read at once (``statvfs``) instead of by a walk."""
    if os.geteuid() != 0:
        missing_prerequisite("the GlusterFS tests need root (glusterd, FUSE mounts)")
    if not Path("/dev/fuse").exists():
        missing_prerequisite("the GlusterFS tests need FUSE (/dev/fuse is missing)")
    paths = ensure_programs(PROGRAMS)
    cli = paths["gluster"]
    ours: subprocess.Popen[bytes] | None = None
    if not _glusterd_pids():
        ours = _start_glusterd(paths["glusterd"], cli, workdir)
    name = f"lmcnvme{secrets.token_hex(4)}"
    brick = workdir / "brickfs" / "brick"
    brick.parent.mkdir(parents=True)
    own_fs = False
    if brick_fs is not None:
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={brick_fs}", "tmpfs",
                            str(brick.parent)], capture_output=True, text=True)
        if r.returncode != 0:
            missing_prerequisite(f"cannot mount a tmpfs for the brick: {r.stderr.strip()}")
        own_fs = True
    brick.mkdir()
    points = tuple(workdir / f"node{i + 1}" for i in range(mounts))
    mounted: list[Path] = []
    created = started = False
    brick_pid = None
    try:
        r = _gluster(cli, "volume", "create", name, f"{socket.gethostname()}:{brick}", "force")
        if r.returncode != 0:
            missing_prerequisite(f"gluster volume create failed: {(r.stdout + r.stderr)[-800:]}")
        created = True
        r = _gluster(cli, "volume", "start", name)
        if r.returncode != 0:
            missing_prerequisite(f"gluster volume start failed: {(r.stdout + r.stderr)[-800:]}")
        started = True
        brick_pid = _brick_pid(name)
        for point in points:
            point.mkdir()
            r = subprocess.run(["mount", "-t", "glusterfs", f"{socket.gethostname()}:/{name}",
                                str(point)], capture_output=True, text=True, timeout=120)
            if r.returncode != 0:
                missing_prerequisite(f"mount -t glusterfs failed: {r.stderr.strip()[-800:]}")
            mounted.append(point)
        yield GlusterVolume(name, brick, points, brick_pid)
    finally:
        for point in mounted:
            if subprocess.run(["umount", str(point)], capture_output=True).returncode != 0:
                subprocess.run(["umount", "-l", str(point)], capture_output=True)
        if started:
            _gluster(cli, "volume", "stop", name, "force")
        if brick_pid is not None and _command_of(brick_pid) == "glusterfsd":
            with contextlib.suppress(ProcessLookupError):
                os.kill(brick_pid, signal.SIGKILL)  # the stop left our brick running
        if created:
            _gluster(cli, "volume", "delete", name)
        if ours is not None:
            _end(ours)
        if own_fs:
            subprocess.run(["umount", "-l", str(brick.parent)], capture_output=True)
