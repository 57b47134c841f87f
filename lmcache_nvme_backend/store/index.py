"""In-memory index: which chunks exist, on which root, their size on disk, LRU order, pins.

Capacity is accounted in real bytes on disk per root, and space for a write is reserved
before it starts, so the byte budget is never exceeded.  No lock of its own: ``catalog.py``
serialises access with one lock and never holds it across I/O.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

from ..disk.format import TensorMeta
from ..io.native import gc_untrack


@dataclass(slots=True)
class IndexEntry:
    """One published chunk file (slots: a store indexes millions).  No field may refer
    back to an entry: the cycle collector does not track it (see :class:`ChunkIndex`)."""

    digest: str
    ns_id: str
    root: int
    size: int
    meta: TensorMeta | None
    last_access_ns: int = 0
    pins: int = 0
    # shared mode: the member whose account counts the file ("": no live member's)
    owner: str = ""


class ChunkIndex:
    """Entries by digest, with one LRU list and one byte budget per root.

    Neither tables nor entries can be part of a reference cycle, so the cycle collector does
    not track them (``native.gc_untrack``): else every full collection visits each entry
    twice with the GIL held, 0.17 s per million (``bench/instruments/bench_gc_pause.py``).
    """

    def __init__(self, budgets: list[int]) -> None:
        self.budgets = list(budgets)
        self._entries: dict[str, IndexEntry] = {}
        self._lru: list[OrderedDict[str, None]] = [OrderedDict() for _ in budgets]
        gc_untrack(*self._lru)  # str keys and None values: never tracked again
        self._used = [0] * len(budgets)
        self._reserved = [0] * len(budgets)
        # the namespaces each root has or may have entries of (noted per entry added and per
        # namespace a writer takes up, not per publish: ``store/namespaces.py`` looks at
        # their directories)
        self._namespaces: list[set[str]] = [set() for _ in budgets]

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, digest: str) -> bool:
        return digest in self._entries

    def get(self, digest: str) -> IndexEntry | None:
        return self._entries.get(digest)

    def get_many(self, digests: Iterable[str]) -> list[IndexEntry | None]:
        """``get`` of each digest (no Python call per digest)."""
        return list(map(self._entries.get, digests))

    def used_bytes(self, root: int | None = None) -> int:
        return sum(self._used) if root is None else self._used[root]

    def reserved_bytes(self, root: int | None = None) -> int:
        return sum(self._reserved) if root is None else self._reserved[root]

    def add(self, entry: IndexEntry) -> IndexEntry | None:
        """Insert (or replace) an entry as most recently used; the entry it replaced."""
        digest, root = entry.digest, entry.root
        replaced = self._entries.get(digest)
        if replaced is not None:
            self.remove(digest)
        self._entries[digest] = entry
        gc_untrack(entry, self._entries)
        self._lru[root][digest] = None
        self._used[root] += entry.size
        self._namespaces[root].add(entry.ns_id)
        return replaced

    def publish(self, entry: IndexEntry, reserved: int) -> IndexEntry | None:
        """``add`` a chunk just written in place of its reservation of ``reserved`` bytes."""
        self._reserved[entry.root] -= reserved
        return self.add(entry)

    def publish_layout(self, digests: Iterable[str], roots: Sequence[int], ns_id: str,
                       size: int, meta: TensorMeta, now_ns: int) -> None:
        """``publish`` of chunks just written of one namespace and layout, each ``size``
        bytes on disk and reserved as such: the loop of ``add`` without a call per chunk."""
        entries, lru, used, reserved = self._entries, self._lru, self._used, self._reserved
        added = []
        for digest, root in zip(digests, roots, strict=True):
            if digest in entries:
                self.remove(digest)
            entries[digest] = entry = IndexEntry(digest, ns_id, root, size, meta, now_ns)
            added.append(entry)
            lru[root][digest] = None
            used[root] += size
            reserved[root] -= size
        gc_untrack(entries, *added)

    def resize(self, entry: IndexEntry, size: int) -> None:
        """Set an entry's size on disk to ``size`` (its byte count follows if indexed)."""
        if self._entries.get(entry.digest) is entry:
            self._used[entry.root] += size - entry.size
        entry.size = size

    def remove(self, digest: str) -> IndexEntry | None:
        entry = self._entries.pop(digest, None)
        if entry is not None:
            del self._lru[entry.root][digest]
            self._used[entry.root] -= entry.size
        return entry

    def remove_many(self, digests: Iterable[str]) -> list[IndexEntry]:
        """Remove each digest's entry (no call per digest); the entries that were there."""
        entries, lru, used = self._entries, self._lru, self._used
        removed = []
        for digest in digests:
            entry = entries.pop(digest, None)
            if entry is not None:
                del lru[entry.root][digest]
                used[entry.root] -= entry.size
                removed.append(entry)
        return removed

    def note_namespace(self, ns_id: str) -> None:
        """A writer takes up namespace ``ns_id``: its chunks may land on any root."""
        for namespaces in self._namespaces:
            namespaces.add(ns_id)

    def namespaces(self, root: int) -> list[str]:
        """The namespaces ``root`` has, had or may have entries of."""
        return list(self._namespaces[root])

    def drop_namespace(self, root: int, ns_id: str) -> list[IndexEntry]:
        """Remove every entry of namespace ``ns_id`` on ``root`` (a walk of the whole
        table: for a namespace whose directory was removed, not on any chunk's path)."""
        return self.remove_many([digest for digest, entry in self._entries.items()
                                 if entry.ns_id == ns_id and entry.root == root])

    def touch(self, digest: str, now_ns: int) -> None:
        entry = self._entries.get(digest)
        if entry is not None:
            entry.last_access_ns = now_ns
            self._lru[entry.root].move_to_end(digest)

    def pin(self, digest: str) -> bool:
        entry = self._entries.get(digest)
        if entry is None:
            return False
        entry.pins += 1
        return True

    def unpin(self, digest: str) -> bool:
        entry = self._entries.get(digest)
        if entry is None or entry.pins == 0:
            return False
        entry.pins -= 1
        return True

    def plan_reservation(self, root: int, size: int) -> list[IndexEntry] | None:
        """Victims (LRU first, pinned skipped) that make room for ``size`` more bytes: ``[]``
        when it fits already, None when it cannot fit even after evicting every one."""
        excess = self._used[root] + self._reserved[root] + size - self.budgets[root]
        if excess <= 0:
            return []
        victims: list[IndexEntry] = []
        for digest in self._lru[root]:
            if excess <= 0:
                break
            entry = self._entries[digest]
            if entry.pins == 0:
                victims.append(entry)
                excess -= entry.size
        return victims if excess <= 0 else None

    def coldest(self, root: int, need: int, skip: set[str]) -> list[IndexEntry]:
        """Least recently used unpinned entries of ``root`` (not in ``skip``) whose sizes
        add up to at least ``need`` bytes (fewer when the root has no more)."""
        victims: list[IndexEntry] = []
        for digest in self._lru[root]:
            if need <= 0:
                break
            entry = self._entries[digest]
            if entry.pins == 0 and digest not in skip:
                victims.append(entry)
                need -= entry.size
        return victims

    def reserve(self, root: int, size: int) -> None:
        self._reserved[root] += size

    def release(self, root: int, size: int) -> None:
        self._reserved[root] -= size

    def snapshot(self) -> list[IndexEntry]:
        """Every entry, in no particular order: a copy of the table's values, about 20 ms
        for a million (walking the LRU lists instead takes about 20 times longer)."""
        return list(self._entries.values())

    def lru_order(self, root: int) -> Iterator[IndexEntry]:
        """Entries of a root, least recently used first."""
        return (self._entries[d] for d in self._lru[root])
