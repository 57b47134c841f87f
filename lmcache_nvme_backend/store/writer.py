"""Writing chunks: admission, the write-back threads, reservation and eviction, publishing.

A store call only registers and enqueues (``submit_many``); writer threads take
each chunk from the byte-bounded queue, yield to reads in flight, pick the root
(rendezvous hashing over healthy roots), reserve the file's bytes against that
root's budget (evicting least recently used, unpinned chunks, and more while the
filesystem is below ``nvme.min_free_gb``), write
``<name>.tmp-<host>-<pid>-<thread>`` and rename it into place.  Only then is the
chunk indexed, and only then is its host memory released.
"""

from __future__ import annotations

import contextlib
import enum
import errno
import logging
import os
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from ..config import NVMeSettings
from ..disk.format import (
    combine_block_digests,
    encode_header,
    file_size_for,
    max_key_bytes,
    text_bytes,
)
from ..disk.gpusum import host_checksum
from ..disk.layout import temp_name
from ..disk.safe_fs import open_dir_beneath, open_dirs_beneath
from ..io.posix import NotAChunkFile, PosixIOEngine, create_in_dir
from .catalog import Catalog
from .index import IndexEntry
from .roots import (
    Roots,
    RootState,
    note_full,
    note_space,
    unlink_quietly,
    write_namespace_file,
)
from .stats import Counter, StoreStats
from .writeback import ChunkWrite, ReadPriorityGate, WriteBackQueue

if TYPE_CHECKING:
    from .shared import SharedTree

logger = logging.getLogger(__name__)

WRITER_NICE = 10


class SubmitResult(enum.Enum):
    QUEUED = "queued"
    DUPLICATE = "duplicate"
    QUEUE_FULL = "queue_full"
    OVERSIZE = "oversize"
    CLOSED = "closed"


