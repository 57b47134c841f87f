"""This process as a member of one shared root (see ``tree.py``, docs/deployment.md).

A ``RootMember`` joins the root's ledger (or serves reads only, saying why), renews its
lease, follows the other members' journals into the index, follows the ledger (its
account, acknowledgements, spare headroom), keeps headroom ready for writes, and leaves
cleanly.  Its janitor duties are in ``janitor.py``, its account in ``share.py`` (making
room) and ``account.py`` (the books).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING

from ...config import NVMeSettings
from ...disk.coordination import LEDGER_DIR, MEMBERS_DIR, evicting_dir, new_member_id
from ...disk.format import FORMAT_VERSION
from ...disk.safe_fs import makedirs_beneath
from ..catalog import Catalog
from ..index import IndexEntry
from ..roots import RootState, note_full
from ..stats import Counter, StoreStats
from .janitor import Janitor
from .journal import Batch, JournalTail, JournalWriter
from .leases import (
    LEASE_S,
    Lease,
    Liveness,
    new_lease,
    on_this_host_and_gone,
    read_leases,
    remove_member_files,
    write_lease,
)
from .ledger import DEAD, LEDGER_FORMAT, LIVE, LedgerChain, LedgerDoc, LedgerError
from .ledger import Account as LedgerAccount
from .share import Account

if TYPE_CHECKING:
    from ..free_space import FreeSpaceGuard

logger = logging.getLogger(__name__)

CATCH_UP_S = 0.02  # an evicter reads the journals again if its view is older than this
APPLY_BATCH = 4096  # journal records applied to the index under one hold of its lock
MAX_REFILL = 64 << 20


def _gib(n: int) -> str:
    return f"{n / 2**30:.4g} GiB"


class RootMember:
    """This process as a member of one shared root."""

    def __init__(self, root: RootState, budget: int, settings: NVMeSettings, catalog: Catalog,
                 stats: StoreStats) -> None:
        self.root = root
        self.path = root.layout.root
        self.budget = budget
        self._settings = settings
        self._catalog = catalog
        self._stats = stats
        self.read_only: str | None = None  # why this member cannot write, if it cannot
        self._join_again_at: float | None = None  # reading only for now (version skew)
        self.janitor_rounds = 0  # moved by the janitor thread every round (``leases.py``)
        self.stopping = threading.Event()  # set when the store closes: rounds end early
        self.leases: dict[str, Lease] = {}
        self._lease_ok = -1e18
        self._largest = 0
        self._warned: set[str] = set()
        self._ingest_lock = threading.Lock()
        self._ingested_at = -1e18
        self.room_wanted = threading.Event()  # set when the headroom fell below its target
        self._new_identity()

    def _new_identity(self) -> None:
        self.member = new_member_id()
        chain = LedgerChain(self.path, self.member, self._settings.file_mode,
                            self._settings.dir_mode, durable=self._settings.fsync == "full")
        self.account = Account(self.root, self.member, self._catalog, self._stats, chain,
                               refill=min(self.budget // 256, MAX_REFILL), budget=self.budget,
                               catch_up=self._catch_up)
        self.tail = JournalTail(self.path, self.member, self.root.direct, self._stats)
        self.liveness = Liveness()
        self.lease = new_lease(self.member)
        self.janitor = Janitor(self.account, self.liveness, self._catalog, self._stats,
                               self.ingest, self.stopping)

    # -- joining and leaving ---------------------------------------------------------------

    def join(self) -> None:
        """Create this member's lease, journal and account (or serve reads only)."""
        try:
            for rel in (MEMBERS_DIR, LEDGER_DIR, evicting_dir(self.member)):
                makedirs_beneath(self.path, rel, self._settings.dir_mode)
            self.heartbeat(raise_errors=True)
            self.account.journal = JournalWriter(self.path, self.member,
                                                 self._settings.file_mode)
        except OSError as exc:
            self._serve_reads_only(exc.strerror or str(exc))
            return
        try:
            self._enter_ledger()
        except (LedgerError, OSError) as exc:
            self._serve_reads_only(f"the ledger: {exc}")

    def _enter_ledger(self) -> None:
        chain = self.account.chain
        doc = chain.latest()
        if doc is not None and doc.format < LEDGER_FORMAT and self._older_members(doc):
            return
        mine = LedgerAccount(0, LIVE, self.budget, FORMAT_VERSION)
        if doc is None:
            first = LedgerDoc(0, self.budget, self.member, {self.member: mine},
                              orphans_cap=self._catalog.used_bytes(self.root.index))
            if chain.create(first):
                self.account.adopt(first)
                logger.info("NVMe tier: %s: shared budget of %s for every member of this "
                            "directory (ledger created; %.1f MiB already on disk).",
                            self.path, _gib(self.budget), first.orphans_cap / 2**20)
                return
        before: list[LedgerDoc] = []

        def change(doc: LedgerDoc) -> bool:
            before[:] = [doc.copy()]
            running = [m for m in doc.live() if m != self.member and m in self.leases
                       and not on_this_host_and_gone(m)]
            if doc.budget != self.budget and not running:
                doc.budget, doc.budget_by = self.budget, self.member
            doc.accounts[self.member] = LedgerAccount(0, LIVE, self.budget, FORMAT_VERSION)
            return True

        joined = self.account.update(change)
        if joined is None:
            raise LedgerError("could not add this member's account")
        self._warn_budget(before[0], joined)

    def _older_members(self, doc: LedgerDoc) -> bool:
        """Version skew (docs/deployment.md): while members of an older version of the
        package run, this member serves reads only (their versions name no predecessor,
        so it would set them aside) and tries to join again every ``LEASE_S``; once none
        runs, its first version moves the ledger to this format."""
        older = sorted(m for m in doc.live() if m != self.member and m in self.leases
                       and self.leases[m].ledger_format < LEDGER_FORMAT
                       and not on_this_host_and_gone(m))
        if not older:
            return False
        self._serve_reads_only(
            f"member(s) {', '.join(older[:4])} of an older version of the package (ledger "
            f"format {doc.format}, this version writes format {LEDGER_FORMAT}) are running; "
            f"this member joins once they stopped (it tries every {LEASE_S:.0f} s): upgrade "
            "them, or stop them")
        self._join_again_at = time.monotonic() + LEASE_S
        return True

    def _warn_budget(self, before: LedgerDoc, joined: LedgerDoc) -> None:
        """Say which budget applies when this member's differs (the rule: the smallest of
        the recorded budget and the running members' configured ones)."""
        was, now = before.effective_budget(), joined.effective_budget()
        if was == self.budget == now:
            return
        if now != self.budget:
            logger.warning(
                "NVMe tier: %s: nvme.max_size_gb gives this member %s for this path, but "
                "the directory's budget is %s (the smallest of the budget set by member %s "
                "and those of the running members); %s applies to every member. Give every "
                "member the same nvme.max_size_gb.", self.path, _gib(self.budget), _gib(now),
                joined.budget_by, _gib(now))
        elif joined.budget_by == self.member and before.budget_by != self.member:
            logger.warning(
                "NVMe tier: %s: the directory's budget was %s (set by member %s); no "
                "member is running, so this member's nvme.max_size_gb (%s for this "
                "path) applies from now on.", self.path, _gib(was), before.budget_by,
                _gib(self.budget))
        else:
            logger.warning(
                "NVMe tier: %s: the directory's budget was %s; this member's "
                "nvme.max_size_gb (%s for this path) is smaller and the smallest budget of "
                "the running members applies, so %s applies to every member while it runs.",
                self.path, _gib(was), _gib(self.budget), _gib(now))

    def _serve_reads_only(self, why: str) -> None:
        self.read_only = why
        self._catalog.members[self.root.index] = ""
        logger.warning("NVMe tier: %s: cannot take part in the directory's shared budget "
                       "(%s): this process serves the chunks the members publish and writes "
                       "nothing there (writes are dropped and counted in capacity_drops).",
                       self.path, why)

    def leave(self) -> None:
        """A clean exit: the account keeps exactly the bytes it owns (its headroom goes
        back to the pool) and becomes the orphans' at the janitor's next round."""
        if self.read_only is None and self.account.journal is not None:
            if not self.account.fenced:
                self.account.leaving = True
                self.account.update(self.account.departing_cap())
            self.account.journal.close()
            remove_member_files(self.path, self.member)
        self.tail.close()

    # -- background ------------------------------------------------------------------------

    def _catch_up(self) -> None:
        if time.monotonic() - self._ingested_at > CATCH_UP_S:
            self.ingest(wait=False)

    def ingest(self, wait: bool = True) -> None:
        """Apply what the other members' journals say since the last call (a bounded read
        of each, ``JournalTail.poll``: the rest next time).  Without ``wait`` (a writer
        about to evict), nothing while another thread reads them."""
        if not self._ingest_lock.acquire(blocking=wait):
            return
        try:
            self._ingested_at = time.monotonic()
            for batch in self.tail.poll():
                self._apply(batch)
        finally:
            self._ingest_lock.release()

    def _apply(self, batch: Batch) -> None:
        """Apply one member's records to the index, ``APPLY_BATCH`` at a time (lookups and
        writers take the index's lock in between)."""
        now_ns = time.time_ns()
        published = list(batch.published.values())
        deleted = list(batch.deleted)
        if batch.first:  # history, in no order with the others': ask the directory
            published = [p for p in published if self._catalog.entry(p.digest)
                         is not None or self.root.layout.has_chunk(p.ns_id, p.digest)]
            deleted = [d for d in deleted if (e := self._catalog.entry(d)) is not None
                       and not self.root.layout.has_chunk(e.ns_id, d)]
        entries = [IndexEntry(p.digest, p.ns_id, self.root.index, p.size, p.meta, now_ns,
                              owner=batch.member) for p in published]
        removed: list[IndexEntry] = []
        for i in range(0, max(len(entries), len(deleted), len(batch.accessed)), APPLY_BATCH):
            added, gone, doubles = self._catalog.apply_remote(
                entries[i : i + APPLY_BATCH], deleted[i : i + APPLY_BATCH],
                batch.accessed[i : i + APPLY_BATCH], now_ns)
            removed += gone
            self._stats.add(Counter.SHARED_ADOPTED, added)
            if len(self.account.doubles) < 65536:
                self.account.doubles.extend(doubles)
        if batch.snapshot is not None:
            removed += self._catalog.drop_owned_except(batch.member, batch.snapshot)
        self._catalog.notify_removed(removed)
        self._stats.add(Counter.SHARED_VANISHED, len(removed))

    def heartbeat(self, raise_errors: bool = False) -> None:
        """Renew this member's lease and read the others'."""
        if self.read_only is None or self._join_again_at is not None:
            lease = self.lease
            lease.seq += 1
            lease.read_only = self.read_only is not None
            lease.janitor_rounds = self.janitor_rounds
            stats = self.account.stats()
            lease.owned_bytes, lease.owned_chunks = stats["owned_bytes"], stats["owned_chunks"]
            lease.cap, lease.reserved = stats["cap"], stats["reserved"]
            lease.budget, lease.chunk_format, lease.ledger_format = \
                self.budget, FORMAT_VERSION, LEDGER_FORMAT
            lease.newest_read_age_s, lease.oldest_read_age_s = \
                self.account.read_ages(time.time_ns())
            try:
                write_lease(self.path, lease, self._settings.file_mode)
                self._lease_ok = time.monotonic()
            except OSError as exc:
                if raise_errors:
                    raise
                self._warn_once("lease", "NVMe tier: %s: cannot renew this member's lease "
                                "(%s); it stops writing after %.0f s without one.",
                                self.path, exc, LEASE_S / 2)
        self.leases = read_leases(self.path)
        self.liveness.observe(self.leases)
        self._compare_settings()

    def _compare_settings(self) -> None:
        doc = self.account.chain.cached
        if doc is None:
            return
        for member, lease in self.leases.items():
            if member == self.member:
                continue
            budget = doc.effective_budget()
            if lease.budget and lease.budget != budget:
                self._warn_once(
                    f"budget:{member}", "NVMe tier: %s: member %s (host %s, pid %d) is "
                    "configured with %s for this path, the directory's budget is %s (the "
                    "smallest of the budget set by member %s and the running members'); %s "
                    "applies to every member.", self.path, member, lease.host,
                    lease.pid, _gib(lease.budget), _gib(budget), doc.budget_by, _gib(budget))
            if lease.chunk_format and lease.chunk_format != FORMAT_VERSION:
                self._warn_once(
                    f"format:{member}", "NVMe tier: %s: member %s writes chunk format %d, "
                    "this member format %d; each member writes its own and reads formats up "
                    "to its own, so %s.", self.path, member, lease.chunk_format,
                    FORMAT_VERSION, "its chunks are misses here" if lease.chunk_format >
                    FORMAT_VERSION else "both read this member's older files")

    def _warn_once(self, key: str, message: str, *args: object) -> None:
        if key not in self._warned:
            self._warned.add(key)
            logger.warning(message, *args)

    def sync(self) -> None:
        """Follow the ledger: adopt it, acknowledge, return spare headroom, and keep the
        journal compact; a member taken over as dead rejoins under a new id."""
        if self._join_again_at is not None and time.monotonic() >= self._join_again_at:
            self._join_again()
        if self.read_only is not None:
            return
        doc = self.account.chain.latest()
        if doc is not None:
            self.account.adopt(doc)
        if self.account.fenced:
            self._rejoin()
            return
        self.account.tidy(keep=2 * max(self.headroom_target(), self._largest))
        journal = self.account.journal
        if journal is not None:
            if journal.wants_rotation(len(self.account.owned)):
                journal.rotate(self.account.owned_lines())
            journal.retire_old()

    def _join_again(self) -> None:
        """A member reading only for version skew tries to join again."""
        self.read_only, self._join_again_at = None, None
        try:
            self._enter_ledger()
        except (LedgerError, OSError) as exc:
            self._serve_reads_only(f"the ledger: {exc}")
        if self.read_only is None:
            self._catalog.members[self.root.index] = self.member
            logger.warning("NVMe tier: %s: member %s joins the directory's shared budget "
                           "now.", self.path, self.member)

    def _rejoin(self) -> None:
        """Join again under a new id; the writes still in flight settle in the new
        account, which makes room for them first (claims or evicts) before it writes more."""
        old, books = self.member, self.account
        if books.journal is not None:
            books.journal.close()
        self.tail.close()
        self._new_identity()
        in_flight = books.hand_over(self.account)
        self._catalog.members[self.root.index] = self.member
        logger.warning("NVMe tier: %s: member %s rejoins the directory as %s (%.1f MiB of "
                       "writes in flight move to its account).", self.path, old, self.member,
                       in_flight / 2**20)
        self.join()
        if self.read_only is None and in_flight:
            self.account.ensure_headroom(0)

    def janitor_round(self) -> None:
        if self.tail.reading_history():  # a walk now would count chunks whose owner is
            return  # still unread here as orphans: after the journals are caught up
        self.janitor.tick(self.leases, time.monotonic())

    def is_janitor(self) -> bool:
        doc = self.account.chain.cached
        if doc is None or self.read_only is not None or self.account.fenced:
            return False
        return self.janitor_of(doc) == self.member

    def janitor_of(self, doc: LedgerDoc) -> str | None:
        """The janitor as this member sees it: the live member with the smallest id whose
        janitor thread is not stalled (``leases.py``); None when there is none."""
        live = [m for m in doc.live() if m == self.member or
                self.liveness.alive(m) and not self.liveness.janitor_stalled(m)]
        return min(live, default=None)

    def janitor_stalled(self) -> int:
        """1 while a live member with a smaller id than the janitor's is passed over
        because its janitor thread stalled (see ``janitor_of``)."""
        doc = self.account.chain.cached
        if doc is None:
            return 0
        janitor = self.janitor_of(doc)
        return int(any(m < (janitor or "~") and m != self.member and
                       self.liveness.alive(m) and self.liveness.janitor_stalled(m)
                       for m in doc.live()))

    # -- writes ----------------------------------------------------------------------------

    def may_write(self) -> bool:
        if self.read_only is not None or self.account.fenced or self.account.journal is None:
            return False
        if time.monotonic() - self._lease_ok > LEASE_S / 2:
            self._warn_once("fenced", "NVMe tier: %s: this member's lease is %.0f s old; it "
                            "stops writing until it is renewed (its share may be taken over).",
                            self.path, time.monotonic() - self._lease_ok)
            return False
        return True

    def headroom_target(self) -> int:
        """The headroom kept ready in the background, so that a write seldom waits for an
        eviction: ``refill`` (budget / 256, at most 64 MiB) when that holds whole chunks,
        else none (a small budget is not emptied ahead of writes that may never come)."""
        return self.account.refill if self.account.refill >= self._largest > 0 else 0

    def keep_room(self) -> None:
        """Restore the headroom target (the ``nvme-room`` thread)."""
        target = self.headroom_target()
        if target and self.account.headroom() < target and self.may_write():
            self.account.ensure_headroom(target)

    def reserve(self, size: int, guard: FreeSpaceGuard) -> bool:
        """Reserve ``size`` bytes of this directory's budget (and of free space)."""
        if not self.may_write():
            return False
        self._largest = max(self._largest, size)
        if not self.account.make_room(size):
            return False
        if self.account.headroom() < self.headroom_target():
            self.room_wanted.set()
        self._catalog.note_reserved(self.root.index, size)
        while not guard.room_for(size):
            if self.account.evict(size) < 0:
                self._catalog.release(self.root.index, size)
                note_full(self.root, None)
                return False
            guard.refresh()
        return True

    def describe(self) -> dict[str, int]:
        doc = self.account.chain.cached
        stats = self.account.stats()
        live = [m for m in doc.live() if m == self.member or self.liveness.alive(m)] \
            if doc is not None else []
        return {
            "directory_budget_bytes": doc.effective_budget() if doc is not None else 0,
            "member_bytes": stats["owned_bytes"],
            "member_cap_bytes": stats["cap"],
            "members_live": len(live),
            "members_dead": 0 if doc is None else sum(
                a.state == DEAD or (a.state == LIVE and m not in live)
                for m, a in doc.accounts.items()),
            "orphan_bytes": doc.orphans_cap if doc is not None else 0,
            "ledger_updates": self.account.chain.updates,
            "ledger_conflicts": self.account.chain.conflicts,
            "ledger_damaged": self.account.chain.damaged_total,
            "janitor_stalled": self.janitor_stalled(),
        }


