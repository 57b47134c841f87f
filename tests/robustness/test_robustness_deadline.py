"""A hung filesystem never stalls the caller (``nvme.io_deadline_s``).

The hang is injected at the I/O engine's seam (``support.io_faults.StuckReads``): every read
batch is held, as a read on a stopped GlusterFS brick is, then really runs when released,
late, into whatever buffers the store gave the engine.  The same case on a real stopped
brick is ``test_robustness_gluster_hang.py``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest
from support.chunks import CHUNK, NS, payload_for, put, read
from support.io_faults import StuckReads, before_each_write
from support.stores import StoreFactory

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
