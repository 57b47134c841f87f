"""Reads under a deadline (``nvme.io_deadline_s``): a caller has its answer by then, whatever
the filesystem does.

On network storage a read can hang for as long as the filesystem's own timeouts (GlusterFS:
``network.ping-timeout``, 42 s; a hard NFS mount: for ever), in the kernel, where no thread
can be interrupted.  So a call that reads a path with a deadline (``RootState.deadline_s``:
the setting's number, or under ``auto`` 5 s on network filesystems and none on local ones,
which read straight into the caller's buffers) has the engine read into buffers the store
owns (``StagingPool``): a call answered in time has its served chunks copied into the caller's
buffers; a call past its deadline is answered with misses, and its buffers stay the store's
until the engine hands the batch back, late, when they are discarded.  Late bytes never
reach memory the caller got back.  The paths such a call read go out of service
(``RootState.hung``: lookups of their chunks are misses, writes go elsewhere or are dropped)
until the filesystem answers a probe from a thread of its own and every late batch on them
came back (``HangWatch``).
"""

from __future__ import annotations

import ctypes
import heapq
import itertools
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Sequence

from ..disk.format import padded_length
from ..io.buffers import AlignedBuffer, buffer_address
from .index import IndexEntry
from .roots import Roots, RootState
from .stats import Counter, StoreStats

logger = logging.getLogger(__name__)

#: Idle staging buffers kept for the next calls, in bytes (more are unmapped).
STAGING_IDLE_BYTES = 128 * 1024 * 1024

#: How often the watch probes a path out of service, at most.
PROBE_EVERY_S = 1.0


class StagingPool:
    """Page-aligned buffers the engine reads into when reads have a deadline, reused by size."""

    def __init__(self, idle_bytes: int = STAGING_IDLE_BYTES) -> None:
        self._idle_bytes = idle_bytes
        self._held = 0
        self._free: dict[int, list[AlignedBuffer]] = {}
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> AlignedBuffer:
        """A buffer of at least ``nbytes`` (padded to O_DIRECT's alignment)."""
        size = padded_length(nbytes)
        with self._lock:
            free = self._free.get(size)
            if free:
                self._held -= size
                return free.pop()
        return AlignedBuffer(size)

    def give(self, buffers: Iterable[AlignedBuffer]) -> None:
        """Buffers the engine is done with: kept while the idle bytes allow, else unmapped."""
        dropped = []
        with self._lock:
            for buf in buffers:
                if self._held + buf.size > self._idle_bytes:
                    dropped.append(buf)
                    continue
                self._free.setdefault(buf.size, []).append(buf)
                self._held += buf.size
        for buf in dropped:
            buf.close()


def copy_served(served: Sequence[bool], dests: Sequence[memoryview],
                staging: Sequence[AlignedBuffer | None], lengths: Sequence[int]) -> None:
    """Copy each served chunk's payload from its staging buffer into the caller's buffer
    (``ctypes.memmove`` lets go of the GIL)."""
    for ok, dest, buf, n in zip(served, dests, staging, lengths, strict=True):
        if ok and buf is not None:
            ctypes.memmove(buffer_address(dest), buffer_address(buf.view), n)


class DeadlineCall:
    """One read call under a deadline: the engine's completion and the deadline race, the
    first one wins, under the call's lock."""

    __slots__ = ("deadline", "roots", "staging", "on_expire", "done", "expired", "lock")

    def __init__(self, deadline: float, roots: set[int], staging: list[AlignedBuffer],
                 on_expire: Callable[[], None] | None = None) -> None:
        self.deadline = deadline
        self.roots = roots
        self.staging = staging
        self.on_expire = on_expire  # asynchronous calls: answers the caller with misses
        self.done = False
        self.expired = False
        self.lock = threading.Lock()

    def finish(self) -> bool:
        """The engine handed the batch back: True when in time (the call is answered from
        it), False when the deadline passed first (the batch is to be discarded)."""
        with self.lock:
            self.done = not self.expired
            return self.done

    def expire(self) -> bool:
        """The deadline passed: True when the engine had not answered (the call is a miss)."""
        with self.lock:
            self.expired = not self.done
            return self.expired


