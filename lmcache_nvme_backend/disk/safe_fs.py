"""File operations inside a cache tree that never follow a link.

Another local user may plant links, directories or FIFOs under the names the store uses.
Every open, create, mkdir, rename, unlink and listing below a cache root goes through this
module, which resolves the path beneath the root's descriptor following no link in any
component (``resolve.py``).  The root itself (``nvme.path``) is trusted.  A link, or a
non-directory where the tree needs one, is :class:`NotAChunkFile`: a miss for a read, a
dropped write, never a drive error.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

from .resolve import exact_mode, make_dirs_at, open_at
from .resolve import use_openat2 as use_openat2  # tests of the walk switch it here

_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_O_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
_O_DIRECTORY = getattr(os, "O_DIRECTORY", 0)
_O_PATH = getattr(os, "O_PATH", os.O_RDONLY)


def dir_mode_for(file_mode: int) -> int:
    """Directory mode for a file mode: search (x) added wherever read is granted
    (0600 -> 0700, 0640 -> 0750, 0644 -> 0755)."""
    return file_mode | (file_mode & 0o444) >> 2


class NotAChunkFile(OSError):
    """A path in the cache tree holds something the store never uses (a link, a special
    file, or a directory where a file belongs, or the reverse)."""


def _unsafe(exc: OSError, root: Path | str, rel: str) -> OSError:
    """ELOOP (a link) or ENOTDIR (a file where a directory belongs) as ``NotAChunkFile``."""
    if exc.errno == errno.ELOOP:
        return NotAChunkFile(errno.ELOOP, "a symbolic link in the cache tree (never followed)",
                             str(Path(root) / rel))
    if exc.errno in (errno.ENOTDIR, errno.EXDEV):
        return NotAChunkFile(exc.errno, "not a directory of the cache tree", str(Path(root) / rel))
    return exc


# One descriptor per cache root, opened on first use and kept: a read then costs one
# openat2.  A root deleted meanwhile (its descriptor's directory has no link left) is
# opened again by name.
_ROOT_FDS: dict[str, int] = {}
_ROOT_LOCK = threading.Lock()


def _root_fd(root: Path | str, fresh: bool = False) -> int:
    key = os.fspath(root)
    with _ROOT_LOCK:
        fd = _ROOT_FDS.get(key)
        if fd is not None and not fresh:
            return fd
        new = os.open(key, _O_PATH | _O_DIRECTORY | _O_CLOEXEC)
        _ROOT_FDS[key] = new
        if fd is not None:
            _STALE_FDS.append(fd)  # another thread may still be using it: left open
        return new


_STALE_FDS: list[int] = []


def root_descriptor(root: str) -> int:
    """The kept descriptor of a cache root (no lock: a dict read is atomic)."""
    fd = _ROOT_FDS.get(root)
    return fd if fd is not None else _root_fd(root)


def refresh_root_descriptor(root: str) -> bool:
    """Reopen ``root``'s kept descriptor if it was deleted; False when the root is gone."""
    fd = _ROOT_FDS.get(root)
    if fd is None or not _root_deleted(fd):
        return True
    try:
        _root_fd(root, fresh=True)
    except OSError:  # gone for now: the next refresh tries again
        return False
    return True


def _root_deleted(fd: int) -> bool:
    try:
        return os.fstat(fd).st_nlink == 0
    except OSError:
        return True


def _check_rel(rel: str) -> list[str]:
    parts = [p for p in rel.split("/") if p]
    if not parts or any(p in (".", "..") for p in parts) or rel.startswith("/"):
        raise ValueError(f"'{rel}' is not a path below a cache root")
    return parts


def open_beneath(root: Path | str, rel: str, flags: int, mode: int = 0o600) -> int:
    """``open(root / rel, flags, mode)`` following no link in ``rel``: :class:`NotAChunkFile`
    for a link (or a file where a directory belongs), other errors as they come."""
    rel = "/".join(_check_rel(rel))
    root_fd = _root_fd(root)
    try:
        try:
            return open_at(root_fd, rel, flags, mode)
        except FileNotFoundError:
            if not _root_deleted(root_fd):
                raise
        return open_at(_root_fd(root, fresh=True), rel, flags, mode)
    except OSError as exc:
        raise _unsafe(exc, root, rel) from None


def open_dir_beneath(root: Path | str, rel: str) -> int:
    """A descriptor (``O_RDONLY``) of the directory ``root / rel`` (``rel`` may be ``""``)."""
    if not rel:
        return os.open(root, os.O_RDONLY | _O_DIRECTORY | _O_CLOEXEC)
    return open_beneath(root, rel, os.O_RDONLY | _O_DIRECTORY)


