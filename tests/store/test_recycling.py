"""Removed chunk files kept for reuse (``nvme.recycle_mb``) through a real ``ChunkStore``:
deletes and evictions feed the native engine's pool, later writes of the same size
overwrite those files, every read serves exactly what was stored, and nothing kept
outlives the store (a close removes it, a crash leaves temp files the next start
removes)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from support.chunks import CHUNK, NS, files_on_disk, payload_for, put, read
from support.stores import StoreFactory

from lmcache_nvme_backend.disk.layout import TEMP_INFIX
from lmcache_nvme_backend.io import native

FILE_BYTES = 4096 + (CHUNK + 4095) // 4096 * 4096  # header and padded payload


@pytest.fixture(autouse=True)
def native_only(native_io: str | None) -> None:
    if native_io != "on":
        pytest.skip("retired files are the native engine's; the Python engine removes files")


def recycled() -> int:
    return native.counters()["recycled_writes"]


def kept(root: Path) -> list[Path]:
    return [p for p in files_on_disk(root) if TEMP_INFIX in p.name]


def test_deleted_chunks_are_rewritten_in_place_and_read_back_exactly(
        open_store: StoreFactory, tmp_path: Path) -> None:
    store = open_store()
    root = tmp_path / "cache"
    old = [f"old{i}" for i in range(6)]
    for key in old:
        put(store, key)
    assert store.flush(10)
    assert store.remove_many(old) == 6
    assert len(kept(root)) == 6 and store.usage()["retired_bytes"] == 6 * FILE_BYTES
    assert all(read(store, key) is None for key in old)

    before = recycled()
    new = [f"new{i}" for i in range(8)]
    for key in new:
        put(store, key)
    assert store.flush(10)
    assert recycled() - before == 6  # six reused, two made
    assert kept(root) == [] and store.usage()["retired_bytes"] == 0
    assert all(read(store, key) == payload_for(key) for key in new)
    assert all(read(store, key) is None for key in old)
    assert len(files_on_disk(root)) == 8


def test_evictions_feed_the_writes_that_made_room(open_store: StoreFactory,
                                                  tmp_path: Path) -> None:
    """A full store turning over: every victim's file is kept and taken again by the write
    of its size, the budget holds, and the survivors read back exactly."""
    budget_files = 120
    store = open_store(max_size_gb=budget_files * FILE_BYTES / 2**30)
    before = recycled()
    keys = [f"k{i}" for i in range(200)]
    for key in keys:
        put(store, key)
        assert store.flush(10)
    assert recycled() - before >= 60  # the 80 writes past the budget took victims' files
    assert store.usage()["used_bytes"] <= store.usage()["capacity_bytes"]
    on_disk = files_on_disk(tmp_path / "cache")
    assert sum(p.stat().st_size for p in on_disk) <= \
        store.usage()["capacity_bytes"] + store.settings.recycle_bytes
    survivors = [key for key in keys if store.contains(key)]
    assert len(survivors) >= budget_files - 2
    assert all(read(store, key) == payload_for(key) for key in survivors)


def test_close_removes_what_is_kept(open_store: StoreFactory, tmp_path: Path) -> None:
    store = open_store()
    for key in ("a", "b", "c"):
        put(store, key)
    assert store.flush(10)
    store.remove_many(["a", "b"])
    assert len(kept(tmp_path / "cache")) == 2
    store.close()
    assert [p.name for p in files_on_disk(tmp_path / "cache")] == \
        [store.chunk_path("c", NS).name]
    reopened = open_store()
    assert read(reopened, "c") == payload_for("c")
    assert read(reopened, "a") is None


def test_kept_files_left_by_a_crash_are_removed_at_the_next_start(
        open_store: StoreFactory, tmp_path: Path) -> None:
    root = tmp_path / "cache"
    script = f"""
import os
from support.chunks import put
from support.stores import open_store
store = open_store({str(root)!r}, native_io="on")
for key in ("a", "b", "c"):
    put(store, key)
assert store.flush(10)
store.remove_many(["a", "b"])
os._exit(0)  # killed: no close
"""
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120,
                   cwd=Path(__file__).resolve().parents[1])
    assert len(kept(root)) == 2
    store = open_store()
    assert kept(root) == []
    assert store.counter("removed_temp_files") == 2
    assert read(store, "c") == payload_for("c")
    assert read(store, "a") is None and read(store, "b") is None


def test_a_chunk_removed_while_it_is_read_is_a_miss_not_a_bad_file(
        open_store: StoreFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """The race recycling makes possible: a read opens a chunk's file, the chunk is deleted
    and its file overwritten with another chunk before the read lands.  The read finds the
    other key: a miss, with no quarantine, no invalid-file count and no warning, since the
    index no longer holds the chunk; a bad file of a chunk still indexed is rejected as
    always."""
    store = open_store()
    for key in ("a", "b"):
        put(store, key)
    assert store.flush(10)
    engine = store.engine
    assert engine is not None
    read_batch = engine.read  # a call of one chunk is one share

    def racing_read(shares):  # type: ignore[no-untyped-def]
        store.remove_many(["a"])
        shutil.copyfile(store.chunk_path("b", NS), store.chunk_path("a", NS))
        return read_batch(shares)

    monkeypatch.setattr(engine, "read", racing_read)
    assert read(store, "a") is None
    assert store.counter("invalid_files") == 0 and store.counter("quarantined_files") == 0
    monkeypatch.setattr(engine, "read", read_batch)
    assert read(store, "b") == payload_for("b")

    put(store, "c")
    assert store.flush(10)
    shutil.copyfile(store.chunk_path("b", NS), store.chunk_path("c", NS))  # c still indexed
    assert read(store, "c") is None
    assert store.counter("invalid_files") == 1 and store.counter("quarantined_files") == 1


def test_recycle_mb_zero_removes_files_at_once(open_store: StoreFactory,
                                               tmp_path: Path) -> None:
    store = open_store(recycle_mb=0)
    put(store, "a")
    assert store.flush(10)
    store.remove_many(["a"])
    assert files_on_disk(tmp_path / "cache") == []
    assert store.usage()["retired_bytes"] == 0
