"""Checks of one cache directory for ``doctor`` and ``check-config``: the path and its tree
(from ``disk/probe.py``, the probe the store runs at start), filesystem, O_DIRECT, free space
against a budget, alignment.  A missing path is checked in its nearest existing parent.
"""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

from ..config import min_free_bytes_for
from ..disk.format import ALIGNMENT
from ..disk.mounts import MountInfo
from ..disk.probe import PathProbe, PathState
from ..io.posix import probe_direct_io
from ..store.access import describe_owner, user_name
from .check import FAIL, INFO, PASS, WARN, Check
from .common import GIB

GOOD_LOCAL_FS = {"ext4", "xfs"}
SHARED_FS = {"lustre", "gpfs", "beegfs", "wekafs", "nfs", "nfs4", "cephfs", "ceph"}
COW_FS = {"btrfs", "zfs", "bcachefs"}
MEMORY_FS = {"tmpfs", "ramfs", "devtmpfs"}
# Kernel filesystems that hold no files of their own: nothing can be created there.
KERNEL_FS = {"proc", "sysfs", "cgroup", "cgroup2", "debugfs", "tracefs", "securityfs",
             "devpts", "configfs", "pstore", "bpf", "mqueue", "hugetlbfs", "efivarfs"}
LOW_FREE_GB = 10.0
EXT4_SYSFS = Path("/sys/fs/ext4")


def check_path(probe: PathProbe, mount: MountInfo | None,
               missing_status: str = WARN) -> tuple[Check, Path | None]:
    """Exists (or can be created) and is writable; and the directory the other checks run
    in.  A missing path whose nearest existing parent is writable is ``missing_status``."""
    path, where = probe.path, probe.where
    if probe.state is PathState.NOT_A_DIRECTORY:
        return Check("path", FAIL, f"{path} exists and is not a directory",
                     "point nvme.path at a directory"), None
    if probe.state is PathState.BLOCKED:
        return Check("path", FAIL, f"{path} does not exist, and it cannot be created: {where} "
                     "is not a directory", "point nvme.path at a directory"), None
    if probe.error is not None:
        return _unwritable(probe, mount, probe.error), None
    if not probe.exists:
        return Check("path", missing_status, f"{path} does not exist yet; {where} is "
                     "writable (checks below ran there)",
                     "nothing to do if this is intended: the backend creates it"), where
    return Check("path", PASS, f"{path} is a writable directory"), where


def _unwritable(probe: PathProbe, mount: MountInfo | None, exc: OSError) -> Check:
    """Why no file can be created where the probe ran, in words that match the cause."""
    path, probe_dir = probe.path, probe.where
    where = "" if probe.exists else f"{path} does not exist, and it cannot be created: "
    if mount is not None and mount.fstype in KERNEL_FS:
        return Check("path", FAIL, f"{where}{probe_dir} is on {mount.fstype}, a kernel "
                     f"filesystem that holds no files ({exc.strerror})",
                     "point nvme.path at a directory on the NVMe drive")
    if exc.errno == errno.EROFS:
        return Check("path", FAIL, f"{where}{probe_dir} is on a read-only filesystem",
                     "remount it read-write, or choose another directory")
    if exc.errno in (errno.EACCES, errno.EPERM):
        me = user_name(os.geteuid())
        return Check("path", FAIL, f"{where}{probe_dir} is {describe_owner(probe_dir)}; this "
                     f"user ({me}) may not create files in it",
                     f"grant the server's user write access (as root: chown {me}: "
                     f"{probe_dir}), or choose another directory")
    return Check("path", FAIL, f"{where}no file can be created in {probe_dir} "
                 f"({exc.strerror})", "choose a directory on a writable local filesystem")


def check_tree(probe: PathProbe) -> Check | None:
    """An existing tree whose directories this user cannot use, or whose marker is a newer
    version's: what the store refuses at start.  None when no tree was walked."""
    path = probe.path
    if probe.layout_error is not None:
        return Check("cache tree", FAIL, probe.layout_error,
                     "upgrade lmcache-nvme-backend, or choose another directory")
    if not probe.tree_checked:
        return None
    me = user_name(os.geteuid())
    problems = probe.unusable
    if not problems:
        return Check("cache tree", PASS, f"every directory of {path} is usable by {me}")
    return Check("cache tree", FAIL, f"{len(problems)} director"
                 f"{'ies' if len(problems) > 1 else 'y'} of the tree cannot be listed and "
                 f"written by {me}, e.g. {problems[0]} ({describe_owner(problems[0])}); the "
                 "tier refuses to start",
                 f"as root: chown -R {me}: {path} (or run the server as the owner)")


def ext4_has_journal(mount: MountInfo) -> bool | None:
    """Whether an ext4 mount keeps a journal (its ``journal_task`` in sysfs is not
    ``<none>``); None when sysfs does not say."""
    name = os.path.basename(os.path.realpath(mount.device))
    try:
        return (EXT4_SYSFS / name / "journal_task").read_text().strip() != "<none>"
    except OSError:
        return None


