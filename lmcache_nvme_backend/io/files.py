"""Opening chunk files: only regular files, never through a link, and the O_DIRECT probe.

Every read of a chunk file opens it with :func:`open_for_read`, every chunk (temp)
file is created with :func:`create_for_write` (or :func:`create_in_dir`, in a shard
directory the writer has open); inside a cache tree both resolve
beneath the root without following a link in any component (``disk/safe_fs.py``).
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
from pathlib import Path

from ..disk.format import ALIGNMENT
from ..disk.layout import split_tree_path
from ..disk.safe_fs import (
    NotAChunkFile,
    create_beneath,
    create_in,
    kind_of,
    open_beneath,
    require_regular,
)
from .buffers import AlignedBuffer

_O_DIRECT = getattr(os, "O_DIRECT", 0)
_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_O_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
_O_DIRECTORY = getattr(os, "O_DIRECTORY", 0)


def probe_direct_io(directory: Path, existing: Path | None = None) -> bool:
    """Whether files in ``directory`` accept O_DIRECT writes and reads of aligned buffers.

    The probe file has a random name, created ``O_EXCL | O_NOFOLLOW`` (a name planted in
    the directory is skipped, never followed).  On a full filesystem (ENOSPC / EDQUOT:
    no block or no inode for the probe) the answer comes from reading ``existing`` (a
    regular file in the same filesystem, e.g. the cache marker) with O_DIRECT, which
    needs no space; with no such file the answer is False (buffered I/O, always safe).
    """
    if not _O_DIRECT:
        return False
    buf = AlignedBuffer(ALIGNMENT)
    try:
        for _ in range(16):
            probe = directory / f".odirect-probe-{os.getpid()}-{secrets.token_hex(8)}"
            try:
                fd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_EXCL | _O_NOFOLLOW | _O_DIRECT
                             | _O_CLOEXEC, 0o600)
                break
            except FileExistsError:
                continue
            except OSError as exc:
                # Linux creates the file before it refuses O_DIRECT with EINVAL.
                _unlink_missing_ok(probe)
                return _probe_answer(exc, existing)
        else:
            raise FileExistsError(errno.EEXIST, "no free probe file name", str(directory))
        try:
            os.pwrite(fd, buf.view, 0)
            os.preadv(fd, [buf.view], 0)
            return True
        except OSError as exc:
            return _probe_answer(exc, existing)
        finally:
            os.close(fd)
            _unlink_missing_ok(probe)
    finally:
        buf.close()


def _probe_answer(exc: OSError, existing: Path | None) -> bool:
    """What an error of the write probe says: EINVAL is O_DIRECT refused; a full filesystem
    leaves the answer to a read of ``existing``; anything else is raised."""
    if exc.errno == errno.EINVAL:
        return False
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return existing is not None and probe_direct_read(existing)
    raise exc


def probe_direct_read(path: Path) -> bool:
    """Whether an existing regular file reads with O_DIRECT into an aligned buffer.

    Writes nothing and needs no free space: what ``lmcache-nvme verify`` uses, and
    the store's probe on a full filesystem.  A missing or unusable file is False.
    """
    if not _O_DIRECT:
        return False
    buf = AlignedBuffer(ALIGNMENT)
    try:
        fd = open_for_read(path, direct=True)
    except OSError:
        buf.close()
        return False
    try:
        os.preadv(fd, [buf.view], 0)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
        buf.close()


def _unlink_missing_ok(path: Path) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)


def open_for_read(path: Path, direct: bool) -> int:
    """Open a chunk file for reading (see :func:`open_for_read_sized`)."""
    return open_for_read_sized(path, direct)[0]


def open_for_read_sized(path: Path, direct: bool) -> tuple[int, int]:
    """Open a chunk file for reading; every read of a chunk file opens it here.
    Returns the descriptor and the file's size (from the ``fstat`` of the check).

    ``O_NOFOLLOW | O_NONBLOCK`` (a FIFO never blocks the reader) and an ``fstat``
    check: anything but a regular file raises :class:`NotAChunkFile`, which readers
    treat as a miss, not a drive error.  A file in a cache tree's shard directory is
    opened beneath its root without following a link in any component
    (``disk/safe_fs.py``).
    """
    flags = os.O_RDONLY | _O_NOFOLLOW | _O_NONBLOCK | _O_CLOEXEC
    where = split_tree_path(path)
    try:
        if where is not None:
            fd = open_beneath(where[0], where[1], flags | (_O_DIRECT if direct else 0))
        else:
            fd = os.open(path, flags | (_O_DIRECT if direct else 0))
    except OSError as exc:
        if isinstance(exc, NotAChunkFile):
            raise
        if exc.errno == errno.ELOOP:
            raise NotAChunkFile(errno.ELOOP, "a symbolic link (never followed)",
                                str(path)) from None
        if exc.errno in (errno.ENXIO, errno.EISDIR, errno.EINVAL):
            # a socket (ENXIO), or O_DIRECT refused by a directory or a special file
            try:
                st = os.lstat(path)
            except OSError:
                raise exc from None
            if not stat.S_ISREG(st.st_mode):
                raise NotAChunkFile(exc.errno, f"a {kind_of(st.st_mode)}, not a chunk file",
                                    str(path)) from None
        raise
    return fd, require_regular(fd, path, "a chunk file").st_size


def create_for_write(path: Path, direct: bool, mode: int) -> int:
    """Create a new chunk (temp) file with exactly ``mode`` for writing.

    ``O_EXCL`` (never an existing file or link); in a cache tree's shard directory no
    component is reached through a link (``NotAChunkFile``).
    """
    where = split_tree_path(path)
    if where is not None:
        return create_beneath(where[0], where[1], mode, _write_flags(direct))
    dir_fd = os.open(path.parent, os.O_RDONLY | _O_DIRECTORY | _O_CLOEXEC)
    try:
        return create_in_dir(dir_fd, path.name, direct, mode)
    finally:
        os.close(dir_fd)


def create_in_dir(dir_fd: int, name: str, direct: bool, mode: int) -> int:
    """Create the new chunk (temp) file ``name`` with exactly ``mode`` in an open directory
    (``O_EXCL | O_NOFOLLOW``: never an existing file or link)."""
    return create_in(dir_fd, name, mode, _write_flags(direct))


def _write_flags(direct: bool) -> int:
    return os.O_WRONLY | (_O_DIRECT if direct else 0)
