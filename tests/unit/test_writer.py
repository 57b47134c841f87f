"""Store calls through the writer (``store/writer.py``, ``store/placement.py``) on a real
filesystem, on each engine: one admission, one placement and one settlement per layout,
and every way a chunk does not make it."""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from support import prerequisites
from support.chunks import CHUNK, NS, files_on_disk, meta_for, payload_for, put, read
from support.stores import StoreFactory

from lmcache_nvme_backend.disk.format import file_size_for
from lmcache_nvme_backend.disk.layout import key_digest, namespace_id
from lmcache_nvme_backend.io import native
from lmcache_nvme_backend.store import ChunkStore, ChunkWrite, TaskOutcome

SIZE = file_size_for(CHUNK)
StoreOpener = Callable[..., ChunkStore]


@pytest.fixture(params=["on", "off"], ids=["native", "python"])
def task_store(request: pytest.FixtureRequest, open_store: StoreFactory) -> StoreOpener:
    """Stores on each engine in turn."""
    if request.param == "on" and not native.available():
        prerequisites.missing_prerequisite(native.unavailable_reason())
    return functools.partial(open_store, native_io=request.param)


def submit(store: ChunkStore, keys: list[str]) -> list[TaskOutcome]:
    done: list[TaskOutcome] = []
    meta = meta_for(CHUNK)
    store.submit_task(keys, [NS] * len(keys), [meta] * len(keys),
                      [memoryview(payload_for(key)) for key in keys], done.append)
    assert store.flush(10)
    return done


def assert_settled(store: ChunkStore) -> None:
    """Nothing left pending, queued or reserved."""
    usage = store.usage()
    assert (usage["pending_writes"], usage["queue_bytes"], usage["reserved_bytes"]) == (0, 0, 0)


def test_a_task_of_one_layout_is_admitted_and_published_in_one_step(
        task_store: StoreOpener, tmp_path: Path) -> None:
    store = task_store(max_size_gb=0.05)
    # the first chunk of a namespace comes back for Python to write its name file
    assert submit(store, ["first"]) == [TaskOutcome(True, CHUNK, None, [key_digest("first")],
                                                    [SIZE])]
    assert (tmp_path / "cache" / "ns" / namespace_id(NS) / "NAMESPACE").read_text().strip() == NS
    keys = [f"k{i}" for i in range(8)]
    done = submit(store, keys)
    assert done == [TaskOutcome(True, 8 * CHUNK, None, [key_digest(k) for k in keys],
                                [SIZE] * 8)]
    assert all(read(store, key) == payload_for(key) for key in keys)
    assert store.usage()["entries"] == 9 and store.usage()["used_bytes"] == 9 * SIZE
    assert store.counter("writes_completed") == 9 and store.counter("write_bytes") == 9 * CHUNK
    assert store.stats_snapshot()["writes_enqueued"] == 9
    assert_settled(store)
    entry = store.entry("k3")
    assert entry is not None and entry.meta == meta_for(CHUNK) and entry.size == SIZE
    assert entry.ns_id == namespace_id(NS)


def test_chunks_stored_or_repeated_are_duplicates_and_the_task_still_succeeds(
        task_store: StoreOpener) -> None:
    store = task_store(max_size_gb=0.05)
    put(store, "old")
    assert store.flush(10)
    done = submit(store, ["old", "a", "a", "b"])
    assert done == [TaskOutcome(True, 2 * CHUNK, [1, 3], [key_digest("a"), key_digest("b")],
                                [SIZE] * 2)]
    assert store.counter("duplicate_puts") == 2
    assert store.stats_snapshot()["writes_enqueued"] == 3  # "old", "a", "b": no duplicate
    assert read(store, "a") == payload_for("a") and read(store, "b") == payload_for("b")
    assert submit(store, ["a", "b"]) == [TaskOutcome(True, 0, [], [], [])]
    assert_settled(store)


def test_chunks_spread_over_several_paths_are_reported_root_by_root(
        task_store: StoreOpener, tmp_path: Path) -> None:
    paths = [tmp_path / "d0", tmp_path / "d1"]
    store = task_store(*paths, max_size_gb=0.1)
    keys = [f"spread-{i}" for i in range(16)]
    (outcome,) = submit(store, keys)
    assert outcome.ok
    assert outcome.stored is not None and sorted(outcome.stored) == list(range(16))
    assert outcome.digests == [key_digest(keys[i]) for i in outcome.stored]
    assert all(read(store, key) == payload_for(key) for key in keys)
    assert all(files_on_disk(path) for path in paths)  # both drives took some
    assert_settled(store)


def test_a_full_budget_evicts_the_least_recently_used_and_their_files_go(
        task_store: StoreOpener, tmp_path: Path) -> None:
    store = task_store(max_size_gb=4.5 * SIZE / (1 << 30))  # room for four chunks
    assert submit(store, ["old0", "old1", "old2", "old3"])[0].ok
    assert store.contains("old0")  # a use: old1 is now the least recently used
    (outcome,) = submit(store, ["new0", "new1"])
    assert outcome.ok
    assert [store.contains(k) for k in ("old0", "old1", "old2", "old3")] == \
        [True, False, False, True]
    assert len(files_on_disk(tmp_path / "cache")) == 4
    assert store.usage()["used_bytes"] == 4 * SIZE and store.counter("evictions") == 2
    assert read(store, "new1") == payload_for("new1")
    assert_settled(store)


