"""Injected faults: ENOSPC, EIO / short reads, read-only or deleted directory, a failing path,
an unusable path at startup.  Nothing may crash, nothing wrong may be served."""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.chunks import NS, meta_for, payload_for, read
from support.io_faults import FlakyReads, fail_writes_under
from support.mounts import tmpfs
from support.stores import StoreFactory

from lmcache_nvme_backend.config import NVMeConfigError
from lmcache_nvme_backend.store import free_space
from lmcache_nvme_backend.store import roots as roots_mod
from lmcache_nvme_backend.store.chunk_store import ChunkStore

pytestmark = pytest.mark.timeout(60)

MIB = 1024 * 1024
SIZE = MIB - 100


def put(store: ChunkStore, key: str, size: int = SIZE) -> object:
    return store.submit(key, NS, meta_for(size), memoryview(payload_for(key, size)),
                        release=lambda: None)


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """An 8 MiB tmpfs, unmounted afterwards; skipped where mounting is not permitted."""
    with tmpfs(tmp_path / "mnt", "8m") as mnt:
        yield mnt


def temp_files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if ".tmp-" in p.name]


def test_free_space_guard_evicts_before_the_filesystem_fills(small_fs: Path,
                                                             open_store: StoreFactory) -> None:
    store = open_store(small_fs / "cache")
    try:
        for i in range(12):  # 12 MiB into 8 MiB
            put(store, f"k{i}")
            assert store.flush(10)
        assert store.contains("k11") and not store.contains("k0")
        assert store.counter("evictions") > 0
        assert store.counter("write_failures") == 0
    finally:
        store.close()


def test_enospc_drops_the_write_leaves_no_partial_file_and_reads_keep_working(
        small_fs: Path, monkeypatch: pytest.MonkeyPatch, open_store: StoreFactory) -> None:
    # Another tenant fills the filesystem between the free-space check and the write:
    # the guard sees plenty of room, the write itself gets ENOSPC.
    monkeypatch.setattr(free_space, "free_bytes", lambda path: 1 << 40)
    store = open_store(small_fs / "cache")
    try:
        keys = [f"k{i}" for i in range(12)]  # 12 MiB into 8 MiB: must hit ENOSPC
        for key in keys:
            put(store, key)
            assert store.flush(10)
        stored = [k for k in keys if store.contains(k)]
        assert stored, "nothing fit at all"
        assert len(stored) < len(keys)
        assert store.counter("capacity_drops") == len(keys) - len(stored)
        assert store.counter("write_failures") == 0
        assert not temp_files(small_fs)
        for f in (small_fs / "cache" / "ns").rglob("*.kv"):
            assert f.stat().st_size % 4096 == 0
        # a full filesystem is not a broken drive: what is stored keeps being served
        assert store.stats_snapshot()["roots_offline"] == 0
        for key in stored:
            assert read(store, key, SIZE) == payload_for(key, SIZE)
    finally:
        store.close()
    assert not temp_files(small_fs)


@pytest.mark.parametrize("mode", ["eio", "short"])
def test_injected_read_errors_are_counted_misses(tmp_path: Path, mode: str,
                                                 open_store: StoreFactory) -> None:
    store = open_store(tmp_path / "c")
    try:
        put(store, "a")
        assert store.flush(10)
        with FlakyReads(store, mode):
            assert read(store, "a", SIZE) is None
            assert store.counter("read_failures") == 1
        if mode == "eio":  # the file is intact: served again once the drive answers
            assert read(store, "a", SIZE) == payload_for("a", SIZE)
        else:  # a short file is quarantined, never served
            assert store.counter("invalid_files") == 1
            assert read(store, "a", SIZE) is None
    finally:
        store.close()


