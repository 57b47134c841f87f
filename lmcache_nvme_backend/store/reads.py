"""Reading chunk files: headers for metadata, payloads into host buffers, and the judgement.

A read the engine could not serve, and every read of the GPU reader (kvikio), ends in
:meth:`ChunkReader.complete`: the I/O outcome is classified (gone or unreadable: a miss,
forgotten; a drive error: counted against the root; a short file: invalid), then
``disk.validate`` judges header and payload; an invalid file is forgotten and quarantined.
"""

from __future__ import annotations

import errno
import functools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NamedTuple

from ..disk.format import ChunkHeader, TensorMeta, texts_bytes
from ..disk.layout import digest_of_key_bytes, key_digest
from ..disk.validate import Defect, Expected, Verdict, defect, judge_chunk
from ..io import engine
from ..io.buffers import AlignedBuffer
from ..io.engine import ChunkEngine
from ..io.files import read_failure
from ..io.posix import NotAChunkFile, ShortFileError, read_header
from .catalog import Catalog
from .deadline import DeadlineCall, HangWatch, StagingPool, copy_served
from .index import IndexEntry
from .roots import Roots, RootState, quarantine_file
from .stats import Counter, ReadPath, StoreStats

logger = logging.getLogger(__name__)


class ChunkRead(NamedTuple):
    """One chunk to read: its key and a writable host buffer of at least its payload length.
    ``length``, when given, is the payload length the caller's buffer layout needs; a chunk
    stored with another length is a miss (not a damaged file)."""

    key: str
    dest: memoryview
    length: int | None = None


class ReadPlan(NamedTuple):
    """Where a stored chunk lives (``rel`` below the root ``root_dir``), and how to read it."""

    key: str
    key_bytes: bytes  # the key as the header holds it (encoded once per read)
    digest: str
    rel: str
    payload_len: int
    meta: TensorMeta
    direct: bool
    root: int
    root_dir: Path

    @property
    def path(self) -> Path:
        return self.root_dir / self.rel


#: A read call handed to the engine, as its completion needs it: ``(keys, encoded, digests,
#: entries, roots, order, nbytes, roots_read)``: the call's columns, its index entries
#: and roots when it was planned, the positions read in the batch's order (None: every one,
#: in order), their payload bytes and the roots they are on.  A plain tuple (one per call).
_Call = tuple[Sequence[str], list[bytes], list[str], "list[IndexEntry | None]",
              "list[RootState | None]", "list[int] | None", int, set[int]]


def _share(root: RootState, ns_id: str, meta: TensorMeta, digests: list[str],
           dests: list[memoryview], encoded: list[bytes]) -> engine.ReadShare:
    """The read share of chunks on ``root`` in one namespace and layout."""
    return (root.descriptor(), root.layout.chunk_naming(ns_id), root.direct, meta.nbytes,
            meta.to_json(), digests, dests, encoded)


def _grouped(entries: list[IndexEntry | None], roots: list[RootState | None],
             dests: Sequence[memoryview], lengths: Sequence[int | None], digests: list[str],
             encoded: list[bytes]) -> tuple[list[int], list[engine.ReadShare], int, set[int]]:
    """The readable chunks of a call as one share per root, namespace and layout: their
    positions in the batch's order, the shares, their payload bytes and their roots."""
    groups: dict[tuple[int, str, int], tuple[IndexEntry, TensorMeta, RootState, list[int]]] = {}
    for i, entry in enumerate(entries):
        if entry is None or (meta := entry.meta) is None or (root := roots[entry.root]) is None:
            continue
        length = lengths[i]
        if len(dests[i]) < meta.nbytes or (length is not None and length != meta.nbytes):
            continue  # a buffer for another layout: a miss
        group = (entry.root, entry.ns_id, id(meta))
        if group not in groups:
            groups[group] = (entry, meta, root, [])
        groups[group][3].append(i)
    order: list[int] = []
    shares: list[engine.ReadShare] = []
    nbytes = 0
    for entry, meta, root, mine in groups.values():
        order += mine
        nbytes += len(mine) * meta.nbytes
        shares.append(_share(root, entry.ns_id, meta, [digests[i] for i in mine],
                             [dests[i] for i in mine], [encoded[i] for i in mine]))
    return order, shares, nbytes, {entry.root for entry, *_ in groups.values()}


