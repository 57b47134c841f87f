"""The GPU read path on a CUDA GPU: kvikio into the pool, host bounce, strict mode,
GPU-side verification, the fallbacks (kvikio missing, cuFile refusing), the backend end to
end, and writes from GPU memory."""

from __future__ import annotations

import asyncio
import os
import random
import sys
from pathlib import Path

import pytest
import torch
from support.stores import StoreFactory

from lmcache_nvme_backend.config import MIB, NVMeConfigError, NVMeSettings
from lmcache_nvme_backend.disk.format import HEADER_SIZE
from lmcache_nvme_backend.disk.gpusum import (
    DeviceWeights,
    device_checksum,
    host_checksum,
    to_unsigned,
)
from lmcache_nvme_backend.gpu.pool import GpuBufferPool
from lmcache_nvme_backend.gpu.reader import GpuChunkReader, build_gpu_reader
from lmcache_nvme_backend.gpu.select import KVIKIO_PATHS, GpuProbe, PathDecision, select_read_path
from lmcache_nvme_backend.io.kvikio import KvikioPayloadReader
from lmcache_nvme_backend.store import ReadPath
from lmcache_nvme_backend.store.chunk_store import ChunkStore
from lmcache_nvme_backend.testing.gpu import (
    Chunks,
    HostTier,
    chunk_meta,
    in_pool,
    make_reader,
    object_bytes,
    release_all,
    write_chunks,
)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA GPU (see docs/gpu.md)")

DEVICE = "cuda:0"
SIZE = 4 * MIB + 6144  # several kvikio tasks, not a multiple of 4 KiB


@pytest.fixture(scope="module")
def probe() -> GpuProbe:
    found = GpuProbe.detect()
    print(f"\nGPU probe: {found}")
    return found


@pytest.fixture
def store(cache_dir: Path, open_store: StoreFactory) -> ChunkStore:
    """A store on ``cache_dir`` that records GPU checksums, closed at teardown."""
    s = open_store(cache_dir)
    s.set_gpu_checksums(True)
    return s


def kvikio_decision(probe: GpuProbe) -> PathDecision:
    pytest.importorskip("kvikio")
    decision = select_read_path("auto", DEVICE, 64 * MIB, probe)
    assert decision.path in KVIKIO_PATHS, decision.reason
    return decision


def kvikio_reader(task_mb: float = 1.0) -> KvikioPayloadReader:
    return KvikioPayloadReader(threads=8, task_size=int(task_mb * MIB), strict=False)


@pytest.mark.parametrize("size", [1, 3, 4096, 16385, 3 * MIB + 7])
@pytest.mark.parametrize("offset", [0, 1, 4096])
def test_device_checksum_on_cuda_equals_host(size: int, offset: int) -> None:
    data = random.Random(size).randbytes(size)
    buf = torch.zeros(size + offset + 64, dtype=torch.uint8, device=DEVICE)
    buf[offset : offset + size] = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(DEVICE)
    sums = device_checksum(buf[offset:], size, DeviceWeights(DEVICE)).tolist()
    assert tuple(to_unsigned(v) for v in sums) == host_checksum(data)


def test_probe_and_auto_decision_agree(probe: GpuProbe) -> None:
    assert probe.cuda_devices >= 1
    decision = select_read_path("auto", DEVICE, 64 * MIB, probe)
    print(f"auto decision: {decision}")
    assert decision.refusal is None
    if probe.kvikio_version is not None:
        assert decision.path in KVIKIO_PATHS


def test_kvikio_reads_straight_into_the_cuda_pool(store: ChunkStore, probe: GpuProbe) -> None:
    decision = kvikio_decision(probe)
    chunks = write_chunks(store, 6, SIZE)
    reader = make_reader(store, decision, DEVICE, 64 * MIB, HostTier(64 * MIB),
                         payload_reader=kvikio_reader(),
                         register=decision.path == ReadPath.KVIKIO_GDS)
    try:
        objs = reader.read(chunks.keys, chunks.metas)
        assert all(o is not None and o.tensor is not None and o.tensor.is_cuda for o in objs)
        assert all(o is not None and in_pool(reader.pool, o) for o in objs)
        assert [object_bytes(o) for o in objs if o] == chunks.payloads
        snap = store.stats_snapshot()
        prefix = decision.path.replace("-", "_")
        assert snap[f"path_{prefix}_chunks"] == 6
        assert snap[f"path_{prefix}_bytes"] == 6 * SIZE
        assert snap["path_posix_chunks"] == 0  # no host leg
        assert snap["gpu_checksum_failures"] == snap["gpu_unverified_fallbacks"] == 0
        print(f"{decision.path}: {snap[f'path_{prefix}_gbps']:.2f} GB/s (small, warm)")
        release_all(objs)
    finally:
        reader.close()


