"""The books of this member's account of one shared root's budget, in step with the ledger.

The account (``ledger.py``) holds ``cap`` bytes; this member owns ``usage`` bytes of chunk
files, has ``reserved`` bytes of writes (``writing``) and deletions in flight, and writes
only while ``usage + reserved <= cap``.  A member taken over as dead rejoins with a new
account, and the writes still in flight under the old one settle in the new one's books
(``hand_over``).  ``AccountBooks`` keeps those numbers and the chunks behind ``usage``: it adopts
each ledger version (the cap, and ``freed`` entries of owned chunks others evicted),
updates the ledger, claims budget from the pool, counts publishes and shares reads.

An owner can hear that its file is gone (the evicter's journal, a read that misses) before
it reads the ``freed`` entry, and store the chunk again meanwhile: the entry is the earlier
file's, so that file is counted apart (*superseded*) until its entry comes, or until no
eviction of it is pending (``gc``, quarantine), and the new file stays counted.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence

from ..catalog import Catalog
from ..index import IndexEntry
from ..roots import RootState
from .journal import JournalWriter, accessed_lines, published_line
from .ledger import DEPARTED, LIVE, LedgerChain, LedgerDoc, LedgerError
from .ledger import Account as LedgerAccount

logger = logging.getLogger(__name__)

ACCESS_RESOLUTION_S = 0.05  # a chunk's reads are shared at most this often


class Fenced(Exception):
    """This member's account is gone from the ledger (taken over as dead)."""


