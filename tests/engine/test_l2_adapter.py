"""NVMeL2Adapter through LMCache's real L2 adapter interface, loader and config parser."""

from __future__ import annotations

import argparse
import gc
import os
import select
import threading
import time
import typing
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from lmcache.lmcache_native import Bitmap
from lmcache.v1.distributed.api import MemoryLayoutDesc, ObjectKey
from lmcache.v1.distributed.config import EvictionConfig
from lmcache.v1.distributed.internal_api import L2StoreResult
from lmcache.v1.distributed.l2_adapters import create_l2_adapter
from lmcache.v1.distributed.l2_adapters.config import (
    add_l2_adapters_args,
    parse_args_to_l2_adapters_config,
)
from lmcache.v1.distributed.storage_controllers.eviction_controller import (
    L2AdapterEvictionState,
)
from lmcache.v1.memory_management import (
    MemoryFormat,
    MemoryObj,
    MemoryObjMetadata,
    TensorMemoryObj,
)
from lmcache.v1.platform import consume_fd
from support.io_faults import before_each_write

from lmcache_nvme_backend import NVMeConfigError
from lmcache_nvme_backend.adapters.l2_adapter import (
    NVMeL2Adapter,
    NVMeL2AdapterConfig,
    refuse_persist_disabled,
)
from lmcache_nvme_backend.adapters.object_keys import (
    object_key_namespace,
    object_key_parts,
    object_key_string,
    parse_object_key_string,
)
from lmcache_nvme_backend.disk.format import HEADER_SIZE, file_size_for
from lmcache_nvme_backend.disk.layout import key_digest, namespace_id
from lmcache_nvme_backend.io import native

pytestmark = pytest.mark.timeout(120)

CHUNK_BYTES = 256 * 1024  # small chunks keep the suite fast; the path is the same
LAYOUT = {0: MemoryLayoutDesc(shapes=[torch.Size([CHUNK_BYTES])], dtypes=[torch.uint8])}


# -- helpers ---------------------------------------------------------------------


def plugin_spec(path: Path, **params: Any) -> dict[str, Any]:
    return {"type": "plugin", "module_path": "lmcache_nvme_backend",
            "class_name": "NVMeL2Adapter",
            "adapter_params": {"path": str(path), "max_size_gb": 1, "min_free_gb": 0,
                               **params}}


def load_adapter(path: Path, **params: Any) -> NVMeL2Adapter:
    """Through LMCache's own command-line parser and plugin factory, as the server does."""
    import json

    parser = add_l2_adapters_args(argparse.ArgumentParser())
    args = parser.parse_args(["--l2-adapter", json.dumps(plugin_spec(path, **params))])
    (config,) = parse_args_to_l2_adapters_config(args).adapters
    adapter = create_l2_adapter(config)
    assert isinstance(adapter, NVMeL2Adapter)
    return adapter


AdapterFactory = Callable[..., NVMeL2Adapter]


@pytest.fixture
def open_adapter() -> Iterator[AdapterFactory]:
    """``load_adapter`` whose adapters are closed at the end of the test."""
    made: list[NVMeL2Adapter] = []

    def factory(path: Path, **params: Any) -> NVMeL2Adapter:
        made.append(load_adapter(path, **params))
        return made[-1]

    yield factory
    for adapter in made:
        adapter.close()


def make_keys(n: int, start: int = 0, model: str = "org/model", salt: str = "") -> list[ObjectKey]:
    return [ObjectKey(chunk_hash=(start + i).to_bytes(16, "big"), model_name=model,
                      kv_rank=0x01000100, object_group_id=0, cache_salt=salt)
            for i in range(n)]


def make_objs(n: int, seed: int | None, nbytes: int = CHUNK_BYTES) -> list[MemoryObj]:
    """Host memory objects like L1's; random content (seed) or a NaN-like 0xEE fill (None)."""
    objs: list[MemoryObj] = []
    gen = torch.Generator().manual_seed(seed if seed is not None else 0)
    for _ in range(n):
        backing = torch.empty(nbytes + 4096, dtype=torch.uint8)
        off = (-backing.data_ptr()) % 4096
        raw = backing[off : off + nbytes]
        if seed is None:
            raw.fill_(0xEE)
        else:
            raw.copy_(torch.randint(0, 256, (nbytes,), generator=gen, dtype=torch.uint8))
        meta = MemoryObjMetadata(shape=torch.Size([nbytes]), dtype=torch.uint8, address=0,
                                 phy_size=nbytes, fmt=MemoryFormat.KV_2LTD, ref_count=1)
        objs.append(TensorMemoryObj(raw_data=raw, metadata=meta, parent_allocator=None))
    return objs


