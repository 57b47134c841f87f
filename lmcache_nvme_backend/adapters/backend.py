"""``NVMeBackend``: the chunk store behind LMCache's ``storage_plugins`` hook.

Translates only: LMCache keys become key strings and namespaces, memory objects host
buffers and tensor metadata.  Configuration (LMCache YAML)::

    storage_plugins: ["nvme"]
    extra_config:
      storage_plugin.nvme.module_path: lmcache_nvme_backend
      storage_plugin.nvme.class_name: NVMeBackend
      nvme.path: /mnt/nvme0/lmcache
      nvme.max_size_gb: 500
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from ..config import NVMeConfigError, NVMeSettings
from ..gpu.reader import GpuChunkReader, build_gpu_reader
from ..gpu.select import chunk_bytes_of
from ..store import ChunkStore, Counter, ReadPath
from ._common import (
    EngineKeyNames,
    RestartMissWatch,
    announce,
    check_token_hashing,
    loading,
)
from .lmcache_range import lmcache_imports
from .memory_objects import (
    host_memory,
    read_into_host_objects,
    served_prefix,
    submit_objects,
)

with lmcache_imports():
    from lmcache.utils import CacheEngineKey
    from lmcache.v1.memory_management import MemoryObj
    from lmcache.v1.storage_backend.abstract_backend import StoragePluginInterface

if TYPE_CHECKING:
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.metadata import LMCacheMetadata
    from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend

TIER = "NVMe tier"


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
        with loading(TIER, "LMCache keeps running without the NVMe tier until this is fixed."):
            if local_cpu_backend is None:
                raise NVMeConfigError(
                    "local_cpu: the NVMe tier stages chunks in LMCache's host memory tier; "
                    "set local_cpu: true and max_local_cpu_size > 0 in the LMCache config.")
            settings = NVMeSettings.from_extra_config(config.extra_config if config else None)
            self.store = ChunkStore(settings)
            self._naming = EngineKeyNames(self.store)
            self._gpu = self._build_gpu_path(settings, dst_device, metadata, local_cpu_backend)
        self.local_cpu_backend: LocalCPUBackend = local_cpu_backend
        self._executor = ThreadPoolExecutor(max_workers=2, thread_name_prefix="nvme-get")
        self._observer = announce("NVMeBackend", TIER, self.store, self.stats,
                                  f", read path {self.read_path}")
        self._restart_watch = RestartMissWatch(TIER, self.store,
                                               check_token_hashing(TIER, config))

    def __str__(self) -> str:
        return "NVMeBackend"

    def _build_gpu_path(self, settings: NVMeSettings, dst_device: str,
                        metadata: LMCacheMetadata | None,
                        local_cpu_backend: LocalCPUBackend) -> GpuChunkReader | None:
        """The GPU read path for a CUDA ``dst_device`` (docs/gpu.md); None: host objects."""
        self.read_path = ReadPath.POSIX
        try:
            decision, reader = build_gpu_reader(self.store, settings, dst_device,
                                                host=host_memory(local_cpu_backend),
                                                chunk_bytes=chunk_bytes_of(metadata))
        except BaseException:
            self.store.close()
            raise
        self.read_path = decision.path
        return reader

    # -- lookups -------------------------------------------------------------

    def contains(self, key: CacheEngineKey, pin: bool = False) -> bool:
        hit = self.store.lookup(*self._naming(key), pin=pin)
        self._restart_watch()
        return hit

    def batched_contains(self, keys: list[CacheEngineKey], pin: bool = False) -> int:
        hits = self.store.lookup_prefix(self._naming.many(keys), pin=pin)
        self._restart_watch()
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
        if copies := submit_objects(self.store, self._naming, keys, objs, on_complete_callback):
            self.store.count(Counter.DEVICE_WRITE_COPIES, copies)

    async def async_batched_submit_put_task(
        self,
        keys: Sequence[CacheEngineKey],
        objs: list[MemoryObj],
        transfer_spec: Any = None,
        on_complete_callback: Callable[[CacheEngineKey], None] | None = None,
    ) -> None:
        self.batched_submit_put_task(keys, objs, transfer_spec, on_complete_callback)

    def submit_put_task(self, key: CacheEngineKey, obj: MemoryObj) -> None:
        self.batched_submit_put_task([key], [obj])

    # -- reads ---------------------------------------------------------------

    def get_blocking(self, key: CacheEngineKey) -> MemoryObj | None:
        return self.batched_get_blocking([key])[0]

    def batched_get_blocking(self, keys: list[CacheEngineKey]) -> list[MemoryObj | None]:
        """Read the chunks into memory objects (GPU pool objects on a CUDA worker with a
        pool that has room, else host ones); None for each chunk not served."""
        key_strs = [k.to_string() for k in keys]
        metas = [self.store.tensor_meta(k) for k in key_strs]
        if self._gpu is not None:
            return self._gpu.read(key_strs, metas, keys)
        return read_into_host_objects(self.store, self.local_cpu_backend, key_strs, metas)

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
        return served_prefix(objs)

    # -- plumbing --------------------------------------------------------------

    def get_allocator_backend(self) -> LocalCPUBackend:
        return self.local_cpu_backend

    def stats(self) -> dict[str, float]:
        """Counters and usage of the tier (see docs/configuration.md for each name)."""
        snap = self.store.stats_snapshot()
        if self._gpu is not None:
            snap.update(self._gpu.gauges())
        return snap

    def close(self) -> None:
        self._observer.close()
        self._executor.shutdown(wait=True)
        if self._gpu is not None:
            self._gpu.close()
        self.store.close()
