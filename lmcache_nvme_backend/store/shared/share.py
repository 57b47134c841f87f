"""This member's account of one shared root's budget: reserving, evicting, publishing.

The account (``store/shared/ledger.py``) holds ``cap`` bytes; this member owns ``usage`` bytes of
chunk files and has ``reserved`` bytes of writes in flight, and writes only while
``usage + reserved <= cap``.  When that does not fit it first claims unheld budget from
the ledger's pool, then evicts the directory's least recently used chunks, whoever wrote
them (the index holds every member's chunks and their recency, ``store/shared/journal.py``):

1. each victim is *claimed* by renaming it into ``shared/evicting/<member>/`` (exactly one
   member can move a file, so two members never both count one deletion);
2. victims other members own are taken out of their accounts and added to this one, in
   one ledger update; the owners learn of it from ``freed`` entries;
3. the claimed files are deleted, and only then is the room used (it is held as
   ``reserved`` until the unlink succeeded), so the tree never holds more than its budget.

An owner can hear that its file is gone (the evicter's journal, a read that misses) before
it reads the ledger version with the ``freed`` entry, and store the chunk again meanwhile:
that entry is the earlier file's, so the earlier file is counted apart (*superseded*) until
its entry comes, or until no eviction of it is pending (it was removed otherwise: ``gc``,
quarantine), and the new file stays counted.

A member that dies between any two of these steps leaves state the janitor completes
(``store/shared/janitor.py``).
"""

from __future__ import annotations

import logging
import random
import threading
from collections.abc import Callable, Sequence

from ...disk.coordination import EVICTING_DIR, evicting_dir, evicting_name
from ...disk.safe_fs import (
    NotAChunkFile,
    exists_beneath,
    rename_beneath,
    scandir_beneath,
    unlink_beneath,
)
from ..catalog import Catalog
from ..index import IndexEntry
from ..roots import RootState
from ..stats import Counter, StoreStats
from .journal import JournalWriter, accessed_lines, deleted_line, published_line
from .ledger import DEPARTED, LIVE, LedgerChain, LedgerDoc, LedgerError
from .ledger import Account as LedgerAccount

logger = logging.getLogger(__name__)

ACCESS_RESOLUTION_S = 0.05  # a chunk's reads are shared at most this often
MAKE_ROOM_TRIES = 32
RACE_SPREAD = 4


class Fenced(Exception):
    """This member's account is gone from the ledger (taken over as dead)."""