def wait_fd(fd: int, timeout_s: float = 30.0) -> None:
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    assert poller.poll(timeout_s * 1000), "event fd was not signalled"
    consume_fd(fd)


def bits(bitmap: Bitmap, n: int) -> list[bool]:
    got = set(bitmap.get_indices_list())
    return [i in got for i in range(n)]


def store(adapter: NVMeL2Adapter, keys: list[ObjectKey], objs: list[MemoryObj]
          ) -> L2StoreResult:
    task = adapter.submit_store_task(keys, objs)
    done: dict[int, L2StoreResult] = {}
    while task not in done:
        wait_fd(adapter.get_store_event_fd())
        done.update(adapter.pop_completed_store_tasks())
    return done[task]


def lookup(adapter: NVMeL2Adapter, keys: list[ObjectKey]) -> list[bool]:
    task = adapter.submit_lookup_and_lock_task(keys, LAYOUT)
    while (result := adapter.query_lookup_and_lock_result(task)) is None:
        wait_fd(adapter.get_lookup_and_lock_event_fd())
    return bits(result, len(keys))


def load(adapter: NVMeL2Adapter, keys: list[ObjectKey], objs: list[MemoryObj]) -> list[bool]:
    task = adapter.submit_load_task(keys, objs)
    while (result := adapter.query_load_result(task)) is None:
        wait_fd(adapter.get_load_event_fd())
    return bits(result, len(keys))


def same(a: MemoryObj, b: MemoryObj) -> bool:
    return torch.equal(a.tensor, b.tensor)  # type: ignore[arg-type]


# -- configuration -------------------------------------------------------------------


def test_config_validates_adapter_params_with_named_fields(tmp_path: Path) -> None:
    cfg = NVMeL2AdapterConfig.from_dict({"path": str(tmp_path), "max_size_gb": 2,
                                         "io_threads": 4, "shared": "true"})
    assert cfg.settings.paths == (tmp_path,)
    assert cfg.settings.io_threads == 4 and cfg.settings.shared is True
    with pytest.raises(NVMeConfigError, match=r"adapter_params\.path: missing"):
        NVMeL2AdapterConfig.from_dict({"max_size_gb": 2})
    with pytest.raises(NVMeConfigError, match=r"did you mean 'adapter_params\.max_size_gb'"):
        NVMeL2AdapterConfig.from_dict({"path": str(tmp_path), "max_size_gib": 2})
    with pytest.raises(NVMeConfigError, match=r"adapter_params\.io_threads: 'x' is not a number"):
        NVMeL2AdapterConfig.from_dict({"path": str(tmp_path), "max_size_gb": 1,
                                       "io_threads": "x"})
    with pytest.raises(NVMeConfigError, match=r"adapter_params\.shared: 'maybe'"):
        NVMeL2AdapterConfig.from_dict({"path": str(tmp_path), "max_size_gb": 1,
                                       "shared": "maybe"})
    assert "max_size_gb" in NVMeL2AdapterConfig.help()


def test_server_parser_and_factory_reject_bad_params_clearly(tmp_path: Path) -> None:
    """The error the server prints names the JSON field (LMCache wraps it as a ValueError)."""
    with pytest.raises(ValueError, match=r"adapter_params\.max_size_gb: -1 is out of range"):
        load_adapter(tmp_path, max_size_gb=-1)
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ValueError, match="exists and is not a directory"):
        load_adapter(blocker)


def test_raw_dict_construction_also_validates(tmp_path: Path) -> None:
    adapter = NVMeL2Adapter({"path": str(tmp_path), "max_size_gb": 1, "min_free_gb": 0})
    adapter.close()
    with pytest.raises(NVMeConfigError, match="max_size_gb"):
        NVMeL2Adapter({"path": str(tmp_path)})


