"""The GPU read path run on CPU tensors, up to the CUDA call.

A pool on the CPU stands in for GPU memory and ``PosixTensorPayloadReader``
for kvikio; everything else (pool, verification with the GPU checksum,
quarantine, fallbacks, counters, the backend's wiring) is the real code.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest
import torch
from lmcache.utils import CacheEngineKey
from lmcache.v1.config import LMCacheEngineConfig
from support.stores import StoreFactory

from lmcache_nvme_backend.adapters.backend import NVMeBackend
from lmcache_nvme_backend.adapters.memory_objects import device_payload, is_device_object
from lmcache_nvme_backend.config import MIB, NVMeConfigError
from lmcache_nvme_backend.disk.format import HEADER_SIZE, decode_header
from lmcache_nvme_backend.disk.gpusum import host_checksum
from lmcache_nvme_backend.disk.layout import key_digest, namespace_id
from lmcache_nvme_backend.gpu.reader import GpuChunkReader
from lmcache_nvme_backend.gpu.select import PathDecision
from lmcache_nvme_backend.io.kvikio import PayloadRead, PosixTensorPayloadReader
from lmcache_nvme_backend.store import ReadPath
from lmcache_nvme_backend.store.chunk_store import ChunkStore
from lmcache_nvme_backend.testing.gpu import (
    NAMESPACE,
    HostTier,
    chunk_meta,
    chunk_payload,
    in_pool,
    make_reader,
    object_bytes,
    release_all,
    write_chunks,
)

SIZE = 3 * 65536 + 2048  # not a multiple of 4 KiB
COMPAT = PathDecision(ReadPath.KVIKIO_COMPAT, "test")
BOUNCE = PathDecision(ReadPath.HOST_BOUNCE, "test")

needs_no_cuda = pytest.mark.skipif(torch.cuda.is_available(),
                                   reason="checks the CPU-only behaviour")


@pytest.fixture
def store(open_store: StoreFactory) -> ChunkStore:
    """A store on ``tmp_path / "cache"`` that records GPU checksums, closed at teardown."""
    s = open_store(max_size_gb=0.2)
    s.set_gpu_checksums(True)
    return s


ReaderFactory = Callable[..., GpuChunkReader]


@pytest.fixture
def reader(store: ChunkStore) -> Iterator[ReaderFactory]:
    made: list[GpuChunkReader] = []

    def factory(decision: PathDecision = COMPAT, pool_bytes: int = 8 * MIB,
                payload_reader: object = None, strict: bool = False,
                host: HostTier | None = None) -> GpuChunkReader:
        r = make_reader(store, decision, "cpu", pool_bytes, host or HostTier(16 * MIB),
                        payload_reader=payload_reader or PosixTensorPayloadReader(),  # type: ignore[arg-type]
                        strict=strict)
        made.append(r)
        return r

    yield factory
    for r in made:
        r.close()


def chunk_file(store: ChunkStore, key: str) -> Path:
    return store.layouts[0].chunk_path(namespace_id(NAMESPACE), key_digest(key))


def counters(store: ChunkStore, *names: str) -> list[float]:
    snap = store.stats_snapshot()
    return [snap[n] for n in names]


def test_writer_records_the_checksum_the_gpu_path_checks(store: ChunkStore) -> None:
    chunks = write_chunks(store, 2, SIZE)
    for key, payload in zip(chunks.keys, chunks.payloads, strict=True):
        header = decode_header(chunk_file(store, key).read_bytes()[:HEADER_SIZE])
        assert header.gpu_checksum == host_checksum(payload)
    assert store.counter("gpu_checksums_recorded") == 2


def test_kvikio_path_serves_verified_pool_objects(store: ChunkStore,
                                                  reader: ReaderFactory) -> None:
    chunks = write_chunks(store, 4, SIZE)
    r = reader()
    objs = r.read(chunks.keys, chunks.metas)
    assert [object_bytes(o) for o in objs if o] == chunks.payloads
    assert all(o is not None and in_pool(r.pool, o) for o in objs)
    assert counters(store, "path_kvikio_compat_chunks", "path_kvikio_compat_bytes",
                    "read_chunks", "path_posix_chunks", "gpu_checksum_failures") == \
        [4, 4 * SIZE, 4, 0, 0]
    assert store.stats_snapshot()["path_kvikio_compat_gbps"] > 0
    assert r.gauges()["gpu_pool_objects_lent"] == 4
    release_all(objs)
    assert r.gauges()["gpu_pool_objects_lent"] == 0


def test_host_bounce_reads_on_the_host_and_copies(store: ChunkStore,
                                                  reader: ReaderFactory) -> None:
    chunks = write_chunks(store, 3, SIZE)
    r = reader(BOUNCE)
    objs = r.read(chunks.keys, chunks.metas)
    assert [object_bytes(o) for o in objs if o] == chunks.payloads
    assert all(o is not None and in_pool(r.pool, o) for o in objs)
    # the host leg is a POSIX read (xxh3 verified); the chunk is served by host-bounce
    assert counters(store, "path_host_bounce_chunks", "path_host_bounce_bytes",
                    "path_posix_chunks", "path_kvikio_compat_chunks") == [3, 3 * SIZE, 3, 0]
    release_all(objs)


def test_corrupt_payload_is_a_counted_quarantined_miss(store: ChunkStore,
                                                       reader: ReaderFactory) -> None:
    chunks = write_chunks(store, 2, SIZE)
    path = chunk_file(store, chunks.keys[1])
    with open(path, "r+b") as f:  # one bit, deep inside the payload
        f.seek(HEADER_SIZE + SIZE // 2)
        byte = f.read(1)[0]
        f.seek(HEADER_SIZE + SIZE // 2)
        f.write(bytes([byte ^ 0x10]))
    objs = reader().read(chunks.keys, chunks.metas)
    assert objs[0] is not None and objs[1] is None
    assert counters(store, "gpu_checksum_failures", "checksum_failures", "quarantined_files",
                    "read_failures") == [1, 1, 1, 1]
    assert not path.exists() and not store.contains(chunks.keys[1])
    release_all(objs)


def test_file_without_gpu_checksum_is_verified_on_the_host(store: ChunkStore,
                                                           reader: ReaderFactory) -> None:
    store.set_gpu_checksums(False)  # written before the GPU path was on
    chunks = write_chunks(store, 2, SIZE)
    objs = reader().read(chunks.keys, chunks.metas)
    assert [object_bytes(o) for o in objs if o] == chunks.payloads
    assert counters(store, "gpu_unverified_fallbacks", "path_host_bounce_chunks",
                    "path_kvikio_compat_chunks") == [2, 2, 0]
    release_all(objs)


def test_pool_exhaustion_serves_host_objects(store: ChunkStore,
                                             reader: ReaderFactory) -> None:
    chunks = write_chunks(store, 3, SIZE)
    r = reader(pool_bytes=256 * 1024)  # room for one chunk
    objs = r.read(chunks.keys, chunks.metas)
    assert [object_bytes(o) for o in objs if o] == chunks.payloads
    assert [in_pool(r.pool, o) for o in objs if o] == [True, False, False]
    assert counters(store, "gpu_pool_fallbacks", "path_kvikio_compat_chunks",
                    "path_posix_chunks") == [2, 1, 2]
    release_all(objs)


def test_pool_exhaustion_in_host_bounce_serves_host_objects(store: ChunkStore,
                                                            reader: ReaderFactory) -> None:
    chunks = write_chunks(store, 2, SIZE)
    r = reader(BOUNCE, pool_bytes=256 * 1024)
    objs = r.read(chunks.keys, chunks.metas)
    assert [object_bytes(o) for o in objs if o] == chunks.payloads
    assert [in_pool(r.pool, o) for o in objs if o] == [True, False]
    assert store.counter("gpu_pool_fallbacks") == 1
    release_all(objs)


def test_pool_takes_back_objects_only_the_host_tier_holds(store: ChunkStore,
                                                          reader: ReaderFactory) -> None:
    chunks = write_chunks(store, 3, SIZE)
    host = HostTier(16 * MIB)
    r = reader(pool_bytes=256 * 1024, host=host)
    first = r.read(chunks.keys[:1], chunks.metas[:1])[0]
    assert first is not None and in_pool(r.pool, first)
    host.keep(chunks.keys[0], first)  # LMCache's storage manager does this...
    first.ref_count_down()  # ...and its retrieve is done with the object
    second = r.read(chunks.keys[1:2], chunks.metas[1:2])[0]
    assert second is not None and in_pool(r.pool, second)  # the pool reclaimed the slot
    assert chunks.keys[0] not in host.hot_cache
    assert store.counter("gpu_pool_fallbacks") == 0
    # an object still in use (or pinned) is never taken back
    host.keep(chunks.keys[1], second)
    third = r.read(chunks.keys[2:3], chunks.metas[2:3])[0]
    assert third is not None and not in_pool(r.pool, third)
    assert chunks.keys[1] in host.hot_cache and object_bytes(second) == chunks.payloads[1]
    assert store.counter("gpu_pool_fallbacks") == 1
    release_all([second, third])
    host.remove(chunks.keys[1])


class FailingReader:
    name = "failing"

    def read(self, reads: Sequence[PayloadRead]) -> None:
        for r in reads:
            r.error = RuntimeError("cuFileBufRegister failed")


def test_kvikio_failure_falls_back_in_auto(store: ChunkStore, reader: ReaderFactory) -> None:
    chunks = write_chunks(store, 2, SIZE)
    objs = reader(payload_reader=FailingReader()).read(chunks.keys, chunks.metas)
    assert [object_bytes(o) for o in objs if o] == chunks.payloads
    assert counters(store, "gpu_read_errors", "path_host_bounce_chunks",
                    "quarantined_files") == [2, 2, 0]
    release_all(objs)


def test_kvikio_failure_is_a_loud_miss_in_strict_mode(store: ChunkStore,
                                                      reader: ReaderFactory) -> None:
    chunks = write_chunks(store, 2, SIZE)
    objs = reader(payload_reader=FailingReader(), strict=True).read(chunks.keys, chunks.metas)
    assert objs == [None, None]
    assert counters(store, "gpu_read_errors", "path_host_bounce_chunks",
                    "quarantined_files") == [2, 0, 0]
    assert all(chunk_file(store, k).exists() for k in chunks.keys)  # not the file's fault
    assert store.contains(chunks.keys[0])


def test_vanished_and_truncated_files_are_misses(store: ChunkStore,
                                                 reader: ReaderFactory) -> None:
    chunks = write_chunks(store, 3, SIZE)
    chunk_file(store, chunks.keys[0]).unlink()
    os.truncate(chunk_file(store, chunks.keys[1]), HEADER_SIZE + 4096)
    objs = reader().read(chunks.keys, chunks.metas)
    assert objs[0] is None and objs[1] is None and objs[2] is not None
    assert not store.contains(chunks.keys[0]) and not store.contains(chunks.keys[1])
    assert store.counter("quarantined_files") == 1  # the truncated one
    release_all(objs)


def test_unknown_keys_are_misses(store: ChunkStore, reader: ReaderFactory) -> None:
    chunks = write_chunks(store, 1, SIZE)
    objs = reader().read(["nope", chunks.keys[0]], [chunk_meta(SIZE), chunks.metas[0]])
    assert objs[0] is None and objs[1] is not None
    release_all(objs)


# -- the backend on a CUDA dst_device, on this CPU-only machine --------------------


def engine_config(tmp_path: Path, **extra: object) -> LMCacheEngineConfig:
    return LMCacheEngineConfig.from_dict({
        "chunk_size": 256, "local_cpu": True, "max_local_cpu_size": 0.1,
        "storage_plugins": ["nvme"],
        "extra_config": {"storage_plugin.nvme.module_path": "lmcache_nvme_backend",
                         "storage_plugin.nvme.class_name": "NVMeBackend",
                         "nvme.path": str(tmp_path / "c"), "nvme.max_size_gb": 0.2,
                         "nvme.min_free_gb": 0, "nvme.manifest_interval_s": 0,
                         **{f"nvme.{k}": v for k, v in extra.items()}}})


def lmcache_key(i: int) -> CacheEngineKey:
    return CacheEngineKey("gpu-test-model", 1, 0, 1000 + i, torch.bfloat16)


def tier_threads() -> set[str]:
    """The tier's threads in this process: Python ones by name (``nvme-writer-*``,
    ``nvme-io-done``), the native engine's by their kernel names (``nvme-native-*``)."""
    python = {f"{t.name}:{t.native_id}" for t in threading.enumerate()
              if t.name.startswith(("nvme-writer", "nvme-io-done"))}
    native = {f"{task.name}" for task in Path("/proc/self/task").iterdir()
              if (task / "comm").read_text().startswith("nvme-native")}
    return python | native


