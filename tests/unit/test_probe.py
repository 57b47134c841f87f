"""disk/probe.py: the one probe of a cache directory, and the setting error it renders.

The settings look with it (``look_only``), the store checks each root with it at start
(``store/access.py``), and ``doctor`` / ``check-config`` report it (``cli/path_checks.py``).
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from lmcache_nvme_backend.disk import probe as probe_mod
from lmcache_nvme_backend.disk.layout import MARKER_NAME
from lmcache_nvme_backend.disk.probe import (
    PathProbe,
    PathState,
    nearest_existing,
    path_problem,
    probe_path,
)


def entries(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


def test_a_writable_directory_is_ready_and_the_probe_leaves_nothing(tmp_path: Path) -> None:
    found = probe_path(tmp_path)
    assert (found.state, found.where, found.exists, found.error) == (
        PathState.READY, tmp_path, True, None)
    assert found.tree_checked and found.unusable == ()
    assert found.layout is not None and not found.marker
    assert entries(tmp_path) == set()
    assert path_problem(found) is None


def test_a_missing_path_is_probed_in_its_nearest_existing_parent(tmp_path: Path) -> None:
    target = tmp_path / "a" / "b"
    found = probe_path(target)
    assert (found.state, found.where, found.exists) == (PathState.MISSING, tmp_path, False)
    assert found.layout is None and not found.tree_checked
    assert not (tmp_path / "a").exists() and entries(tmp_path) == set()
    assert path_problem(found) is None


def test_a_file_and_a_path_below_one(tmp_path: Path) -> None:
    a_file = tmp_path / "file"
    a_file.write_text("x")
    found = probe_path(a_file)
    assert found.state is PathState.NOT_A_DIRECTORY
    assert path_problem(found) == (f"'{a_file}' exists and is not a directory",
                                   "Point it at a directory (it is created if missing).")
    below = probe_path(a_file / "sub" / "cache")
    assert (below.state, below.where) == (PathState.BLOCKED, a_file)
    assert path_problem(below) == (f"cannot create '{a_file / 'sub' / 'cache'}': Not a "
                                   "directory", "Create it yourself or choose a writable "
                                   "location.")
    assert a_file.read_text() == "x"


def test_a_link_that_leads_nowhere_is_not_a_directory(tmp_path: Path) -> None:
    (tmp_path / "link").symlink_to(tmp_path / "nowhere")
    assert nearest_existing(tmp_path / "link") == tmp_path / "link"
    assert probe_path(tmp_path / "link").state is PathState.NOT_A_DIRECTORY
    assert probe_path(tmp_path / "link" / "sub").state is PathState.BLOCKED
    assert not (tmp_path / "nowhere").exists()


def test_look_only_creates_and_reads_nothing(tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    def no_write(directory: Path) -> OSError | None:
        raise AssertionError("look_only must not create a file")

    monkeypatch.setattr(probe_mod, "_probe_file", no_write)
    assert probe_path(tmp_path, look_only=True).state is PathState.READY
    assert probe_path(tmp_path / "x", look_only=True).state is PathState.MISSING
    assert probe_path(tmp_path, look_only=True).layout is None


@pytest.mark.parametrize(("code", "state"), [(errno.ENOSPC, PathState.FULL),
                                             (errno.EDQUOT, PathState.FULL),
                                             (errno.EACCES, PathState.UNWRITABLE),
                                             (errno.EROFS, PathState.UNWRITABLE)])
def test_the_probe_file_error_decides(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                      code: int, state: PathState) -> None:
    monkeypatch.setattr(probe_mod, "_probe_file",
                        lambda directory: OSError(code, os.strerror(code)))
    found = probe_path(tmp_path)
    assert found.state is state
    assert found.error is not None and found.error.errno == code


def probe_with(path: Path, code: int, exists: bool = True, marker: bool = False) -> PathProbe:
    state = PathState.FULL if code in probe_mod.FULL_ERRNOS else PathState.UNWRITABLE
    return PathProbe(path, state, path if exists else path.parent,
                     OSError(code, os.strerror(code)), marker=marker)


def test_the_setting_error_of_each_failed_write(tmp_path: Path) -> None:
    path = tmp_path / "cache"
    assert path_problem(probe_with(path, errno.EROFS)) == (
        f"'{path}' is not writable (read-only filesystem)",
        "Grant this process write access or choose another directory.")
    assert path_problem(probe_with(path, errno.EACCES)) == (
        f"'{path}' is not writable (Permission denied)",
        "Grant this process write access or choose another directory.")
    assert path_problem(probe_with(path, errno.EACCES, exists=False)) == (
        f"cannot create '{path}': Permission denied",
        "Create it yourself or choose a writable location.")
    # a full filesystem still starts: the store serves what the directory holds
    assert path_problem(probe_with(path, errno.ENOSPC)) is None


@pytest.mark.parametrize("code", [errno.EROFS, errno.EACCES, errno.EPERM])
def test_shared_mode_serves_a_cache_directory_it_may_not_write(tmp_path: Path,
                                                               code: int) -> None:
    path = tmp_path / "cache"
    assert path_problem(probe_with(path, code, marker=True), shared=True) is None
    assert path_problem(probe_with(path, code, marker=True)) is not None  # not shared
    assert path_problem(probe_with(path, code), shared=True) is not None  # not a cache dir
    assert path_problem(probe_with(path, errno.EIO, marker=True), shared=True) is not None


def test_a_newer_layout_and_the_marker_are_read(tmp_path: Path) -> None:
    (tmp_path / MARKER_NAME).write_bytes(b"lmcache-nvme-backend cache root, chunk format 1\n"
                                         b"shard_levels 3\n")
    found = probe_path(tmp_path)
    assert found.marker and found.layout is None and not found.tree_checked
    assert found.layout_error is not None and "says shard_levels 3" in found.layout_error


def test_no_tree_walk_when_not_asked(tmp_path: Path) -> None:
    found = probe_path(tmp_path, tree=False)
    assert found.state is PathState.READY and not found.tree_checked