def test_gpu_checksum_catches_a_flipped_bit(store: ChunkStore, probe: GpuProbe) -> None:
    from lmcache_nvme_backend.disk.layout import key_digest, namespace_id

    decision = kvikio_decision(probe)
    chunks = write_chunks(store, 2, SIZE)
    path = store.layouts[0].chunk_path(namespace_id("gpu-harness-model"),
                                            key_digest(chunks.keys[0]))
    fd = os.open(path, os.O_RDWR)
    try:
        pos = HEADER_SIZE + SIZE - 5
        byte = os.pread(fd, 1, pos)[0]
        os.pwrite(fd, bytes([byte ^ 0x01]), pos)
    finally:
        os.close(fd)
    if hasattr(os, "posix_fadvise"):  # make kvikio see the new byte, not a stale page
        fd = os.open(path, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
    reader = make_reader(store, decision, DEVICE, 64 * MIB, HostTier(64 * MIB),
                         payload_reader=kvikio_reader())
    try:
        objs = reader.read(chunks.keys, chunks.metas)
        assert objs[0] is None and objs[1] is not None
        assert store.counter("gpu_checksum_failures") == 1
        assert store.counter("quarantined_files") == 1
        release_all(objs)
    finally:
        reader.close()


def assert_read_through_the_host(store: ChunkStore, reader: GpuChunkReader, count: int) -> None:
    """``count`` new chunks read by ``reader``: CUDA objects, exact bytes, all of them through
    the host path."""
    chunks = write_chunks(store, count, SIZE)
    objs = reader.read(chunks.keys, chunks.metas)
    assert all(o is not None and o.tensor is not None and o.tensor.is_cuda for o in objs)
    assert [object_bytes(o) for o in objs if o] == chunks.payloads
    assert store.counter("path_host_bounce_chunks") == count
    release_all(objs)


def test_host_bounce_into_cuda(store: ChunkStore) -> None:
    reader = make_reader(store, PathDecision(ReadPath.HOST_BOUNCE, "test"), DEVICE, 64 * MIB,
                         HostTier(64 * MIB))
    try:
        assert_read_through_the_host(store, reader, 4)
    finally:
        reader.close()


def test_strict_mode_starts_only_with_gds(store: ChunkStore, probe: GpuProbe) -> None:
    from lmcache_nvme_backend.adapters.memory_objects import host_memory

    pytest.importorskip("kvikio")
    strict = NVMeSettings.from_params({"path": str(store.settings.paths[0]), "max_size_gb": 1,
                                       "gds_mode": "on", "gpu_pool_mb": 64})
    host = HostTier(MIB)
    expected = select_read_path("on", DEVICE, strict.gpu_pool_bytes, probe)
    if expected.refusal:
        with pytest.raises(NVMeConfigError, match=r"^nvme\.gds_mode: 'on' \(strict\) but"):
            build_gpu_reader(store, strict, DEVICE, probe=probe,
                             host=host_memory(host))  # type: ignore[arg-type]
        print(f"strict mode refused, as it should here: {expected.refusal}")
    else:
        decision, reader = build_gpu_reader(store, strict, DEVICE, probe=probe,
                                            host=host_memory(host))  # type: ignore[arg-type]
        assert decision.path == ReadPath.KVIKIO_GDS and reader is not None
        reader.close()


def test_without_kvikio_auto_reads_into_cuda_through_the_host(
        store: ChunkStore, monkeypatch: pytest.MonkeyPatch) -> None:
    from lmcache_nvme_backend.adapters.memory_objects import host_memory

    for name in [m for m in sys.modules if m == "kvikio" or m.startswith("kvikio.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "kvikio", None)  # `import kvikio` raises ImportError
    missing = GpuProbe.detect()
    assert missing.cuda_devices >= 1 and missing.kvikio_version is None, missing
    assert missing.kvikio_error
    refused = select_read_path("on", DEVICE, 64 * MIB, missing).refusal
    assert refused is not None and "kvikio" in refused
    auto = NVMeSettings.from_params({"path": str(store.settings.paths[0]), "max_size_gb": 1,
                                     "gpu_pool_mb": 64, "gds_mode": "auto"})
    decision, reader = build_gpu_reader(store, auto, DEVICE, probe=missing,
                                        host=host_memory(HostTier(64 * MIB)))
    assert decision.path == ReadPath.HOST_BOUNCE and reader is not None, decision
    print(f"without kvikio: {decision.reason}")
    try:
        assert_read_through_the_host(store, reader, 3)
    finally:
        reader.close()


def test_a_cufile_refusal_is_served_through_the_host(store: ChunkStore, probe: GpuProbe) -> None:
    """kvikio with compat mode off: cuFile serves the file or refuses it; a refused chunk is
    read through the host (``gpu_read_errors``), never lost or served wrong."""
    import kvikio.defaults

    decision = kvikio_decision(probe)
    chunks = write_chunks(store, 3, SIZE)
    before = kvikio.defaults.get("compat_mode")
    try:
        assert_served_with_compat_mode_off(store, decision, chunks)
    finally:
        kvikio.defaults.set({"compat_mode": before})  # the strict reader switched it off


def assert_served_with_compat_mode_off(store: ChunkStore, decision: PathDecision,
                                       chunks: Chunks) -> None:
    """Every chunk served with exact bytes, all by kvikio or all through the host."""
    reader = make_reader(store, decision, DEVICE, 64 * MIB, HostTier(64 * MIB),
                         payload_reader=KvikioPayloadReader(threads=8, task_size=MIB,
                                                            strict=True))
    try:
        objs = reader.read(chunks.keys, chunks.metas)
        assert all(o is not None and o.tensor is not None and o.tensor.is_cuda for o in objs)
        assert all(o is not None and in_pool(reader.pool, o) for o in objs)
        assert [object_bytes(o) for o in objs if o] == chunks.payloads
        refused = store.counter("gpu_read_errors")
        prefix = decision.path.replace("-", "_")
        served = {"kvikio": store.counter(f"path_{prefix}_chunks"),
                  "host": store.counter("path_host_bounce_chunks")}
        print(f"compat mode off: cuFile refused {refused} of 3 chunks; served {served}")
        assert refused in (0, 3) and served == ({"kvikio": 3, "host": 0} if refused == 0
                                                else {"kvikio": 0, "host": 3})
        release_all(objs)
    finally:
        reader.close()


def test_pool_registration_failure_is_not_fatal() -> None:
    from lmcache_nvme_backend.adapters.memory_objects import fit_to_payload

    pytest.importorskip("kvikio")
    pool = GpuBufferPool(16 * MIB, DEVICE, fit=fit_to_payload, register=True)
    print(f"cuFile registration of the pool: {pool.registered}")
    pool.close()


def test_backend_on_cuda_end_to_end_and_writes_from_gpu_memory(cache_dir: Path) -> None:
    from lmcache.utils import CacheEngineKey
    from lmcache.v1.config import LMCacheEngineConfig

    from lmcache_nvme_backend.adapters.backend import NVMeBackend

    config = LMCacheEngineConfig.from_dict({
        "chunk_size": 256, "local_cpu": True, "max_local_cpu_size": 0.1,
        "storage_plugins": ["nvme"],
        "extra_config": {"storage_plugin.nvme.module_path": "lmcache_nvme_backend",
                         "storage_plugin.nvme.class_name": "NVMeBackend",
                         "nvme.path": str(cache_dir), "nvme.max_size_gb": 1,
                         "nvme.min_free_gb": 0, "nvme.gpu_pool_mb": 64}})
    host = HostTier(64 * MIB)
    backend = NVMeBackend(dst_device=DEVICE, config=config, local_cpu_backend=host,  # type: ignore[arg-type]
                          loop=asyncio.new_event_loop())
    try:
        print(f"backend read path: {backend.read_path}")
        keys = [CacheEngineKey("gpu-e2e", 1, 0, 500 + i, torch.bfloat16) for i in range(4)]
        payloads = [random.Random(i).randbytes(SIZE) for i in range(4)]
        objs = []
        for payload in payloads[:2]:  # host memory objects, as LMCache hands them
            obj = host.allocate(torch.Size([SIZE // 2]), torch.bfloat16)
            assert obj is not None and obj.tensor is not None
            obj.tensor.view(torch.uint8).copy_(torch.frombuffer(bytearray(payload),
                                                                dtype=torch.uint8))
            objs.append(obj)
        assert backend._gpu is not None
        for payload in payloads[2:]:  # GPU memory objects
            obj = backend._gpu.pool.allocate(chunk_meta(SIZE))
            assert obj is not None and obj.tensor is not None and obj.tensor.is_cuda
            obj.tensor.view(torch.uint8).copy_(torch.frombuffer(bytearray(payload),
                                                                dtype=torch.uint8).to(DEVICE))
            objs.append(obj)
        backend.batched_submit_put_task(keys, objs)
        release_all(objs)
        assert backend.store.flush(60)
        got = backend.batched_get_blocking(keys)
        assert [object_bytes(o) for o in got if o] == payloads
        assert all(o is not None and in_pool(backend._gpu.pool, o) for o in got)
        stats = backend.stats()
        assert stats["device_write_copies"] == 2
        prefix = backend.read_path.replace("-", "_")
        assert stats[f"path_{prefix}_chunks"] == 4
        release_all(got)
    finally:
        backend.close()
