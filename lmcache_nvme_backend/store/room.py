"""Room for new chunks: reservations against each root's budget and free-space floor,
eviction of the least recently used unpinned chunks, and removal of chunk files.  In shared
mode the budget is the directory's one, kept with the other members (``shared/tree.py``).
"""

from __future__ import annotations

import errno
import logging
import os
from typing import TYPE_CHECKING

from ..io.engine import ChunkEngine
from .catalog import Catalog
from .free_space import FreeSpaceGuard
from .index import IndexEntry
from .roots import Roots, RootState, note_full
from .stats import Counter, StoreStats

if TYPE_CHECKING:
    from .shared.tree import SharedTree

logger = logging.getLogger(__name__)


class Room:
    """Capacity of one store's roots."""

    def __init__(self, catalog: Catalog, roots: Roots, stats: StoreStats,
                 engine: ChunkEngine) -> None:
        self._catalog = catalog
        self._roots = roots
        self._stats = stats
        self._engine = engine
        #: One free-space floor per root (``nvme.min_free_gb``).
        self.guards = [FreeSpaceGuard(root.layout.root, root.min_free_bytes) for root in roots]
        #: Shared mode: the directory's budget is kept with the other members there.
        self.shared: SharedTree | None = None

    def reserve(self, root: RootState, size: int,
                deferred: list[IndexEntry] | None = None) -> bool:
        """Reserve ``size`` bytes on ``root``, evicting LRU chunks for budget and free space.
        ``deferred``: the victims' files are only added to it, for the write that needs the
        room to remove first (the free-space guard counts them freed).  In shared mode the
        victims are claimed and deleted with the other members, never deferred."""
        guard = self.guards[root.index]
        if self.shared is not None:
            return self.shared.reserve(root, size, guard)
        victims = self._catalog.reserve(root.index, size)
        if victims is None:
            return False
        if victims:
            self._evict(victims, guard, deferred)
        while not guard.room_for(size):
            oldest = self._catalog.pop_oldest_unpinned(root.index)
            if oldest is None:
                self._catalog.release(root.index, size)
                note_full(root, None)
                return False
            self._evict([oldest], guard, deferred)
            if deferred is None:
                guard.refresh()
        return True

    def _evict(self, victims: list[IndexEntry], guard: FreeSpaceGuard,
               deferred: list[IndexEntry] | None) -> None:
        if deferred is None:
            self.unlink(victims)
        else:
            deferred += victims
            guard.will_free(sum(victim.size for victim in victims))
        self._evicted(victims)

    def evict_deferred(self, root: RootState, victims: list[IndexEntry]) -> None:
        """Remove now the files of victims that ``reserve`` deferred for a write that will not
        run (the reservation failed, or was given back): they left the index already."""
        if victims:
            self.unlink(victims)
            self.guards[root.index].freed(sum(victim.size for victim in victims))

    def evict(self, victims: list[IndexEntry]) -> None:
        """Delete the files of entries already taken out of the index, and say so."""
        if victims:
            self.unlink(victims)
            self._evicted(victims)

    def _evicted(self, victims: list[IndexEntry]) -> None:
        self._stats.add(Counter.EVICTIONS, len(victims))
        self._stats.add(Counter.EVICTED_BYTES, sum(victim.size for victim in victims))
        self._catalog.notify_removed(victims)

    def unlink(self, entries: list[IndexEntry]) -> None:
        """Remove the entries' files (one already gone is fine; other failures are logged;
        shared mode: claimed and accounted for in the directory's ledger first)."""
        if self.shared is not None:
            self.shared.delete(entries)
            return
        if len(self._roots) == 1:  # every deletion of the common deployment: no tables
            root = self._roots[0]
            fd, chunk_rel = root.descriptor(), root.layout.chunk_rel
            items = [(fd, chunk_rel(e.ns_id, e.digest)) for e in entries]
        else:  # each root has its own descriptor and may have its own shard levels
            roots = {index: self._roots[index] for index in {e.root for e in entries}}
            fds = {index: root.descriptor() for index, root in roots.items()}
            items = [(fds[e.root], roots[e.root].layout.chunk_rel(e.ns_id, e.digest))
                     for e in entries]
        errors = self._engine.unlink(items)
        if not any(errors):
            return
        for entry, err in zip(entries, errors, strict=True):
            if err not in (0, errno.ENOENT):
                logger.debug("could not remove %s: %s", self._roots[entry.root].layout.chunk_path(
                    entry.ns_id, entry.digest), os.strerror(err))