def test_key_strings_are_reversible_and_namespaced() -> None:
    for key in make_keys(2) + make_keys(1, salt="user-7"):
        assert parse_object_key_string(object_key_string(key)) == key
    assert parse_object_key_string("not@a key") is None
    (salted,) = make_keys(1, salt="u1")
    assert object_key_namespace(salted) == "org/model@u1"
    assert object_key_namespace(make_keys(1)[0]) == "org/model"


def test_key_strings_keep_the_form_files_on_disk_were_named_by() -> None:
    """A chunk file's name is the digest of this string: files written by earlier versions
    are found only while it stays ``model@0xRANK@GROUP@HASH[@salt]`` exactly."""
    key = ObjectKey(chunk_hash=bytes(range(8)), model_name="org/model", kv_rank=5,
                    object_group_id=26)
    assert object_key_string(key) == "org/model@0x00000005@1a@0001020304050607"
    salted = ObjectKey(chunk_hash=b"\xff", model_name="m", kv_rank=0, cache_salt="u1")
    assert object_key_parts(salted) == ("m@0x00000000@0@ff@u1", "m@u1")
    assert object_key_parts(key) == (object_key_string(key), "org/model")


# -- the interface ----------------------------------------------------------------------


def test_event_fds_are_distinct_and_closed(tmp_path: Path) -> None:
    a = load_adapter(tmp_path / "a")
    b = load_adapter(tmp_path / "b")
    fds = [a.get_store_event_fd(), a.get_lookup_and_lock_event_fd(), a.get_load_event_fd(),
           b.get_store_event_fd(), b.get_lookup_and_lock_event_fd(), b.get_load_event_fd()]
    assert len(set(fds)) == 6
    a.close()
    b.close()
    for fd in fds:
        with pytest.raises(OSError):
            os.fstat(fd)


@pytest.mark.parametrize("engine", ["auto", "off"], ids=["native-when-built", "python"])
def test_store_lookup_load_round_trip_is_byte_exact(tmp_path: Path, open_adapter: AdapterFactory,
                                                    engine: str) -> None:
    """Each I/O engine (tasks finish on different threads, and signal LMCache differently)."""
    adapter = open_adapter(tmp_path, native_io=engine)
    assert (adapter.store.engine.name == "python") == (engine == "off" or not native.available())
    accessed: list[list[ObjectKey]] = []
    listener = type("Listener", (), {
        "on_l2_keys_stored": lambda self, keys, sizes: None,
        "on_l2_keys_accessed": lambda self, keys: accessed.append(list(keys)),
        "on_l2_keys_deleted": lambda self, keys: None})
    adapter.register_listener(listener())
    keys, objs = make_keys(6), make_objs(6, seed=1)
    result = store(adapter, keys, objs)
    assert result.is_successful() and result.bytes_transferred() == 6 * CHUNK_BYTES
    missing = make_keys(2, start=100)
    assert lookup(adapter, keys + missing) == [True] * 6 + [False] * 2
    dest = make_objs(8, seed=None)
    assert load(adapter, [*keys[:3], *missing, *keys[3:]], dest[:3] + dest[6:] + dest[3:6]) \
        == [True] * 3 + [False] * 2 + [True] * 3
    for src, got in zip(objs, dest[:6], strict=True):
        assert same(src, got)  # every chunk, the first of the batch included
    assert all(bool((d.tensor == 0xEE).all()) for d in dest[6:])  # type: ignore[union-attr]
    assert load(adapter, keys[:2], make_objs(2, seed=None)) == [True, True]
    assert accessed == [keys, keys[:2]]  # what each load served, for LMCache's LRU
    adapter.submit_unlock(keys)
    # files: one per chunk, header + aligned payload, in the model's namespace
    ns = namespace_id("org/model")
    for key in keys:
        path = adapter.store.layouts[0].chunk_path(ns, key_digest(object_key_string(key)))
        assert path.stat().st_size == file_size_for(CHUNK_BYTES) == HEADER_SIZE + CHUNK_BYTES


def test_duplicate_store_succeeds_without_rewriting(tmp_path: Path,
                                                    open_adapter: AdapterFactory) -> None:
    adapter = open_adapter(tmp_path)
    keys, objs = make_keys(3), make_objs(3, seed=2)
    assert store(adapter, keys, objs).is_successful()
    again = store(adapter, keys, make_objs(3, seed=3))
    assert again.is_successful() and again.bytes_transferred() == 0
    dest = make_objs(3, seed=None)
    assert load(adapter, keys, dest) == [True] * 3
    assert all(same(a, b) for a, b in zip(objs, dest, strict=True))
    assert store(adapter, [], []).is_successful()


