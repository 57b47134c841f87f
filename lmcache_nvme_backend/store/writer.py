"""Writing chunks: one admission, one placement, one settlement per layout of a store call.

A call (keys, namespaces, metadata and payloads as columns) is admitted per layout (one
metadata object and namespace): chunks too big or already stored dropped, the payload
bytes accounted in the byte-bounded queue (``nvme.queue_full_policy``); ``placement.py``
places the rest, the engine writes them, and the batch is settled before the call is told
(one decision per layout, each lock once per call: ``docs/benchmarks.md``).
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Sequence

from ..config import NVMeSettings
from ..disk.format import TensorMeta, file_size_for, max_key_bytes, namespace_bytes, texts_bytes
from ..disk.layout import digest_of_key_bytes, namespace_id
from ..io.engine import Batch, ChunkEngine
from .catalog import Catalog
from .index import IndexEntry
from .placement import Layout, Placed, Placement
from .room import Room
from .roots import Roots
from .stats import Counter, StoreStats
from .writeback import ChunkWrite, SubmitResult, TaskOutcome, WriteBackQueue

logger = logging.getLogger(__name__)

#: How long a closing store waits for cancelled writes to hand their buffers back.
CANCEL_WAIT_S = 5.0

OnTaskDone = Callable[[TaskOutcome], None]


class ChunkWriter:
    """Admission and write-back of one store."""

    def __init__(self, settings: NVMeSettings, catalog: Catalog, roots: Roots, room: Room,
                 engine: ChunkEngine, stats: StoreStats) -> None:
        self.settings = settings
        self.catalog = catalog
        self.engine = engine
        self.stats = stats
        self.queue = WriteBackQueue(settings.write_queue_bytes)
        self.closed = False
        # Set when chunks are read into GPU memory: files also carry gpusum's checksum.
        self.record_gpu_checksums = False
        self.room = room
        self.placement = Placement(settings, catalog, roots, room, stats)
        # queue_full_policy wait waits at most the paths' read deadline (nvme.io_deadline_s),
        # if any: a queue held by writes to a hung filesystem does not hold the caller (the
        # chunk is dropped and counted)
        self._full_wait_s = roots.deadline_s or 1e9
        self._layout: Layout | None = None  # the last one seen: replaced whole

    # -- store calls -----------------------------------------------------------

    def submit_many(self, writes: Sequence[ChunkWrite]) -> list[SubmitResult]:
        """Queue chunks for persistence without waiting for the drive, as one task: each
        write's ``on_persisted`` runs once its file is published, and every ``release``
        exactly once when the call has ended, whatever the result."""
        end = _WritesEnd(writes)
        results = [SubmitResult.CLOSED] * len(writes)
        try:
            results = self.submit_task([w.key for w in writes], [w.namespace for w in writes],
                                       [w.meta for w in writes],
                                       [w.payload for w in writes], end.ended)
        finally:
            end.admitted(results)
        return results

    def submit_task(self, keys: Sequence[str], namespaces: Sequence[str],
                    metas: Sequence[TensorMeta], payloads: Sequence[memoryview],
                    on_done: OnTaskDone) -> list[SubmitResult]:
        """A call's chunks, layout by layout (``ChunkStore.submit_task``); what admission did
        with each.  ValueError (after ``on_done``, nothing stored) for a payload that is not
        the size its metadata says."""
        n = len(keys)
        if n and metas.count(metas[0]) == n and namespaces.count(namespaces[0]) == n and \
                list(map(len, payloads)).count(metas[0].nbytes) == n:  # the common call
            return self._write(self._layout_of(metas[0], namespaces[0]), keys, payloads,
                               on_done)
        wrong = [i for i in range(n) if len(payloads[i]) != metas[i].nbytes]
        if wrong:
            _call(on_done, TaskOutcome.failed())
            raise ValueError(f"tensor metadata says {metas[wrong[0]].nbytes} bytes, payload "
                             f"has {len(payloads[wrong[0]])}")
        parts: dict[tuple[int, str], list[int]] = {}
        for i in range(n):
            parts.setdefault((id(metas[i]), namespaces[i]), []).append(i)
        gather = _Gather(list(parts.values()), on_done)
        results = [SubmitResult.CLOSED] * n
        for k, mine in enumerate(parts.values()):
            layout = self._layout_of(metas[mine[0]], namespaces[mine[0]])
            try:
                part = self._write(layout, [keys[i] for i in mine],
                                   [payloads[i] for i in mine],
                                   functools.partial(gather.part_done, k))
            except BaseException:  # the engine refused: the parts not handed over end too
                for rest in range(k + 1, len(parts)):
                    gather.part_done(rest, TaskOutcome.failed())
                raise
            for i, result in zip(mine, part, strict=True):
                results[i] = result
        if not parts:  # nothing to persist
            _call(on_done, TaskOutcome(True, 0, [], [], []))
        return results

    def _layout_of(self, meta: TensorMeta, namespace: str) -> Layout:
        layout = self._layout
        if layout is None or layout.meta is not meta or layout.namespace != namespace:
            file_size = file_size_for(meta.nbytes)
            layout = self._layout = Layout(
                meta, namespace, meta.nbytes, file_size, max_key_bytes(namespace, meta),
                meta.nbytes <= self.queue.capacity and file_size <= self.catalog.budgets[0],
                meta.to_json(), namespace_bytes(namespace), namespace_id(namespace))
            self.catalog.note_namespace(layout.ns_id)  # its directory is watched from now on
        return layout

    # -- admission -------------------------------------------------------------

    def _write(self, layout: Layout, keys: Sequence[str], payloads: Sequence[memoryview],
               on_done: OnTaskDone) -> list[SubmitResult]:
        """Admit, place and hand to the engine the chunks of one layout; ``on_done`` once
        every one ended."""
        n = len(keys)
        if self.closed:
            _call(on_done, TaskOutcome.failed())
            return [SubmitResult.CLOSED] * n
        nbytes = layout.nbytes
        key_bytes = texts_bytes(keys)
        results = [SubmitResult.QUEUED] * n
        digests = list(map(digest_of_key_bytes, key_bytes))
        offered: Sequence[int] = range(n)
        if not layout.fits or (n and max(map(len, key_bytes)) > layout.key_room):
            offered = self._oversize(layout, key_bytes, results)
        stale: list[IndexEntry] = []
        fresh = self.catalog.register(digests if len(offered) == n else
                                      [digests[i] for i in offered], time.time_ns(),
                                      layout.ns_id, stale)
        if stale:
            self.room.evict(stale)
        if False in fresh:
            self.stats.add(Counter.DUPLICATE_PUTS, fresh.count(False))
            for i, new in zip(offered, fresh, strict=True):
                if not new:
                    results[i] = SubmitResult.DUPLICATE
            offered = [i for i, new in zip(offered, fresh, strict=True) if new]
        positions = offered if self.queue.hold(len(offered) * nbytes, len(offered)) else \
            self._wait_or_drop(offered, nbytes, digests, results)
        admitted = len(positions) == n or results.count(SubmitResult.QUEUED) + \
            results.count(SubmitResult.DUPLICATE) == n
        if not positions:
            _call(on_done, TaskOutcome(admitted, 0, [], [], []))
            return results
        placed = self.placement.place(layout, positions, digests, payloads, key_bytes)
        done = functools.partial(self._settle, placed, len(positions), admitted, on_done)
        if not placed[4]:  # no chunk has a root with room
            done(None)
            return results
        try:
            self.engine.submit_write(self.placement.shares(placed, self.record_gpu_checksums),
                                     done)
        except BaseException:
            self.placement.undo(placed)
            self.queue.release(len(positions) * nbytes, len(positions))
            _call(on_done, TaskOutcome.failed())
            raise
        return results

    def _oversize(self, layout: Layout, key_bytes: list[bytes],
                  results: list[SubmitResult]) -> list[int]:
        """Mark the chunks too big for the queue or the budget, or with a key too long for
        the header: dropped, counted, and said once; the others."""
        for i, key in enumerate(key_bytes):
            if not layout.fits or len(key) > layout.key_room:
                results[i] = SubmitResult.OVERSIZE
        if not self.stats.get(Counter.OVERSIZE_DROPS):
            logger.warning(
                "NVMe tier: not storing a %d-byte chunk: it exceeds nvme.write_queue_mb "
                "(%d bytes) or the budget per path (%d bytes), or its key is too long for "
                "the header. Raise nvme.write_queue_mb / nvme.max_size_gb.", layout.nbytes,
                self.queue.capacity, self.catalog.budgets[0])
        self.stats.add(Counter.OVERSIZE_DROPS, results.count(SubmitResult.OVERSIZE))
        return [i for i, result in enumerate(results) if result is SubmitResult.QUEUED]

    def _wait_or_drop(self, offered: Sequence[int], nbytes: int, digests: list[str],
                      results: list[SubmitResult]) -> Sequence[int]:
        """The offered chunks did not fit the queue at once: wait for room, or drop what does
        not fit now (``nvme.queue_full_policy``); mark the refused ones; the accepted ones."""
        if not offered:  # a closed queue holds nothing
            return offered
        wait = self.settings.queue_full_policy == "wait"
        if wait:
            self.stats.add(Counter.QUEUE_FULL_WAITS)
        wait_s = self._full_wait_s if wait else 0.0
        ok = self.queue.offer([nbytes] * len(offered), wait_s=wait_s)
        refused = [i for i, fits in zip(offered, ok, strict=True) if not fits]
        self.catalog.end_pending(digests[i] for i in refused)
        for i in refused:
            results[i] = SubmitResult.CLOSED if self.closed else SubmitResult.QUEUE_FULL
        if not self.closed:
            self.stats.add(Counter.QUEUE_FULL_DROPS, len(refused))
        return [i for i, fits in zip(offered, ok, strict=True) if fits]

    def _settle(self, placed: Placed, accepted: int, admitted: bool, on_done: OnTaskDone,
                result: Batch | None) -> None:
        """The engine finished a batch (``result``; None: nothing placed): settle it, give
        the queue its bytes back, tell the call (LMCache holds its objects until then)."""
        try:
            outcome = self.placement.settle(placed, result)
        except BaseException:
            self.queue.release(accepted * placed[0].nbytes, accepted)
            _call(on_done, TaskOutcome.failed())
            raise
        self.queue.release(accepted * placed[0].nbytes, accepted)
        _call(on_done, outcome if admitted else outcome._replace(ok=False))

    def flush(self, timeout_s: float = 60.0) -> bool:
        """Wait until every queued write has finished (persisted or dropped)."""
        return self.queue.wait_empty(timeout_s)

    def close(self, timeout_s: float) -> None:
        """Finish queued writes (up to ``timeout_s``), drop the rest."""
        self.closed = True
        if not self.flush(timeout_s):
            logger.warning("NVMe tier: write-back did not finish within %.0f s; dropping the "
                           "rest.", timeout_s)
            self.engine.cancel_writes()  # writes not started end as cancelled
            self.flush(CANCEL_WAIT_S)
        self.queue.close()


class _Gather:
    """A call of several layouts: one outcome once every part ended (positions in the call)."""

    def __init__(self, parts: list[list[int]], on_done: OnTaskDone) -> None:
        self._parts = parts
        self._on_done = on_done
        self._left = len(parts)
        self._outcome = TaskOutcome(True, 0, [], [], [])
        self._lock = threading.Lock()

    def part_done(self, k: int, part: TaskOutcome) -> None:
        mine = self._parts[k]
        stored = mine if part.stored is None else [mine[i] for i in part.stored]
        with self._lock:
            ok, nbytes, so_far, digests, sizes = self._outcome
            self._outcome = TaskOutcome(ok and part.ok, nbytes + part.nbytes,
                                        [*(so_far or []), *stored], digests + part.digests,
                                        sizes + part.file_sizes)
            self._left -= 1
            last = self._left == 0
        if last:
            _call(self._on_done, self._outcome)


class _WritesEnd:
    """How the writes of a ``submit_many`` call end: one not queued released at once; the
    queued ones once admission and the call's outcome (either may come first) are both in:
    each persisted one marked and its ``on_persisted`` run, then each one's ``release``."""

    def __init__(self, writes: Sequence[ChunkWrite]) -> None:
        self._writes = writes
        self._results: list[SubmitResult] | None = None
        self._outcome: TaskOutcome | None = None
        self._lock = threading.Lock()

    def admitted(self, results: list[SubmitResult]) -> None:
        for write, result in zip(self._writes, results, strict=True):
            if result is not SubmitResult.QUEUED:  # at once: its memory is not needed
                _run(write.release, write.key)
        with self._lock:
            self._results = results
            outcome = self._outcome
        if outcome is not None:
            self._end_queued(results, outcome)

    def ended(self, outcome: TaskOutcome) -> None:
        with self._lock:
            self._outcome = outcome
            results = self._results
        if results is not None:
            self._end_queued(results, outcome)

    def _end_queued(self, results: list[SubmitResult], outcome: TaskOutcome) -> None:
        writes = self._writes
        for i in range(len(writes)) if outcome.stored is None else outcome.stored:
            writes[i].persisted = True
            _run(writes[i].on_persisted, writes[i].key)
        for write, result in zip(writes, results, strict=True):
            if result is SubmitResult.QUEUED:
                _run(write.release, write.key)


def _call(on_done: OnTaskDone, outcome: TaskOutcome) -> None:
    try:
        on_done(outcome)
    except Exception:  # a caller's callback must not break the store's thread
        logger.exception("NVMe tier: completing a store task failed")


def _run(callback: Callable[[], None] | None, key: str) -> None:
    if callback is None:
        return
    try:
        callback()
    except Exception:  # one caller's callback must not keep the rest
        logger.exception("NVMe tier: a callback of the write of %s failed", key)
