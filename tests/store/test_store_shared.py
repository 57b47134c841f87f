"""ChunkStore shared mode (``lookup`` on disk) and removal listeners, without LMCache."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from support.stores import StoreFactory

from lmcache_nvme_backend.disk.format import TensorMeta, file_size_for
from lmcache_nvme_backend.disk.layout import key_digest, namespace_id
from lmcache_nvme_backend.store.chunk_store import ChunkRead, ChunkStore, ChunkWrite
from lmcache_nvme_backend.store.index import IndexEntry

pytestmark = pytest.mark.timeout(60)

NBYTES = 64 * 1024
META = TensorMeta(shapes=((NBYTES,),), dtypes=("uint8",), fmt=1, nbytes=NBYTES)


def put(store: ChunkStore, key: str, ns: str = "model", fill: int = 1) -> bytes:
    payload = bytes([fill]) * NBYTES
    store.submit(key, ns, META, memoryview(payload), release=lambda: None)
    assert store.flush(30)
    return payload


def read(store: ChunkStore, key: str) -> bytes | None:
    buf = bytearray(NBYTES)
    (ok,) = store.read_into([ChunkRead(key, memoryview(buf))])
    return bytes(buf) if ok else None


def test_lookup_equals_contains_without_shared_mode(tmp_path: Path,
                                                    open_store: StoreFactory) -> None:
    a = open_store(tmp_path)
    b = open_store(tmp_path)
    put(a, "k1")
    assert a.lookup("k1", "model")
    assert not b.lookup("k1", "model")  # b's index was built before a wrote
    assert b.counter("shared_adopted") == 0


def test_shared_lookup_adopts_chunks_another_store_wrote(tmp_path: Path,
                                                         open_store: StoreFactory) -> None:
    a = open_store(tmp_path, shared=True)
    b = open_store(tmp_path, shared=True)
    c = open_store(tmp_path, shared=True)
    payload = put(a, "k1", fill=7)
    assert not c.lookup("k1", "other-model")  # files are looked for in the key's namespace
    assert not b.contains("k1")
    assert b.lookup("k1", "model", pin=True)
    assert b.counter("shared_adopted") == 1
    assert b.tensor_meta("k1") == META
    assert read(b, "k1") == payload
    assert b.usage()["used_bytes"] == file_size_for(NBYTES)
    assert b.unpin("k1")
    assert not b.lookup("absent", "model")


def test_shared_lookup_forgets_files_another_store_evicted(tmp_path: Path,
                                                          open_store: StoreFactory) -> None:
    a = open_store(tmp_path, shared=True)
    b = open_store(tmp_path, shared=True)
    put(a, "k1")
    assert b.lookup("k1", "model")
    assert a.remove("k1")  # the other process evicts it
    assert not b.lookup("k1", "model")
    assert b.counter("shared_vanished") == 1
    assert b.usage()["entries"] == 0
    # and a read racing the removal is a miss, not an error
    put(a, "k2")
    assert b.lookup("k2", "model")
    a.remove("k2")
    assert read(b, "k2") is None


def test_shared_lookup_rejects_a_file_naming_another_key(tmp_path: Path,
                                                         open_store: StoreFactory) -> None:
    a = open_store(tmp_path, shared=True)
    put(a, "k1")
    src = a.layouts[0].chunk_path(namespace_id("model"), key_digest("k1"))
    dst = a.layouts[0].chunk_path(namespace_id("model"), key_digest("k2"))
    dst.parent.mkdir(parents=True, exist_ok=True)
    os.link(src, dst)  # a file under k2's name whose header says k1
    assert not a.lookup("k2", "model")
    assert not dst.exists() and a.counter("invalid_files") == 1


def test_removal_listener_sees_evictions_and_removals(tmp_path: Path,
                                                      open_store: StoreFactory) -> None:
    budget_gb = 2 * file_size_for(NBYTES) / 1024**3
    store = open_store(tmp_path, max_size_gb=budget_gb)
    removed: list[list[IndexEntry]] = []
    store.add_removal_listener(removed.append)
    store.add_removal_listener(lambda entries: 1 / 0)  # a failing listener is contained
    put(store, "a")
    put(store, "b")
    put(store, "c")  # evicts a
    assert [[e.digest for e in batch] for batch in removed] == [[key_digest("a")]]
    assert store.remove("b")
    assert [e.digest for e in removed[-1]] == [key_digest("b")]
    assert removed[-1][0].size == file_size_for(NBYTES)
    os.unlink(store.layouts[0].chunk_path(namespace_id("model"), key_digest("c")))
    assert read(store, "c") is None  # the vanished file leaves the index, listeners hear it
    assert [e.digest for e in removed[-1]] == [key_digest("c")]


def test_submit_release_and_persisted_callbacks(tmp_path: Path,
                                                open_store: StoreFactory) -> None:
    store = open_store(tmp_path)
    events: list[str] = []
    payload = memoryview(b"x" * NBYTES)
    store.submit_many([ChunkWrite("k", "model", META, payload,
                                  release=lambda: events.append("released"),
                                  on_persisted=lambda: events.append("persisted"))])
    assert store.flush(30)
    assert events == ["persisted", "released"]