def check_filesystem(mount: MountInfo | None) -> Check:
    if mount is None:
        return Check("filesystem", WARN, "not found in /proc/mounts",
                     "check that /proc is mounted")
    where = f"{mount.fstype} ({mount.device} on {mount.mountpoint})"
    fs = mount.fstype
    if fs == "ext4" and ext4_has_journal(mount) is False:
        return Check("filesystem", INFO, f"{where}: ext4 without a journal, which does not "
                     "reuse an inode deleted in the last minute and checks every candidate: "
                     "creating chunk files costs more kernel CPU the more the cache evicts "
                     "(2-5x a journaled ext4's on the benchmark's writers, "
                     "docs/benchmarks.md)",
                     "give the filesystem a journal (unmounted: tune2fs -O has_journal "
                     f"{mount.device}) or use xfs")
    if fs in GOOD_LOCAL_FS:
        return Check("filesystem", PASS, where)
    if fs in SHARED_FS:
        return Check("filesystem", PASS, f"{where}: shared filesystem, several processes or "
                     "nodes can use one cache tree")
    if fs in MEMORY_FS:
        return Check("filesystem", WARN, f"{where}: memory, not a drive; the tier would "
                     "duplicate host memory and GDS cannot read from it",
                     "put nvme.path on an NVMe drive formatted ext4 or xfs")
    if fs == "overlay" or fs.startswith("fuse"):
        return Check("filesystem", WARN, f"{where}: container or FUSE filesystem, usually "
                     "without O_DIRECT and slow for large files",
                     "bind-mount a directory of the NVMe drive into the container "
                     "(docker -v /mnt/nvme0/lmcache:/cache) and use that")
    if fs in COW_FS:
        return Check("filesystem", WARN, f"{where}: copy-on-write filesystem; checksumming "
                     "and CoW cost bandwidth, and GDS does not support it",
                     "prefer ext4 or xfs for the cache directory")
    return Check("filesystem", WARN, f"{where}: not a filesystem this backend is tested on",
                 "prefer ext4 or xfs on a local NVMe drive")


def check_direct_io(probe_dir: Path, required: bool = False) -> Check:
    """The store's O_DIRECT probe; ``required`` (``nvme.direct_io: on``): a refusal fails."""
    try:
        ok = probe_direct_io(probe_dir)
    except OSError as exc:
        return Check("O_DIRECT", FAIL, f"probe failed: {exc.strerror or exc}",
                     "make the directory writable")
    if ok:
        return Check("O_DIRECT", PASS, "supported: reads bypass the page cache")
    if required:
        return Check("O_DIRECT", FAIL, "not supported here, and nvme.direct_io is 'on': the "
                     "tier refuses to start", "put the cache on a local ext4 or xfs "
                     "filesystem, or set nvme.direct_io: auto (buffered I/O)")
    return Check("O_DIRECT", WARN, "not supported here: the backend falls back to buffered "
                 "I/O (nvme.direct_io: auto) or refuses to start (on); GPUDirect Storage "
                 "cannot work", "use a local ext4 or xfs filesystem on the NVMe drive")


def check_free_space(probe_dir: Path, max_size_gb: float | None,
                     min_free_gb: float | None) -> Check:
    usage = shutil.disk_usage(probe_dir)
    min_free_gb = min_free_bytes_for(min_free_gb, usage.total) / GIB  # None: auto
    free_gb = usage.free / GIB
    detail = f"{free_gb:.1f} GiB free of {usage.total / GIB:.1f} GiB"
    if free_gb < min_free_gb:
        return Check("free space", FAIL, f"{detail}, below the guard nvme.min_free_gb="
                     f"{min_free_gb:g}: every write would be dropped",
                     "free space on the drive or lower nvme.min_free_gb")
    if max_size_gb is not None and max_size_gb + min_free_gb > free_gb:
        return Check("free space", WARN, f"{detail}; nvme.max_size_gb={max_size_gb:g} plus "
                     f"the guard {min_free_gb:g} GiB does not fit (counting space the cache "
                     "already uses as taken): the free-space guard will evict before the "
                     "budget is reached", "lower nvme.max_size_gb or free space")
    if max_size_gb is None and free_gb < LOW_FREE_GB:
        return Check("free space", WARN, f"{detail}: little room for a cache tier",
                     "use a larger drive or free space")
    return Check("free space", PASS, detail)


def _logical_block_size(mount: MountInfo | None) -> int | None:
    if mount is None or not mount.device.startswith("/dev/"):
        return None
    name = os.path.basename(os.path.realpath(mount.device))
    for candidate in (f"/sys/class/block/{name}/queue/logical_block_size",
                      f"/sys/class/block/{name}/../queue/logical_block_size"):
        try:
            return int(Path(candidate).read_text())
        except (OSError, ValueError):
            continue
    return None


def check_alignment(probe_dir: Path, mount: MountInfo | None) -> Check:
    st = os.statvfs(probe_dir)
    lbs = _logical_block_size(mount)
    detail = f"filesystem block size {st.f_bsize} bytes"
    if lbs is not None:
        detail += f", device logical block size {lbs} bytes"
    sizes = [st.f_bsize] + ([lbs] if lbs else [])
    if all(s and ALIGNMENT % s == 0 for s in sizes):
        return Check("alignment", PASS, f"{detail}; chunk payloads are {ALIGNMENT}-byte "
                     "aligned, which O_DIRECT and GDS accept here")
    return Check("alignment", WARN, f"{detail}: larger than the chunk format's {ALIGNMENT}-"
                 "byte alignment, so O_DIRECT reads of payloads may be refused",
                 f"format the filesystem with {ALIGNMENT}-byte blocks (mkfs.xfs -b size=4096, "
                 "mkfs.ext4 -b 4096)")
