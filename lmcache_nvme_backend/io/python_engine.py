"""The Python I/O engine: the seam's batches (``engine.py``) on Python threads.

It implements ``ChunkEngine`` with the behaviour of the compiled engine (``native.py`` over
``csrc/``): the same statuses, details and errnos for the same files, from the same plain
values (``tests/unit/test_engine_contract.py`` runs one suite against both).  It is what a
store runs where the extension was not built, and the reference the compiled engine is
checked against.  Each chunk's steps are ``python_chunks.py``; this module owns the threads
and the batches:

* **reads**: ``threads`` reader threads take a batch's pieces (``task_size`` bytes at most)
  in order, several chunks and pieces of one chunk in parallel (the system calls and the
  checksum let go of the GIL); ``read`` helps with its own batch's pieces on the calling
  thread (a batch of at most two pieces runs there alone, no hand-off), ``submit_read``
  hands the batch to the readers and ``on_done`` runs on the one that ends its last chunk;
* **writes**: ``write_threads`` writer threads at nice 10 take the chunks of the batches in
  order; before each chunk a writer lets this engine's reads in flight go first, for at
  most 50 ms (``priority.py``); ``on_done`` runs on the writer that ends a batch's last
  chunk.

A callback that raises is logged; no thread ever dies of one.  ``close`` lets every queued
batch finish and hands it back before the threads end.
"""

from __future__ import annotations

import errno
import functools
import logging
import threading
from collections import deque
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager

from ..disk.format import ALIGNMENT
from .beneath import unlink_at
from .engine import FAILED, OK, Batch, OnDone, ReadShare, WriteShare
from .posix import ChunkFileIO
from .priority import ReadPriorityGate, lower_thread_cpu_priority
from .python_chunks import ShareRead, ShareWrite, shares_to_reads, shares_to_writes

logger = logging.getLogger(__name__)

#: Pieces of a blocking read at most this many run on the calling thread alone.
INLINE_PIECES = 2


class _ReadBatch:
    """A read batch in flight: its chunks, the pieces not taken yet, and who hears of it."""

    def __init__(self, reads: list[ShareRead], on_done: OnDone | None) -> None:
        self.reads = reads
        self.pending = deque((read, piece) for read in reads for piece in read.pieces)
        self.on_done = on_done  # None: a blocking read, which waits for ``finished``
        self.finished = threading.Event()
        self._left = len(reads)
        self._lock = threading.Lock()

    def chunk_done(self) -> bool:
        """One chunk is final; True when it was the batch's last."""
        with self._lock:
            self._left -= 1
            return self._left == 0

    def result(self) -> Batch:
        statuses = bytes([read.status for read in self.reads])
        details = [(i, *read.detail) for i, read in enumerate(self.reads)
                   if read.detail is not None]
        return Batch(statuses, details)


class _WriteBatch:
    """A write batch in flight: its chunks and each one's outcome."""

    def __init__(self, writes: list[ShareWrite], on_done: OnDone) -> None:
        self.writes = writes
        self.on_done = on_done
        self._statuses = bytearray([FAILED] * len(writes))
        self._errors = [0] * len(writes)
        self._left = len(writes)
        self._lock = threading.Lock()

    def chunk_done(self, index: int, status: int, err: int) -> bool:
        """Chunk ``index`` ended so; True when it was the batch's last."""
        with self._lock:
            self._statuses[index] = status
            self._errors[index] = err
            self._left -= 1
            return self._left == 0

    def result(self) -> Batch:
        return Batch(bytes(self._statuses),
                     [(i, status, self._errors[i]) for i, status in enumerate(self._statuses)
                      if status != OK])


