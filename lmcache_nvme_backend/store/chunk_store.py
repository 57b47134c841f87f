"""``ChunkStore``: the storage core's one entry point, a façade over its parts.

Keys are plain strings (the adapters translate LMCache keys); payloads are host buffers.
Writes are queued and published atomically by writer threads; a read is served only after
header, key, length and payload checksum match; a restart rebuilds the index from the tree
and the manifest (``docs/architecture.md`` names each part's module).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager
from pathlib import Path

from ..config import NativeIOMode, NVMeConfigError, NVMeSettings
from ..disk.format import ChunkHeader, TensorMeta
from ..disk.layout import (
    RETIRED_FILES_WRITER,
    RootLayout,
    key_digest,
    key_digests,
    namespace_id,
    temp_name,
)
from ..disk.validate import Expected, Verdict, judge_chunk
from ..io import engine_for, native
from ..io.engine import ChunkEngine
from ..io.native import NativeEngine
from ..io.posix import read_header
from .catalog import Catalog, RemovalListener
from .deadline import HangWatch
from .index import IndexEntry
from .namespaces import NamespaceWatch
from .reads import ChunkRead, ChunkReader, ReadPlan
from .recovery import ManifestKeeper, recover_root
from .room import Room
from .roots import RootInfo, Roots
from .shared.tree import SharedTree
from .stats import Counter, HistogramSnapshot, ReadPath, StoreStats
from .writeback import ChunkWrite, SubmitResult, TaskOutcome
from .writer import CANCEL_WAIT_S, ChunkWriter

__all__ = ["ChunkRead", "ChunkStore", "ChunkWrite", "ReadPlan", "SubmitResult",
           "TaskOutcome"]

logger = logging.getLogger(__name__)

#: The ``stats()`` key of the chunks accepted into the write-back queue: the queue counts
#: them under the lock it holds anyway, not ``StoreStats``.
WRITES_ENQUEUED = "writes_enqueued"


class ChunkStore:
    """Chunk files on one or more directories, with an LRU byte budget and async write-back."""

    def __init__(self, settings: NVMeSettings) -> None:
        self.settings = settings
        self._stats = StoreStats()
        self._roots = Roots.open(settings.paths, settings.direct_io, settings.file_mode,
                                 settings.min_free_gb, settings.shared, settings.key_prefix,
                                 settings.io_deadline_s)
        self._catalog = Catalog([settings.max_size_bytes // len(self._roots)] * len(self._roots))
        # writer threads: ``nvme.write_threads``, or one per path
        self.engine = engine = _engine(settings, settings.write_threads or len(self._roots))
        # reads on the paths with a deadline (nvme.io_deadline_s) go through it; none: the
        # store reads straight into the caller's buffers
        self._watch = HangWatch(self._roots, self._stats) if self._roots.deadline_s else None
        self._reader = ChunkReader(self._catalog, self._roots, engine, self._stats, self._watch)
        self._room = Room(self._catalog, self._roots, self._stats, engine)
        self._writer = ChunkWriter(settings, self._catalog, self._roots, self._room, engine,
                                   self._stats)
        self._closed = False
        for root in self._roots:
            recover_root(root, self._catalog, self._stats, self._room.evict,
                         enforce_budget=not settings.shared)
        self._shared: SharedTree | None = None
        if settings.shared:
            self._shared = SharedTree(settings, self._catalog, self._roots, self._stats)
            self._shared.start()
            self._room.shared = self._shared
        self._manifests = ManifestKeeper(self._roots, self._catalog, settings.file_mode,
                                         settings.manifest_interval_s)
        # namespace directories removed (lmcache-nvme forget): checked now, then every second
        self._namespaces = NamespaceWatch(self._catalog, self._roots, self._room, self._shared)
        self._namespaces.check()
        self._namespaces.start()

    @property
    def io_engine_name(self) -> str:
        """``native`` (the compiled batch engine) or ``python``, and why not native."""
        if self.engine.name == NativeEngine.name:
            return f"native ({native.simd()} checksums)"
        if self.settings.native_io == NativeIOMode.OFF:
            return "python (nvme.native_io: off)"
        return f"python, slower: {native.unavailable_reason()}"

    @property
    def writer_thread_ids(self) -> list[int]:
        """Kernel ids of the threads that write chunk files (the engine's)."""
        return self.engine.writer_thread_ids()

    # -- lookups -------------------------------------------------------------

    def contains(self, key: str, pin: bool = False) -> bool:
        """Whether this process's index holds a published chunk for ``key`` (optionally pinned)."""
        return self._lookup(key, None, pin)

    def lookup(self, key: str, namespace: str, pin: bool = False) -> bool:
        """Whether ``key`` is stored in ``namespace`` (optionally pinned).  Memory only (in
        shared mode the index holds the other processes' chunks too)."""
        return self._lookup(key, namespace_id(namespace), pin)

    def _lookup(self, key: str, ns_id: str | None, pin: bool) -> bool:
        hit = self._catalog.lookup(key_digest(key), self._roots.healthy, time.time_ns(), pin,
                                   ns_id)
        self._stats.add(Counter.LOOKUPS)  # per key in-process: two counts, not three
        self._stats.add(Counter.HITS if hit else Counter.MISSES)
        return hit

    def lookup_many(self, keys: Sequence[str], namespaces: Sequence[str],
                    pin: bool = False) -> list[bool]:
        """``lookup(keys[i], namespaces[i])`` of each under one lock hold (memory only)."""
        hits = self._catalog.lookup_many(key_digests(keys), self._roots.healthy,
                                         time.time_ns(), pin, list(map(namespace_id, namespaces)))
        found = sum(hits)
        self._stats.add(Counter.LOOKUPS, len(hits))
        self._stats.add(Counter.HITS, found)
        self._stats.add(Counter.MISSES, len(hits) - found)
        return hits

    def lookup_prefix(self, keys: Iterable[tuple[str, str]], pin: bool = False) -> int:
        """How many leading ``(key, namespace)`` pairs are stored (LMCache's prefix hit)."""
        hits = 0
        for key, namespace in keys:
            if not self.lookup(key, namespace, pin=pin):
                break
            hits += 1
        return hits

    def is_pending(self, key: str) -> bool:
        """Whether ``key`` is queued for writing and not yet published."""
        return self._catalog.is_pending(key_digest(key))

    def pin(self, key: str) -> bool:
        return self._catalog.pin(key_digest(key))

    def unpin(self, key: str) -> bool:
        return self._catalog.unpin(key_digest(key))

    def entry(self, key: str) -> IndexEntry | None:
        """The index entry of ``key`` (where it lives, its size, recency and pins), if any."""
        return self._catalog.entry(key_digest(key))

    def tensor_meta(self, key: str) -> TensorMeta | None:
        """Allocation metadata of a stored chunk (read from its header if not yet known)."""
        return self._reader.tensor_meta(key)

    def remove(self, key: str) -> bool:
        """Delete a chunk (pinned or not)."""
        return self.remove_many([key]) == 1

    def remove_many(self, keys: Sequence[str],
                    unlink_in: Callable[..., object] | None = None) -> int:
        """Delete chunks (pinned or not), their files in one batch; how many were stored.
        ``unlink_in(unlink, entries)`` (e.g. an executor's ``submit``) unlinks the files
        instead, so the caller does not wait on the drive (the index is updated already)."""
        entries = self._catalog.remove_many(key_digests(keys))
        if entries and unlink_in is not None:
            self._catalog.notify_removed(entries)
            unlink_in(self._room.unlink, entries)
        elif entries:
            self._room.unlink(entries)
            self._catalog.notify_removed(entries)
        return len(entries)

    def namespace_names(self) -> set[str]:
        """The readable names of the namespaces in the cache directories."""
        return {name for root in self._roots for name in root.layout.namespace_names().values()}

    def refresh_shared(self) -> None:
        """Shared mode: sync with the other members now (done every 0.1 s anyway)."""
        if self._shared is not None:
            self._shared.refresh()

    def shared_members(self) -> list[str]:
        """Shared mode: this process's member id on each root (empty otherwise)."""
        return self._shared.member_ids() if self._shared is not None else []

    def add_removal_listener(self, listener: RemovalListener) -> None:
        """Call ``listener`` (outside the store lock) with entries that leave the index:
        evictions, removals, and files found missing or invalid."""
        self._catalog.add_removal_listener(listener)

    # -- writes --------------------------------------------------------------

    def submit(self, key: str, namespace: str, meta: TensorMeta, payload: memoryview,
               release: Callable[[], None],
               on_persisted: Callable[[], None] | None = None) -> SubmitResult:
        """Queue one chunk for persistence; see ``submit_many``."""
        return self.submit_many([ChunkWrite(key, namespace, meta, payload, release,
                                            on_persisted)])[0]

    def submit_many(self, writes: Sequence[ChunkWrite]) -> list[SubmitResult]:
        """Queue chunks for persistence without waiting for the drive; each ``payload`` stays
        valid until its ``release``, called exactly once whatever the result."""
        return self._writer.submit_many(writes)

    def submit_task(self, keys: Sequence[str], namespaces: Sequence[str],
                    metas: Sequence[TensorMeta], payloads: Sequence[memoryview],
                    on_done: Callable[[TaskOutcome], None]) -> None:
        """Queue a task's chunks (the i-th of each sequence is one chunk); ``on_done``
        (``TaskOutcome``) runs once after all of them ended, maybe before this returns
        (if this raises, it ran with nothing persisted).  The multiprocess server's path."""
        self._writer.submit_task(keys, namespaces, metas, payloads, on_done)

    def flush(self, timeout_s: float = 60.0) -> bool:
        """Wait until every queued write has finished (persisted or dropped)."""
        return self._writer.flush(timeout_s)

    def set_gpu_checksums(self, enabled: bool) -> None:
        """Also record ``gpusum``'s checksum in files written from now on (GPU read path)."""
        self._writer.record_gpu_checksums = enabled

    @property
    def gpu_checksums(self) -> bool:
        return self._writer.record_gpu_checksums

    # -- reads ---------------------------------------------------------------

    def read_into(self, reads: Sequence[ChunkRead]) -> list[bool]:
        """Fill each buffer with its chunk's payload once header, key and payload checksum
        match; False (a miss, the buffer may hold garbage) otherwise, and after ``close``."""
        if self._closed:
            return self._closed_misses(len(reads))
        served: list[bool] = []
        try:
            self._reader.read([r.key for r in reads], [r.dest for r in reads],
                              [r.length for r in reads], served.extend, wait=True)
            return served
        except RuntimeError:  # the I/O pool was shut down by a close racing this read
            if not self._closed:
                raise
            return self._closed_misses(len(reads))

    def _closed_misses(self, n: int) -> list[bool]:
        self._stats.add(Counter.READ_FAILURES, n)
        return [False] * n

    def read_async(self, keys: Sequence[str], dests: Sequence[memoryview],
                   lengths: Sequence[int | None], on_done: Callable[[list[bool]], None]) -> None:
        """``read_into`` without waiting: the I/O thread that judges the last chunk calls
        ``on_done(served)`` (keep it short)."""
        if self._closed:
            on_done([False] * len(keys))
            return
        self._reader.read(keys, dests, lengths, on_done, wait=False)

    def plan_reads(self, keys: Sequence[str]) -> list[ReadPlan | None]:
        """Where each chunk lives, for a reader outside the store (the GPU path)."""
        return self._reader.plan(keys)

    def reading(self) -> AbstractContextManager[None]:
        """Hold while reading outside the store: write-back yields to readers."""
        return self.engine.reading()

    def complete_read(self, plan: ReadPlan, header: bytes, error: BaseException | None,
                      payload_ok: Callable[[ChunkHeader], bool]) -> Verdict:
        """Judge a read done outside the store by ``read_into``'s rules, with its counters."""
        return self._reader.complete(plan, header, error, payload_ok)

    def chunk_path(self, key: str, namespace: str) -> Path:
        """Where the chunk file of ``key`` is (if indexed) or would be placed."""
        digest = key_digest(key)
        entry = self._catalog.entry(digest)
        root = self._roots[entry.root] if entry is not None else self._roots.choose(digest)
        return (root or self._roots[0]).layout.chunk_path(namespace_id(namespace), digest)

    def iter_keys(self) -> Iterator[str]:
        """The key of every valid chunk file on disk (reads each header: slow; changes nothing)."""
        for root in self._roots:
            for loc in root.layout.iter_chunks():
                try:
                    raw, size = read_header(loc.path, root.direct)
                except OSError:
                    continue
                verdict = judge_chunk(raw, Expected(digest=loc.digest, ns_id=loc.namespace_id,
                                                    file_size=size))
                if verdict.header is not None and verdict.ok:
                    yield verdict.header.key

    # -- state and counters -------------------------------------------------------

    @property
    def layouts(self) -> list[RootLayout]:
        """The on-disk layout of each cache directory, in ``nvme.path`` order."""
        return [root.layout for root in self._roots]

    def describe_roots(self) -> list[RootInfo]:
        """Each cache directory's path, I/O mode, health, free space, budget and use."""
        budgets = self._catalog.budgets
        return [dataclasses.replace(info, capacity_bytes=budgets[i],
                                    used_bytes=self._catalog.used_bytes(i))
                for i, info in enumerate(self._roots.describe())]

    def healthy(self) -> bool:
        """Whether at least one cache directory is in service."""
        return any(root.healthy for root in self._roots)

    def count(self, counter: Counter, amount: float = 1) -> None:
        """Add to one of the tier's counters (for readers outside the store)."""
        self._stats.add(counter, amount)

    def counter(self, name: Counter | str) -> float:
        """One counter's value, by member or by its ``stats()`` key."""
        if name == WRITES_ENQUEUED:
            return self._writer.queue.accepted
        return self._stats.get(name)

    def record_read(self, path: ReadPath, chunks: int, nbytes: int, seconds: float) -> None:
        """Account one read call of a reader outside the store (per-path counters)."""
        self._stats.record_read(path, chunks, nbytes, seconds)

    def histograms(self) -> dict[str, HistogramSnapshot]:
        return self._stats.histograms()

    def usage(self) -> dict[str, int]:
        usage = self._catalog.usage()
        usage["queue_bytes"] = self._writer.queue.bytes_held
        usage["retired_bytes"] = self.engine.retired_bytes()
        return usage

    def stats_snapshot(self) -> dict[str, float]:
        snap = self._stats.snapshot()
        snap[WRITES_ENQUEUED] = self._writer.queue.accepted
        snap.update(self.usage())
        snap["roots_offline"] = sum(not r.healthy for r in self._roots)
        snap["roots_hung"] = sum(r.hung for r in self._roots)
        snap["deadline_roots"] = sum(r.deadline_s > 0 for r in self._roots)
        if self._shared is not None:
            snap.update(self._shared.describe())
        snap["direct_io_roots"] = sum(r.direct for r in self._roots)
        return snap

    # -- shutdown --------------------------------------------------------------

    def save_manifests(self) -> None:
        """Snapshot every root's index now (it is also saved periodically and at close)."""
        self._manifests.save_all()

    def close(self) -> None:
        """Finish queued writes (up to ``close_timeout_s``), save manifests, stop threads.
        With a read deadline on any path (``nvme.io_deadline_s``) it returns within
        ``close_bound_s`` even while I/O is stuck in the kernel (a hung network filesystem):
        the step it waited for is named in the log, and left to finish on daemon threads."""
        if self._closed:
            return
        self._closed = True
        if self._watch is None:
            self._shut_down([])
            return
        steps: list[str] = []
        closer = threading.Thread(target=self._shut_down, args=(steps,), name="nvme-close",
                                  daemon=True)
        closer.start()
        closer.join(self.close_bound_s)
        if closer.is_alive():
            hung = [str(root.layout.root) for root in self._roots if root.hung]
            logger.warning("NVMe tier: close() gave up after %.0f s while %s (paths out of "
                           "service: %s); left to finish on a daemon thread, with the I/O "
                           "threads stuck in the filesystem.", self.close_bound_s,
                           steps[-1] if steps else "starting", ", ".join(hung) or "none")

    @property
    def close_bound_s(self) -> float:
        """How long ``close`` waits at most (with a read deadline on any path): the
        write-back's ``close_timeout_s`` and cancel wait, then a deadline for each of the
        other steps."""
        return self.settings.close_timeout_s + CANCEL_WAIT_S + 3 * self._roots.deadline_s

    def _shut_down(self, steps: list[str]) -> None:
        """``close``'s steps, each named in ``steps`` as it starts."""
        steps.append("stopping the namespace watch")
        self._namespaces.stop()
        steps.append("finishing queued writes")
        self._writer.close(self.settings.close_timeout_s)
        steps.append("saving manifests")
        self._manifests.stop()
        self._manifests.save_all()
        if self._shared is not None:
            steps.append("leaving the shared directory")
            self._shared.close()
        if self._watch is not None:
            steps.append("answering reads in flight")
            self._watch.stop(self._watch.deadline_s)
        steps.append("stopping the I/O engine")
        self.engine.close()
        steps.append("closed")


def _engine(settings: NVMeSettings, writers: int) -> ChunkEngine:
    """The I/O engine ``nvme.native_io`` asks for (``on`` refuses to start without it)."""
    if settings.native_io == NativeIOMode.ON and not native.available():
        raise NVMeConfigError(f"nvme.native_io: on, but {native.unavailable_reason()}. "
                              "Or set nvme.native_io: auto to run the Python engine.")
    return engine_for(settings.native_io, settings.io_threads, writers,
                      settings.task_size_bytes, recycle_bytes=settings.recycle_bytes,
                      recycle_suffix=temp_name("", writer=RETIRED_FILES_WRITER))
