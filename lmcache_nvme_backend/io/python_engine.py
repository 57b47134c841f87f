"""The Python I/O engine: the seam's batches (``engine.py``) on Python threads.

It gives the compiled engine's (``native.py`` over ``csrc/``) statuses, details and errnos
for the same files (``tests/unit/test_engine_contract.py`` runs one suite on both); a store
runs it where the extension was not built.  Each chunk is one job (``python_chunks.py``);
this module owns the threads and the batches:

* **reads**: ``threads`` reader threads take a batch's chunks in order (system calls and
  checksums let go of the GIL); a chunk over ``task_size`` is read in pieces by its one
  job; ``read`` helps on the calling thread (a batch of at most ``INLINE_CHUNKS`` runs
  there alone), ``submit_read`` hands the batch over and ``on_done`` runs on the reader
  that ends its last chunk;
* **writes**: ``write_threads`` writer threads take the batches' chunks in order at nice
  ``WRITER_NICE`` (a read is what inference waits for), and before each chunk let reads in
  flight go first, for at most ``READS_FIRST_S`` so writes never starve (as
  ``csrc/workers.c`` does); ``on_done`` runs on the writer that ends a batch.

A callback that raises is logged; no thread dies of one.  ``close`` lets every queued batch
finish and hands it back before the threads end.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from typing import TypeVar

from ..disk.format import ALIGNMENT
from .engine import Batch, OnDone, ReadShare, WriteShare
from .python_chunks import ShareRead, ShareWrite, shares_to_reads, shares_to_writes, unlink_at

logger = logging.getLogger(__name__)

#: The nice value of a writer thread.
WRITER_NICE = 10

#: How long a writer waits at most for the reads in flight before each chunk.
READS_FIRST_S = 0.05

#: Chunks of a blocking read at most this many run on the calling thread alone.
INLINE_CHUNKS = 2

_Entry = TypeVar("_Entry")


class ReadPriorityGate:
    """Writers yield to reads in flight, for at most ``max_wait_s`` so writes never starve."""

    def __init__(self, max_wait_s: float = READS_FIRST_S) -> None:
        self.max_wait_s = max_wait_s
        self._readers = 0
        self._released = False
        self._cond = threading.Condition()

    def begin_read(self) -> None:
        """A read starts (an asynchronous read ends on another thread)."""
        with self._cond:
            self._readers += 1

    def end_read(self) -> None:
        with self._cond:
            self._readers -= 1
            if self._readers == 0:
                self._cond.notify_all()

    @contextmanager
    def reading(self) -> Iterator[None]:
        """``begin_read`` and ``end_read`` around a block."""
        self.begin_read()
        try:
            yield
        finally:
            self.end_read()

    def wait_for_readers(self) -> bool:
        """Block while reads are in flight, at most ``max_wait_s``; whether it waited."""
        with self._cond:
            if self._readers == 0 or self._released:
                return False
            self._cond.wait_for(lambda: self._readers == 0 or self._released,
                                timeout=self.max_wait_s)
            return True

    def release_writers(self) -> None:
        """From now on writers never wait (a closing engine's queued writes go at once)."""
        with self._cond:
            self._released = True
            self._cond.notify_all()


class _Batch:
    """A batch in flight: its chunks, those not taken yet (reads), and who hears of it."""

    def __init__(self, chunks: Sequence[ShareRead | ShareWrite], on_done: OnDone) -> None:
        self.chunks = chunks
        self.pending = deque(chunks)
        self.on_done = on_done
        self._left = len(chunks)
        self._lock = threading.Lock()

    def chunk_done(self) -> bool:
        """One chunk is final; True when it was the batch's last."""
        with self._lock:
            self._left -= 1
            return self._left == 0

    def result(self) -> Batch:
        return Batch(bytes([chunk.status for chunk in self.chunks]),
                     [(i, *chunk.detail) for i, chunk in enumerate(self.chunks)
                      if chunk.detail is not None])


class PythonEngine:
    """Chunk reads and writes in batches of shares on Python threads; one per chunk store."""

    name = "python"

    def __init__(self, threads: int, write_threads: int, task_size: int) -> None:
        if threads < 1 or write_threads < 1 or task_size < ALIGNMENT or task_size % ALIGNMENT:
            raise ValueError("threads and write_threads must be >= 1 and task_size a "
                             f"positive multiple of {ALIGNMENT}")
        self.task_size = task_size
        self._gate = ReadPriorityGate()
        self._lock = threading.Lock()
        self._reads_ready = threading.Condition(self._lock)
        self._writes_ready = threading.Condition(self._lock)
        self._reads: deque[_Batch] = deque()  # the batch once per chunk
        # a chunk of a batch, or (None) a batch to hand back: empty, or cancelled
        self._writes: deque[tuple[_Batch, ShareWrite | None]] = deque()
        self._closing = False
        # set by each writer once at its nice value (writer_thread_ids waits for them)
        self._writer_ready = [threading.Event() for _ in range(write_threads)]
        self._readers = [threading.Thread(target=self._serve, name=f"nvme-py-rd-{i}",
                                          args=(self._reads, self._reads_ready, self._read_next),
                                          daemon=True) for i in range(threads)]
        self._writers = [threading.Thread(target=self._write_worker, args=(ready,),
                                          name=f"nvme-py-wr-{i}", daemon=True)
                         for i, ready in enumerate(self._writer_ready)]
        for thread in (*self._readers, *self._writers):
            thread.start()

    # -- reads -----------------------------------------------------------------------------

    def read(self, shares: Sequence[ReadShare]) -> Batch:
        self._refuse_if_closed()
        finished = threading.Event()
        batch = _Batch(shares_to_reads(shares), lambda _: finished.set())
        if not batch.chunks:
            return Batch(b"", [])
        self._gate.begin_read()
        if len(batch.chunks) > INLINE_CHUNKS:
            with self._lock:
                self._reads.extend([batch] * len(batch.chunks))
                self._reads_ready.notify(len(batch.chunks))
        while self._read_next(batch):
            pass
        finished.wait()
        return batch.result()

    def submit_read(self, shares: Sequence[ReadShare], on_done: OnDone) -> None:
        """Start reading a batch; ``on_done(batch)`` runs on the reader that ends it."""
        batch = _Batch(shares_to_reads(shares), on_done)
        with self._lock:
            self._refuse_if_closed(batch.chunks)
            self._gate.begin_read()
            self._reads.extend([batch] * max(1, len(batch.chunks)))
            self._reads_ready.notify(max(1, len(batch.chunks)))

    def _read_next(self, batch: _Batch) -> bool:
        """Run the batch's next chunk; False when none was left (an empty one is handed back)."""
        try:
            chunk = batch.pending.popleft()
        except IndexError:
            if not batch.chunks:
                self._read_done(batch)
            return False
        chunk.run(self.task_size)
        if batch.chunk_done():
            self._read_done(batch)
        return True

    def _read_done(self, batch: _Batch) -> None:
        self._gate.end_read()
        _hand_back(batch)

    # -- writes ----------------------------------------------------------------------------

    def submit_write(self, shares: Sequence[WriteShare], on_done: OnDone) -> None:
        """Start writing a batch; ``on_done(batch)`` runs on the writer that ends it."""
        batch = _Batch(writes := shares_to_writes(shares), on_done)
        with self._lock:
            self._refuse_if_closed(writes)
            self._writes.extend([(batch, write) for write in writes] or [(batch, None)])
            self._writes_ready.notify(max(1, len(writes)))

    def cancel_writes(self) -> int:
        """Chunks not started yet end as ``ECANCELED`` (a closing store); how many."""
        with self._lock:
            queued = list(self._writes)
            self._writes.clear()
            for batch, write in queued:
                if write is not None:
                    write.cancel()
                    if not batch.chunk_done():
                        continue
                self._writes.append((batch, None))
            self._writes_ready.notify_all()
        return sum(write is not None for _, write in queued)

    def _write_worker(self, ready: threading.Event) -> None:
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WRITER_NICE)
        except (AttributeError, OSError) as exc:  # refused: the writer keeps its priority
            logger.debug("could not lower the writer thread's priority: %s", exc)
        ready.set()
        self._serve(self._writes, self._writes_ready, self._write)

    def _write(self, entry: tuple[_Batch, ShareWrite | None]) -> None:
        batch, write = entry
        if write is not None:
            self._gate.wait_for_readers()  # reads in flight go first, for a while
            write.run(self.task_size)
            if not batch.chunk_done():
                return
        _hand_back(batch)

    # -- the rest of the protocol ------------------------------------------------------------

    def unlink(self, items: Sequence[tuple[int, str]]) -> list[int]:
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
        """Finish queued reads and writes, hand back their batches, stop every thread (but
        the calling one); later reads and writes are refused."""
        with self._lock:
            self._closing = True
            self._reads_ready.notify_all()
            self._writes_ready.notify_all()
        self._gate.release_writers()  # queued writes go at once
        for thread in (*self._readers, *self._writers):
            if thread is not threading.current_thread():
                thread.join()

    def _serve(self, queue: deque[_Entry], ready: threading.Condition,
               run: Callable[[_Entry], object]) -> None:
        """An engine thread: ``run`` each entry of ``queue`` until closed and drained."""
        while True:
            with self._lock:
                while not queue and not self._closing:
                    ready.wait()
                if not queue:
                    return
                entry = queue.popleft()
            try:
                run(entry)
            except Exception:  # an engine thread survives anything one entry does
                logger.exception("NVMe tier: an I/O engine step failed unexpectedly")

    def _refuse_if_closed(self, chunks: Sequence[ShareRead | ShareWrite] = ()) -> None:
        """``RuntimeError`` once closed, the refused batch's buffers let go of."""
        if self._closing:
            for chunk in chunks:
                chunk.release()
            raise RuntimeError("the Python I/O engine is closed")


def _hand_back(batch: _Batch) -> None:
    """Give a batch to its callback; one that raises is logged, and the thread goes on."""
    try:
        batch.on_done(batch.result())
    except Exception:
        logger.exception("NVMe tier: completing an I/O batch failed")