class Account:
    """The bytes this member owns, holds in flight, and may hold, on one root."""

    def __init__(self, root: RootState, member: str, catalog: Catalog, stats: StoreStats,
                 chain: LedgerChain, refill: int,
                 catch_up: Callable[[], None] = lambda: None) -> None:
        self.root = root
        self.path = root.layout.root
        self.member = member
        self._catalog = catalog
        self._stats = stats
        self.chain = chain
        self.refill = refill
        # reads the other members' journals (rate-limited) so that victims are chosen
        # by the freshest recency there is
        self._catch_up = catch_up
        self.journal: JournalWriter | None = None
        self.fenced = False
        self.leaving = False
        self._lock = threading.Lock()  # the fields below
        self._ledger_lock = threading.Lock()  # this process's ledger updates, one at a time
        self.owned: dict[str, int] = {}
        # earlier files of chunks stored again before their ``freed`` entry came: sizes
        self._superseded: dict[str, list[int]] = {}
        self.usage = 0
        self.reserved = 0
        self.cap = 0
        self._doc_n = 0
        self._processed = 0  # the last ``freed`` entry applied
        self._claiming: set[str] = set()
        self._spread = 1
        self._stuck: dict[str, int] = {}  # claimed files whose unlink failed (held reserved)
        self._stuck_own: dict[str, str] = {}  # of those, this member's own: name -> digest
        self._cleared: set[str] = set()  # recorded evicting names deleted, to clear
        self._shared_at: dict[str, float] = {}
        self.doubles: list[tuple[str, str]] = []  # (digest, other owner): for the janitor

    # -- state -----------------------------------------------------------------------

    def headroom(self) -> int:
        with self._lock:
            return self.cap - self.usage - self.reserved

    def adopt(self, doc: LedgerDoc) -> None:
        """Take a ledger version as this member's view: apply the ``freed`` entries (the
        owned chunks others evicted) and the cap, both from the same version."""
        with self._lock:
            if doc.n <= self._doc_n:
                return
            self._doc_n = doc.n
            account = doc.accounts.get(self.member)
            if account is None or account.state != LIVE:
                if not self.fenced and not self.leaving:
                    logger.error("NVMe tier: %s: this member (%s) is no longer in the "
                                 "directory's ledger (its lease was not renewed in time and "
                                 "its share was taken over); it stops writing there.",
                                 self.path, self.member)
                self.fenced = True
                return
            for seq, digest, _size in account.freed:
                if seq > self._processed:
                    self.usage -= self._forget(digest)
                    self._processed = seq
            self.cap = account.cap

    def update(self, change: Callable[[LedgerDoc], bool]) -> LedgerDoc | None:
        """One ledger update from this process, adopted; None when the ledger refused."""
        try:
            with self._ledger_lock:
                doc = self.chain.update(change)
        except Fenced:
            self.fenced = True
            return None
        except (LedgerError, OSError) as exc:
            logger.warning("NVMe tier: %s: cannot update the directory's ledger: %s",
                           self.path, exc)
            return None
        self.adopt(doc)
        return doc

    def _mine(self, doc: LedgerDoc) -> LedgerAccount:
        account = doc.accounts.get(self.member)
        if account is None or account.state != LIVE:
            raise Fenced()
        return account

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
                    self.reserved += size if reserve else 0
                    return True
            doc = self.chain.cached
            if doc is not None and doc.pool() > 0 and self._claim(size - free + self.refill):
                continue
            # evict exactly what is missing (a whole chunk more would cost hits)
            if self.evict(size - free) < 0 and not self._claim(size - free):
                return False  # nothing left to evict (all pinned or in flight)
        return False

    def _claim(self, want: int) -> bool:
        """Move up to ``want`` bytes from the pool into this account."""
        got = 0

        def change(doc: LedgerDoc) -> bool:
            nonlocal got
            account = self._mine(doc)
            got = max(0, min(want, doc.pool()))
            account.cap += got
            return got > 0

        return self.update(change) is not None and got > 0

    def release(self, size: int) -> None:
        with self._lock:
            self.reserved -= size

    def published(self, entry: IndexEntry, replaced: IndexEntry | None, reserved: int) -> None:
        """A chunk file this member wrote is in place: it owns it now, and says so."""
        with self._lock:
            old = self.owned.get(entry.digest, 0)
            if old and (replaced is None or replaced.owner != self.member):
                # the earlier file is gone from the index: a ``freed`` entry may be on its way
                self._superseded.setdefault(entry.digest, []).append(old)
                old = 0
            self.owned[entry.digest] = entry.size
            self.usage += entry.size - old
            self.reserved -= reserved
            if replaced is not None and replaced.owner and replaced.owner != self.member:
                self.doubles.append((entry.digest, replaced.owner))
        if self.journal is not None:
            self.journal.append([published_line(entry.digest, entry.ns_id, entry.size,
                                                entry.meta)])

    def note_reads(self, digests: Sequence[str], now: float) -> None:
        """Share this member's reads (recency) with the others, each chunk at most every
        ``ACCESS_RESOLUTION_S``."""
        fresh = [d for d in dict.fromkeys(digests)
                 if now - self._shared_at.get(d, -1e9) >= ACCESS_RESOLUTION_S]
        if not fresh or self.journal is None:
            return
        for d in fresh:
            self._shared_at[d] = now
        if len(self._shared_at) > 4 * max(len(fresh), 65536):
            cutoff = now - ACCESS_RESOLUTION_S
            self._shared_at = {d: t for d, t in self._shared_at.items() if t >= cutoff}
        self.journal.append(accessed_lines(fresh))

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
            if gained < 0:  # the ledger refused: the claims stay for a later settlement
                gained, theirs = 0, []
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
            name = evicting_name(entry.digest, entry.size, entry.owner)
            try:
                rename_beneath(self.path, layout.relative(layout.chunk_path(entry.ns_id,
                                                                            entry.digest)),
                               f"{evicting_dir(self.member)}/{name}")
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

    def _forget(self, digest: str) -> int:
        """A ``freed`` entry for ``digest``: the bytes this account stops counting (an
        earlier file stored over first, see the module doc).  Called with the lock held."""
        return self._unsupersede(digest) or self.owned.pop(digest, 0)

    def _unsupersede(self, digest: str, size: int | None = None) -> int:
        """Take one earlier file of ``digest`` (of ``size``, when given) off the superseded
        ones; its bytes, 0 when there is none.  Called with the lock held."""
        sizes = self._superseded.get(digest)
        if not sizes or (size is not None and size not in sizes):
            return 0
        taken = sizes[-1] if size is None else size
        sizes.remove(taken)
        if not sizes:
            del self._superseded[digest]
        return taken

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

    def owned_lines(self) -> list[bytes]:
        """``P`` records of every chunk this member owns (a new journal generation's
        snapshot)."""
        with self._lock:
            owned = dict(self.owned)
        entries = self._catalog.entries(list(owned))
        return [published_line(d, e.ns_id, size, e.meta)
                for (d, size), e in zip(owned.items(), entries, strict=True) if e is not None]

    def read_ages(self, now_ns: int) -> tuple[float | None, float | None]:
        """Seconds since the most and least recent use of the chunks this member owns
        (skipped for very large accounts: a heartbeat must stay cheap)."""
        with self._lock:
            if len(self.owned) > 50_000:
                return None, None
            digests = list(self.owned)
        times = [e.last_access_ns for e in self._catalog.entries(digests) if e is not None]
        if not times:
            return None, None
        return max(0.0, (now_ns - max(times)) / 1e9), max(0.0, (now_ns - min(times)) / 1e9)

    def stats(self) -> dict[str, int]:
        """The account's counts; a superseded file is still on disk, so it is one of the
        chunks owned (as its size is in ``owned_bytes``) until it is settled."""
        with self._lock:
            files = len(self.owned) + sum(map(len, self._superseded.values()))
            return {"owned_bytes": self.usage, "owned_chunks": files,
                    "cap": self.cap, "reserved": self.reserved}

    def departing_cap(self) -> Callable[[LedgerDoc], bool]:
        """The ledger change of a clean exit: the account keeps exactly what it owns."""
        with self._lock:
            headroom = self.cap - self.usage - self.reserved

        def change(doc: LedgerDoc) -> bool:
            account = doc.accounts.get(self.member)
            if account is None or account.state != LIVE:
                return False
            account.cap -= max(0, headroom)
            account.state = DEPARTED
            return True

        return change
