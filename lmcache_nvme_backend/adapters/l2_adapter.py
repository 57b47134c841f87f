"""``NVMeL2Adapter``: the chunk store behind LMCache's multiprocess server (``lmcache server``).

Loaded as ``--l2-adapter '{"type": "plugin", "module_path": "lmcache_nvme_backend",
"class_name": "NVMeL2Adapter", "adapter_params": {"path": ..., "max_size_gb": 500}}'``;
``adapter_params`` take the bare ``nvme.<name>`` setting names (docs/configuration.md).

This module only translates: an ``ObjectKey`` becomes a key string (LMCache's ``fs``
adapter's reversible ``model@rank@group@hash[@salt]``) in the namespace ``model[@salt]``,
L1 objects become host buffers, the store's callbacks completed tasks and event-fd
signals.  Every ``submit_*`` returns at once: stores go to the store's write-back (the L1
objects stay read-locked until the task completes), lookups and loads to threads.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import sys
import threading
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ..config import ADAPTER_PARAMS_PREFIX, NVMeConfigError, NVMeSettings, adapter_params_of
from ..io.native import gc_untrack
from ..store import IndexEntry, TaskOutcome
from ._common import BackgroundCalls, announce, ignore_unknown_arguments, logger, open_store
from .lmcache_fixes import fix_cpu_split_kv_registration
from .lmcache_range import lmcache_imports
from .memory_objects import check_pairs, host_views, payload_views, tensor_metas
from .model_build import ModelBuilds
from .object_keys import object_key_columns, object_key_strings

with lmcache_imports():
    from lmcache.lmcache_native import Bitmap
    from lmcache.v1.distributed.api import ObjectKey
    from lmcache.v1.distributed.eviction import L2EvictionPolicy
    from lmcache.v1.distributed.internal_api import L2StoreResult
    from lmcache.v1.distributed.l2_adapters.base import L2AdapterInterface, L2TaskId
    from lmcache.v1.distributed.l2_adapters.config import L2AdapterConfigBase
    from lmcache.v1.platform import EventfdNotifier, EventNotifier, create_event_notifier

if TYPE_CHECKING:
    from lmcache.v1.distributed.api import MemoryLayoutDesc
    from lmcache.v1.distributed.internal_api import L1MemoryDesc, L2AdapterListener
    from lmcache.v1.memory_management import MemoryObj

TIER = "NVMe L2 adapter"

#: Writer threads per path when ``write_threads`` is 0: the server's writers take no core
#: from the engine, and L1 objects stay locked until written.  One O_DIRECT writer reached
#: ~1 GB/s on the test disk, four the rate of LMCache's fs_native (four C++ workers).
WRITERS_PER_PATH = 4


class NVMeL2AdapterConfig(L2AdapterConfigBase):
    """``adapter_params`` of ``NVMeL2Adapter``, validated by ``NVMeSettings``; LMCache's
    plugin loader finds it by name (``<class_name>Config``) and calls :meth:`from_dict`."""

    def __init__(self, settings: NVMeSettings) -> None:
        self.settings = settings

    @classmethod
    def from_dict(cls, d: dict, **kwargs: Any) -> NVMeL2AdapterConfig:
        """``adapter_params`` → validated settings; keyword arguments a newer LMCache may
        pass are logged once and ignored (see ``NVMeL2Adapter``)."""
        ignore_unknown_arguments(f"{TIER} config", kwargs)
        if not isinstance(d, Mapping):
            raise NVMeConfigError(f"adapter_params: expected a JSON object, got "
                                  f"{type(d).__name__}. Give e.g. {{\"path\": "
                                  "\"/mnt/nvme0/lmcache\", \"max_size_gb\": 100}.")
        return cls(NVMeSettings.from_params(adapter_params_of(d),
                                            key_prefix=ADAPTER_PARAMS_PREFIX))

    @classmethod
    def help(cls) -> str:
        names = ", ".join(NVMeSettings.setting_names())
        return ("NVMe L2 adapter (lmcache_nvme_backend.NVMeL2Adapter). adapter_params take "
                "the nvme.<name> settings without the prefix: " + names + ". Required: "
                "path (a directory or a list, one per drive) and max_size_gb. Example: "
                '{"type": "plugin", "module_path": "lmcache_nvme_backend", "class_name": '
                '"NVMeL2Adapter", "adapter_params": {"path": "/mnt/nvme0/lmcache", '
                '"max_size_gb": 500}}')


def _server_settings(config: NVMeL2AdapterConfig | Mapping[str, Any]) -> NVMeSettings:
    """The validated settings, with the server's default of four writers per path."""
    if not isinstance(config, NVMeL2AdapterConfig):
        config = NVMeL2AdapterConfig.from_dict(dict(config))
    settings = config.settings
    if settings.write_threads == 0:
        settings = dataclasses.replace(settings,
                                       write_threads=WRITERS_PER_PATH * len(settings.paths))
    return settings


