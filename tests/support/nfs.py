"""An NFS export served on this machine and mounted over loopback, for the shared-mode test.

The server is NFS-Ganesha (``ganesha.nfsd``, Debian package ``nfs-ganesha-vfs``): a user-space
server this fixture starts on a private port, NFSv4 over TCP only (no rpcbind needed), and
stops at the end,
so the test never touches a system-wide NFS server.  The kernel's NFS client mounts it.
When any step is impossible (no server installed, not root, no NFS client in the kernel,
the mount refused) the test is skipped with the reason.
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from .process import free_port

_CONFIG = """
NFS_CORE_PARAM {{ Protocols = 4; NFS_Port = {port}; Bind_addr = 127.0.0.1;
                  Enable_UDP = false; Enable_NLM = false; Enable_RQUOTA = false; }}
NFSV4 {{ Graceless = true; RecoveryBackend = fs; RecoveryRoot = "{recovery}"; }}
EXPORT {{
  Export_Id = 714; Path = "{export}"; Pseudo = /export; Access_Type = RW;
  Squash = No_Root_Squash; SecType = sys; Protocols = 4; Transports = TCP;
  FSAL {{ Name = VFS; }}
}}
"""


def _kernel_filesystems() -> str:
    try:
        return Path("/proc/filesystems").read_text()
    except OSError:
        return ""


@contextlib.contextmanager
def nfs_mount(workdir: Path) -> Iterator[Path]:
    """Yield a directory on an NFS mount of an export served over loopback (see above)."""
    server = shutil.which("ganesha.nfsd")
    if server is None:
        pytest.skip("no user-space NFS server: install Debian's nfs-ganesha-vfs "
                    "(ganesha.nfsd) to run the NFS test")
    if shutil.which("mount") is None:
        pytest.skip("no mount command")
    export, mnt, recovery = workdir / "export", workdir / "mnt", workdir / "recovery"
    for d in (export, mnt, recovery):
        d.mkdir(parents=True)
    port = free_port()
    config = workdir / "ganesha.conf"
    config.write_text(_CONFIG.format(port=port, recovery=recovery, export=export))
    log = workdir / "ganesha.log"
    proc = subprocess.Popen([server, "-F", "-f", str(config), "-L", str(log),
                             "-p", str(workdir / "ganesha.pid")],
                            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    mounted = False
    try:
        deadline = time.monotonic() + 20
        while "NFS SERVER INITIALIZED" not in (log.read_text() if log.exists() else ""):
            if proc.poll() is not None or time.monotonic() > deadline:
                lines = log.read_text().splitlines() if log.exists() else []
                worst = [ln for ln in lines if ":FATAL :" in ln or ":MAJ :" in ln][-3:]
                pytest.skip(f"the user-space NFS server did not start (exit status "
                            f"{proc.poll()}): {' | '.join(worst) or 'no log'}")
            time.sleep(0.2)
        r = subprocess.run(["mount", "-t", "nfs4", "-o", f"port={port},vers=4.1",
                            "127.0.0.1:/export", str(mnt)], capture_output=True, text=True,
                           timeout=60)
        if r.returncode != 0:
            has_client = "nfs" in _kernel_filesystems()
            pytest.skip("cannot mount the NFS export served on this machine "
                        f"(mount -t nfs4 127.0.0.1:/export: {r.stderr.strip()}); "
                        + ("" if has_client else "this kernel has no NFS client (no nfs in "
                           "/proc/filesystems, and kernel modules cannot be loaded here)"))
        mounted = True
        yield mnt
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(mnt)], capture_output=True)
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
