"""The janitor of a shared root: finishes what dead members left, keeps the ledger true.

The janitor is the live member with the smallest id, as each member sees it (two may act
while views differ: each step is a ledger update that re-checks its premise, or an
idempotent removal).  Each round:

* a member whose lease stopped moving (``leases.py``) is marked dead;
* a dead or departed member's claimed victims are settled (transfers it had not recorded
  are taken from their owners) and deleted, its account merged into the orphans' (its cap
  keeps counting its files), its lease, journal and evicting directory removed;
* after a death, and every ``RECONCILE_S`` (or ten times the last walk's duration), the
  tree is walked: dead writers' temp files go, the orphans' cap is recounted from the
  files no live member owns, and chunks a live member counts that are gone (``gc``,
  quarantine) are released from its account;
* a ledger over its budget is trimmed by evicting the least recently used chunks.

A janitor killed at any point leaves a whole ledger version (each update is one ``link``)
and files the next janitor recognises by name.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable

from ...disk.coordination import (
    EVICTING_DIR,
    LEDGER_DIR,
    MEMBER_RE,
    MEMBERS_DIR,
    evicting_dir,
    journal_path,
    lease_member,
    parse_evicting_name,
    parse_journal_name,
)
from ...disk.layout import TempFile
from ...disk.safe_fs import remove_quietly, scandir_beneath
from ..catalog import Catalog
from ..roots import unlink_quietly
from ..stats import Counter, StoreStats
from .leases import Lease, Liveness, on_this_host_and_gone, remove_member_files
from .ledger import DEAD, DEPARTED, LIVE, LedgerDoc, remove_tree_quietly
from .share import Account

logger = logging.getLogger(__name__)

RECONCILE_S = 60.0
WALK_SHARE = 10  # periodic walks take at most a tenth of the janitor's time
GRACE_S = 0.5  # after a walk: the journals of what was published meanwhile are read
SAID_PER_ROUND = 5  # members named in a round's log lines (the rest are counted)


def _tag(host: str) -> str:
    return re.sub(r"[^A-Za-z0-9_]", "_", host)[:32]


class Janitor:
    """The janitor's duties on one root (run by whichever member is the janitor)."""

    def __init__(self, account: Account, liveness: Liveness, catalog: Catalog,
                 stats: StoreStats, ingest: Callable[[], None],
                 stopping: threading.Event) -> None:
        self.account = account
        self.path = account.path
        self.member = account.member
        self.liveness = liveness
        self._catalog = catalog
        self._stats = stats
        self._ingest = ingest
        self._stopping = stopping
        self._walk_due = True
        self._next_walk = 0.0
        self._dead_writers: set[tuple[str, int]] = set()
        self.walks = 0
        self.last_walk_s = 0.0

    def tick(self, leases: dict[str, Lease], now: float) -> None:
        """One round of duties (see the module doc); each step is one ledger version
        for every member it concerns, and the round ends early when the store closes."""
        doc = self.account.chain.latest()
        if doc is None:
            return
        dead = [m for m, acct in doc.accounts.items()
                if m != self.member and acct.state == LIVE and not self.liveness.alive(m)]
        if dead:
            self._declare_dead(dead, leases)
        doc = self.account.chain.cached or doc
        gone = {m: acct.state for m, acct in doc.accounts.items()
                if acct.state in (DEAD, DEPARTED)}
        for step in (lambda: self._settle(list(gone)), lambda: self._merge(gone),
                     lambda: self._remove_strays(leases)):
            if self._stopping.is_set():
                return
            step()
        if self._walk_due or now >= self._next_walk:
            self.reconcile(leases)
        if not self._stopping.is_set():
            self.trim()
            self._release_doubles()

    # -- dead and departed members --------------------------------------------------------

    def _declare_dead(self, members: list[str], leases: dict[str, Lease]) -> None:
        def change(doc: LedgerDoc) -> bool:
            changed = False
            for member in members:
                acct = doc.accounts.get(member)
                if acct is not None and acct.state == LIVE:
                    acct.state = DEAD
                    changed = True
            return changed

        if self.account.update(change) is None:
            return
        for member in members:
            lease = leases.get(member)
            if lease is not None:
                self._dead_writers.add((_tag(lease.host), lease.pid))
        for member in members[:SAID_PER_ROUND]:
            silent = self.liveness.silent_for(member)
            why = ("its process is gone" if on_this_host_and_gone(member) else
                   f"its lease has not moved for {silent:.0f} s" if silent is not None else
                   "it has no lease")
            logger.warning("NVMe tier: %s: member %s is dead (%s); taking over its share "
                           "of the budget.", self.path, member, why)
        if len(members) > SAID_PER_ROUND:
            logger.warning("NVMe tier: %s: %d more members are dead; taking over their "
                           "shares too.", self.path, len(members) - SAID_PER_ROUND)
        self._stats.add(Counter.SHARED_TAKEOVERS, len(members))
        self._walk_due = True

    def _settle(self, members: list[str]) -> None:
        """Finish gone members' evictions: record the transfers they had not, delete."""
        wanted = set(members)
        claimed = {e.name: [c.name for c in scandir_beneath(self.path, evicting_dir(e.name))]
                   for e in scandir_beneath(self.path, EVICTING_DIR) if e.name in wanted}
        claimed = {m: names for m, names in claimed.items() if names}
        if not claimed:
            return
        doc = self.account.chain.cached
        if doc is None:
            return

        def unrecorded(doc: LedgerDoc, member: str) -> list[tuple[str, tuple[str, int, str]]]:
            gone = doc.accounts.get(member)
            return [] if gone is None else \
                [(n, p) for n in claimed[member]
                 if n not in gone.evicting and (p := parse_evicting_name(n)) is not None]

        if any(unrecorded(doc, m) for m in claimed):
            def change(doc: LedgerDoc) -> bool:
                changed = False
                for member in claimed:
                    todo = unrecorded(doc, member)
                    for name, (digest, size, owner) in todo:
                        doc.take(owner, digest, size, claim_gen=-1)  # orphans: at the walk
                        doc.accounts[member].evicting.append(name)
                    changed |= bool(todo)
                return changed

            if self.account.update(change) is None:
                return
        for member, names in claimed.items():
            for name in names:
                remove_quietly(self.path, f"{evicting_dir(member)}/{name}")

    def _merge(self, gone: dict[str, str]) -> None:
        """Dead and departed members' accounts become the orphans' (one version)."""
        caps: dict[str, int] = {}

        def change(doc: LedgerDoc) -> bool:
            caps.clear()
            for member in gone:
                acct = doc.accounts.get(member)
                if acct is not None and acct.state != LIVE:
                    caps[member] = acct.cap
                    doc.merge_into_orphans(member)
            return bool(caps)

        if not gone or self.account.update(change) is None or not caps:
            return
        self._remove_member_files(set(caps))
        for member in caps:
            self.liveness.forget(member)
        for member in list(caps)[:SAID_PER_ROUND]:
            logger.info("NVMe tier: %s: the %s member %s's chunks (%.1f MiB) now count as "
                        "orphans.", self.path, gone[member], member, caps[member] / 2**20)

    def _remove_member_files(self, members: set[str]) -> None:
        """Leases, journals and evicting directories of ``members`` (one listing)."""
        for entry in scandir_beneath(self.path, MEMBERS_DIR):
            if self._stopping.is_set():
                return
            parsed = parse_journal_name(entry.name)
            if parsed is not None and parsed[0] in members:
                remove_quietly(self.path, journal_path(*parsed))
        for member in members:
            if self._stopping.is_set():
                return
            remove_member_files(self.path, member)
            remove_tree_quietly(self.path, evicting_dir(member))

    def _remove_strays(self, leases: dict[str, Lease]) -> None:
        """Files of members the ledger no longer knows and that are not starting up."""
        doc = self.account.chain.cached
        if doc is None:
            return
        known = set(doc.accounts)

        def stray(member: str) -> bool:
            return member not in known and member != self.member and \
                not self.liveness.alive(member)

        names = {lease_member(e.name) for e in scandir_beneath(self.path, MEMBERS_DIR)}
        names |= {p[0] for e in scandir_beneath(self.path, MEMBERS_DIR)
                  if (p := parse_journal_name(e.name)) is not None}
        names |= {e.name for e in scandir_beneath(self.path, EVICTING_DIR)
                  if MEMBER_RE.match(e.name)}
        strays = {m for m in names if m and stray(m)}
        if strays:
            self._remove_member_files(strays)
        for entry in scandir_beneath(self.path, LEDGER_DIR):
            if entry.name.startswith(".tmp-"):
                owner = entry.name[len(".tmp-"):].rsplit("-", 1)[0]
                if MEMBER_RE.match(owner) and owner not in doc.live() and stray(owner) or \
                        MEMBER_RE.match(owner) and on_this_host_and_gone(owner):
                    remove_quietly(self.path, f"{LEDGER_DIR}/{entry.name}")

    # -- the walk -------------------------------------------------------------------------

    def reconcile(self, leases: dict[str, Lease]) -> None:
        """Walk the tree (see the module doc)."""
        started = time.monotonic()
        self._walk_due = False
        self._next_walk = started + RECONCILE_S
        doc0 = self.account.chain.latest()
        if doc0 is None:
            return
        before = self._catalog.owners(self.account.root.index)
        layout = self.account.root.layout
        files: dict[str, int] = {}
        namespaces: dict[str, str] = {}
        located, temps = layout.scan()
        for loc in located:
            files[loc.digest] = loc.stat.st_size
            namespaces[loc.digest] = loc.namespace_id
        live_writers = {(_tag(lease.host), lease.pid) for m, lease in leases.items()
                        if self.liveness.alive(m)}
        for temp in temps:
            if self._temp_of_dead_writer(temp, live_writers):
                unlink_quietly(temp.path, layout.root)
                self._stats.add(Counter.REMOVED_TEMP_FILES)
        if self._stopping.wait(GRACE_S):
            return
        self._ingest()
        claimed = {p[0] for d in scandir_beneath(self.path, EVICTING_DIR)
                   for e in scandir_beneath(self.path, f"{EVICTING_DIR}/{d.name}")
                   if (p := parse_evicting_name(e.name)) is not None}
        doc1 = self.account.chain.latest()
        if doc1 is None or doc1.orphans_gen != doc0.orphans_gen:
            return  # another janitor recounted meanwhile
        live = set(doc1.live())
        now_owners = self._catalog.owners(self.account.root.index)
        # a file no live member owns, or no journal explains, that is still there
        orphan_bytes = sum(size for d, size in files.items()
                           if now_owners.get(d, ("", 0))[0] not in live
                           and (d in now_owners or d not in before)
                           and layout.has_chunk(namespaces.get(d, ""), d))
        # a chunk a live owner counts that the walk did not list and that is still not
        # there (not one stored again since the walk listed its directory)
        unlisted = [(d, owner) for d, (owner, _) in before.items()
                    if owner in live and d not in files and d not in claimed
                    and now_owners.get(d, ("", 0))[0] == owner]
        vanished = [(d, owner, e) for (d, owner), e in
                    zip(unlisted, self._catalog.entries([d for d, _ in unlisted]), strict=True)
                    if e is None or not layout.has_chunk(e.ns_id, d)]

        def change(doc: LedgerDoc) -> bool:
            if doc.orphans_gen != doc0.orphans_gen:
                return False
            doc.orphans_cap = orphan_bytes
            doc.orphans_gen += 1
            for digest, owner, _ in vanished:
                release(doc, owner, digest)
            return True

        if self.account.update(change) is not None:
            self.walks += 1
            self.last_walk_s = time.monotonic() - started
            # a tree that takes long to walk (millions of chunks on a network filesystem)
            # is walked at most a tenth of the time
            self._next_walk = started + max(RECONCILE_S, WALK_SHARE * self.last_walk_s)
            self._stats.add(Counter.SHARED_RECONCILES)
            if vanished:
                removed = self._catalog.remove_entries(e for _, _, e in vanished if e is not None)
                self._catalog.notify_removed(removed)

    def _temp_of_dead_writer(self, temp: TempFile, live_writers: set[tuple[str, int]]) -> bool:
        writer = (_tag(temp.host), temp.pid)
        if writer in live_writers:
            return False
        # a member declared dead; else this host's process is gone, or an hour old
        return writer in self._dead_writers or temp.is_stale()

    # -- over budget, double counts ------------------------------------------------------

    def trim(self) -> None:
        """Evict (into the pool) while the accounts hold more than the budget."""
        for _ in range(64):
            doc = self.account.chain.cached
            over = 0 if doc is None else -doc.pool(self.account.budget)
            if over <= 0 or self.account.evict(over, to_pool=True) < 0:
                return

    def _release_doubles(self) -> None:
        """Chunks two live members both count (both wrote them at once): one file, so
        the earlier owner is released from it."""
        doubles, self.account.doubles = self.account.doubles, []
        if not doubles:
            return
        owners = self._catalog.owners(self.account.root.index)
        todo = [(d, other) for d, other in doubles if owners.get(d, ("", 0))[0] not in
                ("", other)]
        if not todo:
            return

        def change(doc: LedgerDoc) -> bool:
            changed = False
            for digest, other in todo:
                changed |= release(doc, other, digest)
            return changed

        self.account.update(change)


def release(doc: LedgerDoc, owner: str, digest: str) -> bool:
    """Tell a live ``owner`` to stop counting ``digest`` (its cap stays: the room is its)."""
    acct = doc.accounts.get(owner)
    if acct is None or acct.state != LIVE:
        return False
    acct.freed.append((acct.next_seq, digest, 0))
    acct.next_seq += 1
    return True
