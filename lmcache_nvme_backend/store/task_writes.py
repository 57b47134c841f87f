"""A store task in one admission step and one completion step.

The general write path (``writer.py``) takes a chunk write object per chunk through
admission, the queue, placement and reservation, and publishes each on completion: some
2,000 Python opcodes for a one-chunk task, 1,000 per chunk of an eight-chunk one.  On a big
server one process moves every chunk through one interpreter, so that is what bounds it
(``docs/benchmarks.md``, "The GIL ceiling of one process").  This path takes the common
case of a whole task: every chunk in one layout and namespace with a
key that fits the header, room in the queue now, no shared directory, no GPU checksum.
Python decides once per task and each lock is taken once per task (the queue's, the
catalogue's at admission and at publication); what runs per chunk is its digest and its
index entry.  The engine writes the whole task as one batch, given as one share per root
(``engine.WriteShare``): it makes each chunk's file names from its digest itself.

Anything else goes the general way: ``submit`` returns False before it has changed
anything, or undoes what it did (a reservation that did not fit on every root).  A batch
that comes back with a failed write is settled by the general path's completion, with a
chunk write object built for each of its chunks then.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, NamedTuple

from ..disk.format import TensorMeta, file_size_for, max_key_bytes, namespace_bytes, texts_bytes
from ..disk.layout import digest_of_key_bytes, namespace_id
from ..disk.safe_fs import root_descriptor
from ..io import engine
from ..io.engine import ChunkEngine
from .index import IndexEntry
from .roots import RootState, note_space
from .stats import Counter
from .writeback import ChunkWrite, SubmitResult, TaskOutcome, WriteTask, outcome_of

if TYPE_CHECKING:
    from .writer import ChunkWriter

logger = logging.getLogger(__name__)

OnTaskDone = Callable[[TaskOutcome], None]


class _Layout(NamedTuple):
    """What a task's chunks share, derived once per layout and namespace."""

    meta: TensorMeta
    namespace: str
    nbytes: int
    file_size: int
    key_room: int  # UTF-8 bytes of key that fit the header beside the rest
    fits: bool  # a chunk fits the queue and a root's budget at all
    meta_json: bytes
    namespace_raw: bytes
    ns_id: str


#: A task handed to the engine, as its completion needs it: ``(on_done, layout, keys,
#: payloads, digests, order, roots, groups, started)``; ``order``: the positions written, root
#: by root (None: every one, in order); ``roots``: the root index of each, in that order;
#: ``groups``: per root, its positions and the victims evicted for them.  A plain tuple:
#: a named tuple's constructor is a Python function, and one is built per task.
_Task = tuple[OnTaskDone, _Layout, Sequence[str], Sequence[memoryview], list[str],
              "list[int] | None", list[int], "list[tuple[RootState, list[int], list[IndexEntry]]]",
              float]


