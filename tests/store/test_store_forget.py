"""A running store stops serving a namespace ``lmcache-nvme forget`` dropped, without a
restart (``store/namespaces.py``): alone, and as two members of a shared directory."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from support.stores import StoreFactory

from lmcache_nvme_backend.cli import main as cli_main
from lmcache_nvme_backend.disk.format import TensorMeta, file_size_for
from lmcache_nvme_backend.disk.layout import key_digest, namespace_id
from lmcache_nvme_backend.store.chunk_store import ChunkStore
from lmcache_nvme_backend.store.index import IndexEntry

pytestmark = pytest.mark.timeout(120)

NBYTES = 64 * 1024
FILE = file_size_for(NBYTES)
META = TensorMeta(shapes=((NBYTES,),), dtypes=("uint8",), fmt=1, nbytes=NBYTES)
OLD, NEW = "m#b1", "m#b2"
KEYS = [f"m@0@{i:04x}" for i in range(4)]


def put(store: ChunkStore, ns: str, keys: list[str]) -> None:
    for i, key in enumerate(keys):
        store.submit(key + ns, ns, META, memoryview(bytes([i + 1]) * NBYTES),
                     release=lambda: None)
    assert store.flush(30)


def hits(store: ChunkStore, ns: str) -> list[bool]:
    return [store.lookup(key + ns, ns) for key in KEYS]


def wait_for(what: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not what():
        assert time.monotonic() < deadline, "not within the deadline"
        time.sleep(0.05)


def forget(cache: Path, build: str) -> None:
    assert cli_main(["forget", str(cache), "--model", "m", "--build", build]) == 0


def listen(store: ChunkStore) -> list[IndexEntry]:
    heard: list[IndexEntry] = []
    store.add_removal_listener(heard.extend)
    return heard


def test_a_running_store_stops_serving_a_forgotten_build(open_store: StoreFactory,
                                                          cache_dir: Path) -> None:
    store = open_store(cache_dir)
    put(store, OLD, KEYS)
    put(store, NEW, KEYS)
    heard = listen(store)
    used = store.usage()["used_bytes"]
    assert all(hits(store, OLD)) and all(hits(store, NEW))
    forget(cache_dir, "b1")
    wait_for(lambda: not any(hits(store, OLD)))
    assert all(hits(store, NEW))
    assert {e.digest for e in heard} == {key_digest(k + OLD) for k in KEYS}
    assert store.usage()["used_bytes"] == used - len(KEYS) * FILE
    assert store.usage()["entries"] == len(KEYS)


def test_files_written_into_a_directory_made_again_leave_with_it(
        open_store: StoreFactory, cache_dir: Path) -> None:
    """A writer that makes the namespace's directory again before the store looks: what it
    put there leaves the index and the drive with the rest (nothing unindexed is left)."""
    store = open_store(cache_dir)
    store._namespaces.stop()  # one round at a time, below
    put(store, OLD, KEYS[:2])
    assert store._namespaces.check() == 0  # the round that first sees the directory
    heard = listen(store)
    forget(cache_dir, "b1")
    put(store, OLD, KEYS[2:])  # makes ns/<id> again
    ns_dir = cache_dir / "ns" / namespace_id(OLD)
    assert ns_dir.is_dir() and all(hits(store, OLD)[2:])
    assert store._namespaces.check() == len(KEYS)
    assert not any(hits(store, OLD))
    assert len(heard) == len(KEYS)
    assert not [f for _, _, files in os.walk(ns_dir) for f in files if f.endswith(".kv")]
    assert store.usage()["used_bytes"] == 0
    put(store, OLD, KEYS[:1])  # the directory as it is now is the namespace's from now on
    assert store._namespaces.check() == 0 and hits(store, OLD)[0]


def test_every_member_of_a_shared_directory_stops_serving_it(open_store: StoreFactory,
                                                             cache_dir: Path) -> None:
    a = open_store(cache_dir, shared=True)
    b = open_store(cache_dir, shared=True)
    put(a, OLD, KEYS)
    put(b, NEW, KEYS)
    a.refresh_shared()
    b.refresh_shared()
    assert all(hits(a, OLD) + hits(b, OLD) + hits(a, NEW) + hits(b, NEW))
    heard_a, heard_b = listen(a), listen(b)
    owned = a.stats_snapshot()["member_bytes"]
    forget(cache_dir, "b1")
    wait_for(lambda: not any(hits(a, OLD) + hits(b, OLD)))
    assert all(hits(a, NEW) + hits(b, NEW))
    old = {key_digest(k + OLD) for k in KEYS}
    assert {e.digest for e in heard_a} == old and {e.digest for e in heard_b} == old
    # the member that wrote them no longer counts them in its account of the budget
    assert a.stats_snapshot()["member_bytes"] == owned - len(KEYS) * FILE
    assert b.stats_snapshot()["member_bytes"] == len(KEYS) * FILE
