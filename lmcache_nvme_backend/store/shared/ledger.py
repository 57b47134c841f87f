"""The ledger of a shared cache directory: who may hold how many of the budget's bytes.

A root's budget is split into one *account* per member (a process using the root with
``nvme.shared: true``), an *orphans* account for chunks no live member counts (written by
members that left or died, or found on disk), and the *pool*: ``budget = pool +
orphans.cap + sum(account.cap)``.  A member writes only while what it owns plus its writes
in flight fit its ``cap``.  Caps move only through a new version of the ledger, a
compare-and-set: version ``n + 1`` is written to a temp file and ``link(2)``-ed to its
name, which fails if another member created it first.  ``link`` is atomic on local and
network filesystems alike and no lock is held, so no member waits for another.  An evicted
chunk's size moves from its owner's cap to the evicter's in one version; the owner learns
of it from a ``freed`` entry, so its headroom never changes under it
(``docs/deployment.md``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ...disk.coordination import (
    EPOCH_VERSIONS,
    LEDGER_DIR,
    MEMBER_RE,
    epoch_dir,
    epoch_of,
    is_epoch_name,
    ledger_temp_path,
    version_number,
    version_path,
)
from ...disk.layout import DIGEST_RE
from ...disk.safe_fs import (
    create_beneath,
    link_beneath,
    lstat_beneath,
    makedirs_beneath,
    read_small_file,
    remove_quietly,
    rename_beneath,
    scandir_beneath,
    unlink_beneath,
)

logger = logging.getLogger(__name__)

LEDGER_FORMAT = 1
LIVE, DEAD, DEPARTED = "live", "dead", "departed"
_STATES = (LIVE, DEAD, DEPARTED)
MAX_LEDGER_BYTES = 16 << 20
UPDATE_TRIES = 200


class LedgerError(Exception):
    """The ledger cannot be read or changed (damaged, unwritable, or always contended)."""


@dataclass
class Account:
    """One member's share of the budget."""

    cap: int
    state: str = LIVE
    budget: int = 0  # the budget this member was configured with (warnings, inspect)
    chunk_format: int = 0  # the chunk file format version it writes
    # chunks of this member that others took out of its account: (seq, digest, size)
    freed: list[tuple[int, str, int]] = field(default_factory=list)
    next_seq: int = 1
    # victims this member claimed whose transfer is recorded here, not yet unlinked
    evicting: list[str] = field(default_factory=list)


