"""ChunkStore behaviour on a real filesystem: validation, capacity, write-back, restart, crashes."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
from support.chunks import CHUNK, NS, files_on_disk, meta_for, payload_for, put, read
from support.io_faults import before_each_write
from support.process import child_env, module_command
from support.stores import StoreFactory

from lmcache_nvme_backend.disk.format import HEADER_SIZE, encode_header, file_size_for
from lmcache_nvme_backend.disk.layout import RootLayout, key_digest, namespace_id
from lmcache_nvme_backend.store.chunk_store import ChunkStore, ChunkWrite, SubmitResult, TaskOutcome

SMALL = 0.05  # GiB: the budget of this module's stores unless a test sets its own


def chunk_file(store: ChunkStore, key: str) -> Path:
    return store.layouts[0].chunk_path(namespace_id(NS), key_digest(key))


def test_round_trip_is_byte_exact(open_store: StoreFactory) -> None:
    store = open_store(max_size_gb=SMALL)
    assert put(store, "a") is SubmitResult.QUEUED
    assert store.flush(10)
    assert store.contains("a")
    assert read(store, "a") == payload_for("a")
    assert store.counter("read_bytes") == CHUNK


def test_restart_finds_chunks_and_metadata(open_store: StoreFactory) -> None:
    first = open_store(max_size_gb=SMALL)
    for key in ("a", "b", "c"):
        put(first, key)
    first.close()
    second = open_store(max_size_gb=SMALL)
    assert all(second.contains(k) for k in ("a", "b", "c"))
    assert second.tensor_meta("b") == meta_for(CHUNK)
    assert read(second, "b") == payload_for("b")


def test_restart_without_manifest_reads_headers(open_store: StoreFactory, tmp_path: Path) -> None:
    first = open_store(max_size_gb=SMALL)
    put(first, "a")
    first.close()
    (tmp_path / "cache" / "index" / "manifest.json").unlink()
    second = open_store(max_size_gb=SMALL)
    assert second.contains("a")
    assert second.tensor_meta("a") == meta_for(CHUNK)
    assert read(second, "a") == payload_for("a")


def test_read_of_a_recovered_chunk_needs_no_prior_meta_lookup(open_store: StoreFactory,
                                                             tmp_path: Path) -> None:
    first = open_store(max_size_gb=SMALL)
    put(first, "a")
    first.close()
    (tmp_path / "cache" / "index" / "manifest.json").unlink()
    assert read(open_store(max_size_gb=SMALL), "a") == payload_for("a")


def corrupt_payload_bit(path: Path) -> None:
    with open(path, "r+b") as f:
        f.seek(HEADER_SIZE + 1000)
        byte = f.read(1)
        f.seek(HEADER_SIZE + 1000)
        f.write(bytes([byte[0] ^ 0x01]))


def truncate_file(path: Path) -> None:
    os.truncate(path, path.stat().st_size - 4096)


def replace_with_foreign_bytes(path: Path) -> None:
    path.write_bytes(b"not a chunk file" * 1000)


@pytest.mark.parametrize(
    ("damage", "counter"),
    [(corrupt_payload_bit, "checksum_failures"), (truncate_file, "invalid_files"),
     (replace_with_foreign_bytes, "invalid_files")],
    ids=["bit-flip", "truncated", "foreign"],
)
def test_damaged_file_is_a_counted_quarantined_miss(
        open_store: StoreFactory, damage: Callable[[Path], None], counter: str) -> None:
    store = open_store(max_size_gb=SMALL)
    put(store, "a")
    store.flush(10)
    path = chunk_file(store, "a")
    damage(path)
    assert read(store, "a") is None
    assert store.counter(counter) == 1
    assert store.counter("quarantined_files") == 1
    assert not path.exists()
    assert len(list(store.layouts[0].quarantine_dir.iterdir())) == 1
    assert not store.contains("a")


def test_wrong_key_file_is_never_served(open_store: StoreFactory) -> None:
    store = open_store(max_size_gb=SMALL)
    put(store, "a")
    put(store, "b")
    store.flush(10)
    os.replace(chunk_file(store, "a"), chunk_file(store, "b"))
    assert read(store, "b") is None
    assert store.counter("invalid_files") == 1


def test_absurd_length_header_is_rejected_without_allocation(
        open_store: StoreFactory, tmp_path: Path) -> None:
    """A recovered file whose header claims a huge payload never reaches an allocation."""
    layout = RootLayout(tmp_path / "cache")
    path = layout.chunk_path(namespace_id(NS), key_digest("huge"))
    path.parent.mkdir(parents=True)
    huge = 1 << 35
    path.write_bytes(encode_header("huge", NS, meta_for(huge), huge, 0) + bytes(4096))
    store = open_store(max_size_gb=SMALL)
    assert store.contains("huge")  # listed by the directory scan, not yet validated
    assert store.tensor_meta("huge") is None
    assert store.counter("invalid_files") == 1
    assert not store.contains("huge")


def test_capacity_is_enforced_in_lru_order_and_pins_are_kept(open_store: StoreFactory) -> None:
    per_file = file_size_for(CHUNK)
    store = open_store(max_size_gb=(per_file * 4) / 1024**3)
    for key in ("k0", "k1", "k2", "k3"):
        put(store, key)
        store.flush(10)  # publish in this order, so LRU order is k0..k3
    assert store.pin("k1")
    assert store.contains("k0")  # k0 becomes most recently used; k2 is now the oldest unpinned
    put(store, "k4")
    store.flush(10)
    assert not store.contains("k2")
    assert all(store.contains(k) for k in ("k0", "k1", "k3", "k4"))
    for i in range(5, 12):
        put(store, f"k{i}")
        store.flush(10)
        on_disk = sum(p.stat().st_size for p in files_on_disk(store.layouts[0].root))
        assert on_disk <= store.settings.max_size_bytes + per_file
        assert store.usage()["used_bytes"] <= store.settings.max_size_bytes
    assert store.contains("k1")  # pinned: survived every eviction
    assert read(store, "k1") == payload_for("k1")
    assert store.counter("evictions") >= 7


def test_pinned_chunks_block_writes_rather_than_being_evicted(open_store: StoreFactory) -> None:
    store = open_store(max_size_gb=(file_size_for(CHUNK) * 2) / 1024**3)
    put(store, "a")
    put(store, "b")
    store.flush(10)
    store.pin("a")
    store.pin("b")
    put(store, "c")
    store.flush(10)
    assert not store.contains("c")
    assert store.counter("capacity_drops") == 1
    assert store.contains("a") and store.contains("b")


def test_duplicate_puts_write_once(open_store: StoreFactory) -> None:
    store = open_store(max_size_gb=SMALL)
    assert put(store, "a") is SubmitResult.QUEUED
    second = put(store, "a")
    store.flush(10)
    assert put(store, "a") is SubmitResult.DUPLICATE
    assert second is SubmitResult.DUPLICATE
    assert store.counter("writes_completed") == 1
    assert len(files_on_disk(store.layouts[0].root)) == 1


def test_concurrent_puts_of_one_key(open_store: StoreFactory) -> None:
    store = open_store(max_size_gb=SMALL, write_threads=4)
    results: list[SubmitResult] = []
    barrier = threading.Barrier(8)

    def worker() -> None:
        barrier.wait()
        results.append(put(store, "same"))

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    store.flush(10)
    assert results.count(SubmitResult.QUEUED) == 1
    assert read(store, "same") == payload_for("same")
    assert len(files_on_disk(store.layouts[0].root)) == 1


def test_concurrent_writers_in_two_processes_publish_one_valid_file(
        tmp_path: Path, open_store: StoreFactory) -> None:
    # each child puts shared-0 .. shared-19 (support/store_child.py)
    procs = [subprocess.Popen(module_command("support.store_child", "writer",
                                             tmp_path / "cache"), env=child_env())
             for _ in range(2)]
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    store = open_store(tmp_path / "cache", manifest_interval_s=None)
    try:
        assert all(read(store, f"shared-{i}") == payload_for(f"shared-{i}") for i in range(20))
        assert not list(store.layouts[0].iter_temp_files())
    finally:
        store.close()


class BlockedWrites:
    """Holds every chunk write until released, to fill the write-back queue on purpose."""

    def __init__(self, store: ChunkStore) -> None:
        self.release = threading.Event()
        self.started = threading.Semaphore(0)

        def blocked() -> None:
            self.started.release()
            self.release.wait(30)

        before_each_write(store, blocked)


def test_full_queue_drops_and_counts_without_blocking(open_store: StoreFactory) -> None:
    size = 1024 * 1024
    store = open_store(max_size_gb=SMALL, write_queue_mb=2.5, write_threads=1)
    blocked = BlockedWrites(store)
    assert put(store, "a", size) is SubmitResult.QUEUED
    assert blocked.started.acquire(timeout=10)  # the writer holds "a"; the drive is "stuck"
    assert put(store, "b", size) is SubmitResult.QUEUED
    assert put(store, "c", size) is SubmitResult.QUEUE_FULL  # returns at once while stuck
    assert store.counter("queue_full_drops") == 1
    assert not store.is_pending("c")
    blocked.release.set()
    store.flush(10)
    snapshot = store.stats_snapshot()  # the refused write was never enqueued
    assert (snapshot["writes_enqueued"], snapshot["writes_completed"]) == (2, 2)
    assert store.counter("writes_enqueued") == 2
    assert read(store, "a", size) == payload_for("a", size)
    assert read(store, "b", size) == payload_for("b", size)
    assert not store.contains("c")


def test_wait_policy_waits_for_room(open_store: StoreFactory) -> None:
    size = 1024 * 1024
    store = open_store(max_size_gb=SMALL, write_queue_mb=1.5, write_threads=1,
                       queue_full_policy="wait")
    blocked = BlockedWrites(store)
    put(store, "a", size)
    assert blocked.started.acquire(timeout=10)
    outcome: list[SubmitResult] = []
    waiter = threading.Thread(target=lambda: outcome.append(put(store, "b", size)))
    waiter.start()
    waiter.join(0.5)
    assert waiter.is_alive() and not outcome  # waiting for queue room, not dropped
    blocked.release.set()
    waiter.join(10)
    assert outcome == [SubmitResult.QUEUED]
    store.flush(10)
    assert read(store, "b", size) == payload_for("b", size)
    assert store.counter("queue_full_waits") == 1


def test_release_is_called_once_for_every_outcome(open_store: StoreFactory) -> None:
    store = open_store(max_size_gb=SMALL, write_queue_mb=0.5)
    released: list[str] = []
    data = payload_for("a")

    def submit(key: str, size: int) -> SubmitResult:
        return store.submit(key, NS, meta_for(size), memoryview(data)[:size],
                            release=lambda: released.append(key))

    assert submit("a", CHUNK) is SubmitResult.QUEUED
    store.flush(10)
    assert submit("a", CHUNK) is SubmitResult.DUPLICATE
    assert submit("b", CHUNK) is SubmitResult.QUEUED
    store.flush(10)
    assert sorted(released) == ["a", "a", "b"]


@pytest.mark.parametrize("trial", range(3))
def test_sigkill_mid_write_back_leaves_only_intact_chunks(tmp_path: Path, trial: int,
                                                          open_store: StoreFactory) -> None:
    cache = tmp_path / "cache"
    # the child publishes crash-0, says "writing", then puts crash-1, crash-2, ... (3 MiB + 7)
    proc = subprocess.Popen(module_command("support.store_child", "crash-writer", cache),
                            stdout=subprocess.PIPE, text=True, env=child_env())
    assert proc.stdout is not None and proc.stdout.readline().strip() == "writing"
    threading.Event().wait(0.2 + 0.15 * trial)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    layout = RootLayout(cache)
    assert not any(p.name.endswith(".kv") and p.stat().st_size % 4096
                   for p in files_on_disk(cache))
    store = open_store(cache, manifest_interval_s=None)
    try:
        assert not list(layout.iter_temp_files())  # the dead writer's temp files are gone
        size = 3 * 1024 * 1024 + 7
        found = [loc for loc in layout.iter_chunks()]
        assert found, "the writer published nothing before it was killed"
        keys = [f"crash-{i}" for i in range(400) if store.contains(f"crash-{i}")]
        assert len(keys) == len(found)
        for key in keys:
            assert store.tensor_meta(key) == meta_for(size)
            assert read(store, key, size) == payload_for(key, size)
        assert store.counter("invalid_files") == 0
    finally:
        store.close()


def test_writer_threads_yield_cpu_to_the_engine(open_store: StoreFactory) -> None:
    store = open_store(max_size_gb=SMALL, write_threads=2)
    put(store, "a")
    put(store, "b")
    store.flush(10)
    assert store.writer_thread_ids
    assert all(os.getpriority(os.PRIO_PROCESS, tid) == 10 for tid in store.writer_thread_ids)
    assert os.getpriority(os.PRIO_PROCESS, 0) == 0


def test_default_is_one_writer_per_path(tmp_path: Path, open_store: StoreFactory) -> None:
    store = open_store(tmp_path / "d0", tmp_path / "d1", tmp_path / "d2", max_size_gb=SMALL)
    try:
        assert len(store.writer_thread_ids) == 3
        for i in range(12):
            put(store, f"spread-{i}")
        store.flush(10)
        per_root = [len(files_on_disk(layout.root)) for layout in store.layouts]
        assert sum(per_root) == 12 and all(per_root)  # rendezvous placement uses every path
        assert all(read(store, f"spread-{i}") == payload_for(f"spread-{i}") for i in range(12))
    finally:
        store.close()


def test_submit_many_dedupes_within_a_batch_and_drops_what_does_not_fit(
        open_store: StoreFactory) -> None:
    size = 1024 * 1024
    store = open_store(max_size_gb=SMALL, write_queue_mb=2.5, write_threads=1)
    blocked = BlockedWrites(store)
    released: list[str] = []

    def write(key: str) -> ChunkWrite:
        data = payload_for(key, size)
        return ChunkWrite(key, NS, meta_for(size), memoryview(data),
                          release=lambda: released.append(key))

    results = store.submit_many([write("a"), write("a"), write("b"), write("c")])
    assert results == [SubmitResult.QUEUED, SubmitResult.DUPLICATE, SubmitResult.QUEUED,
                       SubmitResult.QUEUE_FULL]
    assert sorted(released) == ["a", "c"]  # the duplicate and the dropped one, at once
    assert blocked.started.acquire(timeout=10)
    blocked.release.set()
    store.flush(10)
    assert sorted(released) == ["a", "a", "b", "c"]
    assert read(store, "b", size) == payload_for("b", size)


def submit_task(store: ChunkStore, keys: list[str], size: int = CHUNK,
                namespace: str = NS) -> list[TaskOutcome]:
    """Submit ``keys`` as one task; the list ``on_done`` appends its outcome to."""
    done: list[TaskOutcome] = []
    store.submit_task(keys, [namespace] * len(keys), [meta_for(size)] * len(keys),
                      [memoryview(payload_for(key, size)) for key in keys], done.append)
    return done


def test_a_task_completes_once_with_each_chunk_settled(open_store: StoreFactory) -> None:
    store = open_store(max_size_gb=SMALL, write_queue_mb=2.5, write_threads=1)
    put(store, "old")
    store.flush(10)
    blocked = BlockedWrites(store)
    size = 1024 * 1024
    done = submit_task(store, ["old", "a", "b", "c"], size)
    assert blocked.started.acquire(timeout=10)
    assert done == []  # "a" and "b" are being written
    blocked.release.set()
    store.flush(10)
    # "old" was stored already, "c" did not fit the queue: the task failed, "a" and "b" stored
    assert done == [TaskOutcome(False, 2 * size, [1, 2], [key_digest("a"), key_digest("b")],
                                [file_size_for(size)] * 2)]
    assert read(store, "a", size) == payload_for("a", size)
    assert read(store, "c", size) is None
    assert store.counter("duplicate_puts") == 1 and store.counter("queue_full_drops") == 1


def test_a_task_on_a_closed_store_completes_at_once(open_store: StoreFactory) -> None:
    store = open_store(max_size_gb=SMALL)
    store.close()
    assert submit_task(store, ["a", "b"]) == [TaskOutcome(False, 0, [], [], [])]


def test_a_task_of_mixed_layouts_stores_each_chunk_that_fits(open_store: StoreFactory) -> None:
    store = open_store(max_size_gb=SMALL)
    keys = ["a", "k" * 5000, "c", "half", "other"]  # the second key does not fit the header
    metas = [meta_for(CHUNK)] * 3 + [meta_for(CHUNK // 2), meta_for(CHUNK)]  # two layouts
    namespaces = [NS] * 4 + ["another model"]
    payloads = [memoryview(payload_for(key, meta.nbytes))
                for key, meta in zip(keys, metas, strict=True)]
    done: list[TaskOutcome] = []
    store.submit_task(keys, namespaces, metas, payloads, done.append)
    assert store.flush()
    assert len(done) == 1 and not done[0].ok and done[0].stored == [0, 2, 3, 4]
    assert read(store, "a") == payload_for("a", CHUNK)
    assert read(store, "half", CHUNK // 2) == payload_for("half", CHUNK // 2)
    assert store.lookup("other", "another model")
    assert store.counter("oversize_drops") == 1


def test_a_task_with_a_wrong_size_takes_nothing_and_still_completes(
        open_store: StoreFactory) -> None:
    store = open_store(max_size_gb=SMALL)
    done: list[TaskOutcome] = []
    with pytest.raises(ValueError, match="metadata says"):
        store.submit_task(["a", "b"], [NS] * 2, [meta_for(CHUNK), meta_for(CHUNK + 1)],
                          [memoryview(payload_for(key)) for key in "ab"], done.append)
    assert done == [TaskOutcome(False, 0, [], [], [])]
    assert not store.is_pending("a") and read(store, "a") is None
    assert store.counter("oversize_drops") == 0