def test_usage_is_accounted_through_the_base_class(tmp_path: Path,
                                                   open_adapter: AdapterFactory) -> None:
    adapter = open_adapter(tmp_path, max_size_gb=0.5)
    stored: list[list[ObjectKey]] = []
    deleted: list[list[ObjectKey]] = []

    class Listener:
        def on_l2_keys_stored(self, keys: list[ObjectKey], sizes: list[int]) -> None:
            stored.append(list(keys))

        def on_l2_keys_accessed(self, keys: list[ObjectKey]) -> None:
            pass

        def on_l2_keys_deleted(self, keys: list[ObjectKey]) -> None:
            deleted.append(list(keys))

    adapter.register_listener(Listener())  # type: ignore[arg-type]
    plain, salted = make_keys(3), make_keys(2, start=10, salt="tenant")
    assert store(adapter, plain, make_objs(3, seed=4)).is_successful()
    assert store(adapter, salted, make_objs(2, seed=5)).is_successful()
    size = file_size_for(CHUNK_BYTES)
    usage = adapter.get_usage()
    assert usage.total_bytes_used == 5 * size
    assert usage.total_capacity_bytes == int(0.5 * 1024**3)
    assert dict(usage.bytes_by_cache_salt) == {"": 3 * size, "tenant": 2 * size}
    assert adapter.supports_global_eviction
    adapter.delete(salted[:1])
    usage = adapter.get_usage()
    assert usage.total_bytes_used == 4 * size
    assert dict(usage.bytes_by_cache_salt) == {"": 3 * size, "tenant": size}
    assert sorted(sum(stored, []), key=str) == sorted(plain + salted, key=str)
    assert deleted == [salted[:1]]
    assert lookup(adapter, salted) == [False, True]


@pytest.mark.skipif(not native.available(), reason=native.unavailable_reason())
def test_the_keys_kept_for_stored_chunks_are_not_tracked_by_the_cycle_collector(
        tmp_path: Path, open_adapter: AdapterFactory) -> None:
    """One key per chunk on the drive (to tell LMCache which were evicted): tracked, a
    million of them held the GIL 0.26 s in every full collection."""
    adapter = open_adapter(tmp_path)
    keys = make_keys(5)
    assert store(adapter, keys, make_objs(5, seed=11)).is_successful()
    gc.collect()
    assert not [key for key in keys if gc.is_tracked(key)]
    assert not [r for key in keys for r in gc.get_referrers(key) if isinstance(r, dict)]
    deleted: list[list[ObjectKey]] = []
    adapter.register_listener(type("Listener", (), {  # type: ignore[arg-type]
        "on_l2_keys_stored": lambda self, keys, sizes: None,
        "on_l2_keys_accessed": lambda self, keys: None,
        "on_l2_keys_deleted": lambda self, keys: deleted.append(list(keys))})())
    adapter.delete(keys[1:3])
    assert deleted == [keys[1:3]] and lookup(adapter, keys) == [True, False, False, True, True]


def test_object_keys_hold_only_bytes_strings_and_integers() -> None:
    """What makes leaving the adapter's stored keys untracked safe: a key can never be part
    of a reference cycle.  A field of another type in LMCache's ObjectKey needs a look."""
    assert set(typing.get_type_hints(ObjectKey).values()) <= {bytes, str, int}


def test_salt_isolates_chunks(tmp_path: Path, open_adapter: AdapterFactory) -> None:
    adapter = open_adapter(tmp_path)
    (alice,) = make_keys(1, salt="alice")
    (bob,) = make_keys(1, salt="bob")
    assert store(adapter, [alice], make_objs(1, seed=6)).is_successful()
    assert lookup(adapter, [alice, bob]) == [True, False]


