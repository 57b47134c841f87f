"""The store's catalogue: the index, the writes in flight, and who hears of removals.

One lock guards the :class:`ChunkIndex` and the table of pending writes; every method here
is one short critical section without I/O, so a lookup never waits for a drive.  Removal
listeners are called by whoever removed the entries, after the files are gone, unlocked.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from typing import Protocol

from ..disk.format import TensorMeta
from .index import ChunkIndex, IndexEntry

logger = logging.getLogger(__name__)

RemovalListener = Callable[[list[IndexEntry]], None]


class Accounting(Protocol):
    """Who hears of publishes and released reservations (shared mode: the member's
    account of the directory's budget, ``store/shared/share.py``)."""

    def on_publish(self, entry: IndexEntry, replaced: IndexEntry | None,
                   reserved: int) -> None: ...

    def on_release(self, root: int, size: int) -> None: ...


class Catalog:
    """Thread-safe index of published chunks, plus the keys queued for writing."""

    def __init__(self, budgets: Sequence[int]) -> None:
        self._lock = threading.Lock()
        self._index = ChunkIndex(list(budgets))
        self._pending: dict[str, None] = {}  # digests being written
        self._listeners: list[RemovalListener] = []
        # shared mode: this member's id on each root (owner of what it publishes), the
        # uses to share with the other members, and the account that counts its bytes
        self.members: list[str] = []
        self.touched: deque[tuple[int, str]] | None = None
        self.accounting: Accounting | None = None

    @property
    def budgets(self) -> list[int]:
        """Byte budget of each root (fixed at start)."""
        return self._index.budgets

    # -- lookups -------------------------------------------------------------

    def lookup(self, digest: str, root_healthy: Callable[[int], bool], now_ns: int,
               pin: bool = False, ns_id: str | None = None) -> bool:
        """Whether a chunk is indexed on a healthy root (in namespace ``ns_id``, if given);
        a hit counts as a use (and may pin).  Memory only: no filesystem call."""
        with self._lock:
            return self._hit(digest, root_healthy, now_ns, pin, ns_id)

    def lookup_many(self, digests: Iterable[str], root_healthy: Callable[[int], bool],
                    now_ns: int, pin: bool = False,
                    ns_ids: Sequence[str] | None = None) -> list[bool]:
        """``lookup`` for several chunks under one lock hold (in ``ns_ids[i]``, if given)."""
        with self._lock:
            return [self._hit(digest, root_healthy, now_ns, pin,
                              None if ns_ids is None else ns_ids[i])
                    for i, digest in enumerate(digests)]

    def _hit(self, digest: str, root_healthy: Callable[[int], bool], now_ns: int, pin: bool,
             ns_id: str | None) -> bool:
        """One lookup, with the lock held."""
        entry = self._index.get(digest)
        if entry is None or not root_healthy(entry.root) or \
                (ns_id is not None and entry.ns_id != ns_id):
            return False
        self._index.touch(digest, now_ns)
        if pin:
            self._index.pin(digest)
        if self.touched is not None:
            self.touched.append((entry.root, digest))
        return True

    def entry(self, digest: str) -> IndexEntry | None:
        with self._lock:
            return self._index.get(digest)

    def entries(self, digests: Iterable[str]) -> list[IndexEntry | None]:
        """The entries of several digests, read under one lock hold."""
        with self._lock:
            return self._index.get_many(digests)

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

    def register(self, digests: Iterable[str], now_ns: int, ns_id: str,
                 stale: list[IndexEntry]) -> list[bool]:
        """Mark each chunk of namespace ``ns_id`` pending; False for one already stored or
        pending (a use, for LRU).  One indexed under another namespace (another build of the
        weights) leaves the index into ``stale`` (its file to remove) and is registered."""
        fresh: list[bool] = []
        with self._lock:
            for digest in digests:
                if digest in self._pending or digest in self._index:
                    entry = self._index.get(digest)
                    if entry is not None and entry.ns_id != ns_id:
                        stale.extend(self._index.remove_many([digest]))
                    else:
                        self._index.touch(digest, now_ns)
                        if entry is not None and self.touched is not None:
                            self.touched.append((entry.root, digest))
                        fresh.append(False)
                        continue
                self._pending[digest] = None
                fresh.append(True)
        return fresh

    def end_pending(self, digests: Iterable[str]) -> None:
        with self._lock:
            for digest in digests:
                self._pending.pop(digest, None)

    def reserve(self, root: int, size: int) -> list[IndexEntry] | None:
        """Reserve ``size`` bytes on ``root``; the LRU victims removed to make room (None when
        it cannot fit even after evicting every unpinned entry)."""
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

    def note_reserved(self, root: int, size: int) -> None:
        """Count bytes reserved by a decision taken elsewhere (shared mode's account)."""
        with self._lock:
            self._index.reserve(root, size)

    def release(self, root: int, size: int) -> None:
        """Give back a reservation (the write ended, published or not)."""
        with self._lock:
            self._index.release(root, size)
        if self.accounting is not None:
            self.accounting.on_release(root, size)

    def publish_many(self, published: Iterable[tuple[IndexEntry, int]]) -> None:
        """Index chunk files just published in place of their reservations, under one lock
        hold (shared mode: owned by this member, whose account hears of each, unlocked)."""
        done: list[tuple[IndexEntry, IndexEntry | None, int]] = []
        with self._lock:
            index, pending, members = self._index, self._pending, self.members
            accounted = self.accounting is not None
            for entry, reserved in published:
                if members:
                    entry.owner = members[entry.root]
                pending.pop(entry.digest, None)
                replaced = index.publish(entry, reserved)
                if accounted:
                    done.append((entry, replaced, reserved))
        if self.accounting is not None:
            for entry, replaced, reserved in done:
                self.accounting.on_publish(entry, replaced, reserved)

    def publish_layout(self, digests: Sequence[str], roots: Sequence[int], ns_id: str,
                       size: int, meta: TensorMeta, now_ns: int) -> None:
        """``publish_many`` for chunks of one namespace and layout, each ``size`` bytes on
        disk and reserved: one entry built per chunk (shared mode: ``publish_many``)."""
        if self.accounting is not None or self.members:
            self.publish_many([(IndexEntry(digest, ns_id, root, size, meta, now_ns), size)
                               for digest, root in zip(digests, roots, strict=True)])
            return
        with self._lock:
            pop = self._pending.pop
            for digest in digests:
                pop(digest, None)
            self._index.publish_layout(digests, roots, ns_id, size, meta, now_ns)

    def add_recovered(self, root: int, entries: Sequence[IndexEntry],
                      enforce_budget: bool = True) -> list[IndexEntry]:
        """Index the chunks found at start (oldest first); with ``enforce_budget``, the ones
        over the budget are removed LRU first and returned for the caller to delete."""
        over: list[IndexEntry] = []
        with self._lock:
            for entry in entries:
                self._index.add(entry)
            while enforce_budget and self._index.used_bytes(root) > self._index.budgets[root]:
                victim = next(self._index.lru_order(root))
                self._index.remove(victim.digest)
                over.append(victim)
        return over

    def remove_entries(self, entries: Iterable[IndexEntry]) -> list[IndexEntry]:
        """Remove each entry that is still the indexed one for its digest (not one
        published again meanwhile); the ones removed."""
        removed = []
        with self._lock:
            for entry in entries:
                if self._index.get(entry.digest) is entry:
                    self._index.remove(entry.digest)
                    removed.append(entry)
        return removed

    def remove_many(self, digests: Iterable[str]) -> list[IndexEntry]:
        """Take the entries out of the index under one lock hold; the ones that were there."""
        with self._lock:
            return self._index.remove_many(digests)

    def note_namespace(self, ns_id: str) -> None:
        """A writer takes up namespace ``ns_id`` (``ChunkIndex.note_namespace``)."""
        with self._lock:
            self._index.note_namespace(ns_id)

    def namespaces(self, root: int) -> list[str]:
        """The namespaces ``root`` has, had or may have entries of."""
        with self._lock:
            return self._index.namespaces(root)

    def drop_namespace(self, root: int, ns_id: str) -> list[IndexEntry]:
        """Take every entry of namespace ``ns_id`` on ``root`` out of the index (its
        directory was removed; a walk of the table, 40 ms a million entries)."""
        with self._lock:
            return self._index.drop_namespace(root, ns_id)

    # -- shared mode -------------------------------------------------------------

    def coldest(self, root: int, need: int, skip: set[str]) -> list[IndexEntry]:
        """Eviction candidates: least recently used unpinned entries worth ``need`` bytes."""
        with self._lock:
            return self._index.coldest(root, need, skip)

    def apply_remote(self, published: Sequence[IndexEntry], deleted: Sequence[str],
                     accessed: Sequence[str], now_ns: int
                     ) -> tuple[int, list[IndexEntry], list[tuple[str, str]]]:
        """Apply another member's journal: chunks it published (owned by it, most recently
        used), deleted and read.  How many were new here, the entries removed, and
        ``(digest, previous owner)`` where two members published the same chunk."""
        added = 0
        doubles: list[tuple[str, str]] = []
        with self._lock:
            removed = self._index.remove_many(deleted)
            for entry in published:
                old = self._index.get(entry.digest)
                if old is None:
                    self._index.add(entry)
                    added += 1
                    continue
                if old.owner and old.owner != entry.owner:
                    doubles.append((entry.digest, old.owner))
                old.owner = entry.owner
                if old.meta is None:
                    old.meta = entry.meta
                self._index.touch(entry.digest, now_ns)
            for digest in accessed:
                self._index.touch(digest, now_ns)
        return added, removed, doubles

    def drop_owned_except(self, owner: str, keep: set[str]) -> list[IndexEntry]:
        """Remove the entries ``owner`` owns that are not in ``keep`` (its snapshot)."""
        with self._lock:
            gone = [e for e in self._index.snapshot() if e.owner == owner and
                    e.digest not in keep]
            self._index.remove_many(entry.digest for entry in gone)
        return gone

    def resize(self, entry: IndexEntry, size: int) -> None:
        """An entry's real size on disk, where another member's journal claimed another."""
        with self._lock:
            self._index.resize(entry, size)

    def owners(self, root: int) -> dict[str, tuple[str, int]]:
        """``digest -> (owner, size)`` of every entry of ``root``."""
        with self._lock:
            entries = self._index.snapshot()
        return {e.digest: (e.owner, e.size) for e in entries if e.root == root}
    # -- reporting ---------------------------------------------------------------

    def lru_entries(self, root: int) -> list[IndexEntry]:
        """Entries of ``root``, least recently used first (the lock held only to copy the
        table, about 20 ms per million entries)."""
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
            return {"entries": len(self._index), "used_bytes": self._index.used_bytes(),
                    "reserved_bytes": self._index.reserved_bytes(),
                    "capacity_bytes": sum(self._index.budgets),
                    "pending_writes": len(self._pending)}

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