class PythonEngine:
    """Chunk reads and writes in batches of shares on Python threads; one per chunk store."""

    name = "python"

    def __init__(self, threads: int, write_threads: int, task_size: int) -> None:
        """``threads`` readers, ``write_threads`` writers (nice 10), I/Os of at most
        ``task_size`` bytes (a positive multiple of 4 KiB)."""
        if threads < 1 or write_threads < 1 or task_size < ALIGNMENT or task_size % ALIGNMENT:
            raise ValueError("threads and write_threads must be >= 1 and task_size a "
                             f"positive multiple of {ALIGNMENT}")
        self.task_size = task_size
        self._io = ChunkFileIO(task_size)
        self._gate = ReadPriorityGate()
        self._lock = threading.Lock()
        self._reads_ready = threading.Condition(self._lock)
        self._writes_ready = threading.Condition(self._lock)
        self._reads: deque[Callable[[], object]] = deque()  # one entry per piece
        # a chunk of a batch, or a batch's hand-back (cancelled, or empty)
        self._writes: deque[tuple[_WriteBatch, int] | Callable[[], object]] = deque()
        self._closing = False
        # set by each writer once at its nice value (writer_thread_ids waits for them)
        self._writer_ready = [threading.Event() for _ in range(write_threads)]
        self._readers = [threading.Thread(target=self._read_worker, name=f"nvme-py-rd-{i}",
                                          daemon=True) for i in range(threads)]
        self._writers = [threading.Thread(target=self._write_worker, args=(ready,),
                                          name=f"nvme-py-wr-{i}", daemon=True)
                         for i, ready in enumerate(self._writer_ready)]
        for thread in (*self._readers, *self._writers):
            thread.start()

    # -- reads -----------------------------------------------------------------------------

    def read(self, shares: Sequence[ReadShare]) -> Batch:
        """Read and verify a batch; the calling thread helps and returns when all are done."""
        self._refuse_if_closed()
        batch = _ReadBatch(shares_to_reads(shares, self.task_size), None)
        if not batch.reads:
            return Batch(b"", [])
        self._gate.begin_read()
        if len(batch.pending) > INLINE_PIECES:
            with self._lock:
                self._reads.extend([functools.partial(self._run_from, batch)] *
                                   len(batch.pending))
                self._reads_ready.notify(len(batch.pending))
        while self._run_from(batch):
            pass
        batch.finished.wait()
        return batch.result()

    def submit_read(self, shares: Sequence[ReadShare], on_done: OnDone) -> None:
        """Start reading a batch; ``on_done(batch)`` runs on the reader that ends it."""
        batch = _ReadBatch(shares_to_reads(shares, self.task_size), on_done)
        with self._lock:
            if self._closing:
                for read in batch.reads:
                    read.release()
                raise _closed()
            self._gate.begin_read()
            if batch.reads:
                self._reads.extend([functools.partial(self._run_from, batch)] *
                                   len(batch.pending))
            else:  # nothing to read: handed back at once, on a reader
                self._reads.append(functools.partial(self._read_done, batch))
            self._reads_ready.notify(max(1, len(batch.pending)))

    def _run_from(self, batch: _ReadBatch) -> bool:
        """Run the batch's next piece not taken yet; False when none was left."""
        try:
            read, piece = batch.pending.popleft()
        except IndexError:
            return False
        if read.run_piece(piece, self._io.header_buffer()) and batch.chunk_done():
            self._read_done(batch)
        return True

    def _read_done(self, batch: _ReadBatch) -> None:
        self._gate.end_read()
        if batch.on_done is None:
            batch.finished.set()
        else:
            _hand_back(batch.on_done, batch.result())

    def _read_worker(self) -> None:
        self._io.prepare_thread()
        while True:
            with self._lock:
                while not self._reads and not self._closing:
                    self._reads_ready.wait()
                if not self._reads:
                    return  # closing, and every queued piece ran
                entry = self._reads.popleft()
            _guarded(entry)

    # -- writes ----------------------------------------------------------------------------

    def submit_write(self, shares: Sequence[WriteShare], on_done: OnDone) -> None:
        """Start writing a batch; ``on_done(batch)`` runs on the writer that ends it (the
        batch's chunks come back share by share, in order)."""
        batch = _WriteBatch(shares_to_writes(shares), on_done)
        with self._lock:
            if self._closing:
                for write in batch.writes:
                    write.release()
                raise _closed()
            if batch.writes:
                self._writes.extend((batch, i) for i in range(len(batch.writes)))
            else:  # nothing to write: handed back at once, on a writer
                self._writes.append(functools.partial(_hand_back, on_done, batch.result()))
            self._writes_ready.notify(max(1, len(batch.writes)))

    def cancel_writes(self) -> int:
        """Chunks not started yet end as ``ECANCELED`` (a closing store); how many.  Their
        batches are handed back on a writer, as any other."""
        with self._lock:
            queued = [entry for entry in self._writes if isinstance(entry, tuple)]
            kept: deque[tuple[_WriteBatch, int] | Callable[[], object]] = deque(
                entry for entry in self._writes if not isinstance(entry, tuple))
            for batch, index in queued:
                batch.writes[index].release()
                if batch.chunk_done(index, FAILED, errno.ECANCELED):
                    kept.appendleft(functools.partial(_hand_back, batch.on_done,
                                                      batch.result()))
            self._writes = kept
            self._writes_ready.notify_all()
        return len(queued)

    def _write_worker(self, ready: threading.Event) -> None:
        lower_thread_cpu_priority()
        ready.set()
        self._io.prepare_thread()
        while True:
            with self._lock:
                while not self._writes and not self._closing:
                    self._writes_ready.wait()
                if not self._writes:
                    return  # closing, and every queued chunk ran
                entry = self._writes.popleft()
            if isinstance(entry, tuple):
                _guarded(functools.partial(self._write, *entry))
            else:
                _guarded(entry)

    def _write(self, batch: _WriteBatch, index: int) -> None:
        write = batch.writes[index]
        try:
            self._gate.wait_for_readers()  # reads in flight go first, for a while
            status, err = write.run(self._io)
        except Exception:  # never: run reports its errors; counted all the same
            logger.exception("NVMe tier: writing a chunk failed unexpectedly")
            status, err = FAILED, errno.EIO
        if batch.chunk_done(index, status, err):
            _hand_back(batch.on_done, batch.result())

    # -- the rest of the protocol ------------------------------------------------------------

    def unlink(self, items: Sequence[tuple[int, str]]) -> list[int]:
        """Remove chunk files ``(root_fd, rel)`` now, on the calling thread, without following
        a link in their directories; an errno per item (0: removed)."""
        return [unlink_at(root_fd, rel) for root_fd, rel in items]

    def reading(self) -> AbstractContextManager[None]:
        """Held while reading outside the engine: the writers yield to it as to reads."""
        return self._gate.reading()

    def signal_later(self, eventfd: int) -> bool:
        """Never: the caller signals ``eventfd`` itself (no GIL release to share here)."""
        return False

    def writer_thread_ids(self) -> list[int]:
        """Kernel ids of the writer threads (each runs at nice 10: waits until they all do)."""
        for ready in self._writer_ready:
            ready.wait()
        return [int(thread.native_id or 0) for thread in self._writers]

    def retired_bytes(self) -> int:
        """Always 0: this engine removes files, it keeps none for reuse."""
        return 0

    def close(self) -> None:
        """Finish queued reads and writes, hand back their batches, stop every thread (the
        calling one excepted, when a callback closes the engine).  Later calls do nothing
        more; reads and writes are then refused."""
        with self._lock:
            self._closing = True
            self._reads_ready.notify_all()
            self._writes_ready.notify_all()
        self._gate.release_writers()  # queued writes go at once
        for thread in (*self._readers, *self._writers):
            if thread is not threading.current_thread():
                thread.join()

    def _refuse_if_closed(self) -> None:
        if self._closing:
            raise _closed()


def _closed() -> RuntimeError:
    return RuntimeError("the Python I/O engine is closed")


def _hand_back(on_done: OnDone, batch: Batch) -> None:
    """Give a batch to its callback; one that raises is logged, and the thread goes on."""
    try:
        on_done(batch)
    except Exception:
        logger.exception("NVMe tier: completing an I/O batch failed")


def _guarded(work: Callable[[], object]) -> None:
    """Run one queued step; an engine thread survives anything one step does."""
    try:
        work()
    except Exception:
        logger.exception("NVMe tier: an I/O engine step failed unexpectedly")
