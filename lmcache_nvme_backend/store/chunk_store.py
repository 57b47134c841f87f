"""The chunk store: index, capacity, write-back, validation on read, and recovery.

Keys here are plain strings (the adapter translates LMCache keys); payloads are
host buffers.  One lock guards the index and the pending-write table and is
never held across I/O.

Lifecycle of a chunk:

1. ``submit`` registers the write (duplicates of a stored or pending key are
   skipped) and enqueues it; the caller never waits for the drive (policy
   ``drop``) or waits only for queue room (policy ``wait``).
2. A writer thread picks a root (rendezvous hashing over healthy roots),
   reserves the file's bytes against the root's budget (evicting least recently
   used, unpinned chunks), writes ``<name>.tmp-<host>-<pid>-<thread>`` and
   renames it into place.  Only then does the chunk become visible.
3. ``read_into`` reads header and payload, and serves the payload only if the
   header is ours, names the same key, has the expected length and the payload
   checksum matches.  Anything else is a miss, counted, and the file is moved to
   the quarantine directory.
4. On restart the index is rebuilt from the directory tree (the truth), with
   recency and metadata from the manifest.
"""

from __future__ import annotations

import enum
import errno
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path

import xxhash

from ..config import NVMeConfigError, NVMeSettings
from ..disk.format import (
    ChunkHeader,
    FormatError,
    TensorMeta,
    decode_header,
    encode_header,
    file_size_for,
    max_key_bytes,
    payload_checksum,
    text_bytes,
)
from ..disk.gpusum import host_checksum
from ..disk.layout import MARKER_NAME, RootLayout, key_digest, namespace_id
from ..disk.manifest import load_manifest, save_manifest
from ..io.posix import PosixIOEngine, ReadRequest, ShortFileError, probe_direct_io
from .index import ChunkIndex, IndexEntry
from .stats import PATH_POSIX, StoreStats
from .writeback import ReadPriorityGate, WriteBackQueue, WriteJob

logger = logging.getLogger(__name__)

# A root that fails this many I/Os in a row is taken out of service for a while.
ROOT_ERROR_LIMIT = 3
ROOT_RETRY_S = 30.0
MAX_QUARANTINED_FILES = 256
# Index entries copied (and encoded) per lock hold / GIL hold when saving the manifest.
MANIFEST_BATCH = 4096


class SubmitResult(enum.Enum):
    QUEUED = "queued"
    DUPLICATE = "duplicate"
    QUEUE_FULL = "queue_full"
    OVERSIZE = "oversize"
    CLOSED = "closed"


@dataclass
class RootState:
    """One cache directory (usually one drive)."""

    index: int
    layout: RootLayout
    direct: bool
    consecutive_errors: int = 0
    offline_until: float = 0.0

    @property
    def healthy(self) -> bool:
        return time.monotonic() >= self.offline_until


@dataclass(frozen=True)
class ChunkWrite:
    """One chunk to persist: ``payload`` stays valid until the store calls ``release``."""

    key: str
    namespace: str
    meta: TensorMeta
    payload: memoryview
    release: Callable[[], None]
    on_persisted: Callable[[], None] | None = None


@dataclass(frozen=True)
class ReadPlan:
    """Where a stored chunk lives, for a reader outside the store (the GPU path)."""

    key: str
    digest: str
    path: Path
    payload_len: int
    meta: TensorMeta
    direct: bool
    root: int


@dataclass(frozen=True)
class ChunkRead:
    """One chunk to read: its key and a writable host buffer of at least its payload length."""

    key: str
    dest: memoryview