class ChunkWriter:
    """Admission and write-back of one store."""

    def __init__(self, settings: NVMeSettings, catalog: Catalog, roots: Roots,
                 engine: PosixIOEngine, gate: ReadPriorityGate, stats: StoreStats) -> None:
        self.settings = settings
        self._catalog = catalog
        self._roots = roots
        self.engine = engine
        self._gate = gate
        self._stats = stats
        self._queue = WriteBackQueue(settings.write_queue_bytes)
        self._closed = False
        self._free = [FreeSpaceGuard(root.layout.root, root.min_free_bytes)
                      for root in roots]
        # Set when chunks are read into GPU memory: files also carry gpusum's checksum.
        self.record_gpu_checksums = False
        # Shared mode: the directory's budget is kept with the other members there.
        self.shared: SharedTree | None = None
        self.threads = [
            threading.Thread(target=self._writer_loop, name=f"nvme-writer-{i}", daemon=True)
            for i in range(settings.write_threads or len(roots))
        ]

    def start(self) -> None:
        for t in self.threads:
            t.start()

    @property
    def queue_bytes(self) -> int:
        return self._queue.bytes_held

    # -- admission -------------------------------------------------------------

    def submit_many(self, writes: Sequence[ChunkWrite]) -> list[SubmitResult]:
        """Queue chunks for persistence without waiting for the drive.

        Each ``payload`` must stay valid until its ``release`` is called; the store
        calls every ``release`` exactly once, whatever the result (immediately for
        a chunk that is not queued).  One lock round and one writer wake-up serve
        the whole batch, which keeps the engine's store path short.
        """
        if bad := next((w for w in writes if w.meta.nbytes != w.nbytes), None):
            for w in writes:
                w.release()
            raise ValueError(f"tensor metadata says {bad.meta.nbytes} bytes, payload has "
                             f"{bad.nbytes}")
        results = [self._admission(w) for w in writes]
        admitted = [i for i, r in enumerate(results) if r is SubmitResult.QUEUED]
        fresh = self._catalog.register([writes[i] for i in admitted], time.time_ns())
        for i, is_new in zip(admitted, fresh, strict=True):
            if not is_new:
                results[i] = SubmitResult.DUPLICATE
        jobs = {i: writes[i] for i, is_new in zip(admitted, fresh, strict=True) if is_new}
        if jobs:
            self._enqueue(jobs, results)
        for w, result in zip(writes, results, strict=True):
            if result is not SubmitResult.QUEUED:
                w.release()
        self._stats.add(Counter.DUPLICATE_PUTS, results.count(SubmitResult.DUPLICATE))
        return results

    def _admission(self, write: ChunkWrite) -> SubmitResult:
        if self._closed:
            return SubmitResult.CLOSED
        budget = self._catalog.budgets[0]
        too_big = file_size_for(write.nbytes) > budget or write.nbytes > self._queue.capacity
        if too_big or len(text_bytes(write.key)) > max_key_bytes(write.namespace, write.meta):
            if not self._stats.get(Counter.OVERSIZE_DROPS):
                logger.warning(
                    "NVMe tier: not storing a %d-byte chunk: it exceeds nvme.write_queue_mb "
                    "(%d bytes) or the budget per path (%d bytes), or its key is too long for "
                    "the header. Raise nvme.write_queue_mb / nvme.max_size_gb.", write.nbytes,
                    self._queue.capacity, budget)
            self._stats.add(Counter.OVERSIZE_DROPS)
            return SubmitResult.OVERSIZE
        return SubmitResult.QUEUED

    def _enqueue(self, jobs: dict[int, ChunkWrite], results: list[SubmitResult]) -> None:
        """Offer the jobs to the queue; mark the ones it refuses in ``results``."""
        wait = self.settings.queue_full_policy == "wait"
        if wait and self._queue.bytes_held + sum(j.nbytes for j in jobs.values()) > \
                self._queue.capacity:
            self._stats.add(Counter.QUEUE_FULL_WAITS)
        accepted = self._queue.offer_many(list(jobs.values()), wait_s=1e9 if wait else 0.0)
        refused = [(i, job) for (i, job), ok in zip(jobs.items(), accepted, strict=True)
                   if not ok]
        self._stats.add(Counter.WRITES_ENQUEUED, len(jobs) - len(refused))
        if not refused:
            return
        self._catalog.end_pending(job.digest for _, job in refused)
        for i, _ in refused:
            results[i] = SubmitResult.CLOSED if self._closed else SubmitResult.QUEUE_FULL
        if not self._closed:
            self._stats.add(Counter.QUEUE_FULL_DROPS, len(refused))

    def flush(self, timeout_s: float = 60.0) -> bool:
        """Wait until every queued write has finished (persisted or dropped)."""
        return self._queue.wait_empty(timeout_s)

    # -- write-back ------------------------------------------------------------

    def _writer_loop(self) -> None:
        _lower_thread_cpu_priority()
        self.engine.prepare_thread()
        while (job := self._queue.take()) is not None:
            try:
                self._gate.wait_for_readers()
                self._persist(job)
            except Exception:  # a writer thread must survive anything one job does
                logger.exception("NVMe tier: unexpected error persisting %s", job.key)
                self._stats.add(Counter.WRITE_FAILURES)
            finally:
                self._catalog.end_pending([job.digest])
                self._end_job(job)

    def _persist(self, job: ChunkWrite) -> None:
        root = self._roots.choose(job.digest)
        if root is None:
            self._stats.add(Counter.WRITE_FAILURES)
            return
        size = file_size_for(job.nbytes)
        if not self._reserve(root, size):
            self._stats.add(Counter.CAPACITY_DROPS)
            return
        final = root.layout.chunk_path(job.ns_id, job.digest)
        published = False
        started = time.perf_counter()
        try:
            self._write_and_publish(root, job, final)
            published = True
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                # A full filesystem is not a failing drive: drop this write, keep serving.
                self._stats.add(Counter.CAPACITY_DROPS)
                self._free[root.index].refresh()
                note_full(root, exc)
            elif isinstance(exc, NotAChunkFile):
                # A link or file planted where the tree needs a directory: never followed,
                # this write is dropped, the drive is fine.
                self._stats.add(Counter.WRITE_FAILURES)
                logger.warning("NVMe tier: not writing %s: %s", final, exc)
            else:
                self._stats.add(Counter.WRITE_FAILURES)
                self._roots.record_error(root, exc)
        finally:
            if published:
                self._catalog.publish(IndexEntry(job.digest, job.ns_id, root.index, size,
                                                 job.meta, time.time_ns()), reserved=size)
            else:
                self._catalog.release(root.index, size)
        if published:
            root.consecutive_errors = 0
            note_space(root)
            self._stats.record_write(job.nbytes, time.perf_counter() - started)
            if job.on_persisted is not None:
                job.on_persisted()

    def _write_and_publish(self, root: RootState, job: ChunkWrite, final: Path) -> None:
        """Write the chunk under this thread's temp name and rename it to ``final``.

        Create, rename and (``fsync: full``) directory sync all go through one
        descriptor of the shard directory, opened beneath the root without following
        a link; it is opened afresh for every chunk, so a directory replaced meanwhile
        is never written through.  The temp file is removed if anything fails.
        """
        dir_fd = self._open_shard_dir(root, job, final.parent)
        tmp = temp_name(final.name)
        try:
            try:
                self._write_temp(dir_fd, tmp, root, job)
                os.rename(tmp, final.name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp, dir_fd=dir_fd)
                raise
            if self.settings.fsync == "full":
                os.fsync(dir_fd)
        finally:
            os.close(dir_fd)

    def _open_shard_dir(self, root: RootState, job: ChunkWrite, directory: Path) -> int:
        """A descriptor of the chunk's shard directory, created (and the namespace's name
        file with it) when it does not exist yet."""
        rel = root.layout.relative(directory)
        try:
            return open_dir_beneath(root.layout.root, rel)
        except FileNotFoundError:
            pass
        dir_fd = open_dirs_beneath(root.layout.root, rel, self.settings.dir_mode)
        try:
            write_namespace_file(root.layout, job.ns_id, job.namespace, self.settings.file_mode)
        except BaseException:
            os.close(dir_fd)
            raise
        return dir_fd

    def _write_temp(self, dir_fd: int, tmp: str, root: RootState, job: ChunkWrite) -> None:
        """Write the temp file: payload hashed while it is written, header (v2) last."""
        def header_for(digests: list[int]) -> bytes:
            gpu_sum = host_checksum(job.payload) if self.record_gpu_checksums else None
            if gpu_sum is not None:
                self._stats.add(Counter.GPU_CHECKSUMS_RECORDED)
            return encode_header(job.key, job.namespace, job.meta, job.nbytes,
                                 combine_block_digests(digests), gpu_checksum=gpu_sum)

        try:
            fd = create_in_dir(dir_fd, tmp, root.direct, self.settings.file_mode)
        except FileExistsError:
            # Left by a dead writer that had this thread's host, pid and thread id.
            os.unlink(tmp, dir_fd=dir_fd)
            fd = create_in_dir(dir_fd, tmp, root.direct, self.settings.file_mode)
        try:
            self.engine.write_hashed_to(fd, job.payload, header_for, direct=root.direct,
                                        sync_data=self.settings.fsync != "none")
        finally:
            os.close(fd)

    def _end_job(self, job: ChunkWrite) -> None:
        try:
            job.release()
        finally:
            self._queue.done(job)

    # -- capacity --------------------------------------------------------------

    def _reserve(self, root: RootState, size: int) -> bool:
        """Reserve ``size`` bytes on ``root``, evicting LRU chunks for budget and free space
        (shared mode: of the directory's one budget, evicting its LRU chunks, whoever
        wrote them)."""
        if self.shared is not None:
            return self.shared.reserve(root, size, self._free[root.index])
        victims = self._catalog.reserve(root.index, size)
        if victims is None:
            return False
        self.evict(victims)
        guard = self._free[root.index]
        while not guard.room_for(size):
            oldest = self._catalog.pop_oldest_unpinned(root.index)
            if oldest is None:
                self._catalog.release(root.index, size)
                note_full(root, None)
                return False
            self.evict([oldest])
            guard.refresh()
        return True

    def evict(self, victims: list[IndexEntry]) -> None:
        """Delete the files of entries already taken out of the index, and say so."""
        for victim in victims:
            self.unlink(victim)
            self._stats.add(Counter.EVICTIONS)
            self._stats.add(Counter.EVICTED_BYTES, victim.size)
        self._catalog.notify_removed(victims)

    def unlink(self, entry: IndexEntry) -> None:
        """Delete an entry's file (shared mode: claimed and accounted for first)."""
        if self.shared is not None:
            self.shared.delete(entry)
            return
        unlink_quietly(self._roots[entry.root].layout.chunk_path(entry.ns_id, entry.digest))

    # -- shutdown --------------------------------------------------------------

    def close(self, timeout_s: float) -> None:
        """Finish queued writes (up to ``timeout_s``), drop the rest, stop the threads."""
        self._closed = True
        if not self.flush(timeout_s):
            logger.warning("NVMe tier: write-back did not finish within %.0f s; dropping the "
                           "rest.", timeout_s)
        for job in self._queue.close():
            self._catalog.end_pending([job.digest])
            self._end_job(job)
        for t in self.threads:
            t.join()