@needs_no_cuda
def test_strict_mode_refuses_to_start_without_a_gpu(tmp_path: Path) -> None:
    before = tier_threads()
    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("lmcache_nvme_backend").addHandler(handler)
    try:
        with pytest.raises(NVMeConfigError, match=r"nvme.gds_mode: 'on' \(strict\) but no "
                                                  r"usable CUDA GPU"):
            NVMeBackend(dst_device="cuda:0", config=engine_config(tmp_path, gds_mode="on"),
                        local_cpu_backend=HostTier(MIB))  # type: ignore[arg-type]
    finally:
        logging.getLogger("lmcache_nvme_backend").removeHandler(handler)
    assert any(m.startswith("NVMe tier NOT loaded: nvme.gds_mode: 'on' (strict)") for m in seen)
    # the store it had opened is closed again: no threads of it left behind
    assert tier_threads() <= before


def test_strict_mode_refuses_a_cpu_worker(tmp_path: Path) -> None:
    with pytest.raises(NVMeConfigError, match="there is no GPU to read into"):
        NVMeBackend(dst_device="cpu", config=engine_config(tmp_path, gds_mode="on"),
                    local_cpu_backend=HostTier(MIB))  # type: ignore[arg-type]


@needs_no_cuda
def test_cuda_worker_without_a_gpu_uses_host_bounce_end_to_end(tmp_path: Path) -> None:
    host = HostTier(32 * MIB)
    backend = NVMeBackend(dst_device="cuda:0", config=engine_config(tmp_path, gpu_pool_mb=8),
                          local_cpu_backend=host, loop=asyncio.new_event_loop())  # type: ignore[arg-type]
    try:
        assert backend.read_path == ReadPath.HOST_BOUNCE
        assert backend.store.gpu_checksums is False  # the host path verifies with xxh3
        keys = [lmcache_key(i) for i in range(3)]
        objs = []
        for i, _ in enumerate(keys):
            obj = host.allocate(torch.Size([SIZE // 2]), torch.bfloat16)
            assert obj is not None
            obj.tensor.view(torch.uint8).copy_(  # type: ignore[union-attr]
                torch.frombuffer(bytearray(chunk_payload(str(i), SIZE)), dtype=torch.uint8))
            objs.append(obj)
        backend.batched_submit_put_task(keys, objs)
        release_all(objs)
        assert backend.store.flush(30)
        got = backend.batched_get_blocking(keys)
        assert [object_bytes(o) for o in got if o] == [chunk_payload(str(i), SIZE)
                                                        for i in range(3)]
        assert backend._gpu is not None
        assert all(o is not None and in_pool(backend._gpu.pool, o) for o in got)
        stats = backend.stats()
        assert stats["path_host_bounce_chunks"] == 3
        assert stats["gpu_pool_bytes"] == 8 * MIB
        release_all(got)
    finally:
        backend.close()


def test_cpu_worker_keeps_host_objects(tmp_path: Path) -> None:
    backend = NVMeBackend(dst_device="cpu", config=engine_config(tmp_path),
                          local_cpu_backend=HostTier(MIB))  # type: ignore[arg-type]
    try:
        assert backend.read_path == "posix" and backend._gpu is None
        assert "gpu_pool_bytes" not in backend.stats()
    finally:
        backend.close()


def test_write_payload_of_a_memory_object_on_cpu() -> None:
    host = HostTier(MIB)
    obj = host.allocate(torch.Size([1000]), torch.bfloat16)
    assert obj is not None and not is_device_object(obj)
    obj.tensor.view(torch.uint8).copy_(  # type: ignore[union-attr]
        torch.arange(2000, dtype=torch.int32).to(torch.uint8))
    assert bytes(device_payload(obj)) == bytes(obj.byte_array)
    obj.ref_count_down()


@needs_no_cuda
def test_real_kvikio_reader_failing_without_cuda_falls_back(store: ChunkStore,
                                                            reader: ReaderFactory) -> None:
    """kvikio imports here but cannot read (no libcuda): errors, not exceptions, then the
    host path serves the chunks."""
    defaults = pytest.importorskip("kvikio.defaults")

    from lmcache_nvme_backend.io.kvikio import KvikioPayloadReader

    payloads = KvikioPayloadReader(threads=3, task_size=MIB, strict=False)
    assert defaults.get("num_threads") == 3
    assert defaults.get("task_size") == MIB
    chunks = write_chunks(store, 2, SIZE)
    objs = reader(payload_reader=payloads).read(chunks.keys, chunks.metas)
    assert [object_bytes(o) for o in objs if o] == chunks.payloads
    assert counters(store, "gpu_read_errors", "path_host_bounce_chunks") == [2, 2]
    release_all(objs)
