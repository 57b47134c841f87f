"""The store's catalogue: the index, the writes in flight, and who hears of removals.

One lock guards the :class:`ChunkIndex` and the table of pending writes.  Every
method here is one short critical section and none does I/O, so a lookup never
waits for a drive.  Removal listeners are called by whoever removed the entries,
after the files are gone and outside the lock.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Sequence

from ..disk.format import TensorMeta
from .index import ChunkIndex, IndexEntry
from .writeback import ChunkWrite

logger = logging.getLogger(__name__)

RemovalListener = Callable[[list[IndexEntry]], None]


class Catalog:
    """Thread-safe index of published chunks, plus the keys queued for writing."""

    def __init__(self, budgets: Sequence[int]) -> None:
        self._lock = threading.Lock()
        self._index = ChunkIndex(list(budgets))
        self._pending: dict[str, ChunkWrite] = {}
        self._listeners: list[RemovalListener] = []

    @property
    def budgets(self) -> list[int]:
        """Byte budget of each root (fixed at start)."""
        return self._index.budgets

    # -- lookups -------------------------------------------------------------

    def lookup(self, digest: str, root_healthy: Callable[[int], bool], now_ns: int,
               pin: bool = False) -> bool:
        """Whether a chunk is indexed on a healthy root; a hit counts as a use (and may pin)."""
        with self._lock:
            entry = self._index.get(digest)
            hit = entry is not None and root_healthy(entry.root)
            if hit:
                self._index.touch(digest, now_ns)
                if pin:
                    self._index.pin(digest)
        return hit

    def lookup_many(self, digests: Iterable[str], root_healthy: Callable[[int], bool],
                    now_ns: int, pin: bool = False) -> list[bool]:
        """``lookup`` for several chunks under one lock hold."""
        hits: list[bool] = []
        with self._lock:
            for digest in digests:
                entry = self._index.get(digest)
                hit = entry is not None and root_healthy(entry.root)
                if hit:
                    self._index.touch(digest, now_ns)
                    if pin:
                        self._index.pin(digest)
                hits.append(hit)
        return hits

    def entry(self, digest: str) -> IndexEntry | None:
        with self._lock:
            return self._index.get(digest)

    def entries(self, digests: Iterable[str]) -> list[IndexEntry | None]:
        """The entries of several digests, read under one lock hold."""
        with self._lock:
            return [self._index.get(d) for d in digests]

    def learn_meta(self, digest: str, meta: TensorMeta, replace: bool = False) -> None:
        """Record the tensor metadata of an entry recovered without it (read from its header);
        ``replace``: also over metadata the index had (a manifest's that the header denies)."""
        with self._lock:
            entry = self._index.get(digest)
            if entry is not None and (replace or entry.meta is None):
                entry.meta = meta

    def pin(self, digest: str) -> bool:
        with self._lock:
            return self._index.pin(digest)

    def unpin(self, digest: str) -> bool:
        with self._lock:
            return self._index.unpin(digest)

    def is_pending(self, digest: str) -> bool:
        with self._lock:
            return digest in self._pending

    # -- writes in flight ------------------------------------------------------

    def register(self, writes: Sequence[ChunkWrite], now_ns: int) -> list[bool]:
        """Mark each write pending; False for a key already stored or queued (a use, for LRU)."""
        fresh: list[bool] = []
        with self._lock:
            for write in writes:
                digest = write.digest
                if digest in self._pending or digest in self._index:
                    self._index.touch(digest, now_ns)
                    fresh.append(False)
                else:
                    self._pending[digest] = write
                    fresh.append(True)
        return fresh

    def end_pending(self, digests: Iterable[str]) -> None:
        with self._lock:
            for digest in digests:
                self._pending.pop(digest, None)

    def reserve(self, root: int, size: int) -> list[IndexEntry] | None:
        """Reserve ``size`` bytes on ``root``; the LRU victims removed to make room.

        None when the root cannot hold it even after evicting every unpinned entry.
        """
        with self._lock:
            victims = self._index.plan_reservation(root, size)
            if victims is None:
                return None
            for victim in victims:
                self._index.remove(victim.digest)
            self._index.reserve(root, size)
        return victims

    def pop_oldest_unpinned(self, root: int) -> IndexEntry | None:
        """Remove and return the least recently used unpinned entry of ``root``."""
        with self._lock:
            oldest = next((e for e in self._index.lru_order(root) if e.pins == 0), None)
            if oldest is not None:
                self._index.remove(oldest.digest)
            return oldest

    def release(self, root: int, size: int) -> None:
        """Give back a reservation (the write ended, published or not)."""
        with self._lock:
            self._index.release(root, size)

    def publish(self, entry: IndexEntry, reserved: int) -> None:
        """Index a chunk file just published, in place of its reservation."""
        self.publish_many([(entry, reserved)])

    def publish_many(self, published: Iterable[tuple[IndexEntry, int]]) -> None:
        """``publish`` for several chunks under one lock hold."""
        with self._lock:
            for entry, reserved in published:
                self._index.release(entry.root, reserved)
                self._index.add(entry)

    def add_if_absent(self, entry: IndexEntry) -> None:
        """Index a chunk another process published (shared mode)."""
        with self._lock:
            if entry.digest not in self._index:
                self._index.add(entry)

    def add_recovered(self, root: int, entries: Sequence[IndexEntry]) -> list[IndexEntry]:
        """Index the chunks found at start (oldest first); the ones over the budget are returned.

        Over-budget entries (the budget was lowered, or the manifest was stale)
        are removed least recently used first; the caller deletes their files.
        """
        over: list[IndexEntry] = []
        with self._lock:
            for entry in entries:
                self._index.add(entry)
            while self._index.used_bytes(root) > self._index.budgets[root]:
                victim = next(self._index.lru_order(root))
                self._index.remove(victim.digest)
                over.append(victim)
        return over

    def remove(self, digest: str) -> IndexEntry | None:
        with self._lock:
            return self._index.remove(digest)

    def remove_many(self, digests: Iterable[str]) -> list[IndexEntry]:
        """Take the entries out of the index under one lock hold; the ones that were there."""
        with self._lock:
            removed = [self._index.remove(digest) for digest in digests]
        return [entry for entry in removed if entry is not None]

    # -- reporting ---------------------------------------------------------------

    def lru_entries(self, root: int) -> list[IndexEntry]:
        """Entries of ``root``, least recently used (oldest ``last_access_ns``) first.

        The lock is held only to copy the table (about 20 ms per million entries);
        filtering and sorting happen outside it, so lookups and stores barely wait.
        """
        with self._lock:
            entries = self._index.snapshot()
        mine = [e for e in entries if e.root == root]
        mine.sort(key=lambda e: e.last_access_ns)
        return mine

    def used_bytes(self, root: int | None = None) -> int:
        with self._lock:
            return self._index.used_bytes(root)

    def usage(self) -> dict[str, int]:
        with self._lock:
            return {
                "entries": len(self._index),
                "used_bytes": self._index.used_bytes(),
                "reserved_bytes": self._index.reserved_bytes(),
                "capacity_bytes": sum(self._index.budgets),
                "pending_writes": len(self._pending),
            }

    # -- removal listeners ---------------------------------------------------------

    def add_removal_listener(self, listener: RemovalListener) -> None:
        self._listeners.append(listener)

    def notify_removed(self, entries: list[IndexEntry]) -> None:
        """Tell the listeners (outside the lock); a failing listener never breaks the store."""
        if not entries:
            return
        for listener in self._listeners:
            try:
                listener(entries)
            except Exception:
                logger.exception("NVMe tier: removal listener failed")