def _staging_for(pool: StagingPool, entries: list[IndexEntry | None],
                 roots: list[RootState | None], dests: Sequence[memoryview],
                 lengths: Sequence[int | None]
                 ) -> tuple[list[memoryview], list[AlignedBuffer | None]]:
    """Store-owned buffers to read each chunk into (reads under a deadline), and the views
    the engine is given: a staging buffer's, as long as the caller's buffer allows, where a
    chunk is read; the caller's own (never read into) where it is a miss anyway."""
    targets = list(dests)
    staging: list[AlignedBuffer | None] = [None] * len(dests)
    for i, entry in enumerate(entries):
        if entry is None or (meta := entry.meta) is None or roots[entry.root] is None:
            continue
        length = lengths[i]
        if len(dests[i]) < meta.nbytes or (length is not None and length != meta.nbytes):
            continue
        buf = staging[i] = pool.take(meta.nbytes)
        targets[i] = buf.view[:min(len(dests[i]), buf.size)]
    return targets, staging


def _uniform(entries: list[IndexEntry | None], roots: list[RootState | None],
             dests: Sequence[memoryview], lengths: Sequence[int | None]
             ) -> tuple[IndexEntry, TensorMeta, RootState] | None:
    """The first entry, metadata and root when every chunk of a call is read as one share
    (one metadata object, namespace and root in service; buffers that fit)."""
    first = entries[0] if entries else None
    if first is None or (meta := first.meta) is None or (root := roots[first.root]) is None:
        return None
    index, ns_id, nbytes = first.root, first.ns_id, meta.nbytes
    for entry in entries:
        if entry is None or entry.meta is not meta or entry.root != index or \
                entry.ns_id != ns_id:
            return None
    if min(map(len, dests)) < nbytes or \
            lengths.count(None) + lengths.count(nbytes) != len(lengths):
        return None
    return first, meta, root


def _plan_of(key: str, key_bytes: bytes, digest: str, ns_id: str, meta: TensorMeta,
             root: RootState) -> ReadPlan:
    """The read plan of a chunk indexed on ``root``."""
    layout = root.layout
    return ReadPlan(key, key_bytes, digest, layout.chunk_rel(ns_id, digest), meta.nbytes, meta,
                    root.direct, root.index, layout.root)