def open_regular(root: Path | str, rel: str, flags: int = os.O_RDONLY) -> int:
    """Open an existing regular file ``O_NONBLOCK`` (else :class:`NotAChunkFile`)."""
    fd = open_beneath(root, rel, flags | _O_NONBLOCK)
    require_regular(fd, Path(root) / rel, "a regular file")
    return fd


def require_regular(fd: int, path: Path | str, expected: str) -> os.stat_result:
    """The ``fstat`` of a regular file ``fd``; else it is closed, :class:`NotAChunkFile`."""
    try:
        st = os.fstat(fd)
    except OSError:
        os.close(fd)
        raise
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise NotAChunkFile(errno.EINVAL, f"a {kind_of(st.st_mode)}, not {expected}",
                            str(path))
    return st


def kind_of(mode: int) -> str:
    """What a file mode says the entry is, in words."""
    for test, name in ((stat.S_ISLNK, "symbolic link"), (stat.S_ISDIR, "directory"),
                       (stat.S_ISFIFO, "FIFO"), (stat.S_ISSOCK, "socket"),
                       (stat.S_ISCHR, "character device"), (stat.S_ISBLK, "block device"),
                       (stat.S_ISREG, "regular file")):
        if test(mode):
            return name
    return "special file"


def makedirs_beneath(root: Path | str, rel: str, mode: int) -> None:
    """Create the directories of ``rel`` below ``root`` with exactly ``mode`` (whatever the
    umask); a link raises ``NotAChunkFile``."""
    os.close(open_dirs_beneath(root, rel, mode))


def open_dirs_beneath(root: Path | str, rel: str, mode: int) -> int:
    """``makedirs_beneath``, returning a descriptor (``O_RDONLY``) of the deepest directory."""
    rel = "/".join(_check_rel(rel))
    try:
        return open_dir_beneath(root, rel)  # (a deleted root's descriptor is renewed here)
    except FileNotFoundError:
        pass
    try:
        return make_dirs_at(_root_fd(root), rel, mode)[0]
    except OSError as exc:
        raise _unsafe(exc, root, rel) from None


def create_beneath(root: Path | str, rel: str, mode: int, flags: int = os.O_WRONLY) -> int:
    """The descriptor of a new file (``O_EXCL``: never a link) with exactly ``mode``."""
    return exact_mode(open_beneath(root, rel, flags | os.O_CREAT | os.O_EXCL, mode), mode)


def create_in(dir_fd: int, name: str, mode: int, flags: int = os.O_WRONLY) -> int:
    """``create_beneath`` of ``name`` in an open directory."""
    if not name or "/" in name or name in (".", ".."):
        raise ValueError(f"not a file name: {name!r}")
    fd = os.open(name, flags | os.O_CREAT | os.O_EXCL | _O_NOFOLLOW | _O_CLOEXEC, mode,
                 dir_fd=dir_fd)
    return exact_mode(fd, mode)


@contextlib.contextmanager
def _parent(root: Path | str, rel: str) -> Iterator[tuple[int, str]]:
    """The directory holding ``rel``, opened beneath the root, and the entry's name."""
    parts = _check_rel(rel)
    fd = open_dir_beneath(root, "/".join(parts[:-1]))
    try:
        yield fd, parts[-1]
    finally:
        os.close(fd)


def rename_beneath(root: Path | str, src_rel: str, dst_rel: str) -> None:
    """``rename`` within the tree; neither parent is reached through a link."""
    with _parent(root, src_rel) as (src_fd, src_name):
        if src_rel.rpartition("/")[0] == dst_rel.rpartition("/")[0]:  # one directory
            os.rename(src_name, dst_rel.rpartition("/")[2], src_dir_fd=src_fd,
                      dst_dir_fd=src_fd)
            return
        with _parent(root, dst_rel) as (dst_fd, dst_name):
            os.rename(src_name, dst_name, src_dir_fd=src_fd, dst_dir_fd=dst_fd)


def link_beneath(root: Path | str, src_rel: str, dst_rel: str) -> None:
    """``link(2)`` within the tree, no link followed: ``FileExistsError`` when ``dst_rel``
    exists (an atomic compare-and-set on every POSIX filesystem, network ones included)."""
    with (_parent(root, src_rel) as (src_fd, src_name),
          _parent(root, dst_rel) as (dst_fd, dst_name)):
        os.link(src_name, dst_name, src_dir_fd=src_fd, dst_dir_fd=dst_fd, follow_symlinks=False)


