"""Shard levels through the store: a new cache directory gets one level of shard
directories per namespace; a tree made by version 0.2 (two levels, its marker silent about
them) keeps its layout and serves; one store may have roots of both layouts."""

from __future__ import annotations

from pathlib import Path

import pytest
from support.chunks import NS, files_on_disk, payload_for, put, read
from support.stores import StoreFactory

from lmcache_nvme_backend.config import NVMeConfigError
from lmcache_nvme_backend.disk.layout import MARKER_NAME, key_digest, namespace_id
from lmcache_nvme_backend.store.chunk_store import ChunkStore
from lmcache_nvme_backend.store.writeback import SubmitResult

#: The marker version 0.2 wrote (no ``shard_levels`` line: two levels).
MARKER_0_2 = b"lmcache-nvme-backend cache root, chunk format 1\n"
KEYS = [f"key-{i}" for i in range(24)]


def tree_made_by_0_2(path: Path) -> Path:
    path.mkdir(parents=True)
    (path / MARKER_NAME).write_bytes(MARKER_0_2)
    return path


def shard_dirs_of(root: Path, key: str) -> tuple[str, ...]:
    """The directories between the namespace's directory and ``key``'s file, if it is on
    ``root``."""
    digest = key_digest(key)
    found = [p for p in files_on_disk(root) if p.name == f"{digest}.kv"]
    if not found:
        return ()
    (path,) = found
    return path.relative_to(root / "ns" / namespace_id(NS)).parts[:-1]


def store_all(store: ChunkStore, keys: list[str]) -> None:
    assert [put(store, key) for key in keys] == [SubmitResult.QUEUED] * len(keys)
    assert store.flush(30)


def test_a_new_cache_directory_has_one_shard_level(open_store: StoreFactory,
                                                   tmp_path: Path) -> None:
    store = open_store()
    store_all(store, KEYS)
    root = tmp_path / "cache"
    assert (root / MARKER_NAME).read_bytes().endswith(b"\nshard_levels 1\n")
    assert {shard_dirs_of(root, key) for key in KEYS} == {(key_digest(key)[:2],)
                                                         for key in KEYS}
    assert all(read(store, key) == payload_for(key) for key in KEYS)
    assert store.remove_many(KEYS[:4]) == 4
    assert all(shard_dirs_of(root, key) == () for key in KEYS[:4])


def test_a_tree_made_by_0_2_keeps_two_levels_and_serves_after_a_restart(
        open_store: StoreFactory, tmp_path: Path) -> None:
    root = tree_made_by_0_2(tmp_path / "old")
    store = open_store(root)
    store_all(store, KEYS)
    assert all(shard_dirs_of(root, key) == (key_digest(key)[:2], key_digest(key)[2:4])
               for key in KEYS)
    store.close()
    restarted = open_store(root)  # the index rebuilt from the two-level tree
    assert all(read(restarted, key) == payload_for(key) for key in KEYS)
    assert restarted.remove_many(KEYS[:4]) == 4
    assert all(shard_dirs_of(root, key) == () for key in KEYS[:4])
    assert (root / MARKER_NAME).read_bytes() == MARKER_0_2  # never rewritten


def test_one_store_serves_roots_of_both_layouts(open_store: StoreFactory,
                                                tmp_path: Path) -> None:
    old, new = tree_made_by_0_2(tmp_path / "old"), tmp_path / "new"
    keys = [f"key-{i}" for i in range(64)]
    store = open_store(old, new)
    store_all(store, keys)
    on_old = [key for key in keys if shard_dirs_of(old, key)]
    on_new = [key for key in keys if shard_dirs_of(new, key)]
    assert sorted(on_old + on_new) == sorted(keys) and on_old and on_new
    assert all(len(shard_dirs_of(old, key)) == 2 for key in on_old)
    assert all(len(shard_dirs_of(new, key)) == 1 for key in on_new)
    store.close()
    restarted = open_store(old, new)
    assert all(read(restarted, key) == payload_for(key) for key in keys)
    gone = on_old[:3] + on_new[:3]  # one removal batch that spans both roots
    assert restarted.remove_many(gone) == 6
    assert not any(shard_dirs_of(old, key) or shard_dirs_of(new, key) for key in gone)
    assert all(read(restarted, key) == payload_for(key) for key in keys if key not in gone)


def test_a_tree_from_a_newer_layout_is_refused_by_name_at_start(open_store: StoreFactory,
                                                                 tmp_path: Path) -> None:
    root = tmp_path / "newer"
    root.mkdir()
    (root / MARKER_NAME).write_bytes(MARKER_0_2 + b"shard_levels 3\n")
    with pytest.raises(NVMeConfigError, match=rf"^path: {root / MARKER_NAME} says "
                                              r"shard_levels 3, .* Upgrade lmcache-nvme"):
        open_store(root)
    assert sorted(p.name for p in root.iterdir()) == [MARKER_NAME]  # nothing created
