"""Opening chunk files: only regular files, never through a link, and the O_DIRECT probe.

Every read of a chunk file by path opens it with :func:`open_for_read`; :func:`read_failure`
turns an errno a batch engine reported into the exception ``open_for_read`` and the reads
raise for the same file, so callers classify it alike.
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
    """Whether files in ``directory`` accept O_DIRECT writes and reads of aligned buffers
    (a random probe name, ``O_EXCL | O_NOFOLLOW``); on a full filesystem an O_DIRECT read of
    ``existing`` (e.g. the cache marker) answers, without one False."""
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
    """Whether an existing regular file reads with O_DIRECT into an aligned buffer (writes
    nothing: ``verify`` and the probe on a full filesystem use it)."""
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
    """Open a chunk file for reading (no link followed, ``O_NONBLOCK``): the descriptor and
    the file's size; anything but a regular file raises :class:`NotAChunkFile` (a miss)."""
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
    """The exception a read of ``path`` raises here for what an engine reported as
    ``err``: ``FileNotFoundError``, ``PermissionError``, ``ShortFileError`` (ENODATA),
    ``NotAChunkFile`` for a link, a non-directory in the tree, a path out of the root or
    anything but a regular file (found by ``lstat``, no link followed), else ``OSError``."""
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
    """``(kind, where)`` of the first entry on the way to ``path`` (from its trusted root)
    that is not a real directory, or of the file itself; None when nothing is there."""
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
