"""store/access.py: a cache tree whose directories another user created is refused at start
with the directory, its owner and the fix, never with a bare ``Permission denied``; and
``check_paths``, the same check of every configured path before any store opens.

The store runs as ``nobody`` in a child process (``support.other_user``) on a tree that
root created, as when a server was once started as root.
"""

from __future__ import annotations

import errno
import os
import pwd
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.chunks import put
from support.prerequisites import missing_prerequisite
from support.process import child_env, module_command
from support.stores import StoreFactory

from lmcache_nvme_backend import NVMeSettings, check_paths
from lmcache_nvme_backend.config import ADAPTER_PARAMS_PREFIX, NVMeConfigError
from lmcache_nvme_backend.disk import probe as probe_mod
from lmcache_nvme_backend.disk.layout import (
    MARKER_NAME,
    RootLayout,
    key_digest,
    marker_text,
    namespace_id,
)

USER = "nobody"


@pytest.fixture
def other_user() -> str:
    if os.geteuid() != 0:
        missing_prerequisite("needs root: the test builds a tree owned by root and opens it "
                             f"as '{USER}'")
    try:
        pwd.getpwnam(USER)
    except KeyError:
        missing_prerequisite(f"no '{USER}' user on this system")
    return USER


@pytest.fixture
def reachable_dir() -> Iterator[Path]:
    """A directory every user can reach (pytest's tmp_path is private to root)."""
    path = Path(tempfile.mkdtemp(prefix="lmcache-nvme-access-"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path)


def run_as(user: str, *args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(module_command("support.other_user", user, *map(str, args)),
                          env=child_env(), capture_output=True, text=True, timeout=120)


def chown_tree(root: Path, user: str) -> None:
    entry = pwd.getpwnam(user)
    for path in [root, *root.rglob("*")]:
        os.lchown(path, entry.pw_uid, entry.pw_gid)


def tree_state(root: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(root)): (p.lstat().st_uid, p.lstat().st_mode)
            for p in [root, *root.rglob("*")]}


@pytest.fixture
def root_made_tree(reachable_dir: Path, open_store: StoreFactory) -> Path:
    """A cache with one chunk, written by root (directories 0700, files 0600)."""
    cache = reachable_dir / "cache"
    store = open_store(cache)
    put(store, "key-0")
    assert store.flush(30)
    store.close()
    return cache


def test_subdirectories_made_by_root_are_refused_with_owner_and_fix(
        other_user: str, root_made_tree: Path) -> None:
    os.chown(root_made_tree, pwd.getpwnam(other_user).pw_uid, -1)  # only the top is theirs
    before = tree_state(root_made_tree)
    proc = run_as(other_user, "open-store", root_made_tree)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("REFUSED "), proc.stdout + proc.stderr[-3000:]
    message = proc.stdout.strip()
    assert f"'{root_made_tree / 'index'}' is owned by root (uid 0), mode 0700" in message
    assert f"this process runs as {other_user}" in message
    assert "2 more directories of the tree are the same" in message
    assert f"chown -R {other_user}: {root_made_tree}" in message
    assert "Permission denied" not in proc.stdout + proc.stderr
    assert tree_state(root_made_tree) == before  # refused before touching anything


def test_a_shard_directory_made_by_root_is_named(other_user: str, root_made_tree: Path) -> None:
    chown_tree(root_made_tree, other_user)
    digest = key_digest("key-0")
    shard = RootLayout.of(root_made_tree).chunk_path(namespace_id("test-model"), digest).parent
    os.lchown(shard, 0, 0)
    proc = run_as(other_user, "open-store", root_made_tree)
    # the test's settings use bare names (from_params): the error names the key as given
    assert proc.stdout.startswith(f"REFUSED path: '{shard}' is owned by root (uid 0)"), (
        proc.stdout + proc.stderr[-3000:])
    assert "more director" not in proc.stdout


def test_the_tree_given_to_the_service_user_opens_with_its_chunks(
        other_user: str, root_made_tree: Path) -> None:
    chown_tree(root_made_tree, other_user)
    proc = run_as(other_user, "open-store", root_made_tree)
    assert proc.stdout.strip() == "OPENED 1", proc.stdout + proc.stderr[-3000:]


def test_check_paths_refuses_what_the_tree_walk_refuses_and_changes_nothing(
        other_user: str, root_made_tree: Path) -> None:
    os.chown(root_made_tree, pwd.getpwnam(other_user).pw_uid, -1)
    before = tree_state(root_made_tree)
    checked = run_as(other_user, "check-paths", root_made_tree)
    opened = run_as(other_user, "open-store", root_made_tree)
    assert checked.stdout.startswith("REFUSED path: "), checked.stdout + checked.stderr[-3000:]
    assert checked.stdout == opened.stdout  # the store's own words
    assert tree_state(root_made_tree) == before
    chown_tree(root_made_tree, other_user)
    assert run_as(other_user, "check-paths", root_made_tree).stdout.strip() == "USABLE"


# check_paths: what parsing the settings cannot tell, named with the settings' own key

NEWER_MARKER = marker_text(3)  # a layout this version does not know


def entries(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


def extra_config_settings(*paths: Path, **more: object) -> NVMeSettings:
    return NVMeSettings.from_extra_config({"nvme.path": [str(p) for p in paths],
                                           "nvme.max_size_gb": 1, "nvme.min_free_gb": 0,
                                           **{f"nvme.{k}": v for k, v in more.items()}})


def test_check_paths_passes_usable_paths_and_creates_nothing(tmp_path: Path) -> None:
    existing = tmp_path / "nvme0"
    existing.mkdir()
    missing = tmp_path / "nvme1" / "cache"  # created by the store, not by the check
    check_paths(extra_config_settings(existing, missing))
    assert entries(tmp_path) == {"nvme0"}


def test_check_paths_names_the_key_of_a_path_below_a_file(tmp_path: Path) -> None:
    target = tmp_path / "mnt" / "cache"
    settings = extra_config_settings(tmp_path / "ok", target)  # fine when parsed ...
    (tmp_path / "mnt").write_text("x")  # ... then its parent became a file
    with pytest.raises(NVMeConfigError) as refused:
        check_paths(settings)
    assert str(refused.value) == (f"nvme.path: cannot create '{target}': Not a directory. "
                                  "Create it yourself or choose a writable location.")
    assert entries(tmp_path) == {"mnt"}


def test_check_paths_refuses_a_tree_from_a_newer_layout(tmp_path: Path) -> None:
    fine, newer = tmp_path / "nvme0", tmp_path / "nvme1"
    newer.mkdir()
    (newer / MARKER_NAME).write_bytes(NEWER_MARKER)
    settings = NVMeSettings.from_params({"path": [str(fine), str(newer)], "max_size_gb": 1},
                                        key_prefix=ADAPTER_PARAMS_PREFIX)  # parsing passes
    with pytest.raises(NVMeConfigError,
                       match=rf"^adapter_params\.path: {newer / MARKER_NAME} says shard_levels "
                             r"3, .* Upgrade lmcache-nvme-backend"):
        check_paths(settings)
    assert entries(tmp_path) == {"nvme1", f"nvme1/{MARKER_NAME}"}


def test_check_paths_passes_shared_on_a_cache_directory_it_may_only_read(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / MARKER_NAME).write_bytes(marker_text(1))
    monkeypatch.setattr(probe_mod, "_probe_file",  # what a non-root user meets: EACCES
                        lambda directory: OSError(errno.EACCES, os.strerror(errno.EACCES)))
    with pytest.raises(NVMeConfigError, match=rf"^nvme\.path: '{cache}' is not writable "
                                              r"\(Permission denied\)\. Grant this process"):
        check_paths(extra_config_settings(cache))
    check_paths(extra_config_settings(cache, shared=True))  # a member that only reads there
