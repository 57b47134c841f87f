"""The cache directories of a store: opening them, placement, health and quarantine.

A root is one ``nvme.path`` entry, usually one drive.  Chunks are placed by rendezvous
hashing (each digest ranks the roots by ``xxh64(root index, digest)``), so adding or losing
a root moves only its share of the keys.  A root that fails ``ROOT_ERROR_LIMIT`` I/Os in a
row is out of service for ``ROOT_RETRY_S``.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import xxhash

from ..config import EXTRA_CONFIG_PREFIX, NVMeConfigError, io_deadline_for, min_free_bytes_for
from ..disk.format import text_bytes
from ..disk.layout import MARKER_NAME, RootLayout, marker_text, split_tree_path
from ..disk.mounts import is_network_filesystem, mount_for
from ..disk.probe import CREATE_FIX, NOT_A_DIRECTORY_FIX
from ..disk.safe_fs import (
    NotAChunkFile,
    create_beneath,
    dir_mode_for,
    kind_of,
    lstat_beneath,
    makedirs_beneath,
    refresh_root_descriptor,
    rename_beneath,
    root_descriptor,
    scandir_beneath,
    unlink_beneath,
)
from ..io.posix import probe_direct_io, probe_direct_read
from .access import path_error, require_usable_root
from .free_space import free_bytes

logger = logging.getLogger(__name__)

T = TypeVar("T")

# A root that fails this many I/Os in a row is taken out of service for a while.
ROOT_ERROR_LIMIT = 3
ROOT_RETRY_S = 30.0
MAX_QUARANTINED_FILES = 256
#: A filesystem full again within this long after writes resumed: the same full episode.
FULL_EPISODE_S = 60.0


@dataclass
class RootState:
    """One cache directory and its health."""

    index: int
    layout: RootLayout
    direct: bool
    # the free-space guard of this path (nvme.min_free_gb, or scaled to the filesystem)
    min_free_bytes: int = 0
    # its filesystem's type (/proc/mounts; "" when unknown)
    filesystem: str = ""
    # reads here are answered by then (nvme.io_deadline_s, by filesystem for auto); 0: none
    deadline_s: float = 0.0
    consecutive_errors: int = 0
    offline_until: float = 0.0
    # set while writes are dropped because the filesystem is full (see ``note_full``)
    full: bool = False
    full_said: bool = False  # this episode's "is full" line was logged
    space_again_at: float = float("-inf")  # time.monotonic() when writes last resumed
    # a read or write found the directory gone (ENOENT): check the kept descriptor next
    maybe_removed: bool = False
    # a read passed nvme.io_deadline_s: out of service until the filesystem answers again
    hung: bool = False

    def descriptor(self) -> int:
        """The kept descriptor of the directory (renewed if it was made again)."""
        if self.maybe_removed:
            self.maybe_removed = not refresh_root_descriptor(self.layout.root_str)
        return root_descriptor(self.layout.root_str)

    @property
    def healthy(self) -> bool:
        return time.monotonic() >= self.offline_until


@dataclass(frozen=True)
class RootInfo:
    """One of the store's directories as the outside sees it (``free_bytes`` None: unknown)."""

    path: Path
    direct_io: bool
    healthy: bool
    min_free_bytes: int = 0
    free_bytes: int | None = None
    capacity_bytes: int = 0
    used_bytes: int = 0
    filesystem: str = ""
    deadline_s: float = 0.0


