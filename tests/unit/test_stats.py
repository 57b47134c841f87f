"""``StoreStats``: counters, histograms, and the counters read from the histograms."""

from __future__ import annotations

import threading

import pytest

from lmcache_nvme_backend.store.stats import (
    FOLD_EVERY,
    LATENCY_BUCKETS_S,
    Counter,
    ReadPath,
    StoreStats,
    path_counter,
    read_latency,
)


@pytest.fixture
def stats() -> StoreStats:
    return StoreStats()


def test_writes_completed_and_write_seconds_are_the_write_histograms(stats: StoreStats) -> None:
    stats.record_write(3 << 20, 0.002, count=3)  # three chunks, 2 ms each
    stats.record_write(1 << 20, 0.2)
    snap = stats.snapshot()
    assert snap["writes_completed"] == 4 and snap["write_bytes"] == 4 << 20
    assert snap["write_seconds"] == pytest.approx(0.206)
    write = stats.histograms()["write"]
    assert write.count == 4 and write.sum_s == pytest.approx(0.206)
    assert write.bucket_counts[LATENCY_BUCKETS_S.index(0.0025)] == 3
    assert write.bucket_counts[LATENCY_BUCKETS_S.index(0.25)] == 1
    # asked one at a time, the derived counters say the same
    assert stats.get(Counter.WRITES_COMPLETED) == 4
    assert stats.get("write_seconds") == pytest.approx(0.206)


def test_a_read_call_moves_its_path_and_the_store_counters(stats: StoreStats) -> None:
    stats.record_read(ReadPath.POSIX, 3, 300, 0.01, failures=1, checked=(2, 200))
    stats.record_read(ReadPath.POSIX, 1, 100, 0.03, failures=0)
    stats.record_read(ReadPath.HOST_BOUNCE, 2, 64, 0.5)  # a reader outside the store
    snap = stats.snapshot()
    assert snap[path_counter(ReadPath.POSIX, "chunks")] == 4
    assert snap[path_counter(ReadPath.POSIX, "bytes")] == 400
    assert snap[path_counter(ReadPath.POSIX, "seconds")] == pytest.approx(0.04)
    assert snap[path_counter(ReadPath.POSIX, "gbps")] == pytest.approx(400 / 0.04 / 1e9)
    assert snap[path_counter(ReadPath.HOST_BOUNCE, "seconds")] == pytest.approx(0.5)
    # failures and the call's time only from the store's own read path; the chunks an
    # engine verified itself only where it says so
    assert snap["read_failures"] == 1
    assert snap["read_seconds"] == pytest.approx(0.04)
    assert (snap["read_chunks"], snap["read_bytes"]) == (2, 200)
    assert stats.histograms()[read_latency(ReadPath.POSIX)].count == 2
    assert stats.get(path_counter(ReadPath.KVIKIO_GDS, "seconds")) == 0


def test_counts_from_many_threads_add_up(stats: StoreStats) -> None:
    def work() -> None:
        for _ in range(2000):
            stats.record_write(10, 0.001)
            stats.record_read(ReadPath.POSIX, 1, 10, 0.001, failures=0, checked=(1, 10))
            stats.add(Counter.DUPLICATE_PUTS)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    snap = stats.snapshot()
    assert snap["writes_completed"] == snap["read_chunks"] == snap["duplicate_puts"] == 8000
    assert snap["write_bytes"] == snap[path_counter(ReadPath.POSIX, "bytes")] == 80000


def test_calls_are_folded_in_batches_and_every_value_stays_exact(stats: StoreStats) -> None:
    calls = 3 * FOLD_EVERY + 7  # several folds, and a rest still logged when asked
    paths = [ReadPath.POSIX, ReadPath.HOST_BOUNCE, ReadPath.KVIKIO_GDS]
    for i in range(calls):
        own = paths[i % 3] is ReadPath.POSIX
        stats.record_read(paths[i % 3], 2, 20, 0.001 * (i % 5), failures=i % 2 if own else None,
                          checked=(1, 10) if own and i % 4 == 0 else None)
        stats.record_write(30, 0.002, count=2)
        assert len(stats._reads) < FOLD_EVERY and len(stats._writes) < FOLD_EVERY  # bounded
    snap = stats.snapshot()
    posix = [i for i in range(calls) if i % 3 == 0]
    assert snap[path_counter(ReadPath.POSIX, "chunks")] == 2 * len(posix)
    assert snap[path_counter(ReadPath.KVIKIO_GDS, "bytes")] == 20 * len(range(2, calls, 3))
    assert snap["read_failures"] == sum(i % 2 for i in posix)
    assert snap["read_seconds"] == pytest.approx(sum(0.001 * (i % 5) for i in posix))
    assert snap["read_chunks"] == len([i for i in posix if i % 4 == 0])
    assert (snap["writes_completed"], snap["write_bytes"]) == (2 * calls, 30 * calls)
    assert snap["write_seconds"] == pytest.approx(0.004 * calls)
    bounce = stats.histograms()[read_latency(ReadPath.HOST_BOUNCE)]
    assert bounce.count == len(range(1, calls, 3))
    assert bounce.bucket_counts[0] == len([i for i in range(1, calls, 3) if i % 5 == 0])
