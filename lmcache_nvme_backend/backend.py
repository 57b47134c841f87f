"""``NVMeBackend``: the chunk store behind LMCache's ``storage_plugins`` hook.

This module only translates: LMCache keys become key strings and namespaces,
memory objects become host buffers plus tensor metadata, and the store's
results become what LMCache's storage manager expects.  Storage decisions live
in ``store.py``.

Configuration (LMCache YAML)::

    storage_plugins: ["nvme"]
    extra_config:
      storage_plugin.nvme.module_path: lmcache_nvme_backend
      storage_plugin.nvme.class_name: NVMeBackend
      nvme.path: /mnt/nvme0/lmcache
      nvme.max_size_gb: 500
"""

from __future__ import annotations

import asyncio
import ctypes
import functools
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import torch
from lmcache.logging import init_logger
from lmcache.utils import CacheEngineKey
from lmcache.v1.memory_management import MemoryFormat, MemoryObj
from lmcache.v1.storage_backend.abstract_backend import StoragePluginInterface

from .config import NVMeConfigError, NVMeSettings
from .format import TensorMeta
from .store import ChunkRead, ChunkStore, ChunkWrite

if TYPE_CHECKING:
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.metadata import LMCacheMetadata
    from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend

# The package logger carries LMCache's formatting; every module logs through it.
logger = init_logger("lmcache_nvme_backend")


