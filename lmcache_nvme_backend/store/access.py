"""Can this process use a cache directory?  The store's check at start, before it creates
anything there (``disk/probe.py``'s probe, which ``doctor`` and ``check-config`` report).

One it cannot use is refused with an ``NVMeConfigError`` naming the setting, the
directory and the fix; for a tree another user created (a server once started as root),
the directory's owner and mode, this process's user, and the ``chown`` that fixes it.
"""

from __future__ import annotations

import os
import pwd
import stat
from pathlib import Path

from ..config import EXTRA_CONFIG_PREFIX, NVMeConfigError, NVMeSettings
from ..disk.probe import PathProbe, path_problem, probe_path


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


def path_error(key_prefix: str, problem: str, fix: str = "") -> NVMeConfigError:
    """The error of the ``path`` setting (``<prefix>path: <problem>. <fix>``)."""
    return NVMeConfigError(f"{key_prefix}path: {problem}" + (f". {fix}" if fix else ""))


def require_usable_root(path: Path, shared: bool = False,
                        key_prefix: str = EXTRA_CONFIG_PREFIX) -> PathProbe:
    """The probe of ``path``, or ``NVMeConfigError`` (naming ``<key_prefix>path``, the
    problem and the fix) when the store cannot use it; in ``shared`` mode a directory this
    process may not write is served read-only."""
    probe = probe_path(path, tree=os.geteuid() != 0)
    found = path_problem(probe, shared)
    if found is not None:
        raise path_error(key_prefix, *found)
    if probe.layout_error is not None:
        raise path_error(key_prefix, probe.layout_error)
    if probe.unusable:
        raise path_error(key_prefix, *_tree_problem(probe.path, list(probe.unusable)))
    return probe


def check_paths(settings: NVMeSettings) -> None:
    """Check every directory of ``settings.paths`` as the store would, raising
    ``NVMeConfigError`` for the first it would refuse: a launcher's pre-start check
    (``examples/quickstart.py``).  Creates nothing but one probe file per path."""
    for path in settings.paths:
        require_usable_root(path, settings.shared, settings.key_prefix)


def _tree_problem(root: Path, problems: list[Path]) -> tuple[str, str]:
    """(problem, fix) of an existing tree whose directories ``problems`` this process cannot
    use: the first one, its owner, this process's user and the ``chown``."""
    first = problems[0]
    me = user_name(os.geteuid())
    more = (f"; {len(problems) - 1} more director{'ies' if len(problems) > 2 else 'y'} of "
            "the tree are the same" if len(problems) > 1 else "")
    try:
        owner = first.lstat().st_uid
    except OSError:  # removed meanwhile: the message still names it
        owner = os.geteuid()
    return (f"'{first}' is {describe_owner(first)}, and this process runs as {me} (uid "
            f"{os.geteuid()}), which cannot list and write it{more}",
            f"Was the server once started as {user_name(owner)}? Give the tree to the user "
            f"the server runs as (as root: chown -R {me}: {root}), or run the server as "
            f"{user_name(owner)}.")
