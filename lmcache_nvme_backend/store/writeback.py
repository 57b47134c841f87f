"""Write-back plumbing: the chunk writes and tasks, and a queue bounded in bytes.

A store call only hands its chunks to the I/O engine; the engine's writers persist them
from host memory later.  The queue counts the payload bytes handed over and not yet done
(host memory LMCache cannot reuse until the write finishes), so its bound is a memory bound.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

from ..disk.format import TensorMeta, file_size_for, text_bytes
from ..disk.layout import digest_of_key_bytes, namespace_id

logger = logging.getLogger(__name__)


class SubmitResult(enum.Enum):
    """What admission did with one chunk of a store call."""

    QUEUED = "queued"
    DUPLICATE = "duplicate"
    QUEUE_FULL = "queue_full"
    OVERSIZE = "oversize"
    CLOSED = "closed"


class TaskOutcome(NamedTuple):
    """What became of a store task's chunks (``ChunkStore.submit_task``'s ``on_done``)."""

    ok: bool  # every chunk was persisted or was stored (or being stored) already
    nbytes: int  # payload bytes persisted
    stored: list[int] | None  # positions of the chunks persisted (None: all, in order)
    digests: list[str]  # their digests, in that order
    file_sizes: list[int]  # and their bytes on disk

    @classmethod
    def failed(cls) -> TaskOutcome:
        """Nothing persisted, and the task failed."""
        return cls(False, 0, [], [], [])

    @classmethod
    def stored_before(cls) -> TaskOutcome:
        """Nothing to persist: every chunk was stored (or being stored) already."""
        return cls(True, 0, [], [], [])


class ChunkWrite:
    """One chunk to persist.

    ``payload`` stays valid until the store calls ``release``, which it does
    exactly once whatever happens to the write; ``persisted`` is set and then
    ``on_persisted`` runs once the chunk file is published (before ``release``).  A write
    of a :class:`WriteTask` has no ``release`` of its own: its task ends once for all of
    its writes.  What the store derives from the key (its UTF-8, the digest that names the
    file, the namespace's directory id) is computed once here.
    """

    __slots__ = ("key", "namespace", "meta", "payload", "release", "on_persisted", "nbytes",
                 "file_size", "key_bytes", "digest", "ns_id", "persisted", "task")

    def __init__(self, key: str, namespace: str, meta: TensorMeta, payload: memoryview,
                 release: Callable[[], None] | None = None,
                 on_persisted: Callable[[], None] | None = None) -> None:
        self.key = key
        self.namespace = namespace
        self.meta = meta
        self.payload = payload
        self.release = release
        self.on_persisted = on_persisted
        self.task: WriteTask | None = None
        self.nbytes = nbytes = len(payload)
        self.file_size = file_size_for(nbytes)  # bytes on disk, header and padding too
        self.key_bytes = key_bytes = text_bytes(key)
        self.digest = digest_of_key_bytes(key_bytes)  # names the chunk file
        self.ns_id = namespace_id(namespace)  # names the namespace directory
        self.persisted = False


class WriteTask:
    """Writes submitted together that end together (an L2 store task): ``on_done(task)``
    runs once, after every write ended (published, duplicate or dropped; each write's
    ``persisted`` is final then), on the thread that ended the last of them.

    It counts one share per write and one for the submitter, which ends it after
    ``results`` is set: ``on_done`` never sees a task still being submitted.  The writes
    end in as many calls as the store makes (one per written batch, usually), not one per
    write.
    """

    __slots__ = ("writes", "on_done", "results", "_left", "_lock")

    def __init__(self, writes: Sequence[ChunkWrite],
                 on_done: Callable[[WriteTask], None]) -> None:
        self.writes = writes
        self.on_done = on_done
        self.results: list[SubmitResult] | None = None  # None: the submission failed
        self._left = len(writes) + 1
        self._lock = threading.Lock()
        for write in writes:
            write.task = self

    def ended(self, count: int) -> None:
        """``count`` shares ended; the last one calls ``on_done``."""
        with self._lock:
            self._left -= count
            if self._left:
                return
        try:
            self.on_done(self)
        except Exception:  # a caller's callback must not break the store's thread
            logger.exception("NVMe tier: completing a store task failed")


def outcome_of(task: WriteTask) -> TaskOutcome:
    """A finished task's outcome (its writes' ``persisted`` are final)."""
    results = task.results
    ok, nbytes = results is not None, 0
    stored: list[int] = []
    digests: list[str] = []
    sizes: list[int] = []
    for i, write in enumerate(task.writes):
        if write.persisted:
            nbytes += write.nbytes
            if write.nbytes:
                stored.append(i)
                digests.append(write.digest)
                sizes.append(write.file_size)
        elif results is None or results[i] is not SubmitResult.DUPLICATE:
            ok = False
    return TaskOutcome(ok, nbytes, stored, digests, sizes)


def end_writes(writes: Sequence[ChunkWrite]) -> None:
    """Hand ended writes back: each task once for its writes among them, each other write
    to its own ``release``."""
    if not writes:
        return
    first = writes[0].task
    if first is not None and (len(writes) == 1 or all(w.task is first for w in writes)):
        first.ended(len(writes))  # a task's batch: its writes end in one call
        return
    for write in writes:
        try:
            if write.task is not None:
                write.task.ended(1)
            elif write.release is not None:
                write.release()
        except Exception:  # one caller's callback must not keep the rest
            logger.exception("NVMe tier: releasing the buffer of %s failed", write.key)


class WriteBackQueue:
    """The bytes of write jobs handed to the engine and not done yet: at most ``capacity``.

    A job's bytes stay accounted until ``done_many`` (or ``release``) is called for it
    (after the write), because its host memory stays referenced until then.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._bytes = 0
        # jobs ever accepted (the store's ``writes_enqueued``) and done: the difference is
        # the jobs not yet done (zero-byte ones included)
        self._accepted = 0
        self._done = 0
        self._closed = False
        self._waiting = 0  # producers waiting for room, and flushes: release wakes them
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)

    @property
    def bytes_held(self) -> int:
        with self._lock:
            return self._bytes

    @property
    def accepted(self) -> int:
        """Jobs ever accepted."""
        with self._lock:
            return self._accepted

    def offer_many(self, jobs: list[ChunkWrite], wait_s: float) -> list[bool]:
        """Account each job if there is room, waiting up to ``wait_s`` in all for it; per job,
        whether it was accepted (the caller hands the accepted ones to the engine)."""
        if self.hold(sum([job.nbytes for job in jobs]), len(jobs)):
            return [True] * len(jobs)  # the common case: the whole batch fits now
        deadline = time.monotonic() + wait_s
        accepted: list[bool] = []
        with self._lock:
            for job in jobs:
                while not self._closed and self._bytes + job.nbytes > self.capacity:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        break
                    self._wait(remaining)
                fits = not self._closed and self._bytes + job.nbytes <= self.capacity
                if fits:
                    self._bytes += job.nbytes
                    self._accepted += 1
                accepted.append(fits)
        return accepted

    def hold(self, nbytes: int, count: int) -> bool:
        """Account ``count`` jobs of ``nbytes`` in all if they fit now (no wait); ``release``
        gives them back."""
        with self._lock:
            if self._closed or self._bytes + nbytes > self.capacity:
                return False
            self._bytes += nbytes
            self._accepted += count
            return True

    def done_many(self, jobs: list[ChunkWrite]) -> None:
        """The jobs were written (or dropped): their bytes and count leave the queue."""
        self.release(sum([job.nbytes for job in jobs]), len(jobs))

    def release(self, nbytes: int, count: int) -> None:
        """``count`` jobs of ``nbytes`` in all were written (or dropped)."""
        with self._lock:  # on every write's completion: no notify when no one waits
            self._bytes -= nbytes
            self._done += count
            if self._waiting:
                self._cond.notify_all()

    def _wait(self, timeout_s: float) -> None:
        """Wait (holding the lock) for ``release`` or ``close``."""
        self._waiting += 1
        try:
            self._cond.wait(timeout_s)
        finally:
            self._waiting -= 1

    def wait_empty(self, timeout_s: float) -> bool:
        """Wait until every accepted job is done (a zero-byte one too); False on timeout."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while self._bytes > 0 or self._accepted > self._done:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._wait(remaining)
            return True

    def close(self) -> None:
        """Stop accepting jobs (producers waiting for room give up)."""
        with self._lock:
            self._closed = True
            self._cond.notify_all()