class TaskWrites:
    """The path of whole store tasks of one ``ChunkWriter``."""

    def __init__(self, writer: ChunkWriter, engine: ChunkEngine) -> None:
        self._writer = writer
        self._engine = engine
        self._layout: _Layout | None = None  # the last one seen: replaced whole

    def submit(self, keys: Sequence[str], namespaces: Sequence[str],
               metas: Sequence[TensorMeta], payloads: Sequence[memoryview],
               on_done: OnTaskDone) -> bool:
        """Admit and dispatch the task; False (nothing done) when it is not the common case.

        ``on_done`` runs once, on the engine's completion thread (or on this one, for a task
        of duplicates only), after every chunk ended."""
        writer = self._writer
        n = len(keys)
        if not n or writer.closed or writer.record_gpu_checksums or writer.room.shared is not None:
            return False
        meta, namespace = metas[0], namespaces[0]
        if metas.count(meta) != n or namespaces.count(namespace) != n:
            return False
        layout = self._layout
        if layout is None or layout.meta is not meta or layout.namespace != namespace:
            layout = self._layout = self._learn(meta, namespace)
        nbytes = layout.nbytes
        if not layout.fits or list(map(len, payloads)).count(nbytes) != n:
            return False
        key_bytes = texts_bytes(keys)
        if max(map(len, key_bytes)) > layout.key_room:
            return False
        digests = list(map(digest_of_key_bytes, key_bytes))
        catalog = writer.catalog
        fresh = catalog.register(digests, time.time_ns())
        positions: Sequence[int] = range(n) if False not in fresh else \
            [i for i, new in enumerate(fresh) if new]
        if positions and not writer.queue.hold(len(positions) * nbytes, len(positions)):
            catalog.end_pending(digests[i] for i in positions)
            return False  # full: the general path waits or drops, as configured
        if len(positions) < n:
            writer.stats.add(Counter.DUPLICATE_PUTS, n - len(positions))
            if not positions:
                _call(on_done, TaskOutcome.stored_before())
                return True
        groups = self._reserve(positions, digests, layout.file_size)
        if groups is None:  # a root out of service or out of room: chunk by chunk instead
            catalog.end_pending(digests[i] for i in positions)
            writer.queue.release(len(positions) * nbytes, len(positions))
            return False
        if len(groups) == 1 and len(positions) == n:
            order, roots = None, [groups[0][0].index] * n
        else:
            order = [i for _, mine, _ in groups for i in mine]
            roots = [root.index for root, mine, _ in groups for _ in mine]
        task: _Task = (on_done, layout, keys, payloads, digests, order, roots, groups,
                       time.perf_counter())
        shares = self._shares(layout, digests, payloads, groups, key_bytes)
        try:
            self._engine.submit_write(shares, functools.partial(self._written, task))
        except BaseException:
            self._undo(groups, digests, layout.file_size, nbytes)
            _call(on_done, TaskOutcome.failed())
            raise
        return True

    def _learn(self, meta: TensorMeta, namespace: str) -> _Layout:
        writer = self._writer
        file_size = file_size_for(meta.nbytes)
        return _Layout(meta, namespace, meta.nbytes, file_size, max_key_bytes(namespace, meta),
                       0 < meta.nbytes <= writer.queue.capacity and
                       file_size <= writer.catalog.budgets[0],
                       meta.to_json(), namespace_bytes(namespace), namespace_id(namespace))

    def _reserve(self, positions: Sequence[int], digests: list[str], file_size: int
                 ) -> list[tuple[RootState, list[int], list[IndexEntry]]] | None:
        """Each root's share of the chunks with its bytes reserved (and the victims evicted
        for them, whose files the first write of the share removes); None, with nothing
        reserved, when a chunk has no root in service or a share does not fit whole."""
        writer = self._writer
        by_root, homeless = writer.roots.group(positions, digests.__getitem__)
        groups: list[tuple[RootState, list[int], list[IndexEntry]]] = []
        if not homeless:
            for root, mine in by_root:
                victims: list[IndexEntry] = []
                fits = writer.room.reserve(root, len(mine) * file_size, victims)
                groups.append((root, mine if fits else [], victims))
                if not fits:
                    break
            else:
                return groups
        self._undo(groups, digests, file_size)
        return None

    def _undo(self, groups: list[tuple[RootState, list[int], list[IndexEntry]]],
              digests: list[str], file_size: int, nbytes: int = 0) -> None:
        """Give back the reservations of ``groups`` and remove their victims' files now (they
        are out of the index already); with ``nbytes``, also end the chunks' pending state
        and their place in the queue (a dispatch that failed)."""
        writer = self._writer
        for root, mine, victims in groups:
            if mine:
                writer.catalog.release(root.index, len(mine) * file_size)
            writer.room.evict_deferred(root, victims)
            if nbytes:
                writer.catalog.end_pending(digests[i] for i in mine)
                writer.queue.release(len(mine) * nbytes, len(mine))

    def _shares(self, layout: _Layout, digests: list[str], payloads: Sequence[memoryview],
                groups: list[tuple[RootState, list[int], list[IndexEntry]]],
                key_bytes: list[bytes]) -> list[engine.WriteShare]:
        """The engine's shares of a task, one per root (it names each chunk's files from its
        digest: no Python per chunk when the task goes to one root whole)."""
        writer = self._writer
        file_mode, dir_mode, fsync = writer.modes
        temp_suffix = writer.temp_suffix
        shares: list[engine.WriteShare] = []
        for root, mine, victims in groups:
            tree = root.layout
            if len(mine) == len(digests):  # the whole task, in order
                share, share_payloads, share_keys = digests, list(payloads), key_bytes
            else:
                share = [digests[i] for i in mine]
                share_payloads = [payloads[i] for i in mine]
                share_keys = [key_bytes[i] for i in mine]
            shares.append((root_descriptor(tree.root_str),
                           tree.write_naming(layout.ns_id, temp_suffix), layout.namespace_raw,
                           layout.meta_json, root.direct, file_mode, dir_mode, fsync,
                           tree.chunk_rels(victims), share, share_payloads, share_keys, None))
        return shares

    def _written(self, task: _Task, result: engine.Batch) -> None:
        """The engine wrote the task's batch (on its completion thread)."""
        if result.details:
            self._settle_one_by_one(task, result)
            return
        on_done, layout, _, _, digests, order, roots, groups, started = task
        writer = self._writer
        if order is not None:
            digests = [digests[i] for i in order]
        count = len(digests)
        outcome = TaskOutcome.failed()
        try:
            writer.catalog.publish_layout(digests, roots, layout.ns_id, layout.file_size,
                                          layout.meta, time.time_ns())
            outcome = TaskOutcome(True, count * layout.nbytes, order, digests,
                                  [layout.file_size] * count)
            for root, _, victims in groups:
                if victims:
                    writer.room.guards[root.index].freed(sum(v.size for v in victims))
                root.consecutive_errors = 0
                note_space(root)
            writer.stats.record_write(count * layout.nbytes,
                                      (time.perf_counter() - started) / count, count)
        finally:  # whatever happened, the task ends (LMCache holds its objects until then)
            writer.queue.release(count * layout.nbytes, count)
            _call(on_done, outcome)

    def _settle_one_by_one(self, task: _Task, result: engine.Batch) -> None:
        """A chunk of the batch was not published: the general path's completion settles
        the batch (it publishes the others, and says why each failed one did not)."""
        on_done, layout, keys, payloads, _, _, _, groups, started = task
        placed: list[tuple[ChunkWrite, RootState, int]] = []
        victims: list[list[IndexEntry]] = []
        positions: list[int] = []
        for root, mine, gone in groups:
            for i in mine:
                placed.append((ChunkWrite(keys[i], layout.namespace, layout.meta, payloads[i]),
                               root, layout.file_size))
                victims.append(gone)
                positions.append(i)
                gone = []

        def ended(whole: WriteTask) -> None:
            done = outcome_of(whole)  # its positions are the batch's
            _call(on_done, done._replace(stored=[positions[i] for i in done.stored or ()]))

        writes = [write for write, _, _ in placed]
        whole = WriteTask(writes, ended)
        whole.results = [SubmitResult.QUEUED] * len(writes)  # ``persisted`` tells the rest
        whole.ended(1)  # the submitter's share
        self._writer.settle_batch(placed, victims, started, result)


def _call(on_done: OnTaskDone, outcome: TaskOutcome) -> None:
    try:
        on_done(outcome)
    except Exception:  # a caller's callback must not break the store's thread
        logger.exception("NVMe tier: completing a store task failed")
