"""store/access.py: a cache tree whose directories another user created is refused at start
with the directory, its owner and the fix, never with a bare ``Permission denied``.

The store runs as ``nobody`` in a child process (``support.other_user``) on a tree that
root created, as when a server was once started as root.
"""

from __future__ import annotations

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

from lmcache_nvme_backend.disk.layout import RootLayout, key_digest, namespace_id

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
