"""Overload, behaviour only (no timing asserts): a drive slower than the store rate.

Under policy ``drop`` every chunk that does not fit the write queue is refused at once
and counted; the bytes the queue holds never exceed its budget; every chunk is either
persisted or counted as dropped, and every payload is released exactly once.
``bench/bench_overload.py`` measures the latency side through the real engine.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
from support.chunks import meta_for
from support.io_faults import before_each_write
from support.stores import StoreFactory

from lmcache_nvme_backend.store.chunk_store import SubmitResult

SIZE = 256 * 1024


@pytest.mark.timeout(60)
@pytest.mark.parametrize("policy", ["drop", "wait"])
def test_slow_drive_drops_are_counted_and_queue_stays_in_budget(tmp_path: Path, policy: str,
                                                                open_store: StoreFactory
                                                                ) -> None:
    store = open_store(tmp_path / "c", write_queue_mb=1, queue_full_policy=policy)
    before_each_write(store, lambda: time.sleep(0.01))  # far slower than the submit loop
    peak = 0
    stop = threading.Event()

    def sample() -> None:
        nonlocal peak
        while not stop.is_set():
            peak = max(peak, store.usage()["queue_bytes"])
            time.sleep(0.0005)

    sampler = threading.Thread(target=sample)
    sampler.start()
    released: list[int] = []
    payload = memoryview(bytes(SIZE))
    n = 200 if policy == "drop" else 30
    try:
        results = [store.submit(f"k{i}", "m", meta_for(SIZE), payload,
                                release=lambda i=i: released.append(i))  # type: ignore[misc]
                   for i in range(n)]
        assert store.flush(30)
    finally:
        stop.set()
        sampler.join()
        store.close()
    capacity = store.settings.write_queue_bytes
    assert peak <= capacity
    stats = store.stats_snapshot()
    queued = results.count(SubmitResult.QUEUED)
    full = results.count(SubmitResult.QUEUE_FULL)
    assert queued + full == n
    assert stats["queue_full_drops"] == full
    assert stats["writes_completed"] == queued
    assert sorted(released) == list(range(n))  # every payload released exactly once
    if policy == "drop":
        assert full > n // 2  # the slow drive really overflowed the queue
    else:
        assert full == 0 and stats["queue_full_waits"] > 0
