"""Writers are background work: they run at a lower CPU priority and let reads go first.

A read is what an inference request waits for; a write-back only has to finish some time.
So an engine's writer threads run at nice ``WRITER_NICE`` (a thread's own nice value on
Linux: they never take a core from the inference engine's threads when the host is busy),
and before each chunk a writer waits while reads are in flight, for at most
``READS_FIRST_S`` so that writes never starve.  The compiled engine does the same in C
(``csrc/module.c``: ``WRITER_NICE``, ``WRITERS_YIELD_NS``).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager

#: The nice value of a writer thread.
WRITER_NICE = 10

#: How long a writer waits at most for the reads in flight before each chunk.
READS_FIRST_S = 0.05

logger = logging.getLogger(__name__)


def lower_thread_cpu_priority() -> None:
    """Give the calling thread (a writer) nice ``WRITER_NICE``; where the system refuses,
    it keeps its priority (said in the debug log)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WRITER_NICE)
    except (AttributeError, OSError) as exc:
        logger.debug("could not lower the writer thread's priority: %s", exc)


class ReadPriorityGate:
    """Writers yield to reads in flight, for at most ``max_wait_s`` so writes never starve."""

    def __init__(self, max_wait_s: float = READS_FIRST_S) -> None:
        self.max_wait_s = max_wait_s
        self._readers = 0
        self._released = False
        self._cond = threading.Condition()

    @property
    def readers(self) -> int:
        """Reads in flight now."""
        return self._readers

    def begin_read(self) -> None:
        """A read starts (pair with ``end_read``; an asynchronous read ends on another thread)."""
        with self._cond:
            self._readers += 1

    def end_read(self) -> None:
        """A read ended; the writers waiting for it go on when it was the last."""
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
        """Block while reads are in flight, at most ``max_wait_s``; True if the writer had
        to wait."""
        with self._cond:
            if self._readers == 0 or self._released:
                return False
            self._cond.wait_for(lambda: self._readers == 0 or self._released,
                                timeout=self.max_wait_s)
            return True

    def release_writers(self) -> None:
        """From now on writers never wait (an engine that closes: its queued writes go at
        once); a writer waiting now goes on."""
        with self._cond:
            self._released = True
            self._cond.notify_all()