def unlink_beneath(root: Path | str, rel: str, directory: bool = False) -> None:
    """``unlink`` within the tree (a link is removed, never its target); ``directory``:
    ``rmdir`` of an empty directory instead."""
    with _parent(root, rel) as (fd, name):
        (os.rmdir if directory else os.unlink)(name, dir_fd=fd)


def lstat_beneath(root: Path | str, rel: str) -> os.stat_result:
    """``lstat`` of an entry whose parents are reached without following links."""
    with _parent(root, rel) as (fd, name):
        return os.stat(name, dir_fd=fd, follow_symlinks=False)


def exists_beneath(root: Path | str, rel: str) -> bool:
    """Whether ``root / rel`` is there now (``lstat_beneath``; a bad path is not)."""
    try:
        lstat_beneath(root, rel)
    except (OSError, ValueError):
        return False
    return True


def scandir_beneath(root: Path | str, rel: str) -> Iterator[os.DirEntry[str]]:
    """Entries of the directory ``root / rel`` (missing, unreadable or a link: none); ask
    ``is_dir``/``is_file`` with ``follow_symlinks=False``; ``path`` is only the name."""
    try:
        fd = open_dir_beneath(root, rel)
    except (OSError, ValueError):
        return
    try:
        with os.scandir(fd) as it:
            yield from it
    except OSError:
        return
    finally:
        os.close(fd)


def read_small_file(root: Path | str, rel: str, limit: int) -> bytes:
    """At most ``limit`` bytes of a regular file (no link followed, a FIFO never waited on)."""
    fd = open_regular(root, rel)
    try:
        chunks = []
        left = limit
        while left > 0:
            data = os.read(fd, min(left, 1 << 20))
            if not data:
                break
            chunks.append(data)
            left -= len(data)
        return b"".join(chunks)
    finally:
        os.close(fd)


#: How deep ``remove_tree_beneath`` descends (a cache tree is 3 levels below ``ns``).
MAX_TREE_DEPTH = 16


def remove_tree_beneath(root: Path | str, rel: str,
                        removed: Callable[[str, os.stat_result], None] | None = None,
                        passes: int = 3, keep_top: bool = False) -> bool:
    """Delete the directory ``root / rel`` and everything in it following no link (a link
    is removed itself); ``removed(rel_path, lstat)`` hears of each file.  A directory filled
    again meanwhile is listed again, up to ``passes`` times; ``keep_top``: ``root / rel``
    is left, empty.  Whether it is all gone."""
    for _ in range(passes):
        try:
            fd = open_dir_beneath(root, rel)
        except FileNotFoundError:
            return True
        except NotAChunkFile:  # a link or file at the top: removed itself
            return remove_quietly(root, rel) or not exists_beneath(root, rel)
        try:
            _empty_directory(fd, rel, removed, MAX_TREE_DEPTH)
            if keep_top:
                with os.scandir(fd) as it:
                    if next(it, None) is None:
                        return True
                continue
        finally:
            os.close(fd)
        try:
            unlink_beneath(root, rel, directory=True)
            return True
        except FileNotFoundError:
            return True
        except OSError as exc:
            if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                return False
    return False


def _empty_directory(fd: int, rel: str, removed: Callable[[str, os.stat_result], None] | None,
                     depth: int) -> None:
    """Remove what the open directory ``fd`` (at ``rel``) holds, as far as it can."""
    with os.scandir(fd) as it:
        names = [entry.name for entry in it]
    for name in names:
        try:
            st = os.stat(name, dir_fd=fd, follow_symlinks=False)
        except OSError:
            continue
        if not stat.S_ISDIR(st.st_mode):
            try:
                os.unlink(name, dir_fd=fd)
            except OSError:
                continue
            if removed is not None:
                removed(f"{rel}/{name}", st)
            continue
        if depth <= 1:
            continue  # deeper than any cache tree: left (the caller reports the tree kept)
        try:  # O_NOFOLLOW: a directory swapped for a link meanwhile is not entered
            sub = os.open(name, os.O_RDONLY | _O_DIRECTORY | _O_NOFOLLOW | _O_CLOEXEC,
                          dir_fd=fd)
        except OSError:
            continue
        try:
            _empty_directory(sub, f"{rel}/{name}", removed, depth - 1)
        finally:
            os.close(sub)
        with contextlib.suppress(OSError):
            os.rmdir(name, dir_fd=fd)


def remove_quietly(root: Path | str, rel: str) -> bool:
    """Unlink within the tree; False when it was not there or could not be removed."""
    with contextlib.suppress(OSError, ValueError):
        unlink_beneath(root, rel)
        return True
    return False
