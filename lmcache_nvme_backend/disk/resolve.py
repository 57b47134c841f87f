"""Opening and making entries beneath a root's descriptor, never through a link: the one
implementation of ``safe_fs`` and of the Python I/O engine (``io/python_chunks.py``).

A path is resolved by ``openat2(2)`` with ``RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS`` (Linux
5.6+) where the kernel has it, elsewhere by a walk that opens every directory ``O_NOFOLLOW``
relative to its parent.  A link anywhere is ``ELOOP`` or ``ENOTDIR``, never followed; a path
that leaves the root is ``EXDEV``; every failure is an ``OSError`` with its errno.
"""

from __future__ import annotations

import ctypes
import errno
import os

_O_PATH = getattr(os, "O_PATH", os.O_RDONLY)
_O_DIRECTORY = getattr(os, "O_DIRECTORY", 0)
_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_SYS_OPENAT2 = 437  # the same number on every Linux architecture
_RESOLVE = 0x02 | 0x04 | 0x08  # NO_MAGICLINKS | NO_SYMLINKS | BENEATH


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64),
                ("resolve", ctypes.c_uint64)]


class _Openat2:
    """``openat2`` through libc's ``syscall`` (ctypes lets go of the GIL for the call);
    switched off for good after ENOSYS or EPERM (an old kernel, a seccomp filter)."""

    def __init__(self) -> None:
        self.available = False
        try:
            self._syscall = ctypes.CDLL(None, use_errno=True).syscall
            self._syscall.restype = ctypes.c_long
            self.available = os.uname().sysname == "Linux"
        except (OSError, AttributeError):
            pass

    def __call__(self, dir_fd: int, rel: str, flags: int, mode: int) -> int | None:
        """The descriptor; None when ``openat2`` is not there (use the walk)."""
        how = _OpenHow(flags, mode if flags & os.O_CREAT else 0, _RESOLVE)
        fd = self._syscall(ctypes.c_long(_SYS_OPENAT2), ctypes.c_int(dir_fd),
                           ctypes.c_char_p(os.fsencode(rel)), ctypes.byref(how),
                           ctypes.c_size_t(ctypes.sizeof(how)))
        if fd >= 0:
            return int(fd)
        err = ctypes.get_errno()
        if err in (errno.ENOSYS, errno.EPERM):
            self.available = False
            return None
        raise OSError(err, os.strerror(err), rel)


_openat2 = _Openat2()


def use_openat2(enabled: bool) -> bool:
    """Switch ``openat2`` off (tests of the walk) or back on; returns the old state."""
    old = _openat2.available
    _openat2.available = enabled and _Openat2().available
    return old


def open_at(root_fd: int, rel: str, flags: int, mode: int = 0) -> int:
    """``openat(root_fd, rel, flags | O_CLOEXEC, mode)`` without following a link in any
    component and without leaving the root."""
    flags |= _O_CLOEXEC
    if _openat2.available:
        fd = _openat2(root_fd, rel, flags, mode)
        if fd is not None:
            return fd
    return _walk_open(root_fd, rel, flags, mode)


def _walk_open(root_fd: int, rel: str, flags: int, mode: int) -> int:
    """The portable walk: each directory opened ``O_NOFOLLOW`` relative to its parent."""
    parts = _walkable(rel)
    fd = root_fd
    try:
        for part in parts[:-1]:
            if not part:
                continue
            nxt = os.open(part, _O_PATH | _O_DIRECTORY | _O_NOFOLLOW | _O_CLOEXEC, dir_fd=fd)
            if fd != root_fd:
                os.close(fd)
            fd = nxt
        return os.open(parts[-1], flags | _O_NOFOLLOW, mode, dir_fd=fd)
    finally:
        if fd != root_fd:
            os.close(fd)


def _walkable(rel: str) -> list[str]:
    """The components of ``rel`` for a walk from the root; an absolute path, ``.`` or ``..``
    is EXDEV, as ``openat2`` answers a path that leaves the root."""
    parts = rel.split("/")
    if rel.startswith("/") or any(part in ("..", ".") for part in parts):
        raise OSError(errno.EXDEV, os.strerror(errno.EXDEV), rel)
    return parts


def exact_mode(fd: int, mode: int) -> int:
    """``fd``, just created, with exactly ``mode`` whatever the umask (a chmod only where
    needed, as the compiled engine does); ``fd`` is closed on failure."""
    try:
        if os.fstat(fd).st_mode & 0o7777 != mode:
            os.fchmod(fd, mode)
    except OSError:
        os.close(fd)
        raise
    return fd


def make_dir_at(dir_fd: int, name: str, mode: int) -> tuple[int, bool]:
    """Directory ``name`` in ``dir_fd`` made with exactly ``mode`` (or found) and opened
    ``O_RDONLY | O_NOFOLLOW``; and whether this call made it."""
    try:
        os.mkdir(name, mode, dir_fd=dir_fd)
        created = True
    except FileExistsError:
        created = False
    fd = os.open(name, os.O_RDONLY | _O_DIRECTORY | _O_NOFOLLOW | _O_CLOEXEC, dir_fd=dir_fd)
    if created:
        exact_mode(fd, mode)  # mkdir applied the umask
    return fd, created


def make_dirs_at(root_fd: int, rel: str, mode: int) -> tuple[int, int]:
    """Open the directory ``rel`` beneath the root, making missing components with exactly
    ``mode``: its descriptor and the index of the first component made (-1: none).  As
    ``chunkio.c``: the leaf alone first (a shard's parent nearly always exists)."""
    parts = _walkable(rel)
    parent, _, leaf = rel.rpartition("/")
    if parent:
        try:
            parent_fd = open_at(root_fd, parent, os.O_RDONLY | _O_DIRECTORY)
        except FileNotFoundError:
            pass
        else:
            try:
                fd, created = make_dir_at(parent_fd, leaf, mode)
            finally:
                os.close(parent_fd)
            return fd, parent.count("/") + 1 if created else -1
    created_at = -1
    fd = root_fd
    for depth, part in enumerate(parts):
        try:
            nxt, created = make_dir_at(fd, part, mode)
        finally:
            if fd != root_fd:
                os.close(fd)
        if created and created_at < 0:
            created_at = depth
        fd = nxt
    return fd, created_at