class HangWatch:
    """The deadline's bookkeeping and its thread (``nvme-deadline``): expires asynchronous
    calls past their deadline, takes the paths of every expired call out of service, and
    brings a path back once a probe (``os.statvfs``, on a thread of its own, answered within
    the deadline) succeeds and the engine handed back every late batch on it."""

    def __init__(self, roots: Roots, stats: StoreStats) -> None:
        self.deadline_s = roots.deadline_s
        # the roots whose reads have a deadline (nvme.io_deadline_s, per filesystem for auto)
        self.roots = frozenset(root.index for root in roots if root.deadline_s > 0)
        self._everywhere = len(self.roots) == len(roots)
        self.staging = StagingPool()
        self._roots = roots
        self._stats = stats
        self._late = [0] * len(roots)  # expired calls on each root not handed back yet
        self._probing: set[int] = set()
        self._probed_ok: set[int] = set()
        self._calls: list[tuple[float, int, DeadlineCall]] = []  # asynchronous, by deadline
        self._seq = itertools.count()
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="nvme-deadline", daemon=True)
        self._thread.start()

    # -- calls ------------------------------------------------------------------------------

    def covers(self, entries: Iterable[IndexEntry | None]) -> bool:
        """Whether a read of ``entries`` has a deadline: some chunk is on a root with one
        (the whole call is then read under it: its chunks share the engine's batch)."""
        if self._everywhere:
            return True
        roots = self.roots
        return any(entry is not None and entry.root in roots for entry in entries)

    def watch(self, call: DeadlineCall) -> None:
        """Expire the asynchronous ``call`` at its deadline unless it finished before."""
        with self._lock:
            heapq.heappush(self._calls, (call.deadline, next(self._seq), call))
            if self._calls[0][2] is call:
                self._wake.notify()

    def missed(self, call: DeadlineCall, chunks: int) -> None:
        """``call`` expired: count it, and take its paths out of service until its batch
        comes back and they answer a probe (not for the calls a closing store answers)."""
        self._stats.add(Counter.READ_FAILURES, chunks)
        with self._lock:
            for index in call.roots:
                self._late[index] += 1
            if self._stopping:
                return
            self._stats.add(Counter.DEADLINE_MISSES, chunks)
            for index in call.roots:
                root = self._roots[index]
                self._probed_ok.discard(index)
                if not root.hung:
                    root.hung = True
                    root.offline_until = float("inf")
                    logger.warning(
                        "NVMe tier: a read of %d chunk(s) under %s did not finish within "
                        "nvme.io_deadline_s (%g s); served as misses, and the path is out of "
                        "service until its filesystem answers again.", chunks,
                        root.layout.root, self.deadline_s)
            self._wake.notify()

    def late(self, call: DeadlineCall, chunks: int) -> None:
        """The engine handed back an expired call's batch: its bytes are discarded."""
        self._stats.add(Counter.LATE_READS_DISCARDED, chunks)
        self.staging.give(call.staging)
        with self._lock:
            for index in call.roots:
                self._late[index] -= 1
            self._wake.notify()

    # -- the thread ---------------------------------------------------------------------------

    def stop(self, timeout_s: float) -> None:
        """Answer every asynchronous call still waiting (misses), stop the thread."""
        with self._lock:
            self._stopping = True
            self._wake.notify()
        self._thread.join(timeout_s)

    def _loop(self) -> None:
        while True:
            with self._lock:
                if self._stopping:
                    due = [call for _, _, call in self._calls]
                    self._calls.clear()
                else:
                    due = self._due(time.monotonic())
                    hung = [root for root in self._roots if root.hung]
                    if not due:
                        self._restore(hung)
                        self._wake.wait(self._next_wake(bool(hung)))
                        continue
            for call in due:
                if call.expire() and call.on_expire is not None:
                    call.on_expire()
            if self._stopping:
                return

    def _next_wake(self, probing: bool) -> float | None:
        """Seconds until the next deadline or probe (None: nothing to do until woken)."""
        waits = [PROBE_EVERY_S] if probing else []
        if self._calls:
            waits.append(max(self._calls[0][0] - time.monotonic(), 0.001))
        return min(waits, default=None)

    def _due(self, now: float) -> list[DeadlineCall]:
        """The asynchronous calls past their deadline (taken off the heap); those finished
        meanwhile are dropped.  Called with the lock held."""
        due = []
        while self._calls and (self._calls[0][2].done or self._calls[0][0] <= now):
            call = heapq.heappop(self._calls)[2]
            if not call.done:
                due.append(call)
        return due

    def _restore(self, hung: list[RootState]) -> None:
        """Probe each path out of service (one probe at a time each); bring back those that
        answered with no late batch left.  Called with the lock held."""
        for root in hung:
            index = root.index
            if index in self._probed_ok and self._late[index] == 0:
                self._probed_ok.discard(index)
                root.hung = False
                root.offline_until = 0.0
                logger.warning("NVMe tier: %s answers again; back in service.",
                               root.layout.root)
            elif index not in self._probing:
                self._probing.add(index)
                threading.Thread(target=self._probe, args=(root,), name="nvme-probe",
                                 daemon=True).start()

    def _probe(self, root: RootState) -> None:
        """Ask the filesystem for its size (a round trip to a network filesystem's server,
        never answered from a cache); a probe that hangs leaves this thread stuck and no
        other probe of the path starts until it returns."""
        try:
            os.statvfs(root.layout.root_str)
            ok = True
        except OSError:
            ok = False
        with self._lock:
            self._probing.discard(root.index)
            if ok:
                self._probed_ok.add(root.index)
                self._wake.notify()
