"""Write-back plumbing: the chunk writes and tasks, and a queue bounded in bytes.

The queue counts the payload bytes handed to the I/O engine and not yet written (host
memory LMCache cannot reuse until then), so its bound is a memory bound.
"""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

from ..disk.format import TensorMeta, file_size_for, text_bytes
from ..disk.layout import digest_of_key_bytes, namespace_id


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


class ChunkWrite:
    """One chunk to persist: ``payload`` stays valid until ``release`` (called exactly once);
    once the file is published ``persisted`` is set and ``on_persisted`` runs."""

    __slots__ = ("key", "namespace", "meta", "payload", "release", "on_persisted", "persisted")

    def __init__(self, key: str, namespace: str, meta: TensorMeta, payload: memoryview,
                 release: Callable[[], None] | None = None,
                 on_persisted: Callable[[], None] | None = None) -> None:
        self.key = key
        self.namespace = namespace
        self.meta = meta
        self.payload = payload
        self.release = release
        self.on_persisted = on_persisted
        self.persisted = False

    @property
    def nbytes(self) -> int:
        return len(self.payload)

    @property
    def file_size(self) -> int:
        """Bytes on disk, header and padding too."""
        return file_size_for(len(self.payload))

    @property
    def key_bytes(self) -> bytes:
        return text_bytes(self.key)

    @property
    def digest(self) -> str:
        """Names the chunk file."""
        return digest_of_key_bytes(text_bytes(self.key))

    @property
    def ns_id(self) -> str:
        """Names the namespace directory."""
        return namespace_id(self.namespace)


class WriteBackQueue:
    """The bytes of write jobs handed to the engine and not done yet: at most ``capacity``
    (their host memory stays referenced until ``release``, after the write)."""

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
        with self._lock:
            return self._accepted

    def offer(self, sizes: Sequence[int], wait_s: float) -> list[bool]:
        """Account each job of ``sizes`` bytes if there is room, waiting up to ``wait_s`` in
        all for it; per job, whether it was accepted (the caller hands those to the engine)."""
        if self.hold(sum(sizes), len(sizes)):
            return [True] * len(sizes)  # the common case: the whole batch fits now
        deadline = time.monotonic() + wait_s
        accepted: list[bool] = []
        with self._lock:
            for nbytes in sizes:
                while not self._closed and self._bytes + nbytes > self.capacity:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        break
                    self._wait(remaining)
                fits = not self._closed and self._bytes + nbytes <= self.capacity
                if fits:
                    self._bytes += nbytes
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
