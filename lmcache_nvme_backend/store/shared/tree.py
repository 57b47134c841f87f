"""Shared mode: every process that uses a cache directory keeps one budget with the others.

With ``nvme.shared: true`` this process is a *member* of each of its roots (``RootMember``,
``member.py``): it holds an account of the root's budget in the root's ledger
(``ledger.py``; its books ``account.py``, making room ``share.py``), writes what it
publishes, deletes and reads to its journal and follows the others' (``journal.py``: a
lookup is a dictionary lookup), renews a lease (``leases.py``), and, as the janitor,
cleans up after members that died (``janitor.py``).  No server, no lock: the directory is
all the members share, on a local disk or a network filesystem (``docs/deployment.md``).

Three background threads per store: ``nvme-shared`` (journals every ``INGEST_S``, the
ledger every ``LEDGER_S``, the lease every ``HEARTBEAT_S``), ``nvme-janitor``, and
``nvme-room``, which evicts ahead of the writes so that a store call seldom waits.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

from ...config import NVMeSettings
from ..catalog import Catalog
from ..index import IndexEntry
from ..roots import Roots, RootState
from ..stats import StoreStats
from .leases import HEARTBEAT_S
from .member import RootMember

if TYPE_CHECKING:
    from ..free_space import FreeSpaceGuard

logger = logging.getLogger(__name__)

READS_S = 0.025  # this member's reads are shared this often (recency lag elsewhere)
INGEST_S = 0.1
LEDGER_S = 0.25
JANITOR_S = 1.0
ROOM_WAIT_S = 0.5  # the nvme-room thread checks for stop this often when idle


class SharedTree:
    """Shared mode for a store: one ``RootMember`` per root and the background threads."""

    def __init__(self, settings: NVMeSettings, catalog: Catalog, roots: Roots,
                 stats: StoreStats) -> None:
        self._catalog = catalog
        self.members = [RootMember(root, catalog.budgets[root.index], settings, catalog, stats)
                        for root in roots]
        self._room_wanted = threading.Event()
        for member in self.members:
            member.room_wanted = self._room_wanted
        catalog.members = [m.member for m in self.members]
        catalog.touched = deque(maxlen=1 << 20)
        catalog.accounting = self
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def start(self) -> None:
        """Join every root, read the other members' journals once, start the threads."""
        for member in self.members:
            member.join()
            member.ingest()
        for name, loop in (("nvme-shared", self._loop), ("nvme-janitor", self._janitor_loop),
                           ("nvme-room", self._room_loop)):
            thread = threading.Thread(target=loop, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)

    # -- the catalogue's accounting ----------------------------------------------------------

    def on_publish(self, entry: IndexEntry, replaced: IndexEntry | None, reserved: int) -> None:
        self.members[entry.root].account.published(entry, replaced, reserved)

    def on_release(self, root: int, size: int) -> None:
        self.members[root].account.release(size)

    # -- the writer's ------------------------------------------------------------------------

    def reserve(self, root: RootState, size: int, guard: FreeSpaceGuard) -> bool:
        return self.members[root.index].reserve(size, guard)

    def delete(self, entries: list[IndexEntry]) -> None:
        """Delete chunk files (LMCache's remove) with this directory's accounting."""
        for member in self.members:
            mine = [e for e in entries if e.root == member.root.index]
            if mine:
                member.account.delete(mine, evictions=False)

    def forgotten(self, entries: list[IndexEntry]) -> None:
        """Chunks that left the index with their namespace's directory (``forget``)."""
        for member in self.members:
            mine = [e for e in entries if e.root == member.root.index]
            if mine:
                member.account.disown(mine)

    def refresh(self) -> None:
        """Share reads, read journals and the ledger now (not waiting for the thread)."""
        self._share_reads()
        for member in self.members:
            member.ingest()
            member.sync()

    def describe(self) -> dict[str, int]:
        """Directory-wide figures, summed over the roots (``stats()`` keys)."""
        total: dict[str, int] = {}
        for member in self.members:
            for key, value in member.describe().items():
                total[key] = total.get(key, 0) + value
        return total

    def member_ids(self) -> list[str]:
        return [m.member for m in self.members]

    def _share_reads(self) -> None:
        touched = self._catalog.touched
        if not touched:
            return
        per_root: dict[int, list[str]] = {}
        while touched:
            try:
                root, digest = touched.popleft()
            except IndexError:
                break
            per_root.setdefault(root, []).append(digest)
        now = time.monotonic()
        for root, digests in per_root.items():
            self.members[root].account.note_reads(digests, now)

    def _loop(self) -> None:
        due = {"ingest": 0.0, "sync": 0.0, "heartbeat": 0.0}
        while not self._stop.wait(READS_S):
            now = time.monotonic()
            self._guarded(self._share_reads)
            for step, period in (("ingest", INGEST_S), ("sync", LEDGER_S),
                                 ("heartbeat", HEARTBEAT_S)):
                if now < due[step]:
                    continue
                for member in self.members:
                    self._guarded(getattr(member, step))
                due[step] = now + period

    def _room_loop(self) -> None:
        """Keep each root's headroom ready (evictions off the storing thread)."""
        while not self._stop.is_set():
            if not self._room_wanted.wait(ROOM_WAIT_S):
                continue
            self._room_wanted.clear()
            for member in self.members:
                self._guarded(member.keep_room)

    def _janitor_loop(self) -> None:
        while not self._stop.wait(JANITOR_S):
            for member in self.members:
                member.janitor_rounds += 1  # the others see this thread is not stuck
                if member.is_janitor():
                    self._guarded(member.janitor_round)

    @staticmethod
    def _guarded(step: Callable[[], None]) -> None:
        try:
            step()
        except Exception:  # a background step must never end the thread
            logger.exception("NVMe tier: shared-mode background step failed")

    def close(self) -> None:
        """Stop the threads and leave every root (after the writers finished)."""
        self._stop.set()
        self._room_wanted.set()
        for member in self.members:
            member.stopping.set()
        for thread in self._threads:
            thread.join()
        for member in self.members:
            self._guarded(member.leave)
