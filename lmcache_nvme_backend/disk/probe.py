"""Can this process use a directory as a cache root?  The one probe of an ``nvme.path``,
for the settings (``look_only``), the store at start (``store/access.py``) and ``doctor`` /
``check-config``.  It creates and removes one file in the path (or its nearest existing
parent), reads the marker and, with ``tree``, checks every directory of an existing tree.
"""

from __future__ import annotations

import enum
import errno
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from .layout import MARKER_NAME, RootLayout

#: Directories the store keeps directly under a root.
TOP_DIRS = ("index", "quarantine", "ns")
#: Probe file errors that leave a directory usable (the store serves what it holds).
FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
#: Probe file errors a shared-mode member accepts in a cache directory it only reads.
READ_ONLY_ERRNOS = (errno.EROFS, errno.EACCES, errno.EPERM)
NOT_A_DIRECTORY_FIX = "Point it at a directory (it is created if missing)."
CREATE_FIX = "Create it yourself or choose a writable location."
WRITE_FIX = "Grant this process write access or choose another directory."
_USE = os.R_OK | os.W_OK | os.X_OK


class PathState(enum.Enum):
    """What a path is to this process."""

    READY = "ready"  # a directory; files can be created in it (look_only: it is a directory)
    MISSING = "missing"  # absent; files can be created in its nearest existing parent
    NOT_A_DIRECTORY = "not a directory"  # it exists and is not a directory
    BLOCKED = "blocked"  # absent, and its nearest existing ancestor is not a directory
    UNWRITABLE = "unwritable"  # no file can be created in ``where`` (``error`` says why)
    FULL = "full"  # ``where`` has no block or inode left for one more file


@dataclass(frozen=True)
class PathProbe:
    """What :func:`probe_path` found at ``path``."""

    path: Path
    state: PathState
    where: Path  # the path when it exists, else its nearest existing ancestor
    error: OSError | None = None  # why the probe file could not be created
    marker: bool = False  # the path holds the cache marker
    layout: RootLayout | None = None  # None: absent, or its marker is unreadable
    layout_error: str | None = None  # the marker names a layout of a newer version
    # directories of the tree this process cannot list, enter and write (parents first)
    unusable: tuple[Path, ...] = ()
    # whether the tree was walked for ``unusable`` (not when look_only, absent, without
    # ``tree``, with an unreadable marker or on a read-only filesystem)
    tree_checked: bool = False

    @property
    def exists(self) -> bool:
        return self.where == self.path


def nearest_existing(path: Path) -> Path:
    """``path`` (absolute) or its closest ancestor that exists (a link counts, even one
    that leads nowhere: nothing can be created in its place)."""
    path = path.absolute()
    while not os.path.lexists(path) and path != path.parent:
        path = path.parent
    return path


def probe_path(path: Path, *, look_only: bool = False, tree: bool = True) -> PathProbe:
    """What this process can do with ``path`` as a cache directory; ``look_only``: only
    the kind of the path and of its nearest existing ancestor."""
    path = path.absolute()
    where = nearest_existing(path)
    if where == path and not path.is_dir():
        return PathProbe(path, PathState.NOT_A_DIRECTORY, where)
    if where != path and not where.is_dir():
        return PathProbe(path, PathState.BLOCKED, where)
    state = PathState.READY if where == path else PathState.MISSING
    if look_only:
        return PathProbe(path, state, where)
    error = _probe_file(where)
    if error is not None:
        state = PathState.FULL if error.errno in FULL_ERRNOS else PathState.UNWRITABLE
    if where != path:
        return PathProbe(path, state, where, error)
    marker = (path / MARKER_NAME).is_file()
    try:
        layout = RootLayout.of(path)  # reads only
    except ValueError as exc:  # a marker from a newer version
        return PathProbe(path, state, where, error, marker, layout_error=str(exc))
    walk = tree and not _read_only(path)  # nothing can be written there anyway
    unusable = tuple(unusable_dirs(layout)) if walk else ()
    return PathProbe(path, state, where, error, marker, layout, None, unusable, walk)


def path_problem(probe: PathProbe, shared: bool = False) -> tuple[str, str] | None:
    """(problem, fix) of a setting's error when no cache directory can be at the probed path
    or no file can be created there; None when one can (full, or in ``shared`` mode read
    only, included).  The marker and the tree are ``store/access.py``'s to judge."""
    path, error = probe.path, probe.error
    if probe.state is PathState.NOT_A_DIRECTORY:
        return f"'{path}' exists and is not a directory", NOT_A_DIRECTORY_FIX
    if probe.state is PathState.BLOCKED:
        return f"cannot create '{path}': {os.strerror(errno.ENOTDIR)}", CREATE_FIX
    if probe.state is not PathState.UNWRITABLE or error is None:
        return None
    if shared and probe.marker and error.errno in READ_ONLY_ERRNOS:
        return None
    if not probe.exists:
        return f"cannot create '{path}': {error.strerror}", CREATE_FIX
    why = "read-only filesystem" if error.errno == errno.EROFS else error.strerror
    return f"'{path}' is not writable ({why})", WRITE_FIX


def _probe_file(directory: Path) -> OSError | None:
    """Create and remove one file in ``directory``; the error when that fails."""
    try:
        fd, name = tempfile.mkstemp(prefix=".write-probe-", dir=directory)
        os.close(fd)
        os.unlink(name)
    except OSError as exc:
        return exc
    return None


def _read_only(path: Path) -> bool:
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError:
        return False


def _usable(path: Path | str, mode: int) -> bool:
    return os.access(path, mode, effective_ids=True, follow_symlinks=False)


def unusable_dirs(layout: RootLayout) -> list[Path]:
    """Directories of the tree this process cannot list, enter and write (the root only
    needs writing when the store must create something in it); links are not followed."""
    root = layout.root
    missing = [name for name in (*TOP_DIRS, MARKER_NAME) if not (root / name).exists()]
    need = _USE if missing else os.R_OK | os.X_OK
    if not _usable(root, need):
        return [root]
    found = [root / name for name in TOP_DIRS
             if (root / name).is_dir() and not (root / name).is_symlink()
             and not _usable(root / name, _USE)]
    if not _usable(layout.namespaces_dir, os.R_OK | os.X_OK):
        return found
    prefix = f"{root}/"  # strings, not Paths: a full two-level namespace has 65 793 directories
    return found + [root / rel for rel in layout.iter_tree_dirs()
                    if not _usable(prefix + rel, _USE)]