class NVMeBackend(StoragePluginInterface):
    """LMCache storage plugin persisting KV chunks as aligned files on NVMe drives."""

    def __init__(
        self,
        dst_device: str = "cpu",
        config: LMCacheEngineConfig | None = None,
        metadata: LMCacheMetadata | None = None,
        local_cpu_backend: LocalCPUBackend | None = None,
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        super().__init__(dst_device=dst_device, config=config, metadata=metadata,
                         local_cpu_backend=local_cpu_backend, loop=loop)
        try:
            if local_cpu_backend is None:
                raise NVMeConfigError(
                    "local_cpu: the NVMe tier stages chunks in LMCache's host memory tier; "
                    "set local_cpu: true and max_local_cpu_size > 0 in the LMCache config.")
            settings = NVMeSettings.from_extra_config(config.extra_config if config else None)
            self.store = ChunkStore(settings)
        except NVMeConfigError as exc:
            # LMCache's plugin launcher only logs constructor errors; say plainly what happened.
            logger.error("NVMe tier NOT loaded: %s LMCache keeps running without the NVMe "
                         "tier until this is fixed.", exc)
            raise
        self.local_cpu_backend: LocalCPUBackend = local_cpu_backend
        self._executor = ThreadPoolExecutor(max_workers=2, thread_name_prefix="nvme-get")
        logger.info("NVMe tier ready: %s, budget %.1f GiB, direct I/O on %d of %d path(s).",
                    ", ".join(str(p) for p in settings.paths), settings.max_size_gb,
                    sum(r.direct for r in self.store.roots), len(self.store.roots))

    def __str__(self) -> str:
        return "NVMeBackend"

    # -- lookups -------------------------------------------------------------

    def contains(self, key: CacheEngineKey, pin: bool = False) -> bool:
        return self.store.contains(key.to_string(), pin=pin)

    def batched_contains(self, keys: list[CacheEngineKey], pin: bool = False) -> int:
        hits = 0
        for key in keys:
            if not self.store.contains(key.to_string(), pin=pin):
                break
            hits += 1
        return hits

    async def batched_async_contains(self, lookup_id: str, keys: list[CacheEngineKey],
                                     pin: bool = False) -> int:
        return self.batched_contains(keys, pin=pin)

    def exists_in_put_tasks(self, key: CacheEngineKey) -> bool:
        return self.store.is_pending(key.to_string())

    def pin(self, key: CacheEngineKey) -> bool:
        return self.store.pin(key.to_string())

    def unpin(self, key: CacheEngineKey) -> bool:
        return self.store.unpin(key.to_string())

    def remove(self, key: CacheEngineKey, force: bool = True) -> bool:
        return self.store.remove(key.to_string())

    def touch_cache(self) -> None:
        """Recency is updated on every lookup and read; nothing is deferred."""

    # -- writes --------------------------------------------------------------

    def batched_submit_put_task(
        self,
        keys: Sequence[CacheEngineKey],
        objs: list[MemoryObj],
        transfer_spec: Any = None,
        on_complete_callback: Callable[[CacheEngineKey], None] | None = None,
    ) -> None:
        """Queue the chunks for write-back; never waits for the drive."""
        self.store.submit_many([self._chunk_write(key, obj, on_complete_callback)
                                for key, obj in zip(keys, objs, strict=True)])

    async def async_batched_submit_put_task(
        self,
        keys: Sequence[CacheEngineKey],
        objs: list[MemoryObj],
        transfer_spec: Any = None,
        on_complete_callback: Callable[[CacheEngineKey], None] | None = None,
    ) -> None:
        self.batched_submit_put_task(keys, objs, transfer_spec, on_complete_callback)

    def submit_put_task(self, key: CacheEngineKey, obj: MemoryObj) -> None:
        self.store.submit_many([self._chunk_write(key, obj, None)])

    @staticmethod
    def _chunk_write(key: CacheEngineKey, obj: MemoryObj,
                     on_complete: Callable[[CacheEngineKey], None] | None) -> ChunkWrite:
        """Reference the object (the store releases it) and describe it as a chunk write."""
        obj.ref_count_up()
        return ChunkWrite(
            key.to_string(), key.model_name, tensor_meta_of(obj), obj.byte_array,
            release=obj.ref_count_down,
            on_persisted=None if on_complete is None else (lambda: _call_safely(on_complete, key)),
        )

    # -- reads ---------------------------------------------------------------

    def get_blocking(self, key: CacheEngineKey) -> MemoryObj | None:
        return self.batched_get_blocking([key])[0]

    def batched_get_blocking(self, keys: list[CacheEngineKey]) -> list[MemoryObj | None]:
        """Read the chunks into host memory objects; None for each chunk not served."""
        key_strs = [k.to_string() for k in keys]
        objs: list[MemoryObj | None] = []
        for key_str in key_strs:
            meta = self.store.tensor_meta(key_str)
            objs.append(None if meta is None else self._allocate(meta))
        reads = [ChunkRead(k, host_view(o)) for k, o in zip(key_strs, objs, strict=True) if o]
        served = iter(self.store.read_into(reads))
        results: list[MemoryObj | None] = []
        for obj in objs:
            if obj is not None and not next(served):
                obj.ref_count_down()
                obj = None
            results.append(obj)
        return results

    def get_non_blocking(self, key: CacheEngineKey,
                         location: str | None = None) -> Future[MemoryObj | None] | None:
        return self._executor.submit(self.get_blocking, key)

    async def batched_get_non_blocking(self, lookup_id: str, keys: list[CacheEngineKey],
                                       transfer_spec: Any = None) -> list[MemoryObj]:
        """Prefetch path: read off the event loop, return the served prefix, release pins."""
        loop = asyncio.get_running_loop()
        try:
            objs = await loop.run_in_executor(self._executor, self.batched_get_blocking, keys)
        finally:
            for key in keys:
                self.store.unpin(key.to_string())
        prefix: list[MemoryObj] = []
        for obj in objs:
            if obj is None:
                break
            prefix.append(obj)
        for obj in objs[len(prefix) :]:
            if obj is not None:
                obj.ref_count_down()
        return prefix

    def _allocate(self, meta: TensorMeta) -> MemoryObj | None:
        shapes = [torch.Size(s) for s in meta.shapes]
        dtypes = [getattr(torch, d) for d in meta.dtypes]
        fmt = MemoryFormat(meta.fmt)
        if len(shapes) == 1:
            obj = self.local_cpu_backend.allocate(shapes[0], dtypes[0], fmt)
        else:
            obj = self.local_cpu_backend.allocate(shapes, dtypes, fmt)
        if obj is None:
            logger.warning("NVMe tier: host memory for a %d-byte chunk is exhausted; serving a "
                           "miss.", meta.nbytes)
            return None
        if obj.get_size() != meta.nbytes:
            if obj.get_size() < meta.nbytes:
                obj.ref_count_down()
                return None
            obj.set_used_size(meta.nbytes)
        return obj

    # -- plumbing --------------------------------------------------------------

    def get_allocator_backend(self) -> LocalCPUBackend:
        return self.local_cpu_backend

    def stats(self) -> dict[str, float]:
        """Counters and usage of the tier (see docs/configuration.md for each name)."""
        return self.store.stats_snapshot()

    def close(self) -> None:
        self._executor.shutdown(wait=True)
        self.store.close()


def tensor_meta_of(obj: MemoryObj) -> TensorMeta:
    """The allocation metadata recorded in a chunk header."""
    meta = obj.metadata
    shapes = meta.shapes if meta.shapes else [meta.shape]
    dtypes = meta.dtypes if meta.dtypes else [meta.dtype]
    return TensorMeta(
        shapes=tuple(tuple(int(d) for d in s) for s in shapes),
        dtypes=tuple(str(d).removeprefix("torch.") for d in dtypes),
        fmt=int(meta.fmt.value),
        nbytes=obj.get_size(),
    )


def host_view(obj: MemoryObj) -> memoryview:
    """Writable view of the object's whole physical allocation (padding included).

    Exposing the physical size lets an aligned allocation take an O_DIRECT read
    of the padded payload in place, with no staging copy.
    """
    size = max(obj.get_physical_size(), obj.get_size())
    return memoryview(_ubyte_array_type(size).from_address(obj.data_ptr)).cast("B")


@functools.lru_cache(maxsize=256)
def _ubyte_array_type(size: int) -> type[ctypes.Array[ctypes.c_ubyte]]:
    # ctypes builds a new heap type for every ``c_ubyte * n``; reuse them.
    return ctypes.c_ubyte * size


def _call_safely(callback: Callable[[CacheEngineKey], None], key: CacheEngineKey) -> None:
    try:
        callback(key)
    except Exception as exc:  # LMCache's contract: callback errors are logged, not raised
        logger.warning("NVMe tier: on_complete_callback failed for %s: %s", key, exc)
