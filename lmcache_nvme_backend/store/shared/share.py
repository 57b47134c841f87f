"""Making room in this member's account of one shared root: the pool, then evicting.

A write that does not fit the account's headroom (``account.py``: ``usage + reserved``
within ``cap``) first claims unheld budget from the ledger's pool, then evicts the
directory's least recently used chunks, whoever wrote them (the index holds every member's
chunks and their recency, ``journal.py``):

1. each victim is *claimed* by renaming it into ``shared/evicting/<member>/`` (only one
   member can move a file, so no deletion is counted twice);
2. victims other members own move from their accounts to this one in one ledger update;
   the owners learn of it from ``freed`` entries;
3. the claimed files are deleted; only then is the room used (held as ``reserved`` until
   the unlink succeeded), so the tree never holds more than its budget.

A member dying between two steps leaves state the janitor completes (``janitor.py``).  In
the background ``Account`` retries failed unlinks, settles superseded files (``account.py``)
no eviction is pending for, and tidies the ledger (acknowledgements, claims, headroom).
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable, Sequence

from ...disk.coordination import EVICTING_DIR, evicting_dir, evicting_name
from ...disk.safe_fs import (
    NotAChunkFile,
    exists_beneath,
    link_beneath,
    lstat_beneath,
    rename_beneath,
    scandir_beneath,
    unlink_beneath,
)
from ..catalog import Catalog
from ..index import IndexEntry
from ..roots import RootState
from ..stats import Counter, StoreStats
from .account import AccountBooks
from .journal import deleted_line
from .ledger import LedgerChain, LedgerDoc

logger = logging.getLogger(__name__)

MAKE_ROOM_TRIES = 32
RACE_SPREAD = 4


class Account(AccountBooks):
    """This member's account on one root (``AccountBooks``), making room as it writes."""

    def __init__(self, root: RootState, member: str, catalog: Catalog, stats: StoreStats,
                 chain: LedgerChain, refill: int, budget: int,
                 catch_up: Callable[[], None] = lambda: None) -> None:
        super().__init__(root, member, catalog, chain, refill, budget)
        self._stats = stats
        # reads the other members' journals (rate-limited) so that victims are chosen
        # by the freshest recency there is
        self._catch_up = catch_up
        # under the books' lock:
        self._claiming: set[str] = set()
        self._spread = 1
        self._stuck: dict[str, int] = {}  # claimed files whose unlink failed (held reserved)
        self._stuck_own: dict[str, str] = {}  # of those, this member's own: name -> digest
        self._cleared: set[str] = set()  # recorded evicting names deleted, to clear

    # -- writes ----------------------------------------------------------------------

    def make_room(self, size: int) -> bool:
        """Reserve ``size`` bytes: from headroom, the pool, or by evicting (global LRU)."""
        return self.ensure_headroom(size, reserve=True)

    def ensure_headroom(self, size: int, reserve: bool = False) -> bool:
        """Make this account's headroom at least ``size`` (and reserve it, with
        ``reserve``): from the pool, or by evicting the directory's coldest chunks."""
        for _ in range(MAKE_ROOM_TRIES):
            if self.fenced:
                return False
            with self._lock:
                free = self.cap - self.usage - self.reserved
                if free >= size:
                    if reserve:
                        self.reserved += size
                        self.writing += size
                    return True
            doc = self.chain.cached
            if doc is not None and doc.pool(self.budget) > 0 and \
                    self._claim(size - free + self.refill):
                continue
            # evict exactly what is missing (a whole chunk more would cost hits)
            if self.evict(size - free) < 0 and not self._claim(size - free):
                return False  # nothing left to evict (all pinned or in flight)
        return False

    # -- evictions and deletes ------------------------------------------------------------

    def evict(self, want: int, to_pool: bool = False) -> int:
        """Evict the root's least recently used chunks worth ``want`` bytes; the bytes of
        room this account gained (``to_pool``: the bytes that left the accounts), 0 when
        other members took the candidates first, -1 when there is no candidate."""
        self._catch_up()
        doc = self.chain.cached
        claim_gen = doc.orphans_gen if doc is not None else -1
        with self._lock:
            skip = set(self._claiming)
        candidates = self._catalog.coldest(self.root.index, want * self._spread, skip)
        if not candidates:
            return -1
        victims = candidates
        if self._spread > 1:  # members racing for the same coldest chunks: spread out
            random.shuffle(candidates)
            victims, need = [], want
            for entry in candidates:
                if need <= 0:
                    break
                victims.append(entry)
                need -= entry.size
        return self.delete(victims, claim_gen, to_pool)

    def delete(self, victims: Sequence[IndexEntry], claim_gen: int | None = None,
               to_pool: bool = False, evictions: bool = True) -> int:
        """Claim, account for and delete chunk files (see the module doc); the room gained.
        ``evictions``: count them as evictions (not for LMCache's explicit deletes)."""
        if claim_gen is None:
            doc = self.chain.cached
            claim_gen = doc.orphans_gen if doc is not None else -1
        digests = {v.digest for v in victims}
        with self._lock:
            self._claiming |= digests
        try:
            claimed, gone = self._claim_files(victims)
            # lost races for the coldest chunks: choose among more of them next time
            self._spread = RACE_SPREAD if gone else 1
            mine = [(e, n) for e, n in claimed if e.owner == self.member and not to_pool]
            theirs = [(e, n) for e, n in claimed if e.owner != self.member or to_pool]
            # room taken from others is not usable before their files are gone
            expected = 0 if to_pool else sum(e.size for e, _ in theirs)
            with self._lock:
                self.reserved += expected
            gained = self._transfer(theirs, claim_gen, to_pool) if theirs else 0
            if gained < 0:  # the ledger refused: the victims go back, uncounted nowhere
                restored = self._restore(theirs)
                claimed = [c for c in claimed if c[1] not in restored]
                theirs = [c for c in theirs if c[1] not in restored]
                gained = 0
            deleted = self._unlink_all(mine + theirs)
            with self._lock:
                self.reserved -= expected
                for entry, name in mine:
                    if name not in deleted:  # counted until ``retry_stuck`` deletes it
                        self._stuck_own[name] = entry.digest
                    elif size := self.owned.pop(entry.digest, None):
                        self.usage -= size
                        gained += size
                self._cleared.update(n for _, n in theirs if n in deleted)
            if self.journal is not None:
                self.journal.append([deleted_line(e.digest) for e, _ in claimed])
            removed = self._catalog.remove_entries([e for e, _ in claimed] + gone)
            self._catalog.notify_removed(removed)
            if evictions:
                self._stats.add(Counter.EVICTIONS, len(claimed))
                self._stats.add(Counter.EVICTED_BYTES, sum(e.size for e, _ in claimed))
            self._stats.add(Counter.SHARED_TRANSFERS, len(theirs))
            return gained
        finally:
            with self._lock:
                self._claiming -= digests

    def _claim_files(self, victims: Sequence[IndexEntry]
                     ) -> tuple[list[tuple[IndexEntry, str]], list[IndexEntry]]:
        claimed: list[tuple[IndexEntry, str]] = []
        gone: list[IndexEntry] = []
        layout = self.root.layout
        for entry in victims:
            rel = layout.chunk_rel(entry.ns_id, entry.digest)
            try:
                # the credit is the file's size, not what a journal said it was
                if (size := lstat_beneath(self.path, rel).st_size) != entry.size:
                    self._catalog.resize(entry, size)
                name = evicting_name(entry.digest, entry.size, entry.owner)
                rename_beneath(self.path, rel, f"{evicting_dir(self.member)}/{name}")
                claimed.append((entry, name))
            except (FileNotFoundError, NotAChunkFile):
                gone.append(entry)  # another member took it, or it is not ours to move
            except OSError as exc:
                logger.debug("NVMe tier: cannot claim %s for eviction: %s", entry.digest, exc)
        return claimed, gone

    def _transfer(self, theirs: list[tuple[IndexEntry, str]], claim_gen: int,
                  to_pool: bool) -> int:
        """Take the victims out of their owners' accounts (into this one unless
        ``to_pool``); the bytes gained, -1 when the ledger could not be updated."""
        names = [n for _, n in theirs]
        gained = 0

        def change(doc: LedgerDoc) -> bool:
            nonlocal gained
            gained = sum(doc.take(e.owner, e.digest, e.size, claim_gen) for e, _ in theirs)
            if not to_pool:
                account = self._mine(doc)
                account.cap += gained
                account.evicting.extend(names)
            return True

        return gained if self.update(change) is not None else -1

    def _restore(self, theirs: list[tuple[IndexEntry, str]]) -> set[str]:
        """Put claimed victims whose transfer was not recorded back where they were (their
        owners still count them); the names put back.  A victim whose place was taken
        meanwhile (stored again) is deleted with the rest, as an eviction its owner's
        books settle (``account.py``, superseded files)."""
        restored = set()
        layout = self.root.layout
        for entry, name in theirs:
            claimed = f"{evicting_dir(self.member)}/{name}"
            try:
                link_beneath(self.path, claimed,
                             layout.relative(layout.chunk_path(entry.ns_id, entry.digest)))
                unlink_beneath(self.path, claimed)
                restored.add(name)
            except OSError as exc:
                logger.debug("NVMe tier: cannot put back the victim %s: %s", name, exc)
        if restored:
            logger.warning("NVMe tier: %s: the ledger refused an eviction's transfer; its "
                           "%d victim(s) are back in place, %d deleted.", self.path,
                           len(restored), len(theirs) - len(restored))
        return restored

    def _unlink_all(self, claimed: list[tuple[IndexEntry, str]]) -> set[str]:
        deleted = set()
        for entry, name in claimed:
            rel = f"{evicting_dir(self.member)}/{name}"
            try:
                unlink_beneath(self.path, rel)
            except FileNotFoundError:
                pass
            except OSError as exc:
                logger.warning("NVMe tier: cannot delete the evicted %s: %s (retried)", rel, exc)
                with self._lock:
                    self._stuck[name] = entry.size
                    self.reserved += entry.size
                continue
            deleted.add(name)
        return deleted

    def retry_stuck(self) -> None:
        """Delete claimed files whose unlink failed before; their room is freed after."""
        with self._lock:
            stuck = dict(self._stuck)
        for name, size in stuck.items():
            try:
                unlink_beneath(self.path, f"{evicting_dir(self.member)}/{name}")
            except FileNotFoundError:
                pass
            except OSError:
                continue
            with self._lock:
                self._stuck.pop(name, None)
                self.reserved -= size
                self._cleared.add(name)
                digest = self._stuck_own.pop(name, None)
                if digest is not None:
                    self.usage -= self._forget(digest)

    # -- background ------------------------------------------------------------------------

    def tidy(self, keep: int) -> None:
        """Acknowledge ``freed`` entries, clear deleted evicting names, and give headroom
        beyond ``keep`` back to the pool (held reserved while the update runs)."""
        self.retry_stuck()
        self._settle_superseded()
        with self._lock:
            processed = self._processed
            cleared = set(self._cleared)
            excess = max(0, self.cap - self.usage - self.reserved - keep)
            self.reserved += excess
        doc = self.chain.cached
        mine = doc.accounts.get(self.member) if doc is not None else None
        if mine is not None:
            cleared |= self._claims_not_held(mine.evicting, cleared)
        due = mine is not None and (
            any(seq <= processed for seq, _, _ in mine.freed) or
            any(n in cleared for n in mine.evicting))
        if not due and not excess:
            with self._lock:
                self.reserved -= excess
            return

        def change(doc: LedgerDoc) -> bool:
            account = self._mine(doc)
            freed = [f for f in account.freed if f[0] > processed]
            evicting = [n for n in account.evicting if n not in cleared]
            changed = len(freed) != len(account.freed) or len(evicting) != \
                len(account.evicting) or excess > 0
            account.freed, account.evicting = freed, evicting
            account.cap -= excess
            return changed

        self.update(change)
        with self._lock:
            self.reserved -= excess
            self._cleared -= cleared

    def _claims_not_held(self, recorded: list[str], cleared: set[str]) -> set[str]:
        """Names this account's ledger entry lists as claimed that are not in its evicting
        directory (a damaged or planted version's): cleared like deleted ones.  A claim
        is recorded while its file is there, so a name without a file is done."""
        todo = [n for n in recorded if n not in cleared]
        if not todo:
            return set()
        held = {e.name for e in scandir_beneath(self.path, evicting_dir(self.member))}
        return {n for n in todo if n not in held}

    def _settle_superseded(self) -> None:
        """Stop counting the superseded files no eviction is pending for.

        An evicter renames the file into its evicting directory, records the transfer,
        then unlinks it.  The earlier file left the chunk path before this member stored
        the chunk again, so a claim of it is either still in an evicting directory now, or
        recorded in the ledger read after this look; what neither explains was removed
        another way and no ``freed`` entry will come for it.
        """
        with self._lock:
            waiting = [(d, size) for d, sizes in self._superseded.items() for size in sizes]
        if not waiting:
            return
        takers = [e.name for e in scandir_beneath(self.path, EVICTING_DIR)]
        pending = {(d, size) for d, size in waiting
                   if any(exists_beneath(self.path,
                                        f"{evicting_dir(m)}/{evicting_name(d, size, self.member)}")
                          for m in takers)}
        doc = self.chain.latest()
        if doc is not None:
            self.adopt(doc)
        with self._lock:
            for digest, size in waiting:
                if (digest, size) not in pending:
                    self.usage -= self._unsupersede(digest, size)
