"""The filesystem a path lives on (``/proc/mounts``), and whether it is a network one.

The store asks at start, per cache directory, to decide whether reads there run under
``nvme.io_deadline_s`` (``auto``); ``lmcache-nvme doctor`` and ``bench`` ask to describe it.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import NamedTuple

from .probe import nearest_existing

# Filesystems whose calls can hang on a server, a network or a daemon (a stopped GlusterFS
# brick, a lost NFS server, a Ceph MDS failover): ``nvme.io_deadline_s: auto`` puts reads
# there under a deadline.  Every ``fuse.*`` filesystem counts too (a user-space daemon can
# stall like a server); ``fuseblk`` (ntfs-3g and the like on a local block device) does not.
NETWORK_FILESYSTEMS = frozenset({
    "nfs", "nfs4", "cifs", "smb3", "smbfs", "ceph", "glusterfs", "lustre", "beegfs", "gpfs",
    "wekafs", "9p", "afs", "ocfs2", "gfs2", "orangefs", "pvfs2", "virtiofs", "fuse",
})


class MountInfo(NamedTuple):
    """The /proc/mounts entry a path lives on."""

    device: str
    mountpoint: str
    fstype: str
    options: str


def mount_for(path: Path, mounts_file: str = "/proc/mounts") -> MountInfo | None:
    """The mount holding ``path`` (longest matching mount point; the last one wins)."""
    target = str(nearest_existing(path).resolve())
    best: MountInfo | None = None
    try:
        lines = Path(mounts_file).read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        parts = line.split()
        if len(parts) < 4:
            continue
        device, mountpoint, fstype, options = (_unescape_mount(p) for p in parts[:4])
        inside = target == mountpoint or target.startswith(mountpoint.rstrip("/") + "/")
        if inside and (best is None or len(mountpoint) >= len(best.mountpoint)):
            best = MountInfo(device, mountpoint, fstype, options)
    return best


def _unescape_mount(field: str) -> str:
    """/proc/mounts escapes space, tab, newline and backslash as octal (``\\040``)."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def is_network_filesystem(fstype: str) -> bool:
    """Whether a filesystem of type ``fstype`` (as /proc/mounts names it) is a network or
    user-space one (``NETWORK_FILESYSTEMS``)."""
    return fstype in NETWORK_FILESYSTEMS or fstype.startswith("fuse.")