def test_eviction_honours_locks_and_notifies(tmp_path: Path,
                                            open_adapter: AdapterFactory) -> None:
    size = file_size_for(CHUNK_BYTES)
    budget_gb = 4 * size / 1024**3  # room for exactly four chunks
    adapter = open_adapter(tmp_path, max_size_gb=budget_gb)
    first = make_keys(4)
    assert store(adapter, first, make_objs(4, seed=7)).is_successful()
    assert lookup(adapter, first[:1]) == [True]  # locks (pins) the first chunk
    more = make_keys(3, start=50)
    assert store(adapter, more, make_objs(3, seed=8)).is_successful()
    present = lookup(adapter, first)
    assert present == [True, False, False, False]  # the locked one survived
    adapter.submit_unlock(first[:1] * 2)  # the two lookups above locked it twice
    assert adapter.get_usage().total_bytes_used == 4 * size
    assert adapter.store.usage()["used_bytes"] <= 4 * size
    assert store(adapter, make_keys(4, start=90), make_objs(4, seed=9)).is_successful()
    assert lookup(adapter, first[:1]) == [False]  # unlocked: evictable like any other


def test_restart_keeps_data_findable(tmp_path: Path) -> None:
    keys, objs = make_keys(5), make_objs(5, seed=10)
    adapter = load_adapter(tmp_path)
    assert store(adapter, keys, objs).is_successful()
    adapter.close()
    restarted = load_adapter(tmp_path)
    try:
        assert restarted.get_usage().total_bytes_used == 5 * file_size_for(CHUNK_BYTES)
        assert lookup(restarted, keys) == [True] * 5
        dest = make_objs(5, seed=None)
        assert load(restarted, keys, dest) == [True] * 5
        assert all(same(a, b) for a, b in zip(objs, dest, strict=True))
        restarted.delete(keys[:2])  # recovered chunks leave the usage too
        assert restarted.get_usage().total_bytes_used == 3 * file_size_for(CHUNK_BYTES)
    finally:
        restarted.close()


def test_corrupted_chunk_is_a_miss_never_served(tmp_path: Path,
                                               open_adapter: AdapterFactory) -> None:
    adapter = open_adapter(tmp_path)
    keys, objs = make_keys(3), make_objs(3, seed=11)
    assert store(adapter, keys, objs).is_successful()
    path = adapter.store.layouts[0].chunk_path(
        namespace_id("org/model"), key_digest(object_key_string(keys[1])))
    with open(path, "r+b") as f:
        f.seek(HEADER_SIZE + 1000)
        byte = f.read(1)
        f.seek(HEADER_SIZE + 1000)
        f.write(bytes([byte[0] ^ 1]))
    dest = make_objs(3, seed=None)
    assert load(adapter, keys, dest) == [True, False, True]
    assert same(objs[0], dest[0]) and same(objs[2], dest[2])
    assert adapter.stats()["checksum_failures"] == 1
    assert lookup(adapter, keys[1:2]) == [False]