class ChunkReader:
    """Reads and judges chunk files for one store."""

    def __init__(self, catalog: Catalog, roots: Roots, engine: ChunkEngine,
                 stats: StoreStats, watch: HangWatch | None = None) -> None:
        self._catalog = catalog
        self._roots = roots
        self.engine = engine
        self._stats = stats
        self._watch = watch  # nvme.io_deadline_s: reads into staging, answered by then

    # -- headers -------------------------------------------------------------

    def tensor_meta(self, key: str) -> TensorMeta | None:
        """Allocation metadata of a stored chunk (read from its header if not yet known)."""
        digest = key_digest(key)
        entry = self._catalog.entry(digest)
        if entry is None or entry.meta is not None:
            return None if entry is None else entry.meta
        return self._meta_from_header(key, digest, entry)

    def _meta_from_header(self, key: str, digest: str, entry: IndexEntry) -> TensorMeta | None:
        """A chunk recovered without metadata learns it from its header (None: unreadable,
        and forgotten; an invalid file is quarantined)."""
        root = self._roots[entry.root]
        path = root.layout.chunk_path(entry.ns_id, digest)
        try:
            raw, size = read_header(path, root.direct)
        except NotAChunkFile as exc:
            self.not_a_chunk_file(digest, exc)
            return None
        except ShortFileError as exc:  # shorter than a header: never a valid chunk file
            self.reject(root, digest, path, defect(Defect.SHORT, str(exc)))
            return None
        except OSError as exc:
            if not isinstance(exc, FileNotFoundError):
                logger.debug("NVMe tier: cannot read %s: %s", path, exc)
            self.forget(digest)
            return None
        verdict = judge_chunk(raw, Expected(key=key, file_size=size))
        if verdict.header is None or not verdict.ok:
            self.reject(root, digest, path, verdict)
            return None
        self._catalog.learn_meta(digest, verdict.header.tensor_meta)
        return verdict.header.tensor_meta

    # -- payloads ------------------------------------------------------------

    def plan(self, keys: Sequence[str]) -> list[ReadPlan | None]:
        """Where each chunk lives (None: not indexed, unreadable header, or its path is down)."""
        encoded, digests, entries = self._locate(keys)
        roots = self._healthy_roots()
        return [None if entry is None or entry.meta is None or (root := roots[entry.root]) is None
                else _plan_of(key, key_bytes, digest, entry.ns_id, entry.meta, root)
                for key, key_bytes, digest, entry in zip(keys, encoded, digests, entries,
                                                         strict=True)]

    def _locate(self, keys: Sequence[str]
                ) -> tuple[list[bytes], list[str], list[IndexEntry | None]]:
        """Each key's UTF-8, digest and index entry (None: not indexed, or a recovered chunk
        whose header could not be read: its metadata is learned from the header first)."""
        encoded = texts_bytes(keys)
        digests = list(map(digest_of_key_bytes, encoded))
        entries = self._catalog.entries(digests)
        for i, entry in enumerate(entries):
            if entry is not None and entry.meta is None:  # recovered from disk: rare
                self._meta_from_header(keys[i], digests[i], entry)
                entry = self._catalog.entry(digests[i])
                entries[i] = entry if entry is not None and entry.meta is not None else None
        return encoded, digests, entries

    def _healthy_roots(self) -> list[RootState | None]:
        """Each root, or None where it is out of service (its chunks are misses)."""
        return [root if root.healthy else None for root in self._roots]

    def read(self, keys: Sequence[str], dests: Sequence[memoryview],
             lengths: Sequence[int | None], on_done: Callable[[list[bool]], None],
             wait: bool) -> None:
        """``ChunkStore.read_into`` in columns (no object per chunk), answered through
        ``on_done(served)``: without ``wait`` on the I/O thread that judges the last chunk
        (or here, when nothing can be read); it must be quick."""
        encoded, digests, entries = self._locate(keys)
        roots = self._healthy_roots()
        # a local path (no deadline) reads into ``dests`` on this thread; a call on a path
        # with a deadline into staging buffers, by ``_read_by_deadline``
        targets, staging = dests, None
        if self._watch is not None and self._watch.covers(entries):
            targets, staging = _staging_for(self._watch.staging, entries, roots, dests, lengths)
        if uniform := _uniform(entries, roots, targets, lengths):
            first, meta, root = uniform
            shares = [_share(root, first.ns_id, meta, digests, list(targets), encoded)]
            call: _Call = (keys, encoded, digests, entries, roots, None, len(keys) * meta.nbytes,
                           {root.index})
        else:
            order, shares, nbytes, touched = _grouped(entries, roots, targets, lengths, digests,
                                                      encoded)
            call = (keys, encoded, digests, entries, roots, order, nbytes, touched)
            if not order:  # nothing to read: every chunk a miss
                self._stats.add(Counter.READ_FAILURES, len(keys))
                on_done([False] * len(keys))
                return
        if staging is not None:
            assert self._watch is not None
            self._read_by_deadline(self._watch, call, shares, dests, staging, on_done, wait)
            return
        done = functools.partial(self._batch_done, call, on_done, time.perf_counter())
        if wait:
            done(self.engine.read(shares))
        else:
            self.engine.submit_read(shares, done)

    def _read_by_deadline(self, watch: HangWatch, call: _Call,
                          shares: list[engine.ReadShare], dests: Sequence[memoryview],
                          staging: list[AlignedBuffer | None],
                          on_done: Callable[[list[bool]], None], wait: bool) -> None:
        """Read ``call`` by its ``shares`` (into the ``staging`` buffers) on the engine's
        threads, answer ``on_done`` by the deadline: from the batch when it came back in time
        (served chunks copied into ``dests``), with misses otherwise (the batch, when it
        comes back, is discarded: ``HangWatch.late``); the paths with a deadline go out of
        service then."""
        size = len(call[0])
        entries = call[3]
        lengths = [0 if e is None or e.meta is None else e.meta.nbytes for e in entries]
        held = [buf for buf in staging if buf is not None]
        started = time.perf_counter()
        answer: list[bool] = []
        finished = threading.Event()

        def copied(served: list[bool]) -> None:
            copy_served(served, dests, staging, lengths)
            watch.staging.give(held)
            on_done(served)

        def expired() -> None:
            watch.missed(deadline_call, size)
            on_done([False] * size)

        deadline_call = DeadlineCall(time.monotonic() + watch.deadline_s,
                                     call[7] & watch.roots, held, None if wait else expired)

        def done(result: engine.Batch) -> None:
            if not deadline_call.finish():
                watch.late(deadline_call, size)
            elif wait:
                self._batch_done(call, answer.extend, started, result)
                finished.set()
            else:
                self._batch_done(call, copied, started, result)

        try:
            self.engine.submit_read(shares, done)
        except BaseException:
            watch.staging.give(held)
            raise
        if not wait:
            watch.watch(deadline_call)
            return
        if finished.wait(watch.deadline_s) or not deadline_call.expire():
            finished.wait()  # answered in time (maybe just now): judged in a moment
            copied(answer)
        else:
            expired()

    def _batch_done(self, call: _Call, on_done: Callable[[list[bool]], None], started: float,
                    result: engine.Batch) -> None:
        """A read batch the engine finished: judge what it did not serve, account the call,
        answer ``on_done`` (also when accounting fails)."""
        keys, encoded, digests, entries, roots, order, issued_bytes, touched = call
        size = len(keys)
        served = [False] * size
        try:
            if not result.details and order is None:  # the common case: all served
                served = [True] * size
                chunks = engine_chunks = size
                nbytes = engine_bytes = issued_bytes
            else:
                chunks, nbytes, engine_chunks, engine_bytes, touched = self._judge_batch(
                    call, result.details, served)
            for index in touched:
                self._roots[index].consecutive_errors = 0
            self._stats.record_read(ReadPath.POSIX, chunks, nbytes,
                                    time.perf_counter() - started, failures=size - chunks,
                                    checked=(engine_chunks, engine_bytes))
        finally:
            on_done(served)

    def _judge_batch(self, call: _Call, details: list[tuple[int, int, bytes | None, int]],
                     served: list[bool]) -> tuple[int, int, int, int, set[int]]:
        """Mark in ``served`` the chunks of a batch that are served, judging each one the
        engine did not serve; the chunks and bytes served, those served by the engine alone,
        and the roots that served any."""
        keys, encoded, digests, entries, roots, order, _, _ = call
        positions = range(len(keys)) if order is None else order
        judged: dict[int, bool] = {}
        for k, err, header, computed in details:
            i = positions[k]
            entry = entries[i]
            assert entry is not None and entry.meta is not None
            root = roots[entry.root]
            assert root is not None
            plan = _plan_of(keys[i], encoded[i], digests[i], entry.ns_id, entry.meta, root)
            judged[i] = self._verdict(plan, err, header, computed)
        chunks = nbytes = engine_chunks = engine_bytes = 0
        touched: set[int] = set()
        for i in positions:
            entry = entries[i]
            assert entry is not None and entry.meta is not None
            verdict = judged.get(i)
            if verdict is None:  # served by the engine (``complete`` counted the rest)
                engine_chunks += 1
                engine_bytes += entry.meta.nbytes
                touched.add(entry.root)
            if verdict is None or verdict:
                served[i] = True
                chunks += 1
                nbytes += entry.meta.nbytes
        return chunks, nbytes, engine_chunks, engine_bytes, touched

    def _verdict(self, plan: ReadPlan, err: int, header: bytes | None, computed: int) -> bool:
        """Whether a chunk the engine did not serve at once is served after all: the bytes
        landed (``header``) and the validator names what is wrong, or the read failed
        (``err``) and its exception classifies the failure."""
        if header is not None:
            return self.complete(plan, header, None,
                                 lambda h: h.payload_checksum == computed).ok
        if err == errno.ENOENT:  # gone, or the cache directory was removed (and made again)
            self._roots[plan.root].maybe_removed = True
        return self.complete(plan, b"", read_failure(plan.path, err), lambda h: False).ok

    def complete(self, plan: ReadPlan, header: bytes, error: BaseException | None,
                 payload_ok: Callable[[ChunkHeader], bool]) -> Verdict:
        """Judge one read (done here or by another reader), with its counters and quarantine;
        ``payload_ok(header)``: whether the payload matches.  A miss the file system caused
        (gone, not ours, a drive error) is a verdict without a header, not quarantined."""
        root = self._roots[plan.root]
        if isinstance(error, NotAChunkFile):
            # A link, directory or special file planted at the chunk path: a miss for this
            # key, never followed or read, and not a sign that the drive is failing.
            self.not_a_chunk_file(plan.digest, error)
            return defect(Defect.NOT_A_CHUNK, str(error))
        if isinstance(error, (FileNotFoundError, PermissionError)) or \
                getattr(error, "errno", None) == errno.ESTALE:
            # Gone (ESTALE: removed by another NFS client), or not ours to read (another
            # user's file in a shared tree): a miss for this key, not a failing drive.
            self.forget(plan.digest)
            return defect(Defect.NOT_A_CHUNK, f"unreadable: {error}")
        if error is not None and not isinstance(error, ShortFileError):
            self._roots.record_error(root, error)
            return defect(Defect.NOT_A_CHUNK, f"I/O error: {error}")
        verdict = defect(Defect.SHORT, str(error)) if error is not None else judge_chunk(
            header, Expected(key=plan.key, payload_len=plan.payload_len, meta=plan.meta),
            payload_ok)
        if verdict.defect in (Defect.WRONG_LENGTH, Defect.WRONG_META) and \
                verdict.header is not None:
            # The index (a manifest's metadata, a key rewritten elsewhere) disagrees with the
            # header: a miss this time, not the file's fault; the next read allocates from
            # the header's metadata and judges the file in full.
            self._catalog.learn_meta(plan.digest, verdict.header.tensor_meta, replace=True)
            return verdict
        if not verdict.ok:
            if self._catalog.entry(plan.digest) is None:
                # Removed (deleted, evicted) while it was read: the file it had open may hold
                # another chunk by now (nvme.recycle_mb).  A miss, not a bad file.
                return verdict
            if verdict.defect is Defect.CHECKSUM:
                self._stats.add(Counter.CHECKSUM_FAILURES)
            self.reject(root, plan.digest, plan.path, verdict)
            return verdict
        root.consecutive_errors = 0
        self._stats.add(Counter.READ_CHUNKS)
        self._stats.add(Counter.READ_BYTES, plan.payload_len)
        return verdict

    # -- bad files -----------------------------------------------------------

    def reject(self, root: RootState, digest: str, path: Path, verdict: Verdict) -> None:
        """A file failed validation: forget it and move it to quarantine."""
        self._stats.add(Counter.INVALID_FILES)
        logger.warning("NVMe tier: not serving %s: %s; quarantined.", path, verdict.reason)
        self.forget(digest)
        if quarantine_file(root, digest, path):
            self._stats.add(Counter.QUARANTINED_FILES)

    def not_a_chunk_file(self, digest: str, exc: OSError) -> None:
        """Something other than a regular file at a chunk path: forget it, count, log (a
        warning when an indexed chunk is lost to it; a shared-mode probe only counts)."""
        self._stats.add(Counter.SPECIAL_FILES)
        indexed = self._catalog.entry(digest) is not None
        logger.log(logging.WARNING if indexed else logging.DEBUG,
                   "NVMe tier: not serving %s: %s; forgotten, left in place (never followed "
                   "or read).", exc.filename, exc.strerror)
        self.forget(digest)

    def forget(self, digest: str) -> None:
        """Drop an index entry whose file is gone or bad (the listeners hear of it)."""
        self._catalog.notify_removed(self._catalog.remove_many([digest]))
