"""Opening chunk files: only regular files, never through a link, and the O_DIRECT probe.

Every read of a chunk file by path opens it with :func:`open_for_read`, which never
follows a link (a path inside a cache tree resolves beneath the root without following one
in any component, ``disk/safe_fs.py``).  A batch engine reports a failed read as an errno;
:func:`read_failure` turns it into the exception ``open_for_read`` and the reads raise for
the same file, so callers classify it alike.
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
from ..disk.safe_fs import NotAChunkFile, kind_of, open_beneath, require_regular
from .buffers import AlignedBuffer

_O_DIRECT = getattr(os, "O_DIRECT", 0)
_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_O_NONBLOCK = getattr(os, "O_NONBLOCK", 0)


class ShortFileError(OSError):
    """The file ended before the bytes its header promises."""


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
        fd, _ = open_for_read(path, direct=True)
        try:
            os.preadv(fd, [buf.view], 0)
        finally:
            os.close(fd)
        return True
    except OSError:
        return False
    finally:
        buf.close()


def _unlink_missing_ok(path: Path) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)


def open_for_read(path: Path, direct: bool) -> tuple[int, int]:
    """Open a chunk file for reading; every read of a chunk file by path opens it here.
    Returns the descriptor and the file's size (from the ``fstat`` of the check).

    ``O_NOFOLLOW | O_NONBLOCK`` (a FIFO never blocks the reader) and an ``fstat``
    check: anything but a regular file raises :class:`NotAChunkFile`, which readers
    treat as a miss, not a drive error.  A file in a cache tree's shard directory is
    opened beneath its root without following a link in any component
    (``disk/safe_fs.py``).
    """
    flags = os.O_RDONLY | _O_NOFOLLOW | _O_NONBLOCK | _O_CLOEXEC | (_O_DIRECT if direct else 0)
    where = split_tree_path(path)
    try:
        fd = open_beneath(*where, flags) if where is not None else os.open(path, flags)
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


def read_failure(path: Path, err: int) -> OSError:
    """The exception a read of the chunk file ``path`` raises here for what an engine
    reported as ``err``: ``FileNotFoundError`` (ENOENT), ``PermissionError`` (EACCES,
    EPERM), ``ShortFileError`` (ENODATA: shorter than its header and payload),
    ``NotAChunkFile`` for a link, a non-directory in the tree, a path out of the root, or
    something not a regular file at ``path`` (ELOOP, ENOTDIR, EXDEV; EINVAL, ENXIO, EISDIR
    when an ``lstat`` finds no regular file there), else ``OSError(err)`` (ESTALE, EIO,
    ...).  What is there is found without following a link."""
    text = os.strerror(err)
    if err == errno.ENOENT:
        return FileNotFoundError(err, text, str(path))
    if err in (errno.EACCES, errno.EPERM):
        return PermissionError(err, text, str(path))
    if err == errno.ENODATA:
        return ShortFileError(err, "chunk file shorter than its payload", str(path))
    if err in (errno.ELOOP, errno.ENOTDIR, errno.EXDEV, errno.EINVAL, errno.ENXIO,
               errno.EISDIR):
        found = _found_at(path)
        if found is not None and found[1] != path:  # on the way to the file
            kind, where = found
            what = ("a symbolic link in the cache tree (never followed)"
                    if kind == "symbolic link" else f"a {kind}, not a directory of the cache tree")
            return NotAChunkFile(err, f"{what}: {where}", str(path))
        if found is not None and found[0] != "regular file":
            what = ("a symbolic link (never followed)" if found[0] == "symbolic link"
                    else f"a {found[0]}, not a chunk file")
            return NotAChunkFile(err, what, str(path))
        if err == errno.ELOOP:
            return NotAChunkFile(err, "a symbolic link (never followed)", str(path))
        if err in (errno.ENOTDIR, errno.EXDEV):
            return NotAChunkFile(err, "not a directory of the cache tree", str(path))
    return OSError(err, text, str(path))


def _found_at(path: Path) -> tuple[str, Path] | None:
    """What blocks the way to ``path``: the first entry of the cache tree on it (from the
    root, which is trusted) that is not a real directory, or the file itself, as ``(kind,
    where)``; None when nothing is there.  Each entry is ``lstat``-ed (never followed)
    after every one before it was found a real directory."""
    where = split_tree_path(path)
    root, parts = (Path(where[0]), where[1].split("/")) if where else (path.parent, [path.name])
    at = root
    for part in parts:
        at = at / part
        try:
            mode = os.lstat(at).st_mode
        except OSError:
            return None
        if not stat.S_ISDIR(mode) or at == path:
            return kind_of(mode), at
    return None
