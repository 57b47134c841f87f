"""Writing chunks: admission, placement, hand-over to the I/O engine, publishing.

A store call registers its chunks, accounts their bytes in the byte-bounded queue, picks
each chunk's root (rendezvous hashing over healthy roots), reserves the file's bytes
against that root's budget (evicting least recently used, unpinned chunks, and more while
the filesystem is below ``nvme.min_free_gb``) and hands the batch to the engine as write
shares (``io/engine.py``), on the submitting thread.  The engine's writers, at a low CPU
priority, write ``<name>.tmp-<host>-<pid>-<thread>`` and rename it into place; the batch's
completion indexes each chunk, and only then is its host memory released.  A whole store
task in the common case takes a shorter path (``task_writes.py``).  Room and eviction:
``room.py``.
"""

from __future__ import annotations

import errno
import functools
import logging
import operator
import os
import time
from collections.abc import Sequence
from pathlib import Path

from ..config import NVMeSettings
from ..disk.format import TensorMeta, max_key_bytes, namespace_bytes
from ..disk.gpusum import host_checksum
from ..disk.layout import temp_name
from ..disk.safe_fs import refresh_root_descriptor, root_descriptor
from ..io import engine
from ..io.engine import ChunkEngine
from ..io.posix import NotAChunkFile
from .catalog import Catalog
from .index import IndexEntry
from .room import Room
from .roots import Roots, RootState, note_full, note_space, write_namespace_file
from .stats import Counter, StoreStats
from .task_writes import OnTaskDone, TaskWrites
from .writeback import (
    ChunkWrite,
    SubmitResult,
    WriteBackQueue,
    WriteTask,
    end_writes,
    outcome_of,
)

logger = logging.getLogger(__name__)

#: How long a closing store waits for cancelled native writes to hand their buffers back.
CANCEL_WAIT_S = 5.0
_FSYNC_LEVEL = {"none": 0, "data": 1, "full": 2}
_digest_of = operator.attrgetter("digest")  # a write's chunk digest (placement hashes it)