def open_root(index: int, path: Path, direct_io_mode: str, file_mode: int = 0o600,
              min_free_gb: float | None = None, shared: bool = False,
              key_prefix: str = EXTRA_CONFIG_PREFIX,
              io_deadline_s: float | None = None) -> RootState:
    """Check the root (``access.require_usable_root``), create it, its directories and
    marker (exact modes, never through a link), probe O_DIRECT per ``nvme.direct_io``, and
    give it its read deadline (``config.io_deadline_for`` its filesystem).  A full
    filesystem does not stop the start: writes are dropped until space frees."""
    probe = require_usable_root(path, shared, key_prefix)
    dir_mode = dir_mode_for(file_mode)
    if not probe.exists:
        _create_directory(path, dir_mode, key_prefix)
    try:
        layout = probe.layout if probe.layout is not None else RootLayout.of(path)
    except ValueError as exc:  # a marker from a newer version, written meanwhile
        raise path_error(key_prefix, str(exc)) from None
    for d in (layout.index_dir, layout.quarantine_dir, layout.namespaces_dir):
        try:
            makedirs_beneath(path, d.name, dir_mode)
        except NotAChunkFile as exc:
            logger.error("NVMe tier: %s is not a directory of the cache (%s); it is never "
                         "followed. Remove it: until then %s.", d, exc.strerror,
                         {"index": "the index snapshot is not saved",
                          "quarantine": "bad files are deleted instead of kept",
                          "ns": "nothing is read or written there"}[d.name])
        except OSError as exc:
            if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
    _write_marker(path, file_mode, layout.shard_levels)
    direct = direct_io_mode != "off" and _probe(path)
    if direct_io_mode == "on" and not direct:
        raise NVMeConfigError(
            f"{key_prefix}direct_io: '{path}' does not support O_DIRECT (tmpfs, some network "
            "or overlay filesystems). Put the cache on a local NVMe filesystem such as ext4 "
            f"or xfs, or set {key_prefix}direct_io to 'auto' to fall back to buffered I/O.")
    if direct_io_mode == "auto" and not direct:
        logger.warning("NVMe tier: %s does not support O_DIRECT; using buffered I/O there "
                       "(page cache in the data path).", path)
    st = os.statvfs(path)
    min_free = min_free_bytes_for(min_free_gb, st.f_blocks * st.f_frsize)
    mount = mount_for(path)
    filesystem = mount.fstype if mount is not None else ""
    state = RootState(index, layout, direct, min_free_bytes=min_free, filesystem=filesystem,
                      deadline_s=io_deadline_for(io_deadline_s,
                                                 is_network_filesystem(filesystem)))
    if st.f_bavail * st.f_frsize <= min_free or (st.f_files and not st.f_favail):
        state.full = state.full_said = True
        logger.warning("NVMe tier: %s is full (%d MiB, %d inodes free; the guard keeps %d MiB):"
                       " serving the chunks it holds; writes are dropped (capacity_drops) "
                       "until space frees.", path, st.f_bavail * st.f_frsize // 2**20,
                       st.f_favail, min_free // 2**20)
    return state


def _create_directory(path: Path, dir_mode: int, key_prefix: str) -> None:
    """Create ``path`` and its missing parents, each with exactly ``dir_mode``."""
    missing = [p for p in (path, *path.parents) if not p.exists()]
    try:
        for p in reversed(missing):
            try:
                p.mkdir(dir_mode)
            except FileExistsError:
                continue
            os.chmod(p, dir_mode)  # mkdir applied the umask
    except OSError as exc:
        raise path_error(key_prefix, f"cannot create '{path}': {exc.strerror}",
                         CREATE_FIX) from exc
    if not path.is_dir():
        raise path_error(key_prefix, f"'{path}' exists and is not a directory",
                         NOT_A_DIRECTORY_FIX)


def _probe(path: Path) -> bool:
    """O_DIRECT on ``path``: probed by writing, or in a read-only directory by reading."""
    try:
        return probe_direct_io(path, path / MARKER_NAME)
    except OSError as exc:
        if exc.errno not in (errno.EROFS, errno.EACCES, errno.EPERM):
            raise
        return probe_direct_read(path / MARKER_NAME)


def _write_marker(path: Path, file_mode: int, shard_levels: int) -> None:
    """The ``LMCNVME`` marker, created once (never through a link; no space: later)."""
    try:
        st = lstat_beneath(path, MARKER_NAME)
    except FileNotFoundError:
        pass
    else:
        if not stat.S_ISREG(st.st_mode):
            logger.error("NVMe tier: %s is a %s, not the cache marker; it is never followed. "
                         "Remove it so that lmcache-nvme recognises this cache directory.",
                         path / MARKER_NAME, kind_of(st.st_mode))
        return
    try:
        fd = create_beneath(path, MARKER_NAME, file_mode)
    except FileExistsError:
        return  # another process just created it
    except OSError as exc:
        if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        logger.warning("NVMe tier: no space to create the marker %s; it is created at a "
                       "later start.", path / MARKER_NAME)
        return
    try:
        os.write(fd, marker_text(shard_levels))
    except OSError as exc:
        logger.warning("NVMe tier: could not write the marker %s: %s", path / MARKER_NAME, exc)
    finally:
        os.close(fd)


class Roots(list[RootState]):
    """The store's roots, in ``nvme.path`` order."""

    @classmethod
    def open(cls, paths: Sequence[Path], direct_io_mode: str, file_mode: int = 0o600,
             min_free_gb: float | None = None, shared: bool = False,
             key_prefix: str = EXTRA_CONFIG_PREFIX, io_deadline_s: float | None = None) -> Roots:
        """Open (and create) each root; errors name the settings with ``key_prefix``."""
        return cls([open_root(i, path, direct_io_mode, file_mode, min_free_gb, shared,
                              key_prefix, io_deadline_s) for i, path in enumerate(paths)])

    @property
    def deadline_s(self) -> float:
        """The longest read deadline of any root (0: no root has one)."""
        return max((root.deadline_s for root in self), default=0.0)

    def healthy(self, index: int) -> bool:
        return self[index].healthy

    def in_placement_order(self, digest: str) -> list[RootState]:
        """Healthy roots, the one a writer would choose for ``digest`` first."""
        return sorted((r for r in self if r.healthy), reverse=True,
                      key=lambda r: xxhash.xxh64_intdigest(f"{r.index}:{digest}".encode()))

    def choose(self, digest: str) -> RootState | None:
        """The root that holds ``digest`` (None when every root is out of service)."""
        if len(self) == 1:
            only = self[0]
            return only if only.healthy else None
        order = self.in_placement_order(digest)
        return order[0] if order else None

    def group(self, items: Sequence[T], digest_of: Callable[[T], str]
              ) -> tuple[list[tuple[RootState, list[T]]], list[T]]:
        """``items`` grouped by ``choose`` of their digests, and those no root can take."""
        if len(self) == 1:
            only = self[0]
            return ([(only, list(items))], []) if only.healthy else ([], list(items))
        by_root: dict[int, tuple[RootState, list[T]]] = {}
        homeless: list[T] = []
        for item in items:
            root = self.choose(digest_of(item))
            if root is None:
                homeless.append(item)
            else:
                by_root.setdefault(root.index, (root, []))[1].append(item)
        return list(by_root.values()), homeless

    def record_error(self, root: RootState, exc: BaseException) -> None:
        """An I/O error on ``root``: too many in a row take it out of service for a while."""
        root.consecutive_errors += 1
        logger.warning("NVMe tier: I/O error on %s: %s", root.layout.root, exc)
        if root.consecutive_errors >= ROOT_ERROR_LIMIT and root.healthy:
            root.offline_until = time.monotonic() + ROOT_RETRY_S
            logger.error("NVMe tier: taking %s out of service for %.0f s after %d errors in "
                         "a row; other paths keep serving.", root.layout.root, ROOT_RETRY_S,
                         root.consecutive_errors)

    def describe(self) -> list[RootInfo]:
        return [RootInfo(r.layout.root, r.direct, r.healthy, r.min_free_bytes,
                         _free_bytes(r.layout.root), filesystem=r.filesystem,
                         deadline_s=r.deadline_s) for r in self]


def _free_bytes(path: Path) -> int | None:
    """Bytes an unprivileged writer may still use on ``path``'s filesystem (None: unknown)."""
    try:
        return free_bytes(path)
    except OSError:
        return None


def write_namespace_file(layout: RootLayout, ns_id: str, namespace: str, file_mode: int) -> None:
    """The namespace's readable name, created once (``O_EXCL``: never through a link)."""
    try:
        fd = create_beneath(layout.root, layout.relative(layout.namespace_name_file(ns_id)),
                            file_mode)
    except FileExistsError:
        return
    try:
        os.write(fd, text_bytes(namespace) + b"\n")
    finally:
        os.close(fd)


def note_full(root: RootState, exc: BaseException | None) -> None:
    """A write dropped because the filesystem is full: one log line per full episode.  A
    filesystem that fills again within ``FULL_EPISODE_S`` of writes resuming (evictions
    free space that other writers take at once) is the same episode: not logged again."""
    if root.full:
        return
    root.full = True
    if time.monotonic() - root.space_again_at < FULL_EPISODE_S:
        return
    root.full_said = True
    why = f" ({exc})" if exc is not None else " (free space below the guard, nothing left to evict)"
    logger.warning("NVMe tier: %s is full%s: dropping writes (capacity_drops) until space "
                   "frees; stored chunks are still served.", root.layout.root, why)


def note_space(root: RootState) -> None:
    """A write succeeded: writes resume (logged once per full episode)."""
    if root.full:
        root.full = False
        root.space_again_at = time.monotonic()
        if root.full_said:
            root.full_said = False
            logger.info("NVMe tier: %s has space again; writes resume.", root.layout.root)


def quarantine_file(root: RootState, digest: str, path: Path) -> bool:
    """Move a file that failed validation aside (deleted when it cannot be); whether it was
    moved.  At most ``MAX_QUARANTINED_FILES`` are kept per root, the oldest removed first."""
    layout = root.layout
    try:
        rename_beneath(layout.root, layout.relative(path),
                       layout.relative(layout.quarantine_path(digest)))
    except (OSError, ValueError):
        unlink_quietly(path)
        return False
    names = sorted((e.name for e in scandir_beneath(layout.root, "quarantine")),
                   key=lambda n: (_quarantine_age(n), n))
    for old in names[: max(0, len(names) - MAX_QUARANTINED_FILES)]:
        unlink_quietly(layout.quarantine_dir / old, layout.root)
    return True


def _quarantine_age(name: str) -> int:
    parts = name.split(".")
    return int(parts[1]) if len(parts) == 3 and parts[1].isdigit() else 0


def unlink_quietly(path: Path, root: Path | None = None) -> None:
    """Remove a file (failures but ENOENT logged); in a cache tree following no link."""
    try:
        if root is not None:
            unlink_beneath(root, path.relative_to(root).as_posix())
        elif (where := split_tree_path(path)) is not None:
            unlink_beneath(*where)
        else:
            os.unlink(path)
    except (OSError, ValueError) as exc:
        if getattr(exc, "errno", None) != errno.ENOENT:
            logger.debug("could not remove %s: %s", path, exc)