def refuse_persist_disabled(argv: Sequence[str]) -> None:
    """Stop a server whose ``--l2-adapter`` for this adapter says ``"persist_enabled": false``
    (the tier keeps its chunks anyway; LMCache 0.5.6 hides the key from plugins)."""
    specs = [arg.partition("=")[2] if arg.startswith("--l2-adapter=") else nxt
             for arg, nxt in zip(argv, [*argv[1:], ""], strict=True)
             if arg.startswith("--l2-adapter=") or arg == "--l2-adapter"]
    for raw in specs:
        try:
            spec = json.loads(raw)
        except ValueError:
            continue  # LMCache names a malformed --l2-adapter itself
        if (isinstance(spec, dict) and spec.get("class_name") == "NVMeL2Adapter"
                and spec.get("persist_enabled", True) is False):
            raise NVMeConfigError(
                '--l2-adapter "persist_enabled": false: the NVMe tier keeps its chunks '
                "across restarts (that is what it is for) and cannot drop them at "
                'shutdown. Remove "persist_enabled" from the --l2-adapter JSON; to start '
                "empty, give it a new path or run `lmcache-nvme gc --max-size-gb 0 PATH`.")


class NVMeL2Adapter(L2AdapterInterface):
    """LMCache L2 adapter persisting KV chunks as aligned files on NVMe drives."""

    config_class_name = "NVMeL2AdapterConfig"
    _total_bytes_used: int  # the base class's usage counter

    def __init__(self, config: NVMeL2AdapterConfig | Mapping[str, Any],
                 l1_memory_desc: L1MemoryDesc | None = None, **kwargs: Any) -> None:
        """Called as ``NVMeL2Adapter(config[, l1_memory_desc=...])``; arguments a later
        LMCache adds (``**kwargs``) are logged once and not used."""
        ignore_unknown_arguments(TIER, kwargs)
        refuse_persist_disabled(sys.argv)
        store = open_store(TIER, lambda: _server_settings(config))
        fix_cpu_split_kv_registration()  # SGLang's KV pools on a CPU server
        settings = store.settings
        super().__init__(max_capacity_bytes=settings.max_size_bytes)
        self.settings = settings
        self.store = store
        self._lock = threading.Lock()
        self._task_ids = itertools.count()  # next() is atomic: no lock
        self._completed_stores: dict[L2TaskId, L2StoreResult] = {}
        self._completed_lookups: dict[L2TaskId, Bitmap] = {}
        self._completed_loads: dict[L2TaskId, Bitmap] = {}
        # digest -> key of chunks reported to LMCache as stored; one per chunk on the drive,
        # so the table and its keys (never in a reference cycle) are kept out of the cycle
        # collector's full collections (see ChunkIndex)
        self._reported: dict[str, ObjectKey] = {}
        self._closed = False
        self._store_efd = create_event_notifier()
        self._lookup_efd = create_event_notifier()
        self._load_efd = create_event_notifier()
        # A task finished on the engine's completion thread is signalled by the native
        # engine when that thread goes back to waiting: a GIL round trip less per task.
        self._signal_later = store.engine.signal_later \
            if isinstance(self._store_efd, EventfdNotifier) else None
        self._lookup_pool = BackgroundCalls("nvme-l2-lookup")
        self._builds = ModelBuilds(settings.model_build, store.namespace_names)
        # No call may wait on the drive (LMCache may serialize them under one lock): deletes
        # unlink, and stores under queue_full_policy "wait" wait, on a thread of their own.
        self._background = BackgroundCalls("nvme-l2-background")
        self._stores_wait = settings.queue_full_policy == "wait"
        # Chunks found at start count toward usage as one amount (their keys are unknown).
        recovered = store.usage()["used_bytes"]
        with self._usage_lock:
            self._total_bytes_used += recovered
        self._untracked_bytes = recovered
        store.add_removal_listener(self._on_removed)
        self._observer = announce("NVMeL2Adapter", TIER, store, self.stats,
                                  ", shared mode" if settings.shared else "")

    # -- event fds -------------------------------------------------------------

    def get_store_event_fd(self) -> int:
        return self._store_efd.fileno()

    def get_lookup_and_lock_event_fd(self) -> int:
        return self._lookup_efd.fileno()

    def get_load_event_fd(self) -> int:
        return self._load_efd.fileno()

    # -- store -------------------------------------------------------------------

    def submit_store_task(self, keys: list[ObjectKey], objects: list[MemoryObj]) -> L2TaskId:
        """Queue the chunks for write-back, read in place (LMCache keeps them read-locked);
        the task completes once they are on the drive, failed if any chunk was not."""
        task_id = next(self._task_ids)
        keys = list(keys)
        try:
            check_pairs(keys, objects)
            names, namespaces = object_key_columns(keys)
            namespaces = self._builds.namespaces(namespaces)
            metas = tensor_metas(objects)
            payloads = payload_views(objects, [meta.nbytes for meta in metas])
        except Exception:
            logger.exception("NVMe L2 adapter: store task %d has unusable objects", task_id)
            self._stored(task_id, keys, TaskOutcome.failed())
            return task_id
        on_done = functools.partial(self._stored, task_id, keys)
        if self._stores_wait:  # a full queue is waited on by the adapter's thread
            self._background.submit(self.store.submit_task, names, namespaces, metas, payloads,
                                    on_done)
            return task_id
        try:
            self.store.submit_task(names, namespaces, metas, payloads, on_done)
        except Exception:  # the task has completed (failed) all the same
            logger.exception("NVMe L2 adapter: store task %d failed to submit", task_id)
        return task_id

    def _stored(self, task_id: L2TaskId, keys: list[ObjectKey], outcome: TaskOutcome) -> None:
        """Every chunk of the task ended: its result for LMCache, the stored keys announced."""
        stored_keys = keys if outcome.stored is None else [keys[i] for i in outcome.stored]
        with self._lock:
            self._reported.update(zip(outcome.digests, stored_keys, strict=True))
            gc_untrack(self._reported, *stored_keys)
            self._completed_stores[task_id] = L2StoreResult(outcome.ok, outcome.nbytes)
        if stored_keys:
            self._notify_keys_stored(stored_keys, outcome.file_sizes)
        self._signal(self._store_efd)

    def pop_completed_store_tasks(self) -> dict[L2TaskId, L2StoreResult]:
        with self._lock:
            completed, self._completed_stores = self._completed_stores, {}
        return completed

    # -- lookup and lock ---------------------------------------------------------

    def submit_lookup_and_lock_task(self, keys: list[ObjectKey],
                                    group_layout_descs: dict[int, MemoryLayoutDesc]
                                    ) -> L2TaskId:
        """Which keys are stored; each hit is pinned (not evicted) until ``submit_unlock``."""
        task_id = next(self._task_ids)
        self._lookup_pool.submit(self._lookup, task_id, list(keys))
        return task_id

    def _lookup(self, task_id: L2TaskId, keys: list[ObjectKey]) -> None:
        bitmap = Bitmap(len(keys))
        try:
            names, namespaces = object_key_columns(keys)
            self._builds.recheck_if_due()  # here, on the lookup thread: not on the store path
            hits = self.store.lookup_many(names, self._builds.namespaces(namespaces), pin=True)
            for i, hit in enumerate(hits):
                if hit:
                    bitmap.set(i)
        except Exception:
            logger.exception("NVMe L2 adapter: lookup task %d failed", task_id)
        self._finish(self._completed_lookups, self._lookup_efd, task_id, bitmap)

    def query_lookup_and_lock_result(self, task_id: L2TaskId) -> Bitmap | None:
        return self._take(self._completed_lookups, task_id)

    def submit_unlock(self, keys: list[ObjectKey]) -> None:
        """Release the pins of a lookup (in memory only: it cannot fail)."""
        for key in object_key_strings(keys):
            self.store.unpin(key)

    # -- load ----------------------------------------------------------------------

    def submit_load_task(self, keys: list[ObjectKey], objects: list[MemoryObj]) -> L2TaskId:
        """Read each chunk into its L1 object on the store's I/O threads; a bit is set only
        after its checksum matched."""
        task_id = next(self._task_ids)
        keys = list(keys)
        try:
            check_pairs(keys, objects)
            sizes = [obj.get_size() for obj in objects]
            self.store.read_async(object_key_strings(keys), host_views(objects, sizes), sizes,
                                  functools.partial(self._loaded, task_id, keys))
        except Exception:
            logger.exception("NVMe L2 adapter: load task %d failed", task_id)
            self._loaded(task_id, keys, [False] * len(keys))
        return task_id

    def _loaded(self, task_id: L2TaskId, keys: list[ObjectKey], served: list[bool]) -> None:
        if all(served):  # the common case: one call sets every bit
            bitmap, loaded = Bitmap(len(keys), len(keys)), keys
        else:
            bitmap = Bitmap(len(keys))
            bitmap.batched_set([i for i, ok in enumerate(served) if ok])
            loaded = [key for key, ok in zip(keys, served, strict=True) if ok]
        if loaded:
            self._notify_keys_accessed(loaded)
        self._finish(self._completed_loads, self._load_efd, task_id, bitmap)

    def query_load_result(self, task_id: L2TaskId) -> Bitmap | None:
        return self._take(self._completed_loads, task_id)

    def _finish(self, results: dict[L2TaskId, Bitmap], efd: EventNotifier, task_id: L2TaskId,
                bitmap: Bitmap) -> None:
        """Hand a finished lookup or load to LMCache: store its bitmap, signal its fd."""
        with self._lock:
            results[task_id] = bitmap
        self._signal(efd)

    def _signal(self, efd: EventNotifier) -> None:
        """Tell LMCache that ``efd``'s kind of task finished (deferred on the native engine's
        completion thread: see ``__init__``)."""
        if self._signal_later is None or not self._signal_later(efd.fileno()):
            efd.notify()

    def _take(self, results: dict[L2TaskId, Bitmap], task_id: L2TaskId) -> Bitmap | None:
        with self._lock:
            return results.pop(task_id, None)

    # -- eviction and usage ----------------------------------------------------------

    def delete(self, keys: list[ObjectKey]) -> None:
        """Remove the chunks at once, their files unlinked in the background."""
        self.store.remove_many(object_key_strings(keys), unlink_in=self._background.submit)

    # -- LMCache's L2 framework settings -------------------------------------------------

    def register_listener(self, listener: L2AdapterListener) -> None:
        """Refuse LMCache's own L2 eviction (``"eviction"`` in ``--l2-adapter``): the tier's
        budget evicts already."""
        if isinstance(listener, L2EvictionPolicy):
            self.close()
            raise NVMeConfigError(
                '--l2-adapter "eviction": the NVMe tier evicts on its own, least recently '
                "used first, to keep its files within adapter_params.max_size_gb (one "
                "budget for every member in shared mode); LMCache's L2 eviction on top "
                'would evict the same chunks again. Remove the "eviction" block from the '
                "--l2-adapter JSON and set max_size_gb to the space the tier may use.")
        super().register_listener(listener)

    def set_backend_identity(self, name: str, shared: bool = False) -> None:
        """Refuse LMCache's ``"shared": true`` without the tier's shared mode (each server
        would keep its own budget and index of one directory)."""
        if shared and not self.settings.shared:
            self.close()
            raise NVMeConfigError(
                '--l2-adapter "shared": true: several servers on one directory need the '
                'tier\'s shared mode (one budget and one index for all of them). Add '
                '"shared": true to adapter_params as well, or remove "shared" from the '
                "--l2-adapter JSON if only this server uses the directory.")
        super().set_backend_identity(name, shared=shared)

    def _on_removed(self, entries: list[IndexEntry]) -> None:
        """The store dropped chunks (eviction, delete, a vanished or invalid file)."""
        keys: list[ObjectKey] = []
        sizes: list[int] = []
        untracked = 0
        with self._lock:
            for entry in entries:
                key = self._reported.pop(entry.digest, None)
                if key is not None:
                    keys.append(key)
                    sizes.append(entry.size)  # as reported when stored: the file's size
                else:
                    untracked += entry.size
        if untracked:
            with self._usage_lock:
                untracked = min(untracked, self._untracked_bytes)
                self._untracked_bytes -= untracked
                self._total_bytes_used = max(0, self._total_bytes_used - untracked)
        if keys:
            self._notify_keys_deleted(keys, sizes)

    def report_status(self) -> dict:
        snap = self.store.stats_snapshot()
        return {
            "is_healthy": not self._closed and self.store.healthy(),
            "type": "NVMeL2Adapter",
            "paths": [str(p) for p in self.settings.paths],
            "shared": self.settings.shared,
            **{k: snap[k] for k in ("entries", "used_bytes", "capacity_bytes", "pending_writes",
                                    "queue_bytes", "roots_offline", "direct_io_roots", "hits",
                                    "misses", "read_chunks", "read_bytes", "writes_completed",
                                    "write_bytes", "recovered_entries", "checksum_failures",
                                    "shared_adopted")},
        }

    def stats(self) -> dict[str, float]:
        """The store's counters and usage (see docs/configuration.md)."""
        return self.store.stats_snapshot()

    # -- close -------------------------------------------------------------------------

    def close(self) -> None:
        """Finish lookups, loads and queued writes, save the index, close the event fds."""
        if self._closed:
            return
        self._closed = True
        self._observer.close()
        self._lookup_pool.close()
        self._background.close()
        self.store.close()
        self._store_efd.close()
        self._lookup_efd.close()
        self._load_efd.close()
        logger.info("NVMe L2 adapter closed")