class ChunkWriter:
    """Admission and write-back of one store."""

    def __init__(self, settings: NVMeSettings, catalog: Catalog, roots: Roots, room: Room,
                 engine: ChunkEngine, stats: StoreStats) -> None:
        self.settings = settings
        self.room = room
        self.catalog = catalog
        self.roots = roots
        self.engine = engine
        self.stats = stats
        self.queue = WriteBackQueue(settings.write_queue_bytes)
        self.closed = False
        # Set when chunks are read into GPU memory: files also carry gpusum's checksum.
        self.record_gpu_checksums = False
        # The engine's writers share one temp-name suffix (see ``temp_name``); its write
        # shares carry the file mode, directory mode and fsync level.
        self.temp_suffix = temp_name("", writer=0)
        self.modes = (settings.file_mode, settings.dir_mode, _FSYNC_LEVEL[settings.fsync])
        # (metadata, namespace, key bytes that fit the header beside them) of the last task
        # admitted: a server's tasks share a handful of layouts (one tuple: replaced whole).
        self._key_room: tuple[TensorMeta | None, str, int] = (None, "", 0)
        # Whole store tasks in the common case (``task_writes.py``).
        self._tasks = TaskWrites(self, engine)

    @staticmethod
    def writer_count(settings: NVMeSettings, roots: int) -> int:
        """Writer threads (``nvme.write_threads``; 0: one per path)."""
        return settings.write_threads or roots

    @property
    def queue_bytes(self) -> int:
        return self.queue.bytes_held

    @property
    def writes_enqueued(self) -> int:
        """Chunks ever accepted into the write-back queue."""
        return self.queue.accepted

    # -- admission -------------------------------------------------------------

    def submit_many(self, writes: Sequence[ChunkWrite]) -> list[SubmitResult]:
        """Queue chunks for persistence without waiting for the drive.

        Each ``payload`` must stay valid until its ``release`` is called (or its task ends);
        the store calls every ``release`` exactly once, whatever the result (immediately for
        a chunk that is not queued).  One lock round and one writer wake-up serve
        the whole batch, which keeps the engine's store path short.
        """
        if self.closed:
            end_writes(writes)
            return [SubmitResult.CLOSED] * len(writes)
        try:
            results, admitted = self._admit(writes)
        except ValueError:
            end_writes(writes)
            raise
        chosen = list(writes) if len(admitted) == len(writes) else \
            [writes[i] for i in admitted]
        fresh = self.catalog.register(list(map(_digest_of, chosen)), time.time_ns())
        if False in fresh:
            for i, is_new in zip(admitted, fresh, strict=True):
                if not is_new:
                    results[i] = SubmitResult.DUPLICATE
            self.stats.add(Counter.DUPLICATE_PUTS, fresh.count(False))
            admitted = [i for i, is_new in zip(admitted, fresh, strict=True) if is_new]
            chosen = [w for w, is_new in zip(chosen, fresh, strict=True) if is_new]
        if admitted:
            self._dispatch(self._enqueue(chosen, admitted, results))
        if results.count(SubmitResult.QUEUED) < len(writes):
            end_writes([w for w, result in zip(writes, results, strict=True)
                        if result is not SubmitResult.QUEUED])
        return results

    def submit_task(self, keys: Sequence[str], namespaces: Sequence[str],
                    metas: Sequence[TensorMeta], payloads: Sequence[memoryview],
                    on_done: OnTaskDone) -> None:
        """Queue a task's chunks; ``on_done(outcome)`` runs once, after every one of them
        ended (see ``ChunkStore.submit_task``).  The common case runs as one admission and
        one completion (``task_writes.py``); the rest chunk by chunk."""
        if self._tasks.submit(keys, namespaces, metas, payloads, on_done):
            return
        task = WriteTask([ChunkWrite(key, namespace, meta, payload) for key, namespace, meta,
                          payload in zip(keys, namespaces, metas, payloads, strict=True)],
                         lambda whole: on_done(outcome_of(whole)))
        try:
            task.results = self.submit_many(task.writes)
        finally:
            task.ended(1)  # the submitter's share

    def _admit(self, writes: Sequence[ChunkWrite]) -> tuple[list[SubmitResult], list[int]]:
        """QUEUED for each write that fits the queue, the budget and the header (the others
        dropped as oversize), and the indices of those that do.  ValueError, before anything
        is counted, for a write whose payload is not the size its metadata says."""
        budget, capacity = self.catalog.budgets[0], self.queue.capacity
        results = [SubmitResult.QUEUED] * len(writes)
        admitted: list[int] = []
        oversize: list[int] = []
        meta, namespace, key_room = self._key_room
        for i, w in enumerate(writes):
            if w.meta is not meta or w.namespace != namespace:  # a task's chunks share them
                meta, namespace = w.meta, w.namespace
                key_room = max_key_bytes(namespace, meta)
                self._key_room = (meta, namespace, key_room)
            if w.nbytes != meta.nbytes:
                raise ValueError(f"tensor metadata says {meta.nbytes} bytes, payload has "
                                 f"{w.nbytes}")
            if w.file_size <= budget and w.nbytes <= capacity and len(w.key_bytes) <= key_room:
                admitted.append(i)
            else:
                oversize.append(i)
        for i in oversize:
            results[i] = self._oversize(writes[i], budget)
        return results, admitted

    def _oversize(self, write: ChunkWrite, budget: int) -> SubmitResult:
        """A chunk too big for the queue or the budget, or with a key too long for the header:
        dropped, counted, and said once."""
        if not self.stats.get(Counter.OVERSIZE_DROPS):
            logger.warning(
                "NVMe tier: not storing a %d-byte chunk: it exceeds nvme.write_queue_mb "
                "(%d bytes) or the budget per path (%d bytes), or its key is too long for "
                "the header. Raise nvme.write_queue_mb / nvme.max_size_gb.", write.nbytes,
                self.queue.capacity, budget)
        self.stats.add(Counter.OVERSIZE_DROPS)
        return SubmitResult.OVERSIZE

    def _enqueue(self, offered: list[ChunkWrite], positions: list[int],
                 results: list[SubmitResult]) -> list[ChunkWrite]:
        """Offer the writes to the queue (with the native engine, the queue only holds their
        bytes: the caller dispatches them); mark the ones it refuses in ``results`` (at their
        ``positions``); the accepted ones."""
        wait = self.settings.queue_full_policy == "wait"
        if wait and self.queue.bytes_held + sum(j.nbytes for j in offered) > \
                self.queue.capacity:
            self.stats.add(Counter.QUEUE_FULL_WAITS)
        ok = self.queue.offer_many(offered, wait_s=1e9 if wait else 0.0)
        if False not in ok:
            return offered
        refused = [(i, job) for i, job, fits in zip(positions, offered, ok, strict=True)
                   if not fits]
        self.catalog.end_pending(job.digest for _, job in refused)
        for i, _ in refused:
            results[i] = SubmitResult.CLOSED if self.closed else SubmitResult.QUEUE_FULL
        if not self.closed:
            self.stats.add(Counter.QUEUE_FULL_DROPS, len(refused))
        return [job for job, fits in zip(offered, ok, strict=True) if fits]

    def flush(self, timeout_s: float = 60.0) -> bool:
        """Wait until every queued write has finished (persisted or dropped)."""
        return self.queue.wait_empty(timeout_s)

    # -- write-back ------------------------------------------------------------

    def _place(self, jobs: list[ChunkWrite], deferred: list[list[IndexEntry]] | None
               ) -> tuple[list[tuple[ChunkWrite, RootState, int]], list[ChunkWrite]]:
        """Each job's root and reserved bytes; and the jobs with no root or no room (counted).

        With ``deferred`` (the native engine), each placed job's eviction victims are
        appended to it (see ``_reserve``), and the jobs of one root are reserved together
        (one reservation, its victims removed by the first of them) when they all fit."""
        placed: list[tuple[ChunkWrite, RootState, int]] = []
        by_root, dropped = self.roots.group(jobs, _digest_of)
        if dropped:
            self.stats.add(Counter.WRITE_FAILURES, len(dropped))
        for root, mine in by_root:
            victims: list[IndexEntry] = []
            if deferred is not None and len(mine) > 1:
                if self.room.reserve(root, sum(job.file_size for job in mine), victims):
                    placed += [(job, root, job.file_size) for job in mine]
                    deferred += [victims] + [[] for _ in mine[1:]]
                    continue
                # no room for the whole share: what was evicted for it goes now
                self.room.evict_deferred(root, victims)
            for job in mine:
                victims = []
                if self.room.reserve(root, job.file_size, None if deferred is None else victims):
                    placed.append((job, root, job.file_size))
                    if deferred is not None:
                        deferred.append(victims)
                else:
                    self.room.evict_deferred(root, victims)
                    self.stats.add(Counter.CAPACITY_DROPS)
                    dropped.append(job)
        return placed, dropped

    def _settle(self, job: ChunkWrite, root: RootState, size: int, error: OSError | None,
                seconds: float) -> None:
        """Index a published chunk in place of its reservation, or give the bytes back and
        count why it was not published."""
        if error is None:
            self.catalog.publish(IndexEntry(job.digest, job.ns_id, root.index, size, job.meta,
                                             time.time_ns()), reserved=size)
            root.consecutive_errors = 0
            note_space(root)
            self.stats.record_write(job.nbytes, seconds)
            job.persisted = True
            if job.on_persisted is not None:
                job.on_persisted()
            return
        self.catalog.release(root.index, size)
        if error.errno in (errno.ENOSPC, errno.EDQUOT):
            # A full filesystem is not a failing drive: drop this write, keep serving.
            self.stats.add(Counter.CAPACITY_DROPS)
            self.room.guards[root.index].refresh()
            note_full(root, error)
        elif isinstance(error, (NotAChunkFile, FileNotFoundError)):
            # A link or file planted where the tree needs a directory (never followed), or
            # the cache directory removed: this write is dropped, the drive is fine.
            self.stats.add(Counter.WRITE_FAILURES)
            logger.warning("NVMe tier: not writing %s: %s",
                           root.layout.chunk_path(job.ns_id, job.digest), error)
        else:
            self.stats.add(Counter.WRITE_FAILURES)
            self.roots.record_error(root, error)

    def _dispatch(self, jobs: list[ChunkWrite]) -> None:
        """Hand queued jobs to the engine's writers (on the submitting thread: no hand-off);
        ``settle_batch`` settles them when the batch is done."""
        if not jobs:
            return
        victims: list[list[IndexEntry]] = []
        placed, dropped = self._place(jobs, victims)
        self._finish(dropped)
        if not placed:
            return
        placed, victims, shares = self._shares(placed, victims)
        try:
            self.engine.submit_write(shares, functools.partial(
                self.settle_batch, placed, victims, time.perf_counter()))
        except BaseException:
            for _, root, size in placed:
                self.catalog.release(root.index, size)
            self._finish([job for job, _, _ in placed])
            raise

    def _shares(self, placed: list[tuple[ChunkWrite, RootState, int]],
                victims: list[list[IndexEntry]]
                ) -> tuple[list[tuple[ChunkWrite, RootState, int]], list[list[IndexEntry]],
                           list[engine.WriteShare]]:
        """The placed jobs as write shares, one per root, namespace and layout, and the jobs
        and their victims in the batch's order (share by share)."""
        groups: dict[tuple[int, str, int], list[int]] = {}
        for i, (job, root, _) in enumerate(placed):
            groups.setdefault((root.index, job.namespace, id(job.meta)), []).append(i)
        if len(groups) > 1:
            order = [i for mine in groups.values() for i in mine]
            placed, victims = [placed[i] for i in order], [victims[i] for i in order]
        file_mode, dir_mode, fsync = self.modes
        shares: list[engine.WriteShare] = []
        at = 0
        for mine in groups.values():
            share = placed[at : at + len(mine)]
            gone = [v for vs in victims[at : at + len(mine)] for v in vs]
            at += len(mine)
            first, root, _ = share[0]
            layout = root.layout
            jobs = [job for job, _, _ in share]
            shares.append((root_descriptor(layout.root_str),
                           layout.write_naming(first.ns_id, self.temp_suffix),
                           namespace_bytes(first.namespace), first.meta.to_json(), root.direct,
                           file_mode, dir_mode, fsync, layout.chunk_rels(gone),
                           [job.digest for job in jobs], [job.payload for job in jobs],
                           [job.key_bytes for job in jobs],
                           list(map(self._gpu_checksum, jobs)) if self.record_gpu_checksums
                           else None))
        return placed, victims, shares

    def _gpu_checksum(self, job: ChunkWrite) -> tuple[int, int]:
        self.stats.add(Counter.GPU_CHECKSUMS_RECORDED)
        return host_checksum(job.payload)

    def settle_batch(self, placed: list[tuple[ChunkWrite, RootState, int]],
                 victims: list[list[IndexEntry]], started: float, result: engine.Batch
                 ) -> None:
        """A batch of native writes finished (on the engine's completion thread)."""
        seconds = (time.perf_counter() - started) / len(placed)
        all_published = False
        try:
            errors = self._write_errors(placed, result) if result.details else {}
            if any(victims):
                for (_, root, _), gone in zip(placed, victims, strict=True):
                    if gone:  # the first job of a root's reservation removed them
                        self.room.guards[root.index].freed(sum(v.size for v in gone))
            written = [p for i, p in enumerate(placed) if i not in errors] if errors else placed
            now = time.time_ns()
            nbytes = 0
            last_root = None
            entries: list[tuple[IndexEntry, int]] = []
            for job, root, size in written:
                entries.append((IndexEntry(job.digest, job.ns_id, root.index, size, job.meta,
                                           now), size))
                nbytes += job.nbytes
                if root is not last_root:
                    last_root = root
                    root.consecutive_errors = 0
                    note_space(root)
            if written:
                self.catalog.publish_many(entries)
                self.stats.record_write(nbytes, seconds, len(written))
                for job, _, _ in written:
                    job.persisted = True
                    if job.on_persisted is not None:
                        job.on_persisted()
            all_published = not errors
            for i, error in errors.items():
                job, root, size = placed[i]
                if error.errno == errno.ECANCELED:  # closing: not a failure
                    self.catalog.release(root.index, size)
                else:
                    self._settle(job, root, size, error, seconds)
        finally:
            self._finish([job for job, _, _ in placed], all_published)

    def _write_errors(self, placed: list[tuple[ChunkWrite, RootState, int]],
                      result: engine.Batch) -> dict[int, OSError]:
        """The chunks of a batch that were not published, with the reason; a chunk that made
        its namespace's directory gets the name file (and is published)."""
        errors: dict[int, OSError] = {}
        for index, status, err in result.details:
            job, root, _ = placed[index]
            if status == engine.NEW_NAMESPACE:
                write_namespace_file(root.layout, job.ns_id, job.namespace,
                                     self.settings.file_mode)
                continue
            if err == errno.ENOENT:
                # The cache directory itself was removed (and maybe made again): this write
                # is lost, the next ones go through a new descriptor of it.
                refresh_root_descriptor(root.layout.root_str)
            errors[index] = _os_error(err, root.layout.chunk_path(job.ns_id, job.digest))
        return errors

    def _finish(self, jobs: list[ChunkWrite], all_published: bool = False) -> None:
        """The jobs ended (written or not; ``all_published``: each of them published): no
        longer pending, buffers released."""
        if not jobs:
            return
        if not all_published and (unpublished := [job.digest for job in jobs
                                                   if not job.persisted]):
            self.catalog.end_pending(unpublished)  # publishing ended the others'
        try:
            end_writes(jobs)
        finally:
            self.queue.done_many(jobs)

    # -- shutdown --------------------------------------------------------------

    def close(self, timeout_s: float) -> None:
        """Finish queued writes (up to ``timeout_s``), drop the rest, stop the threads."""
        self.closed = True
        if not self.flush(timeout_s):
            logger.warning("NVMe tier: write-back did not finish within %.0f s; dropping the "
                           "rest.", timeout_s)
            self.engine.cancel_writes()  # writes not started end as cancelled
            self.flush(CANCEL_WAIT_S)
        self.queue.close()


def _os_error(err: int, path: Path) -> OSError:
    """The exception the Python engine raises for ``err`` writing ``path``: a link, or a
    file where the tree needs a directory, is ``NotAChunkFile`` (as ``safe_fs`` says)."""
    if err in (errno.ELOOP, errno.ENOTDIR, errno.EXDEV):
        return NotAChunkFile(err, "a link or a non-directory in the cache tree (never "
                                  "followed)", str(path))
    if err == errno.ENOENT:
        return FileNotFoundError(err, "the cache directory was removed", str(path))
    return OSError(err, os.strerror(err), str(path))