class ChunkStore:
    """Chunk files on one or more directories, with an LRU byte budget and async write-back."""

    def __init__(self, settings: NVMeSettings) -> None:
        self.settings = settings
        self.stats = StoreStats()
        self.roots = [self._open_root(i, path) for i, path in enumerate(settings.paths)]
        budget = settings.max_size_bytes // len(self.roots)
        self._lock = threading.Lock()
        self._index = ChunkIndex([budget] * len(self.roots))
        self._pending: dict[str, WriteJob] = {}
        self._known_namespaces: set[tuple[int, str]] = set()
        self._io_pool = ThreadPoolExecutor(settings.io_threads, thread_name_prefix="nvme-io")
        self._engine = PosixIOEngine(settings.task_size_bytes, self._io_pool)
        self._queue = WriteBackQueue(settings.write_queue_bytes)
        self._gate = ReadPriorityGate()
        self._closed = False
        self._stop = threading.Event()
        self._removal_listeners: list[Callable[[list[IndexEntry]], None]] = []
        # Set by a backend that reads into GPU memory: writers also record gpusum's checksum.
        self.record_gpu_checksums = False
        for root in self.roots:
            self._recover(root)
        self._writers = [
            threading.Thread(target=self._writer_loop, name=f"nvme-writer-{i}", daemon=True)
            for i in range(settings.write_threads or len(self.roots))
        ]
        for t in self._writers:
            t.start()
        self._manifest_thread: threading.Thread | None = None
        if settings.manifest_interval_s > 0:
            self._manifest_thread = threading.Thread(
                target=self._manifest_loop, name="nvme-manifest", daemon=True)
            self._manifest_thread.start()

    # -- lookups -------------------------------------------------------------

    def contains(self, key: str, pin: bool = False) -> bool:
        """Whether a published chunk exists for ``key`` (optionally pinning it)."""
        digest = key_digest(key)
        with self._lock:
            entry = self._index.get(digest)
            hit = entry is not None and self.roots[entry.root].healthy
            if hit:
                self._index.touch(digest, time.time_ns())
                if pin:
                    self._index.pin(digest)
        self.stats.add("lookups")
        self.stats.add("hits" if hit else "misses")
        return hit

    def lookup(self, key: str, namespace: str, pin: bool = False) -> bool:
        """``contains``, plus, in shared mode, chunks that other processes published.

        With ``shared`` set, several processes (or nodes on a shared
        filesystem) use the same directories and each has its own index: an
        index hit is confirmed with a ``stat`` (another process may have
        evicted the file) and an index miss looks on disk, where a file is
        adopted only if its header is ours, names this key and matches the
        file's size.  The payload checksum is still verified on every read.
        """
        if not self.settings.shared:
            return self.contains(key, pin=pin)
        digest = key_digest(key)
        with self._lock:
            entry = self._index.get(digest)
            path = None if entry is None else \
                self.roots[entry.root].layout.chunk_path(entry.ns_id, digest)
        if path is not None and not os.path.exists(path):
            self._forget(digest)
            self.stats.add("shared_vanished")
            path = None
        if path is None:
            self._adopt(key, digest, namespace_id(namespace))
        return self.contains(key, pin=pin)

    def _adopt(self, key: str, digest: str, ns_id: str) -> bool:
        """Index a chunk file another process published (shared mode)."""
        order = sorted((r for r in self.roots if r.healthy), reverse=True,
                       key=lambda r: xxhash.xxh64_intdigest(f"{r.index}:{digest}".encode()))
        for root in order:  # the root a writer would choose first
            path = root.layout.chunk_path(ns_id, digest)
            try:
                raw, size = self._engine.read_header(path, root.direct)
            except FileNotFoundError:
                continue
            except OSError as exc:
                logger.debug("NVMe tier: cannot read %s: %s", path, exc)
                continue
            try:
                header = decode_header(raw)
                if header.key != key or header.file_size != size:
                    raise FormatError("header does not describe this key and file")
            except FormatError as exc:
                self._reject(root, digest, path, exc)
                continue
            with self._lock:
                if digest not in self._index:
                    self._index.add(IndexEntry(digest, ns_id, root.index, size,
                                               header.tensor_meta, time.time_ns()))
            self.stats.add("shared_adopted")
            return True
        return False

    def add_removal_listener(self, listener: Callable[[list[IndexEntry]], None]) -> None:
        """Call ``listener`` (outside the store lock) with entries that leave the index.

        Evictions, removals, and files found missing or invalid all count.
        """
        self._removal_listeners.append(listener)

    def _notify_removed(self, entries: list[IndexEntry]) -> None:
        for listener in self._removal_listeners:
            try:
                listener(entries)
            except Exception:  # a listener must never break the store
                logger.exception("NVMe tier: removal listener failed")

    def is_pending(self, key: str) -> bool:
        with self._lock:
            return key_digest(key) in self._pending

    def pin(self, key: str) -> bool:
        with self._lock:
            return self._index.pin(key_digest(key))

    def unpin(self, key: str) -> bool:
        with self._lock:
            return self._index.unpin(key_digest(key))

    def tensor_meta(self, key: str) -> TensorMeta | None:
        """Allocation metadata of a stored chunk (read from its header if not yet known)."""
        digest = key_digest(key)
        with self._lock:
            entry = self._index.get(digest)
            if entry is None or entry.meta is not None:
                return None if entry is None else entry.meta
            root = self.roots[entry.root]
            path = root.layout.chunk_path(entry.ns_id, digest)
        try:
            raw, size = self._engine.read_header(path, root.direct)
            header = decode_header(raw)
            if header.key != key or header.file_size != size:
                raise FormatError("header does not describe this key and file")
        except FileNotFoundError:
            self._forget(digest)
            return None
        except (OSError, FormatError) as exc:
            self._reject(root, digest, path, exc)
            return None
        with self._lock:
            if (current := self._index.get(digest)) is not None:
                current.meta = header.tensor_meta
        return header.tensor_meta

    def remove(self, key: str) -> bool:
        """Delete a chunk (pinned or not)."""
        digest = key_digest(key)
        with self._lock:
            entry = self._index.remove(digest)
        if entry is None:
            return False
        self._unlink(entry)
        self._notify_removed([entry])
        return True

    def usage(self) -> dict[str, int]:
        with self._lock:
            return {
                "entries": len(self._index),
                "used_bytes": self._index.used_bytes(),
                "reserved_bytes": self._index.reserved_bytes(),
                "capacity_bytes": sum(self._index.budgets),
                "pending_writes": len(self._pending),
                "queue_bytes": self._queue.bytes_held,
            }

    def stats_snapshot(self) -> dict[str, float]:
        snap: dict[str, float] = dict(self.stats.snapshot())
        snap.update(self.usage())
        snap["roots_offline"] = sum(not r.healthy for r in self.roots)
        snap["direct_io_roots"] = sum(r.direct for r in self.roots)
        return snap

    # -- reads ---------------------------------------------------------------

    def read_into(self, reads: Sequence[ChunkRead]) -> list[bool]:
        """Fill each buffer with its chunk's payload; False (a miss) for anything not served.

        A buffer is only reported filled after the header names the same key
        and the payload checksum matches, so a False buffer may hold garbage
        and must not be used.
        """
        results = [False] * len(reads)
        plans = self.plan_reads([read.key for read in reads])
        todo = [(i, plan, ReadRequest(plan.path, plan.payload_len, reads[i].dest, plan.direct))
                for i, plan in enumerate(plans) if plan is not None]
        if not todo:
            self.stats.add("read_failures", len(reads))
            return results
        started = time.perf_counter()
        with self._gate.reading():
            self._engine.read_chunks([req for _, _, req in todo])
        elapsed = time.perf_counter() - started
        self.stats.add("read_seconds", elapsed)

        def judge(item: tuple[int, ReadPlan, ReadRequest]) -> bool:
            _, plan, req = item
            return self.complete_read(
                plan, req.header, req.error,
                lambda header: payload_checksum(req.dest[: req.payload_len])
                == header.payload_checksum)

        # Checksumming releases the GIL: verify the chunks of a batch in parallel.
        served_bytes = 0
        for (i, plan, _), ok in zip(todo, self._io_pool.map(judge, todo), strict=True):
            results[i] = ok
            if ok:
                served_bytes += plan.payload_len
        self.stats.record_read(PATH_POSIX, results.count(True), served_bytes, elapsed)
        self.stats.add("read_failures", results.count(False))
        return results

    # -- reads done outside the store (GPU path, gpu_reader.py) --------------

    def plan_reads(self, keys: Sequence[str]) -> list[ReadPlan | None]:
        """Where each chunk lives (None: not indexed, unreadable header, or its path is down)."""
        for key in keys:
            self.tensor_meta(key)  # a chunk recovered from disk learns its meta here
        plans: list[ReadPlan | None] = []
        with self._lock:
            for key in keys:
                digest = key_digest(key)
                entry = self._index.get(digest)
                if entry is None or entry.meta is None or not self.roots[entry.root].healthy:
                    plans.append(None)
                    continue
                root = self.roots[entry.root]
                plans.append(ReadPlan(key, digest, root.layout.chunk_path(entry.ns_id, digest),
                                      entry.meta.nbytes, entry.meta, root.direct, root.index))
        return plans

    def reading(self) -> AbstractContextManager[None]:
        """Hold while reading: write-back yields to readers (as in ``read_into``)."""
        return self._gate.reading()

    def complete_read(self, plan: ReadPlan, header: bytes, error: BaseException | None,
                      payload_ok: Callable[[ChunkHeader], bool]) -> bool:
        """Judge a read done outside the store by ``read_into``'s rules, with its counters.

        ``payload_ok(header)`` says whether the payload matches the header's
        checksum; anything wrong is a miss and the file goes to quarantine.
        """
        root = self.roots[plan.root]
        if isinstance(error, (FileNotFoundError, PermissionError)):
            # Gone, or not ours to read (another user's file in a shared tree): a miss
            # for this key, not a sign that the drive is failing.
            self._forget(plan.digest)
            return False
        if error is not None and not isinstance(error, ShortFileError):
            self._root_error(root, error)
            return False
        try:
            if error is not None:
                raise FormatError(str(error))
            decoded = decode_header(header)
            if decoded.key != plan.key:
                raise FormatError("file holds another key")
            if decoded.payload_len != plan.payload_len:
                raise FormatError("payload length differs from the index")
            if not payload_ok(decoded):
                self.stats.add("checksum_failures")
                raise FormatError("payload checksum mismatch")
        except FormatError as exc:
            self._reject(root, plan.digest, plan.path, exc)
            return False
        root.consecutive_errors = 0
        self.stats.add("read_chunks")
        self.stats.add("read_bytes", plan.payload_len)
        return True

    # -- writes --------------------------------------------------------------

    def submit(self, key: str, namespace: str, meta: TensorMeta, payload: memoryview,
               release: Callable[[], None],
               on_persisted: Callable[[], None] | None = None) -> SubmitResult:
        """Queue one chunk for persistence; see ``submit_many``."""
        return self.submit_many([ChunkWrite(key, namespace, meta, payload, release,
                                            on_persisted)])[0]

    def submit_many(self, writes: Sequence[ChunkWrite]) -> list[SubmitResult]:
        """Queue chunks for persistence without waiting for the drive.

        Each ``payload`` must stay valid until its ``release`` is called; the store
        calls every ``release`` exactly once, whatever the result (immediately for
        a chunk that is not queued).  One lock round and one writer wake-up serve
        the whole batch, which keeps the engine's store path short.
        """
        if bad := next((w for w in writes if w.meta.nbytes != len(w.payload)), None):
            for w in writes:
                w.release()
            raise ValueError(f"tensor metadata says {bad.meta.nbytes} bytes, payload has "
                             f"{len(bad.payload)}")
        results = [self._admission(w) for w in writes]
        jobs: dict[int, WriteJob] = {}
        now = time.time_ns()
        with self._lock:
            for i, (w, result) in enumerate(zip(writes, results, strict=True)):
                if result is not SubmitResult.QUEUED:
                    continue
                digest = key_digest(w.key)
                if digest in self._pending or digest in self._index:
                    self._index.touch(digest, now)
                    results[i] = SubmitResult.DUPLICATE
                    continue
                jobs[i] = self._pending[digest] = WriteJob(
                    digest, w.key, w.namespace, namespace_id(w.namespace), w.meta, w.payload,
                    w.release, w.on_persisted)
        if jobs:
            self._enqueue(jobs, results)
        for w, result in zip(writes, results, strict=True):
            if result is not SubmitResult.QUEUED:
                w.release()
        self.stats.add("duplicate_puts", results.count(SubmitResult.DUPLICATE))
        return results

    def _admission(self, write: ChunkWrite) -> SubmitResult:
        if self._closed:
            return SubmitResult.CLOSED
        nbytes = len(write.payload)
        too_big = file_size_for(nbytes) > self._index.budgets[0] or nbytes > self._queue.capacity
        if too_big or len(text_bytes(write.key)) > max_key_bytes(write.namespace, write.meta):
            if not self.stats.get("oversize_drops"):
                logger.warning(
                    "NVMe tier: not storing a %d-byte chunk: it exceeds nvme.write_queue_mb "
                    "(%d bytes) or the budget per path (%d bytes), or its key is too long for "
                    "the header. Raise nvme.write_queue_mb / nvme.max_size_gb.", nbytes,
                    self._queue.capacity, self._index.budgets[0])
            self.stats.add("oversize_drops")
            return SubmitResult.OVERSIZE
        return SubmitResult.QUEUED

    def _enqueue(self, jobs: dict[int, WriteJob], results: list[SubmitResult]) -> None:
        """Offer the jobs to the queue; mark the ones it refuses in ``results``."""
        wait = self.settings.queue_full_policy == "wait"
        if wait and self._queue.bytes_held + sum(j.nbytes for j in jobs.values()) > \
                self._queue.capacity:
            self.stats.add("queue_full_waits")
        accepted = self._queue.offer_many(list(jobs.values()), wait_s=1e9 if wait else 0.0)
        refused = [(i, job) for (i, job), ok in zip(jobs.items(), accepted, strict=True)
                   if not ok]
        self.stats.add("writes_enqueued", len(jobs) - len(refused))
        if not refused:
            return
        with self._lock:
            for _, job in refused:
                self._pending.pop(job.digest, None)
        for i, _ in refused:
            results[i] = SubmitResult.CLOSED if self._closed else SubmitResult.QUEUE_FULL
        if not self._closed:
            self.stats.add("queue_full_drops", len(refused))

    def flush(self, timeout_s: float = 60.0) -> bool:
        """Wait until every queued write has finished (persisted or dropped)."""
        return self._queue.wait_empty(timeout_s)

    def _writer_loop(self) -> None:
        _lower_thread_cpu_priority()
        while (job := self._queue.take()) is not None:
            try:
                self._gate.wait_for_readers()
                self._persist(job)
            except Exception:  # a writer thread must survive anything one job does
                logger.exception("NVMe tier: unexpected error persisting %s", job.key)
                self.stats.add("write_failures")
            finally:
                with self._lock:
                    self._pending.pop(job.digest, None)
                self._end_job(job)

    def _persist(self, job: WriteJob) -> None:
        root = self._choose_root(job.digest)
        if root is None:
            self.stats.add("write_failures")
            return
        size = file_size_for(job.nbytes)
        if not self._reserve(root, size):
            self.stats.add("capacity_drops")
            return
        final = root.layout.chunk_path(job.ns_id, job.digest)
        tmp = root.layout.temp_path(final)
        published = False
        started = time.perf_counter()
        try:
            self._prepare_dir(root, job, final.parent)
            gpu_sum = host_checksum(job.payload) if self.record_gpu_checksums else None
            header = encode_header(job.key, job.namespace, job.meta, job.nbytes,
                                   payload_checksum(job.payload), gpu_checksum=gpu_sum)
            if gpu_sum is not None:
                self.stats.add("gpu_checksums_recorded")
            self._write_file(root, tmp, header, job.payload)
            os.rename(tmp, final)
            published = True
            if self.settings.fsync == "full":
                _fsync_dir(final.parent)
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                # A full filesystem is not a failing drive: drop this write, keep serving.
                self.stats.add("capacity_drops")
            else:
                self.stats.add("write_failures")
                self._root_error(root, exc)
            _unlink_quietly(tmp)
        finally:
            with self._lock:
                self._index.release(root.index, size)
                if published:
                    self._index.add(IndexEntry(job.digest, job.ns_id, root.index, size,
                                               job.meta, time.time_ns()))
        if published:
            root.consecutive_errors = 0
            self.stats.record_write(job.nbytes, time.perf_counter() - started)
            if job.on_persisted is not None:
                job.on_persisted()

    def _write_file(self, root: RootState, tmp: Path, header: bytes, payload: memoryview) -> None:
        write = lambda: self._engine.write_chunk(  # noqa: E731
            tmp, header, payload, direct=root.direct, mode=self.settings.file_mode,
            sync_data=self.settings.fsync != "none")
        try:
            write()
        except FileExistsError:
            # Left by a dead writer that had this thread's host, pid and thread id.
            _unlink_quietly(tmp)
            write()

    def _reserve(self, root: RootState, size: int) -> bool:
        """Reserve ``size`` bytes on ``root``, evicting LRU chunks for budget and free space."""
        with self._lock:
            victims = self._index.plan_reservation(root.index, size)
            if victims is None:
                return False
            for victim in victims:
                self._index.remove(victim.digest)
            self._index.reserve(root.index, size)
        self._evict(victims)
        while _free_bytes(root.layout.root) - size < self.settings.min_free_bytes:
            with self._lock:
                oldest = next((e for e in self._index.lru_order(root.index) if e.pins == 0), None)
                if oldest is None:
                    self._index.release(root.index, size)
                    return False
                self._index.remove(oldest.digest)
            self._evict([oldest])
        return True

    def _evict(self, victims: list[IndexEntry]) -> None:
        for victim in victims:
            self._unlink(victim)
            self.stats.add("evictions")
            self.stats.add("evicted_bytes", victim.size)
        if victims:
            self._notify_removed(victims)

    def _end_job(self, job: WriteJob) -> None:
        try:
            job.release()
        finally:
            self._queue.done(job)

    # -- roots, failures, quarantine ----------------------------------------

    def _open_root(self, i: int, path: Path) -> RootState:
        layout = RootLayout(path)
        for d in (layout.index_dir, layout.quarantine_dir, layout.namespaces_dir):
            d.mkdir(parents=True, exist_ok=True)
        marker = path / MARKER_NAME
        if not marker.exists():
            marker.write_text("lmcache-nvme-backend cache root, chunk format 1\n")
        mode = self.settings.direct_io
        direct = mode != "off" and probe_direct_io(path)
        if mode == "on" and not direct:
            raise NVMeConfigError(
                f"nvme.direct_io: '{path}' does not support O_DIRECT (tmpfs, some network or "
                "overlay filesystems). Put the cache on a local NVMe filesystem such as ext4 or "
                "xfs, or set nvme.direct_io to 'auto' to fall back to buffered I/O.")
        if mode == "auto" and not direct:
            logger.warning("NVMe tier: %s does not support O_DIRECT; using buffered I/O there "
                           "(page cache in the data path).", path)
        return RootState(i, layout, direct)

    def _choose_root(self, digest: str) -> RootState | None:
        healthy = [r for r in self.roots if r.healthy]
        if not healthy:
            return None
        return max(healthy, key=lambda r: xxhash.xxh64_intdigest(f"{r.index}:{digest}".encode()))

    def _root_error(self, root: RootState, exc: BaseException) -> None:
        root.consecutive_errors += 1
        logger.warning("NVMe tier: I/O error on %s: %s", root.layout.root, exc)
        if root.consecutive_errors >= ROOT_ERROR_LIMIT and root.healthy:
            root.offline_until = time.monotonic() + ROOT_RETRY_S
            logger.error("NVMe tier: taking %s out of service for %.0f s after %d errors in "
                         "a row; other paths keep serving.", root.layout.root, ROOT_RETRY_S,
                         root.consecutive_errors)

    def _prepare_dir(self, root: RootState, job: WriteJob, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        if (root.index, job.ns_id) not in self._known_namespaces:
            name_file = root.layout.namespace_name_file(job.ns_id)
            if not name_file.exists():
                name_file.write_bytes(text_bytes(job.namespace) + b"\n")
            self._known_namespaces.add((root.index, job.ns_id))

    def _reject(self, root: RootState, digest: str, path: Path, why: Exception) -> None:
        """A file failed validation: forget it and move it to quarantine."""
        self.stats.add("invalid_files")
        logger.warning("NVMe tier: not serving %s: %s; quarantined.", path, why)
        self._forget(digest)
        target = root.layout.quarantine_dir / f"{digest}.{time.time_ns()}.bad"
        try:
            os.rename(path, target)
            self.stats.add("quarantined_files")
        except OSError:
            _unlink_quietly(path)
        self._trim_quarantine(root)

    def _trim_quarantine(self, root: RootState) -> None:
        try:
            files = sorted(root.layout.quarantine_dir.iterdir())
        except OSError:
            return
        for old in files[: max(0, len(files) - MAX_QUARANTINED_FILES)]:
            _unlink_quietly(old)

    def _forget(self, digest: str) -> None:
        with self._lock:
            entry = self._index.remove(digest)
        if entry is not None:
            self._notify_removed([entry])

    def _unlink(self, entry: IndexEntry) -> None:
        _unlink_quietly(self.roots[entry.root].layout.chunk_path(entry.ns_id, entry.digest))

    # -- recovery and manifest ------------------------------------------------

    def _recover(self, root: RootState) -> None:
        """Rebuild this root's index from its directory tree and manifest."""
        started = time.perf_counter()
        records = load_manifest(root.layout.index_dir)
        self._remove_stale_temp_files(root)
        found: list[IndexEntry] = []
        for loc in root.layout.iter_chunks():
            rec = records.get(loc.digest)
            if rec is not None and rec.ns_id == loc.namespace_id:
                found.append(IndexEntry(loc.digest, rec.ns_id, root.index, rec.size, rec.meta,
                                        rec.last_access_ns))
                continue
            try:
                st = loc.path.stat()
            except OSError:
                continue
            found.append(IndexEntry(loc.digest, loc.namespace_id, root.index, st.st_size, None,
                                    st.st_mtime_ns))
        found.sort(key=lambda e: e.last_access_ns)
        over: list[IndexEntry] = []
        with self._lock:
            for entry in found:
                self._index.add(entry)
            while self._index.used_bytes(root.index) > self._index.budgets[root.index]:
                victim = next(self._index.lru_order(root.index))
                self._index.remove(victim.digest)
                over.append(victim)
        self._evict(over)
        self.stats.add("recovered_entries", len(found) - len(over))
        logger.info("NVMe tier: %s holds %d chunks (%.1f MiB); index rebuilt in %.3f s.",
                    root.layout.root, len(found) - len(over),
                    self._index.used_bytes(root.index) / 2**20, time.perf_counter() - started)

    def _remove_stale_temp_files(self, root: RootState) -> None:
        now = time.time()
        for tmp in root.layout.iter_temp_files():
            if tmp.is_stale(now=now):
                _unlink_quietly(tmp.path)
                self.stats.add("removed_temp_files")

    def save_manifests(self) -> None:
        """Snapshot every root's index; lookups wait at most one small batch for the lock."""
        for root in self.roots:
            with self._lock:
                digests = self._index.lru_digests(root.index)
            entries: list[IndexEntry] = []
            for start in range(0, len(digests), MANIFEST_BATCH):
                with self._lock:
                    found = (self._index.get(d) for d in digests[start : start + MANIFEST_BATCH])
                    entries.extend(e for e in found if e is not None)
            try:
                save_manifest(root.layout.index_dir, entries, self.settings.file_mode)
            except OSError as exc:
                logger.warning("NVMe tier: could not save manifest of %s: %s",
                               root.layout.root, exc)

    def _manifest_loop(self) -> None:
        while not self._stop.wait(self.settings.manifest_interval_s):
            self.save_manifests()

    # -- shutdown --------------------------------------------------------------

    def close(self) -> None:
        """Finish queued writes (up to ``close_timeout_s``), save manifests, stop threads."""
        if self._closed:
            return
        self._closed = True
        if not self.flush(self.settings.close_timeout_s):
            logger.warning("NVMe tier: write-back did not finish within %.0f s; dropping the "
                           "rest.", self.settings.close_timeout_s)
        for job in self._queue.close():
            with self._lock:
                self._pending.pop(job.digest, None)
            self._end_job(job)
        for t in self._writers:
            t.join()
        self._stop.set()
        if self._manifest_thread is not None:
            self._manifest_thread.join()
        self.save_manifests()
        self._io_pool.shutdown(wait=True)


WRITER_NICE = 10


def _lower_thread_cpu_priority() -> None:
    """Make the calling writer thread yield the CPU to the inference engine's threads.

    On Linux a thread is a task with its own nice value; write-back is background
    work and should never take a core from the engine when the host is busy.
    """
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WRITER_NICE)
    except (AttributeError, OSError) as exc:
        logger.debug("could not lower the writer thread's priority: %s", exc)


def _free_bytes(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _unlink_quietly(path: Path) -> None:
    try:
        os.unlink(path)
    except OSError as exc:
        if exc.errno != errno.ENOENT:
            logger.debug("could not remove %s: %s", path, exc)