def test_unreadable_files_are_misses_and_never_take_the_path_out_of_service(
        tmp_path: Path, open_store: StoreFactory) -> None:
    """Another user's files in a shared tree: each is a miss, the drive stays in service."""
    store = open_store(tmp_path / "c")
    try:
        keys = [f"k{i}" for i in range(roots_mod.ROOT_ERROR_LIMIT + 2)]
        for key in keys:
            put(store, key)
        assert store.flush(10)
        with FlakyReads(store, "eacces"):
            assert all(read(store, key, SIZE) is None for key in keys)
        assert all(root.healthy for root in store.describe_roots())
        assert store.counter("read_failures") == len(keys)
        assert not store.contains(keys[0])  # forgotten, like a vanished file
        put(store, "fresh")
        assert store.flush(10)
        assert read(store, "fresh", SIZE) == payload_for("fresh", SIZE)
    finally:
        store.close()


def test_read_only_remount_then_recovery(small_fs: Path, monkeypatch: pytest.MonkeyPatch,
                                         open_store: StoreFactory) -> None:
    monkeypatch.setattr(roots_mod, "ROOT_RETRY_S", 0.3)
    store = open_store(small_fs / "cache")
    try:
        put(store, "before")
        assert store.flush(10)
        subprocess.run(["mount", "-o", "remount,ro", str(small_fs)], check=True)
        for i in range(5):
            put(store, f"ro-{i}")
        assert store.flush(10)
        assert not any(store.contains(f"ro-{i}") for i in range(5))
        assert store.counter("write_failures") == 5
        # a miss or a hit, never a wrong byte, never a crash
        assert read(store, "before", SIZE) in (None, payload_for("before", SIZE))
        subprocess.run(["mount", "-o", "remount,rw", str(small_fs)], check=True)
        time.sleep(0.4)  # past the (patched) out-of-service interval
        put(store, "after")
        assert store.flush(10)
        assert store.contains("after")
        assert read(store, "after", SIZE) == payload_for("after", SIZE)
        assert not temp_files(small_fs)
    finally:
        store.close()


def test_directory_deleted_at_run_time(tmp_path: Path, open_store: StoreFactory) -> None:
    cache = tmp_path / "c"
    store = open_store(cache)
    try:
        put(store, "a")
        assert store.flush(10)
        shutil.rmtree(cache)
        assert read(store, "a", SIZE) is None  # clean miss
        assert not store.contains("a")  # and forgotten
        put(store, "b")
        assert store.flush(10)
        if not store.contains("b"):  # quarantine / index dirs are gone; a retry recovers
            (cache / "quarantine").mkdir(parents=True, exist_ok=True)
            put(store, "b")
            assert store.flush(10)
        assert read(store, "b", SIZE) == payload_for("b", SIZE)
    finally:
        store.close()


def test_one_failing_path_is_taken_out_of_service(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch,
                                                  open_store: StoreFactory) -> None:
    monkeypatch.setattr(roots_mod, "ROOT_RETRY_S", 3600)
    bad_root, good_root = tmp_path / "bad", tmp_path / "good"
    # One write in flight at a time: writes already on their way to the failing path when
    # it goes out of service fail too, and how many there are would depend on timing.
    store = open_store(bad_root, good_root, write_threads=1)
    try:
        fail_writes_under(store, bad_root)
        keys = [f"k{i}" for i in range(30)]
        for key in keys:
            put(store, key, 4096)
            assert store.flush(10)
        snap = store.stats_snapshot()
        assert snap["roots_offline"] == 1
        roots = store.describe_roots()
        assert not roots[0].healthy and roots[1].healthy
        assert store.counter("write_failures") == 3  # then the path is skipped
        stored = [k for k in keys if store.contains(k)]
        assert len(stored) == 27
        for key in stored:
            assert read(store, key, 4096) == payload_for(key, 4096)
    finally:
        store.close()


def test_startup_on_unusable_path_is_a_clear_error(tmp_path: Path,
                                                   open_store: StoreFactory) -> None:
    a_file = tmp_path / "file"
    a_file.write_text("x")
    with pytest.raises(NVMeConfigError, match="not a directory"):
        open_store(a_file)
    with pytest.raises(NVMeConfigError, match="cannot create"):
        open_store(a_file / "sub")