def test_wrong_layout_load_is_a_miss(tmp_path: Path, open_adapter: AdapterFactory) -> None:
    adapter = open_adapter(tmp_path)
    keys = make_keys(1)
    assert store(adapter, keys, make_objs(1, seed=12)).is_successful()
    assert load(adapter, keys, make_objs(1, seed=None, nbytes=CHUNK_BYTES // 2)) == [False]


def test_concurrent_controllers_are_safe(tmp_path: Path,
                                        open_adapter: AdapterFactory) -> None:
    """A store thread and a prefetch thread, as LMCache runs them, on one adapter."""
    adapter = open_adapter(tmp_path)
    base_keys, base_objs = make_keys(4), make_objs(4, seed=13)
    assert store(adapter, base_keys, base_objs).is_successful()
    errors: list[BaseException] = []
    task_ids: list[int] = []
    # LMCache keeps a stored object (read-locked in L1) until its task completes; the write
    # reads it in place, so the objects must outlive the tasks here too
    stored_objs: list[MemoryObj] = []
    store_lock = threading.Lock()

    def storer() -> None:
        try:
            for r in range(6):
                keys = make_keys(3, start=1000 + 3 * r)
                objs = make_objs(3, seed=100 + r)
                task = adapter.submit_store_task(keys, objs)
                with store_lock:
                    task_ids.append(task)
                    stored_objs.extend(objs)
        except BaseException as exc:
            errors.append(exc)

    def prefetcher() -> None:
        try:
            for _ in range(6):
                assert lookup(adapter, base_keys) == [True] * 4
                dest = make_objs(4, seed=None)
                assert load(adapter, base_keys, dest) == [True] * 4
                assert all(same(a, b) for a, b in zip(base_objs, dest, strict=True))
                adapter.submit_unlock(base_keys)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=storer), threading.Thread(target=prefetcher)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors
    # every store task completes and succeeds
    done: dict[int, L2StoreResult] = {}
    while not set(task_ids) <= set(done):
        wait_fd(adapter.get_store_event_fd())
        done.update(adapter.pop_completed_store_tasks())
    assert all(done[t].is_successful() for t in task_ids)
    stored_keys = make_keys(18, start=1000)
    assert lookup(adapter, stored_keys) == [True] * 18
    dest = make_objs(18, seed=None)
    assert load(adapter, stored_keys, dest) == [True] * 18
    assert all(same(a, b) for a, b in zip(stored_objs, dest, strict=True))


def test_report_status(tmp_path: Path, open_adapter: AdapterFactory) -> None:
    adapter = open_adapter(tmp_path, shared=True)
    status = adapter.report_status()
    assert status["is_healthy"] is True and status["shared"] is True
    assert status["paths"] == [str(tmp_path)]


def test_shared_mode_finds_chunks_another_server_wrote(tmp_path: Path,
                                                       open_adapter: AdapterFactory) -> None:
    one = open_adapter(tmp_path, shared=True)
    two = open_adapter(tmp_path, shared=True)  # started before anything was stored
    keys, objs = make_keys(3), make_objs(3, seed=14)
    assert store(one, keys, objs).is_successful()
    two.store.refresh_shared()  # what the background thread does every 0.1 s
    assert lookup(two, keys) == [True] * 3
    dest = make_objs(3, seed=None)
    assert load(two, keys, dest) == [True] * 3
    assert all(same(a, b) for a, b in zip(objs, dest, strict=True))
    assert two.stats()["shared_adopted"] == 3
    two.submit_unlock(keys)
    one.delete(keys[:1])  # the other server evicts one: a miss here, not an error
    assert lookup(one, keys) == [False, True, True]  # gone from its index at once
    deadline = time.monotonic() + 30  # its file and its journal line follow
    while True:
        two.store.refresh_shared()
        if lookup(two, keys) == [False, True, True] or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert lookup(two, keys) == [False, True, True]


# -- LMCache's L2 framework settings ---------------------------------------------------------


def test_no_call_waits_on_a_stuck_drive(tmp_path: Path, open_adapter: AdapterFactory) -> None:
    """LMCache may make every call into the adapter under one lock (its QoS wrapper does):
    while the drive takes nothing, with a write queue that fills and queue_full_policy
    "wait", each call still returns; what was queued is persisted once the drive is back."""
    adapter = open_adapter(tmp_path, write_queue_mb=2 * CHUNK_BYTES / 2**20,
                           queue_full_policy="wait")
    old_keys, old_objs = make_keys(2, start=100), make_objs(2, seed=3)
    assert store(adapter, old_keys, old_objs).is_successful()
    drive = threading.Event()
    before_each_write(adapter.store, drive.wait)
    unlink = adapter.store.engine.unlink
    adapter.store.engine.unlink = lambda items: (drive.wait(), unlink(items))[1]  # type: ignore[method-assign]
    keys, objs = make_keys(6), make_objs(6, seed=9)
    dest = make_objs(1, seed=None)
    tasks: list[int] = []
    calls: list[Callable[[], object]] = [
        *[lambda i=i: tasks.append(adapter.submit_store_task(keys[i:i + 2], objs[i:i + 2]))
          for i in (0, 2, 4)],  # three times the queue's room
        lambda: adapter.delete(old_keys[:1]),
        lambda: adapter.submit_lookup_and_lock_task(old_keys, LAYOUT),
        lambda: adapter.submit_unlock(old_keys),
        lambda: adapter.submit_load_task(old_keys[1:], dest),
        adapter.get_usage, adapter.report_status]
    caller = threading.Thread(target=lambda: [call() for call in calls], daemon=True)
    caller.start()
    caller.join(timeout=30)
    stuck = caller.is_alive()
    drive.set()
    assert not stuck, "an adapter call waited for the drive"
    results: dict[int, L2StoreResult] = {}
    while len(results) < 3:
        wait_fd(adapter.get_store_event_fd())
        results.update(adapter.pop_completed_store_tasks())
    assert all(results[task].is_successful() for task in tasks)
    assert lookup(adapter, keys) == [True] * 6
    assert lookup(adapter, old_keys) == [False, True]
    loaded = make_objs(6, seed=None)
    assert load(adapter, keys, loaded) == [True] * 6
    assert all(same(a, b) for a, b in zip(objs, loaded, strict=True))
    assert same(dest[0], old_objs[1])


def test_lmcaches_own_l2_eviction_is_refused(tmp_path: Path) -> None:
    adapter = load_adapter(tmp_path)
    config = EvictionConfig(eviction_policy="LRU", trigger_watermark=0.8, eviction_ratio=0.2)
    with pytest.raises(NVMeConfigError, match='"eviction": the NVMe tier evicts on its own'):
        L2AdapterEvictionState(adapter_id=0, adapter=adapter, eviction_config=config)
    assert adapter._closed  # the store let go of its directory for the next start


@pytest.mark.parametrize(("lmcache_shared", "tier_shared", "starts"),
                         [(True, False, False), (True, True, True), (False, True, True),
                          (False, False, True)])
def test_lmcaches_shared_flag_needs_the_tiers_shared_mode(
        tmp_path: Path, open_adapter: AdapterFactory, lmcache_shared: bool,
        tier_shared: bool, starts: bool) -> None:
    adapter = open_adapter(tmp_path, shared=tier_shared)
    if starts:
        adapter.set_backend_identity("plugin", shared=lmcache_shared)
        return
    with pytest.raises(NVMeConfigError, match='Add "shared": true to adapter_params'):
        adapter.set_backend_identity("plugin", shared=lmcache_shared)


@pytest.mark.parametrize("argv", [
    ["lmcache", "server", "--l2-adapter", '{"class_name": "NVMeL2Adapter", '
     '"persist_enabled": false}'],
    ["lmcache", "server", '--l2-adapter={"class_name": "NVMeL2Adapter", '
     '"persist_enabled": false}']])
def test_persist_disabled_on_the_command_line_is_refused(argv: list[str]) -> None:
    with pytest.raises(NVMeConfigError, match='"persist_enabled": false: the NVMe tier keeps'):
        refuse_persist_disabled(argv)


@pytest.mark.parametrize("argv", [
    ["lmcache", "server", "--l2-adapter", '{"class_name": "NVMeL2Adapter", '
     '"persist_enabled": true}'],
    ["lmcache", "server", "--l2-adapter", '{"type": "fs", "persist_enabled": false}'],
    ["lmcache", "server", "--l2-adapter", "{not json"],
    ["lmcache", "server", "--l2-adapter"]])
def test_persist_left_on_or_for_another_adapter_starts(argv: list[str]) -> None:
    refuse_persist_disabled(argv)


# -- KV bound to the model's build -------------------------------------------------------------


def test_after_the_weights_change_no_chunk_of_the_old_ones_is_served(
        tmp_path: Path, package_log: pytest.LogCaptureFixture) -> None:
    """The same model path, other weights, a restart: every earlier chunk is a miss (and
    the log says why); with the weights unchanged the restart still hits."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "model.safetensors").write_bytes(bytes(range(256)) * 4096)
    keys, objs = make_keys(3, model=str(model)), make_objs(3, seed=21)
    adapter = load_adapter(tmp_path / "cache")
    assert store(adapter, keys, objs).is_successful()
    adapter.close()
    adapter = load_adapter(tmp_path / "cache")  # unchanged weights: hits
    assert lookup(adapter, keys) == [True] * 3
    adapter.submit_unlock(keys)
    adapter.close()
    (model / "model.safetensors").write_bytes(bytes(range(255, -1, -1)) * 4096)
    with package_log.at_level("WARNING", "lmcache_nvme_backend"):
        adapter = load_adapter(tmp_path / "cache")
        try:
            assert lookup(adapter, keys) == [False] * 3
            assert "earlier builds" in package_log.text and "are skipped" in package_log.text
            new = make_objs(3, seed=22)
            assert store(adapter, keys, new).is_successful()  # the new build's chunks
            loaded = make_objs(3, seed=None)
            assert load(adapter, keys, loaded) == [True] * 3
            assert all(same(a, b) for a, b in zip(new, loaded, strict=True))
        finally:
            adapter.close()