@dataclass
class LedgerDoc:
    """One version of the ledger."""

    n: int
    budget: int
    budget_by: str
    accounts: dict[str, Account] = field(default_factory=dict)
    orphans_cap: int = 0
    # bumped whenever the orphans' cap is recomputed from a walk of the tree: a victim
    # claimed under an older generation may or may not have been counted by that walk
    orphans_gen: int = 0
    format: int = LEDGER_FORMAT

    def pool(self) -> int:
        """Bytes of the budget no account holds (negative: over-committed)."""
        return self.budget - self.orphans_cap - sum(a.cap for a in self.accounts.values())

    def live(self) -> list[str]:
        return [m for m, a in self.accounts.items() if a.state == LIVE]

    def take(self, owner: str, digest: str, size: int, claim_gen: int) -> int:
        """Take a deleted chunk's bytes out of its owner's account; how many it held.

        A live owner hears of it through a ``freed`` entry.  A chunk without a live owner
        comes out of the orphans' cap, unless the orphans were recounted since the victim
        was claimed (``claim_gen``): that walk decided whether it was counted, so nothing
        is taken (the tree is over-counted until the next walk, never under-counted).
        """
        account = self.accounts.get(owner) if owner else None
        if account is not None and account.state == LIVE:
            account.cap -= size
            account.freed.append((account.next_seq, digest, size))
            account.next_seq += 1
            return size
        if account is not None:  # dead or departed, not yet merged into the orphans
            taken = max(0, min(size, account.cap))
            account.cap -= taken
            return taken
        if claim_gen != self.orphans_gen:
            return 0
        taken = max(0, min(size, self.orphans_cap))
        self.orphans_cap -= taken
        return taken

    def merge_into_orphans(self, member: str) -> None:
        """A dead or departed member's chunks become the orphans'."""
        account = self.accounts.pop(member, None)
        if account is not None:
            self.orphans_cap += max(0, account.cap)

    def copy(self) -> LedgerDoc:
        return LedgerDoc.from_json(self.to_json())

    def to_json(self) -> bytes:
        accounts = {
            m: {"cap": a.cap, "state": a.state, "budget": a.budget,
                "chunk_format": a.chunk_format, "freed": [list(f) for f in a.freed],
                "next": a.next_seq, "evicting": a.evicting}
            for m, a in sorted(self.accounts.items())}
        return json.dumps({"format": self.format, "n": self.n, "budget": self.budget,
                           "budget_by": self.budget_by,
                           "orphans": {"cap": self.orphans_cap, "gen": self.orphans_gen},
                           "accounts": accounts}, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> LedgerDoc:
        """Parse a version; anything but a ledger this code wrote is a ``LedgerError``."""
        try:
            doc = json.loads(raw)
            accounts = {}
            for member, a in doc["accounts"].items():
                if not MEMBER_RE.match(member) or a["state"] not in _STATES:
                    raise ValueError(f"bad account {member[:40]!r}")
                freed = [(_int(s), str(d), _int(z)) for s, d, z in a["freed"]]
                if not all(DIGEST_RE.match(d) for _, d, _ in freed):
                    raise ValueError("bad digest in freed")
                accounts[member] = Account(_signed(a["cap"]), a["state"], _int(a["budget"]),
                                           _int(a["chunk_format"]), freed, _int(a["next"]),
                                           [str(n) for n in a["evicting"]])
            return cls(_int(doc["n"]), _int(doc["budget"]), str(doc["budget_by"]), accounts,
                       _signed(doc["orphans"]["cap"]), _int(doc["orphans"]["gen"]),
                       _int(doc["format"]))
        except (ValueError, TypeError, KeyError, AttributeError, RecursionError) as exc:
            raise LedgerError(f"not a ledger version: {str(exc)[:200]}") from None


def _int(value: object) -> int:
    if type(value) is not int or value < 0:
        raise ValueError(f"not a count: {str(value)[:40]}")
    return value


def _signed(value: object) -> int:
    """A cap: an integer, negative only while a trim is due."""
    if type(value) is not int:
        raise ValueError(f"not a byte count: {str(value)[:40]}")
    return value


class LedgerChain:
    """Reads the newest version of one root's ledger and writes the next one.

    Versions are never rewritten, so a reader that has version ``n`` finds the newest by
    opening ``n + 1``, ``n + 2``, ... (new names show at once on network filesystems, where
    contents may be cached).  Whole epochs are removed, oldest first, once two newer ones
    exist: while ``n`` exists every later version does; a reader whose ``n`` is gone lists.
    """

    def __init__(self, root: Path, member: str, file_mode: int, dir_mode: int,
                 durable: bool = False) -> None:
        self.root = root
        self.member = member
        self._file_mode = file_mode
        self._dir_mode = dir_mode
        self._durable = durable
        self._doc: LedgerDoc | None = None
        self.conflicts = 0
        self.updates = 0

    @property
    def cached(self) -> LedgerDoc | None:
        """The newest version this chain has read or written (no I/O)."""
        return self._doc

    def latest(self) -> LedgerDoc | None:
        """The newest version (None: the root has no ledger yet).  Under a storm of
        updates the answer may already be a little old: an update then simply conflicts."""
        doc = self._doc
        if doc is not None and not self._exists(doc.n):
            doc = None  # our version was removed with its epoch: far behind, list
        for _ in range(UPDATE_TRIES):
            if doc is None:
                n = self._newest_listed()
                if n is None:
                    return None
                doc = self._read(n)
                if doc is None:
                    continue  # retired between the listing and the read: list again
            while (newer := self._read(doc.n + 1)) is not None:
                doc = newer
            self._doc = doc
            return doc
        raise LedgerError(f"{self.root}: the ledger changed faster than it could be read")

    def create(self, doc: LedgerDoc) -> bool:
        """Write version 1 (False: another member created the ledger first)."""
        doc.n = 1
        makedirs_beneath(self.root, epoch_dir(0), self._dir_mode)
        if self._publish(doc):
            self._doc = doc
            return True
        return False

    def update(self, change: Callable[[LedgerDoc], bool]) -> LedgerDoc:
        """Apply ``change`` (which edits a copy, returning False for "nothing to change")
        to the newest version and publish it, recomputing after each conflict."""
        for attempt in range(UPDATE_TRIES):
            doc = self.latest()
            if doc is None:
                raise LedgerError(f"{self.root}: the ledger is missing")
            new = doc.copy()
            if not change(new):
                return doc
            new.n = doc.n + 1
            if self._publish(new):
                self._doc = new
                self.updates += 1
                if new.n % EPOCH_VERSIONS == 0:
                    self._collect_old_epochs(epoch_of(new.n))
                return new
            self.conflicts += 1
            time.sleep(random.uniform(0, 0.0005 * min(attempt + 1, 20)))
        raise LedgerError(f"{self.root}: {UPDATE_TRIES} ledger updates in a row lost to "
                          "other members")

    # -- files -----------------------------------------------------------------------

    def _exists(self, n: int) -> bool:
        try:
            lstat_beneath(self.root, version_path(n))
            return True
        except FileNotFoundError:
            return False

    def _read(self, n: int) -> LedgerDoc | None:
        try:
            raw = read_small_file(self.root, version_path(n), MAX_LEDGER_BYTES)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise LedgerError(f"cannot read ledger version {n} in {self.root}: {exc}") from exc
        doc = LedgerDoc.from_json(raw)
        if doc.n != n:
            raise LedgerError(f"ledger version file {n} says it is version {doc.n}")
        return doc

    def _newest_listed(self) -> int | None:
        epochs = sorted(e.name for e in scandir_beneath(self.root, LEDGER_DIR)
                        if is_epoch_name(e.name) and e.is_dir(follow_symlinks=False))
        for epoch in reversed(epochs):
            numbers = [n for e in scandir_beneath(self.root, f"{LEDGER_DIR}/{epoch}")
                       if (n := version_number(e.name)) is not None]
            if numbers:
                return max(numbers)
        return None

    def _publish(self, doc: LedgerDoc) -> bool:
        """Write ``doc`` as version ``doc.n``; False when that version exists already."""
        tmp = ledger_temp_path(self.member)
        fd = create_beneath(self.root, tmp, self._file_mode)
        try:
            try:
                view = memoryview(doc.to_json())
                while view:
                    view = view[os.write(fd, view):]
                if self._durable:
                    os.fsync(fd)
            finally:
                os.close(fd)
            try:
                link_beneath(self.root, tmp, version_path(doc.n))
            except FileNotFoundError:
                # No epoch directory: a new epoch's, made only while the version before
                # exists (so never one that was retired); else this writer fell behind.
                if doc.n % EPOCH_VERSIONS or not self._exists(doc.n - 1):
                    return False
                makedirs_beneath(self.root, epoch_dir(epoch_of(doc.n)), self._dir_mode)
                link_beneath(self.root, tmp, version_path(doc.n))
            return True
        except FileExistsError:
            return False
        finally:
            remove_quietly(self.root, tmp)

    def _collect_old_epochs(self, current: int) -> None:
        """Remove epochs older than ``current - 1``, oldest first (each renamed away in one
        step, so no reader ever sees an epoch half removed)."""
        for entry in sorted(scandir_beneath(self.root, LEDGER_DIR), key=lambda e: e.name):
            if entry.name.startswith(".gc-") and entry.is_dir(follow_symlinks=False):
                remove_tree_quietly(self.root, f"{LEDGER_DIR}/{entry.name}")  # left behind
                continue
            if not is_epoch_name(entry.name) or int(entry.name) >= current - 1:
                continue
            gone = f"{LEDGER_DIR}/.gc-{entry.name}-{self.member}"
            try:
                rename_beneath(self.root, f"{LEDGER_DIR}/{entry.name}", gone)
            except FileNotFoundError:
                continue  # another member removed it
            except OSError as exc:
                logger.debug("NVMe tier: cannot retire ledger epoch %s: %s", entry.name, exc)
                return
            remove_tree_quietly(self.root, gone)


def remove_tree_quietly(root: Path, rel: str) -> None:
    """Remove a directory of plain files below ``root`` (no link followed)."""
    for entry in scandir_beneath(root, rel):
        remove_quietly(root, f"{rel}/{entry.name}")
    with contextlib.suppress(OSError, ValueError):
        unlink_beneath(root, rel, directory=True)
