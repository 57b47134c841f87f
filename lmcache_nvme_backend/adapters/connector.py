"""``NVMeConnector``: the chunk store as the in-process engine's "remote" tier.

LMCache's ``remote_storage_plugins`` hook wraps it in a ``RemoteBackend``::

    remote_storage_plugins: ["nvme"]
    extra_config:
      remote_storage_plugin.nvme.module_path: lmcache_nvme_backend
      remote_storage_plugin.nvme.class_name: NVMeConnector
      nvme.path: /shared/lmcache
      nvme.max_size_gb: 500
      nvme.shared: true

The remote tier suits storage several engines share: with ``nvme.shared: true`` a chunk
another process published is found and one it evicted is a miss (``ChunkStore.lookup``).
Keys and namespaces are ``NVMeBackend``'s, so both hooks read each other's files.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, List  # noqa: UP035 (a method is named list)

from ..config import NVMeSettings
from ._common import (
    EngineKeyNames,
    RestartMissWatch,
    announce,
    check_token_hashing,
    open_store,
)
from .lmcache_range import lmcache_imports
from .memory_objects import read_into_host_objects, served_prefix, submit_objects

with lmcache_imports():
    from lmcache.utils import CacheEngineKey
    from lmcache.v1.memory_management import MemoryObj
    from lmcache.v1.storage_backend.connector.base_connector import RemoteConnector

if TYPE_CHECKING:
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend

TIER = "NVMe remote connector"


class NVMeConnector(RemoteConnector):
    """LMCache remote connector on the NVMe chunk store (optionally shared between processes)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, local_cpu_backend: LocalCPUBackend,
                 config: LMCacheEngineConfig | None = None, **_: Any) -> None:
        super().__init__(local_cpu_backend.config, local_cpu_backend.metadata)
        self.store = open_store(TIER, lambda: NVMeSettings.from_extra_config(
            config.extra_config if config else None))
        self._naming = EngineKeyNames(self.store)
        self.settings = self.store.settings
        self.loop = loop
        self.local_cpu_backend = local_cpu_backend
        self._executor = ThreadPoolExecutor(2, thread_name_prefix="nvme-remote")
        self._observer = announce("NVMeConnector", TIER, self.store, self.stats,
                                  ", shared mode" if self.settings.shared else "")
        self._restart_watch = RestartMissWatch(TIER, self.store,
                                               check_token_hashing(TIER, config))

    def __repr__(self) -> str:
        return f"<NVMeConnector {', '.join(str(p) for p in self.settings.paths)}>"

    # -- lookups -------------------------------------------------------------

    def exists_sync(self, key: CacheEngineKey) -> bool:
        hit = self.store.lookup(*self._naming(key))
        self._restart_watch()
        return hit

    async def exists(self, key: CacheEngineKey) -> bool:
        return self.exists_sync(key)

    def support_batched_contains(self) -> bool:
        return True

    def batched_contains(self, keys: list[CacheEngineKey]) -> int:
        """Number of leading keys that are stored (prefix hit)."""
        hits = self.store.lookup_prefix(self._naming.many(keys))
        self._restart_watch()
        return hits

    async def batched_async_contains(self, lookup_id: str, keys: list[CacheEngineKey],
                                     pin: bool = False) -> int:
        return self.batched_contains(keys)

    # -- writes --------------------------------------------------------------

    async def put(self, key: CacheEngineKey, memory_obj: MemoryObj) -> None:
        """Queue the chunk for write-back and return (never waits for the drive)."""
        submit_objects(self.store, self._naming, [key], [memory_obj])

    def support_batched_put(self) -> bool:
        return True

    async def batched_put(self, keys: list[CacheEngineKey],
                          memory_objs: list[MemoryObj]) -> None:
        submit_objects(self.store, self._naming, keys, memory_objs)

    # -- reads ---------------------------------------------------------------

    def get_blocking(self, keys: list[CacheEngineKey]) -> list[MemoryObj | None]:
        """Read chunks into new host memory objects; None for each chunk not served."""
        key_strs = [k.to_string() for k in keys]
        metas = [self.store.tensor_meta(key_str) if self.exists_sync(key) else None
                 for key, key_str in zip(keys, key_strs, strict=True)]
        return read_into_host_objects(self.store, self.local_cpu_backend, key_strs, metas)

    async def get(self, key: CacheEngineKey) -> MemoryObj | None:
        return (await self.batched_get([key]))[0]

    def support_batched_get(self) -> bool:
        return True

    async def batched_get(self, keys: list[CacheEngineKey]) -> list[MemoryObj | None]:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, self.get_blocking, list(keys))

    async def batched_get_non_blocking(self, lookup_id: str,
                                       keys: list[CacheEngineKey]) -> list[MemoryObj]:
        """The served prefix; objects after the first miss are released."""
        return served_prefix(await self.batched_get(keys))

    # -- management ------------------------------------------------------------

    def remove_sync(self, key: CacheEngineKey) -> bool:
        return self.store.remove(key.to_string())

    async def list(self) -> List[str]:  # noqa: UP006 (the method shadows list)
        """Keys of every chunk file (reads each file's header: slow on a large cache)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, self._list_keys)

    def _list_keys(self) -> List[str]:  # noqa: UP006
        return list(self.store.iter_keys())

    def support_ping(self) -> bool:
        return True

    async def ping(self) -> int:
        """0 while at least one cache directory is in service."""
        return 0 if self.store.healthy() else 1

    def stats(self) -> dict[str, float]:
        return self.store.stats_snapshot()

    async def close(self) -> None:
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, self._close_blocking)

    def _close_blocking(self) -> None:
        self._observer.close()
        self._executor.shutdown(wait=True)
        self.store.close()

