"""A hung filesystem never stalls the caller (``nvme.io_deadline_s``), and a local one pays
nothing for it.

Under ``auto`` (the default) only paths on network filesystems have a deadline: a local
path reads straight into the caller's buffer on the calling thread, as without the setting.
A number puts every path under it; these tests set one to hold a local path's reads.
The hang is injected at the I/O engine's seam (``support.io_faults.StuckReads``): every read
batch is held, as a read on a stopped GlusterFS brick is, then really runs when released,
late, into whatever buffers the store gave the engine.  The same case on a real stopped
brick is ``test_robustness_gluster_hang.py``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from support.chunks import CHUNK, NS, payload_for, put, read
from support.io_faults import StuckReads, before_each_write
from support.stores import StoreFactory

from lmcache_nvme_backend.adapters._common import describe_deadlines
from lmcache_nvme_backend.disk.mounts import is_network_filesystem, mount_for
from lmcache_nvme_backend.io.buffers import buffer_address
from lmcache_nvme_backend.store.chunk_store import ChunkRead, ChunkStore, SubmitResult

DEADLINE_S = 0.5
BOUND_S = 10.0  # "within the deadline" with room for a loaded machine
PATTERN = bytes(range(256)) * ((CHUNK + 8192) // 256 + 1)


def _until(condition: Callable[[], bool], timeout_s: float = BOUND_S) -> bool:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if condition():
            return True
        time.sleep(0.02)
    return condition()


def _stored(open_store: StoreFactory, *keys: str, **params: object) -> ChunkStore:
    store = open_store(io_deadline_s=DEADLINE_S, close_timeout_s=1, **params)
    for key in keys:
        put(store, key)
    assert store.flush(10)
    return store


def _read_targets(store: ChunkStore, monkeypatch: pytest.MonkeyPatch, key: str,
                  dest: bytearray) -> tuple[bool, list[int], list[str]]:
    """Read ``key`` into ``dest``: whether it was served, the addresses the engine was told
    to read into, and the engine calls: ``read`` (on the calling thread) or ``submit_read``
    (handed to the engine's threads)."""
    targets: list[int] = []
    calls: list[str] = []
    engine = store.engine
    real_read, real_submit = engine.read, engine.submit_read

    def note(call: str, shares):  # type: ignore[no-untyped-def]
        targets.extend(buffer_address(view) for share in shares for view in share[6])
        calls.append(call)

    monkeypatch.setattr(engine, "read", lambda shares: (
        note("read", shares), real_read(shares))[1])
    monkeypatch.setattr(engine, "submit_read", lambda shares, on_done: (
        note("submit_read", shares), real_submit(shares, on_done))[1])
    served = store.read_into([ChunkRead(key, memoryview(dest))])[0]
    return served, targets, calls


def test_a_local_path_has_no_deadline_under_auto_and_reads_into_the_callers_buffer(
        open_store: StoreFactory, cache_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``auto`` (the default) on a local filesystem: no deadline, said in the stats and the
    ready line; the engine reads into the caller's own buffer, on the calling thread."""
    store = open_store()
    mount = mount_for(cache_dir)
    assert mount is not None
    if is_network_filesystem(mount.fstype):
        pytest.skip(f"the test directory is on {mount.fstype}, a network filesystem")
    info = store.describe_roots()[0]
    assert (info.filesystem, info.deadline_s) == (mount.fstype, 0.0)
    assert store.stats_snapshot()["deadline_roots"] == 0
    assert describe_deadlines(store.describe_roots()).startswith("no read deadline")
    put(store, "a")
    assert store.flush(10)
    dest = bytearray(CHUNK + 8192)
    served, targets, calls = _read_targets(store, monkeypatch, "a", dest)
    assert served and bytes(dest[:CHUNK]) == payload_for("a")
    assert targets == [buffer_address(memoryview(dest))] and calls == ["read"]


@pytest.mark.parametrize("deadline_s", [DEADLINE_S, 0])
def test_a_number_sets_the_deadline_of_every_path(
        open_store: StoreFactory, monkeypatch: pytest.MonkeyPatch, deadline_s: float) -> None:
    """A number is that deadline on every path, local ones too (0: none anywhere); under a
    deadline the engine reads into the store's buffer on its own thread, the caller gets
    the bytes copied."""
    store = open_store(io_deadline_s=deadline_s)
    assert store.describe_roots()[0].deadline_s == deadline_s
    assert store.stats_snapshot()["deadline_roots"] == (1 if deadline_s else 0)
    assert describe_deadlines(store.describe_roots()).startswith(
        "read deadline" if deadline_s else "no read deadline")
    put(store, "a")
    assert store.flush(10)
    dest = bytearray(CHUNK + 8192)
    served, targets, calls = _read_targets(store, monkeypatch, "a", dest)
    assert served and bytes(dest[:CHUNK]) == payload_for("a")
    assert (targets == [buffer_address(memoryview(dest))]) is (deadline_s == 0)
    assert calls == ["submit_read" if deadline_s else "read"]


def test_a_stuck_read_is_a_miss_its_path_leaves_and_comes_back(
        open_store: StoreFactory) -> None:
    """Within the deadline: a miss, the caller's buffer untouched then and after the late
    read lands; the path out of service (lookups miss from memory, no read reaches the
    engine); back once the read ends and the filesystem answers; hits with the right bytes."""
    store = _stored(open_store, "a", "b")
    stuck = StuckReads(store)
    dest = bytearray(PATTERN[:CHUNK + 8192])
    started = time.monotonic()
    assert store.read_into([ChunkRead("a", memoryview(dest))]) == [False]
    assert time.monotonic() - started < BOUND_S
    assert bytes(dest) == PATTERN[:CHUNK + 8192]
    snap = store.stats_snapshot()
    assert (snap["deadline_misses"], snap["roots_hung"], snap["roots_offline"]) == (1, 1, 1)
    assert not store.lookup("b", NS) and not store.healthy()
    assert read(store, "b") is None and stuck.batches == 1  # never handed to the engine
    assert store.counter("late_reads_discarded") == 0

    stuck.release()
    assert _until(lambda: store.counter("late_reads_discarded") == 1)
    assert bytes(dest) == PATTERN[:CHUNK + 8192]  # the late bytes went to the store's buffer
    assert _until(lambda: store.stats_snapshot()["roots_hung"] == 0)
    assert store.lookup("b", NS)
    assert read(store, "a") == payload_for("a") and read(store, "b") == payload_for("b")


def test_a_stuck_async_read_is_answered_with_misses_by_its_deadline(
        open_store: StoreFactory) -> None:
    store = _stored(open_store, "a")
    stuck = StuckReads(store)
    dest = bytearray(PATTERN[:CHUNK])
    answers: list[list[bool]] = []
    answered = threading.Event()

    def on_done(served: list[bool]) -> None:
        answers.append(served)
        answered.set()

    store.read_async(["a"], [memoryview(dest)], [CHUNK], on_done)
    assert answered.wait(BOUND_S) and answers == [[False]]
    stuck.release()
    assert _until(lambda: store.counter("late_reads_discarded") == 1)
    assert answers == [[False]] and bytes(dest) == PATTERN[:CHUNK]


def test_close_returns_while_the_io_is_stuck(open_store: StoreFactory,
                                             package_log: pytest.LogCaptureFixture) -> None:
    """close() returns within its bound though the engine's threads cannot be joined, and
    says which step it left."""
    store = _stored(open_store, "a")
    stuck = StuckReads(store)
    try:
        assert read(store, "a") is None
        started = time.monotonic()
        store.close()
        took = time.monotonic() - started
        assert took <= store.close_bound_s + BOUND_S
        assert "close() gave up" in package_log.text
        assert "stopping the I/O engine" in package_log.text
    finally:
        stuck.release()


def test_stores_to_a_hung_path_are_dropped_and_counted(open_store: StoreFactory) -> None:
    store = _stored(open_store, "a")
    stuck = StuckReads(store)
    assert read(store, "a") is None
    assert put(store, "c") is SubmitResult.QUEUED
    assert store.flush(BOUND_S)
    assert store.entry("c") is None and store.counter("write_failures") == 1  # no path
    stuck.release()
    assert _until(lambda: store.healthy())
    put(store, "c")
    assert store.flush(10) and read(store, "c") == payload_for("c")


def test_wait_policy_waits_at_most_the_deadline_for_a_stuck_queue(
        open_store: StoreFactory) -> None:
    """queue_full_policy wait: a queue held by writes that do not end (a hung filesystem)
    holds a store call for the deadline, then the chunk is dropped and counted."""
    store = open_store(io_deadline_s=DEADLINE_S, close_timeout_s=1, queue_full_policy="wait",
                       write_queue_mb=0.3)
    release = threading.Event()
    before_each_write(store, release.wait)
    try:
        assert put(store, "a") is SubmitResult.QUEUED  # holds the queue
        started = time.monotonic()
        assert put(store, "b") is SubmitResult.QUEUE_FULL
        assert time.monotonic() - started < BOUND_S
        assert store.counter("queue_full_drops") == 1
    finally:
        release.set()
    assert store.flush(10) and read(store, "a") == payload_for("a")
