"""The Python engine's opens, directories and unlinks beneath a cache root's descriptor.

The engine (``python_engine.py``) is handed a root as a descriptor, as the compiled one is,
and resolves each chunk's path beneath it with ``disk/resolve.py``, the resolver
``disk/safe_fs.py`` uses too (``openat2`` with ``RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS``
where the kernel has it, else the ``O_NOFOLLOW`` walk), by the rules of ``csrc/chunkio.c``
(``chunk_open_beneath``, ``make_dirs_beneath``, ``chunk_unlink``).  Unlike ``safe_fs``'s
path functions it keeps the errnos as they come (a link is ``ELOOP`` or ``ENOTDIR``, a path
out of the root ``EXDEV``, never ``NotAChunkFile``): the engine reports them as the compiled
one does.
"""

from __future__ import annotations

import errno
import os

from ..disk.resolve import make_dirs_at, open_at, use_openat2

__all__ = ["make_dirs_at", "open_at", "unlink_at", "use_openat2"]

_O_PATH = getattr(os, "O_PATH", os.O_RDONLY)
_O_DIRECTORY = getattr(os, "O_DIRECTORY", 0)


def unlink_at(root_fd: int, rel: str) -> int:
    """Remove the file ``rel`` beneath the root (its directory reached without following a
    link; a link at ``rel`` itself is removed, never its target); 0 or an errno."""
    directory, _, name = rel.rpartition("/")
    try:
        if not directory:
            os.unlink(rel, dir_fd=root_fd)
            return 0
        dir_fd = open_at(root_fd, directory, _O_PATH | _O_DIRECTORY)
        try:
            os.unlink(name, dir_fd=dir_fd)
        finally:
            os.close(dir_fd)
    except OSError as exc:
        return exc.errno or errno.EIO
    except ValueError:  # a NUL in the path
        return errno.EINVAL
    return 0