def test_no_room_for_a_whole_share_reserves_chunk_by_chunk(
        task_store: StoreOpener) -> None:
    store = task_store(max_size_gb=2.5 * SIZE / (1 << 30))  # room for two chunks
    assert submit(store, ["p0", "p1"])[0].ok
    assert store.pin("p0")
    (outcome,) = submit(store, ["n0", "n1"])  # one fits once p1 is evicted, not both
    assert not outcome.ok and outcome.stored == [0]
    assert store.counter("capacity_drops") == 1
    assert store.contains("p0") and not store.contains("p1") and store.contains("n0")
    assert_settled(store)


def test_a_write_that_fails_in_the_batch_is_settled_and_the_others_published(
        task_store: StoreOpener, tmp_path: Path) -> None:
    store = task_store(max_size_gb=0.05)
    keys = ["good0", "bad", "good1"]
    digest = key_digest("bad")
    shard = tmp_path / "cache" / "ns" / namespace_id(NS) / digest[:2]
    shard.parent.mkdir(parents=True, exist_ok=True)
    shard.write_bytes(b"a file where the tree needs a directory")
    (outcome,) = submit(store, keys)
    assert not outcome.ok and sorted(outcome.stored or []) == [0, 2]
    assert outcome.digests == [key_digest(keys[i]) for i in outcome.stored or []]
    assert outcome.nbytes == 2 * CHUNK
    assert read(store, "good0") == payload_for("good0") and not store.contains("bad")
    assert store.counter("write_failures") == 1
    assert_settled(store)


def test_a_dispatch_that_raises_completes_the_task_and_gives_everything_back(
        task_store: StoreOpener, monkeypatch: pytest.MonkeyPatch) -> None:
    store = task_store(max_size_gb=0.05)
    engine = store.engine
    assert engine is not None

    def broken(shares: Any, on_done: Any) -> None:
        raise OSError("engine closed")

    monkeypatch.setattr(engine, "submit_write", broken)
    done: list[TaskOutcome] = []
    with pytest.raises(OSError, match="engine closed"):
        store.submit_task(["a"], [NS], [meta_for(CHUNK)], [memoryview(payload_for("a"))],
                          done.append)
    assert done == [TaskOutcome(False, 0, [], [], [])]
    assert_settled(store)
    assert not store.contains("a")


@pytest.mark.parametrize("way", ["task", "chunk writes"])
def test_chunks_evicted_for_a_share_that_then_does_not_fit_leave_no_file(
        task_store: StoreOpener, monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
        way: str) -> None:
    store = task_store(max_size_gb=2.5 * SIZE / (1 << 30))  # room for two chunks
    assert submit(store, ["old0", "old1"])[0].ok
    guard = store._room.guards[0]
    monkeypatch.setattr(guard, "room_for", lambda size: False)  # the filesystem is full
    if way == "task":
        assert not submit(store, ["n0", "n1"])[0].ok
    else:
        store.submit_many([ChunkWrite(key, NS, meta_for(CHUNK), memoryview(payload_for(key)),
                                      release=lambda: None) for key in ("n0", "n1")])
        assert store.flush(10)
    assert store.counter("evictions") == 2 and store.usage()["entries"] == 0
    assert files_on_disk(tmp_path / "cache") == []  # out of the index, and gone
    assert_settled(store)


def test_a_completion_that_fails_still_ends_the_task(
        task_store: StoreOpener,
        monkeypatch: pytest.MonkeyPatch) -> None:
    store = task_store(max_size_gb=0.05)
    assert submit(store, ["first"])[0].ok  # the namespace exists: the next task is common

    def broken(*args: Any) -> None:
        raise RuntimeError("index broken")

    monkeypatch.setattr(store._catalog, "publish_layout", broken)
    assert submit(store, ["a", "b"]) == [TaskOutcome(False, 0, [], [], [])]
    assert store.usage()["queue_bytes"] == 0  # LMCache's objects are not held forever


def test_a_key_of_an_earlier_model_build_is_replaced_by_the_new_builds_chunk(
        task_store: StoreOpener, tmp_path: Path) -> None:
    """LMCache's key of a chunk does not change with the weights; the namespace does
    (``<model>#<build>``): the new build's chunk replaces the earlier one, whose file goes."""
    store = task_store(max_size_gb=0.05)
    old_ns, new_ns = f"{NS}#build1", f"{NS}#build2"
    meta = meta_for(CHUNK)
    old, new = payload_for("earlier weights"), payload_for("new weights")
    done: list[TaskOutcome] = []
    store.submit_task(["k"], [old_ns], [meta], [memoryview(old)], done.append)
    assert store.flush(10) and done[0].ok
    assert not store.lookup("k", new_ns)  # never served for the other build
    store.submit_task(["k"], [new_ns], [meta], [memoryview(new)], done.append)
    assert store.flush(10) and done[1] == TaskOutcome(True, CHUNK, None, [key_digest("k")],
                                                      [SIZE])
    assert store.lookup("k", new_ns) and not store.lookup("k", old_ns)
    assert read(store, "k") == new
    assert [path.parent.parent.name for path in files_on_disk(tmp_path / "cache")] == \
        [namespace_id(new_ns)]
    assert store.usage()["used_bytes"] == SIZE
    assert_settled(store)
