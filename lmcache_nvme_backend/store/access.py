"""Can this process use a cache tree that already exists?

A tree is often created by one user and later opened by another: a server started
once as root leaves ``index/``, ``quarantine/`` and ``ns/...`` owned by root with mode
``0700``, and the service user's server then cannot list or write them.  Rather than
fail on the first such directory with a bare ``Permission denied``, the store checks
the tree's directories at start and refuses with one message that names the
directory, its owner and mode, this process's user, and the ``chown`` that fixes it.

Only directories are checked (a few per namespace, up to 256 shard directories each,
65 536 in a tree made by version 0.2 or earlier); a chunk file this process may not read
stays a miss when it is asked for.  A process running as root skips the walk (it may use
every directory).
"""

from __future__ import annotations

import os
import pwd
import stat
from pathlib import Path

from ..config import NVMeConfigError
from ..disk.layout import MARKER_NAME, RootLayout

#: Directories the store keeps directly under a root.
TOP_DIRS = ("index", "quarantine", "ns")
_USE = os.R_OK | os.W_OK | os.X_OK


def user_name(uid: int) -> str:
    """The login name of ``uid``, or the number where the user database has none."""
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def describe_owner(path: Path) -> str:
    """``owned by <user> (uid N), mode 0700`` of ``path`` (not following a link)."""
    try:
        st = path.lstat()
    except OSError as exc:
        return f"not readable ({exc.strerror})"
    return (f"owned by {user_name(st.st_uid)} (uid {st.st_uid}), mode "
            f"{stat.S_IMODE(st.st_mode):04o}")


def _usable(path: Path | str, mode: int) -> bool:
    return os.access(path, mode, effective_ids=True, follow_symlinks=False)


def unusable_dirs(layout: RootLayout) -> list[Path]:
    """Directories of the cache tree ``layout`` describes this process cannot list, enter
    and write (the root itself only needs writing when the store must create something in
    it)."""
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


def require_tree_access(layout: RootLayout) -> None:
    """Raise ``NVMeConfigError`` naming the first directory of an existing tree (``layout``)
    that this process cannot use, its owner, and the fix."""
    root = layout.root
    if os.geteuid() == 0 or not root.is_dir():
        return
    problems = unusable_dirs(layout)
    if not problems:
        return
    first = problems[0]
    me = user_name(os.geteuid())
    more = (f"; {len(problems) - 1} more director{'ies' if len(problems) > 2 else 'y'} of "
            "the tree are the same" if len(problems) > 1 else "")
    try:
        owner = first.lstat().st_uid
    except OSError:  # removed meanwhile: the message still names it
        owner = os.geteuid()
    raise NVMeConfigError(
        f"nvme.path: '{first}' is {describe_owner(first)}, and this process runs as {me} "
        f"(uid {os.geteuid()}), which cannot list and write it{more}. Was the server once "
        f"started as {user_name(owner)}? Give the tree to the user the server runs as "
        f"(as root: chown -R {me}: {root}), or run the server as {user_name(owner)}.")
