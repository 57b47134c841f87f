"""Drive the GPU read path outside an engine, on any device (CPU included), for the tests and
``bench/bench_gpu.py``; ``HostTier`` stands in for LMCache's ``LocalCPUBackend``.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from lmcache.v1.memory_allocators.gpu_memory_allocator import GPUMemoryAllocator
from lmcache.v1.memory_management import MemoryFormat, MemoryObj

from ..adapters.memory_objects import host_memory
from ..disk.format import TensorMeta
from ..gpu.pool import GpuBufferPool
from ..gpu.reader import GpuChunkReader
from ..gpu.select import PathDecision
from ..io.kvikio import PayloadReader
from ..store.chunk_store import ChunkStore, SubmitResult

NAMESPACE = "gpu-harness-model"


class HostTier:
    """Host memory objects from LMCache's own allocator, plus a hot cache like L1's."""

    def __init__(self, size: int) -> None:
        self.allocator = GPUMemoryAllocator(size, device="cpu", align_bytes=4096)
        self.hot_cache: dict[Any, MemoryObj] = {}

    def allocate(self, shapes: Any, dtypes: Any, fmt: MemoryFormat = MemoryFormat.KV_2LTD,
                 *args: Any, **kwargs: Any) -> MemoryObj | None:
        return self.allocator.allocate(shapes, dtypes, fmt)

    def keep(self, key: Any, obj: MemoryObj) -> None:
        """What LMCache's storage manager does with a chunk a lower tier returned."""
        obj.ref_count_up()
        self.hot_cache[key] = obj

    def remove(self, key: Any, force: bool = True) -> bool:
        obj = self.hot_cache.pop(key, None)
        if obj is None:
            return False
        while force and obj.is_pinned:
            obj.unpin()
        obj.ref_count_down()
        return True


@dataclass
class Chunks:
    keys: list[str]
    metas: list[TensorMeta]
    payloads: list[bytes]


def chunk_meta(nbytes: int) -> TensorMeta:
    """A bf16 chunk of ``nbytes`` (even) as LMCache would describe it."""
    return TensorMeta(shapes=((nbytes // 2,),), dtypes=("bfloat16",),
                      fmt=int(MemoryFormat.KV_2LTD.value), nbytes=nbytes)


def chunk_payload(key: str, nbytes: int) -> bytes:
    return random.Random(key).randbytes(nbytes)


def write_chunks(store: ChunkStore, count: int, nbytes: int, prefix: str = "chunk",
                 timeout_s: float = 600.0) -> Chunks:
    """Store ``count`` chunks of ``nbytes`` and wait until they are on disk."""
    keys = [f"{prefix}-{i}" for i in range(count)]
    metas = [chunk_meta(nbytes) for _ in keys]
    payloads = [chunk_payload(key, nbytes) for key in keys]
    for key, meta, payload in zip(keys, metas, payloads, strict=True):
        result = store.submit(key, NAMESPACE, meta, memoryview(payload), release=lambda: None)
        if result is SubmitResult.QUEUE_FULL:  # let the writers catch up, then again
            store.flush(timeout_s)
            result = store.submit(key, NAMESPACE, meta, memoryview(payload), release=lambda: None)
        if result is not SubmitResult.QUEUED:
            raise RuntimeError(f"could not queue {key}: {result.value}")
    if not store.flush(timeout_s):
        raise TimeoutError("chunk files were not written in time")
    return Chunks(keys, metas, payloads)


def object_bytes(obj: MemoryObj) -> bytes:
    """The payload bytes of a memory object, wherever it lives."""
    assert obj.tensor is not None
    data = obj.tensor.contiguous().reshape(-1).view(torch.uint8)[: obj.get_size()]
    return bytes(data.cpu().numpy())


def in_pool(pool: GpuBufferPool, obj: MemoryObj) -> bool:
    start = pool.tensor.data_ptr()
    assert obj.tensor is not None
    return start <= obj.tensor.data_ptr() < start + pool.size


def make_reader(store: ChunkStore, decision: PathDecision, device: str, pool_bytes: int,
                host: HostTier, payload_reader: PayloadReader | None = None,
                strict: bool = False, register: bool = False) -> GpuChunkReader:
    glue = host_memory(host)  # HostTier stands in for LMCache's LocalCPUBackend
    pool = GpuBufferPool(pool_bytes, device, fit=glue.fit, register=register,
                         reclaim=glue.reclaim)
    return GpuChunkReader(store, decision, pool, glue, payload_reader=payload_reader,
                          strict=strict)


def release_all(objs: Sequence[MemoryObj | None]) -> None:
    for obj in objs:
        if obj is not None:
            obj.ref_count_down()