class AccountBooks:
    """The bytes this member owns, holds in flight, and may hold, on one root."""

    def __init__(self, root: RootState, member: str, catalog: Catalog, chain: LedgerChain,
                 refill: int, budget: int) -> None:
        self.root = root
        self.path = root.layout.root
        self.member = member
        self._catalog = catalog
        self.chain = chain
        self.refill = refill
        self.budget = budget  # as configured: no ledger version grants more (``pool``)
        self.journal: JournalWriter | None = None
        self.fenced = False
        self.leaving = False
        self._lock = threading.Lock()  # the fields below, and those ``Account`` adds
        self._ledger_lock = threading.Lock()  # this process's ledger updates, one at a time
        self.owned: dict[str, int] = {}
        # earlier files of chunks stored again before their ``freed`` entry came: sizes
        self._superseded: dict[str, list[int]] = {}
        self.usage = 0
        self.reserved = 0
        self.writing = 0  # of ``reserved``: the room of writes in flight
        self.cap = 0
        self._successor: AccountBooks | None = None  # the account that took over them
        self._doc_n = 0
        self._processed = 0  # the last ``freed`` entry applied
        self._shared_at: dict[str, float] = {}
        self.doubles: list[tuple[str, str]] = []  # (digest, other owner): for the janitor

    # -- state -----------------------------------------------------------------------

    def headroom(self) -> int:
        with self._lock:
            return self.cap - self.usage - self.reserved

    def adopt(self, doc: LedgerDoc) -> None:
        """Take a ledger version as this member's view: apply the ``freed`` entries (the
        owned chunks others evicted) and the cap, both from the same version."""
        account = doc.accounts.get(self.member)
        with self._lock:
            fresh = [] if account is None else \
                [f for f in account.freed if f[0] > self._processed]
        false = self._false_freed(doc, fresh)
        with self._lock:
            if doc.n <= self._doc_n:
                return
            self._doc_n = doc.n
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
                    if digest not in false:
                        self.usage -= self._forget(digest)
                    self._processed = seq
            self.cap = account.cap

    def _false_freed(self, doc: LedgerDoc, fresh: list[tuple[int, str, int]]) -> set[str]:
        """The ``freed`` entries of ``fresh`` that cannot be true: the chunk is this
        member's in the index and its file is still in place, not superseded (an evicter
        moves the file away before it records the entry).  They are not applied, so a
        damaged or planted version cannot make this member stop counting files on disk."""
        with self._lock:
            suspect = [d for _, d, size in fresh
                       if size and d in self.owned and d not in self._superseded]
        false = {d for d, e in zip(suspect, self._catalog.entries(suspect), strict=True)
                 if e is not None and e.owner == self.member
                 and self.root.layout.has_chunk(e.ns_id, d)}
        if false:
            logger.warning("NVMe tier: %s: ledger version %d lists %d chunk(s) of this "
                           "member as evicted (accounts.%s.freed) whose files are still in "
                           "place, e.g. %s; those entries are ignored (still counted).",
                           self.path, doc.n, len(false), self.member, sorted(false)[0])
        return false

    def update(self, change: Callable[[LedgerDoc], bool]) -> LedgerDoc | None:
        """One ledger update from this process, adopted; None when the ledger refused.
        A version this member writes also records its configured budget in its account
        (each member keeps its own record true: ``LedgerDoc.effective_budget``)."""
        def change_and_record(doc: LedgerDoc) -> bool:
            changed = change(doc)
            mine = doc.accounts.get(self.member)
            if changed and mine is not None and mine.state == LIVE:
                mine.budget = self.budget
            return changed

        try:
            with self._ledger_lock:
                doc = self.chain.update(change_and_record)
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

    def _claim(self, want: int) -> bool:
        """Move up to ``want`` bytes from the pool into this account."""
        got = 0

        def change(doc: LedgerDoc) -> bool:
            nonlocal got
            account = self._mine(doc)
            got = max(0, min(want, doc.pool(self.budget)))
            account.cap += got
            return got > 0

        return self.update(change) is not None and got > 0

    def release(self, size: int) -> None:
        """A write ended without a file: its room is free again."""
        with self._lock:
            successor = self._successor
            if successor is None:
                self.reserved -= size
                self.writing -= size
                return
        successor.release(size)

    def published(self, entry: IndexEntry, replaced: IndexEntry | None, reserved: int) -> None:
        """A chunk file this member wrote is in place: it owns it now, and says so."""
        with self._lock:
            successor = self._successor
            if successor is None:
                old = self.owned.get(entry.digest, 0)
                if old and (replaced is None or replaced.owner != self.member):
                    # the earlier file is gone from the index: a ``freed`` entry may come
                    self._superseded.setdefault(entry.digest, []).append(old)
                    old = 0
                self.owned[entry.digest] = entry.size
                self.usage += entry.size - old
                self.reserved -= reserved
                self.writing -= reserved
                if replaced is not None and replaced.owner and replaced.owner != self.member:
                    self.doubles.append((entry.digest, replaced.owner))
        if successor is not None:
            successor.published(entry, replaced, reserved)
        elif self.journal is not None:
            self.journal.append([published_line(entry.digest, entry.ns_id, entry.size,
                                                entry.meta)])

    def hand_over(self, successor: AccountBooks) -> int:
        """This account was taken over as dead and ``successor`` is this member's new
        one: the writes in flight under this one settle in the successor's books from now
        on (their room counted there, so that it claims or evicts for it before it writes
        more); the bytes moved."""
        with self._lock:
            moved, self._successor = self.writing, successor
            self.reserved -= moved
            self.writing = 0
        with successor._lock:
            successor.reserved += moved
            successor.writing += moved
        return moved

    def disown(self, entries: Sequence[IndexEntry]) -> None:
        """Stop counting the owned chunks that left the index with their namespace's
        directory (the cap stays: the room is this member's)."""
        with self._lock:
            for entry in entries:
                if entry.owner == self.member and \
                        self.owned.get(entry.digest) == entry.size:
                    self.usage -= self.owned.pop(entry.digest)

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

    # -- superseded files and reports ------------------------------------------------

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

    def owned_lines(self) -> list[bytes]:
        """``P`` records of every chunk this member owns (a journal snapshot)."""
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