def _lower_thread_cpu_priority() -> None:
    """Make the calling writer thread yield the CPU to the inference engine's threads.

    On Linux a thread is a task with its own nice value; write-back is background
    work and should never take a core from the engine when the host is busy.
    """
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WRITER_NICE)
    except (AttributeError, OSError) as exc:
        logger.debug("could not lower the writer thread's priority: %s", exc)


def free_bytes(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


class FreeSpaceGuard:
    """Keeps ``min_free`` bytes free on one root's filesystem without a ``statvfs`` per write.

    The kernel is asked again after ``CHECK_BYTES`` were written or ``CHECK_S``
    passed since it was last asked, and whenever the running estimate comes within
    ``CHECK_BYTES`` of the floor, so near the floor every decision is exact.
    """

    CHECK_BYTES = 256 << 20
    CHECK_S = 1.0

    def __init__(self, path: Path, min_free: int) -> None:
        self._path = path
        self._min_free = min_free
        self._lock = threading.Lock()
        self._free = 0
        self._written = 0
        self._asked_at = -self.CHECK_S

    def refresh(self) -> None:
        """Ask the kernel now (after a deletion, or when a write found the disk full)."""
        with self._lock:
            self._asked_at = -self.CHECK_S

    def room_for(self, size: int) -> bool:
        """Whether ``size`` more bytes keep the floor; if so they are counted as written."""
        with self._lock:
            now = time.monotonic()
            if (now - self._asked_at >= self.CHECK_S or self._written >= self.CHECK_BYTES
                    or self._free - size - self.CHECK_BYTES < self._min_free):
                self._free = free_bytes(self._path)
                self._asked_at = now
                self._written = 0
            if self._free - size < self._min_free:
                return False
            self._free -= size
            self._written += size
            return True

