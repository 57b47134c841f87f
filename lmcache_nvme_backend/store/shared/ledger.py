"""The ledger of a shared cache directory: who may hold how many of the budget's bytes.

A root's budget is split into one *account* per member (a process using the root with
``nvme.shared: true``), an *orphans* account for chunks no live member counts (written by
members that left or died, or found on disk), and the *pool*: ``budget = pool +
orphans.cap + sum(account.cap)``.  A member writes only while what it owns plus its writes
in flight fit its ``cap``.  Caps move only through a new version of the ledger, a
compare-and-set: the next version is written to a temp file and ``link(2)``-ed to its
name, which fails if another member created it first.  ``link`` is atomic on local and
network filesystems alike and no lock is held, so no member waits for another.  An evicted
chunk's size moves from its owner's cap to the evicter's in one version; the owner learns
of it from a ``freed`` entry, so its headroom never changes under it
(``docs/deployment.md``).

**The chain rule**, which every member applies alike, so that no two follow different
chains: each version names its predecessor (``prev``: the digest of its bytes).  From the
last valid version ``v``, a reader looks at the next numbers in turn: a valid version
naming ``v`` becomes ``v``; anything else there (unparseable, out of range, ``n`` not its
name, a link, FIFO or directory, naming another predecessor) is *damage*: its number is
spent, it is set aside (left in place, counted, named in one warning per process; one the
chain had gone past when a reader started, which the members already set aside, is said
at debug level only), and the chain goes on at the next number from ``v``'s state; the
first free number ends the chain and is where the next version goes.  A version far
ahead of the chain (a gap) names no predecessor the chain has, so it is damage too when
the chain reaches it.  Versions are parsed as untrusted input (``ledger_doc.py``) and a
member publishes nothing its own parser would refuse.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ...disk.coordination import (
    LEDGER_DIR,
    epoch_dir,
    epoch_of,
    is_epoch_name,
    ledger_temp_path,
    version_number,
    version_path,
)
from ...disk.safe_fs import (
    NotAChunkFile,
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
from .ledger_doc import (
    DEAD,
    DEPARTED,
    LEDGER_FORMAT,
    LIVE,
    MAX_LEDGER_BYTES,
    Account,
    LedgerDamage,
    LedgerDoc,
    LedgerError,
    NewerLedger,
    digest_of,
    parse_version,
)

__all__ = ["DEAD", "DEPARTED", "LEDGER_FORMAT", "LIVE", "Account", "Damaged", "LedgerChain",
           "LedgerDamage", "LedgerDoc", "LedgerError", "NewerLedger", "remove_tree_quietly"]

logger = logging.getLogger(__name__)

UPDATE_TRIES = 200
START_CANDIDATES = 1024  # versions a reader without a start point considers, newest first


@dataclass(frozen=True)
class Damaged:
    """A version set aside: where, and what is wrong with it."""

    n: int
    path: Path
    why: str
    identity: tuple[int, int, int, int]  # (mode, inode, size, mtime): the same file


class _DamageSaid:
    """The damaged versions this process has warned about (by root, file and identity;
    bounded): another chain of this process on the same root (a member that rejoins,
    another store) does not warn again, and the count (``ledger_damaged``) counts each
    version once, whichever chain set it aside."""

    LIMIT = 4096

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._said: OrderedDict[tuple[Path, tuple[int, int, int, int]], None] = OrderedDict()
        self._counts: dict[Path, int] = {}

    def first(self, root: Path, damaged: Damaged) -> bool:
        """Note ``damaged`` as set aside on ``root``; whether this process had not yet."""
        key = (damaged.path, damaged.identity)
        with self._lock:
            if key in self._said:
                return False
            self._said[key] = None
            if len(self._said) > self.LIMIT:
                self._said.popitem(last=False)
            self._counts[root] = self._counts.get(root, 0) + 1
            return True

    def count(self, root: Path) -> int:
        with self._lock:
            return self._counts.get(root, 0)


_DAMAGE_SAID = _DamageSaid()


class LedgerChain:
    """Reads the newest version of one root's ledger and writes the next one.

    Versions are never rewritten, so a reader that has version ``n`` finds the newest by
    opening the next numbers (new names show at once on network filesystems, where
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
        self._lock = threading.Lock()  # ``_doc``: this process's threads walk the chain
        self.damaged: dict[int, Damaged] = {}  # versions set aside, by number
        self.conflicts = 0
        self.updates = 0

    @property
    def damaged_total(self) -> int:
        """Versions of this root this process set aside (each once)."""
        return _DAMAGE_SAID.count(self.root)

    @property
    def cached(self) -> LedgerDoc | None:
        """The newest version this chain has read or written (no I/O)."""
        return self._doc

    def latest(self) -> LedgerDoc | None:
        """The newest valid version (None: the root has no ledger yet).  Under a storm of
        updates the answer may already be a little old: an update then simply conflicts."""
        return self._latest()[0]

    def _latest(self) -> tuple[LedgerDoc | None, int]:
        """The newest valid version and the number the next one takes (one walk's answer:
        other threads of this process walk the chain too)."""
        doc = self._doc
        if doc is not None and not self._exists(doc.n):
            doc = None  # our version was removed with its epoch: far behind, list
        for _ in range(UPDATE_TRIES):
            try:
                if doc is None:
                    doc, start_next = self._start()
                    if doc is None:
                        return None, start_next
                return self._follow(doc)
            except FileNotFoundError:
                doc = None  # retired between the listing and the read: list again
        raise LedgerError(f"{self.root}: the ledger changed faster than it could be read")

    def create(self, doc: LedgerDoc) -> bool:
        """Write the first version (False: another member created the ledger first)."""
        found, n = self._latest()
        if found is not None:
            return False
        doc.n, doc.prev, doc.format = n, "", LEDGER_FORMAT
        makedirs_beneath(self.root, epoch_dir(epoch_of(doc.n)), self._dir_mode)
        return self._publish(doc, None)

    def update(self, change: Callable[[LedgerDoc], bool]) -> LedgerDoc:
        """Apply ``change`` (which edits a copy, returning False for "nothing to change")
        to the newest version and publish it, recomputing after each conflict."""
        for attempt in range(UPDATE_TRIES):
            doc, n = self._latest()
            if doc is None:
                raise LedgerError(f"{self.root}: the ledger is missing")
            new = doc.copy()
            if not change(new):
                return doc
            new.n, new.prev, new.format = n, doc.digest, LEDGER_FORMAT
            if self._publish(new, doc):
                self.updates += 1
                if epoch_of(new.n) != epoch_of(doc.n):
                    self._collect_old_epochs(epoch_of(new.n))
                return new
            self.conflicts += 1
            time.sleep(random.uniform(0, 0.0005 * min(attempt + 1, 20)))
        raise LedgerError(f"{self.root}: {UPDATE_TRIES} ledger updates in a row lost to "
                          "other members")

    # -- the chain rule ------------------------------------------------------------------

    def _follow(self, doc: LedgerDoc) -> tuple[LedgerDoc, int]:
        """Walk from ``doc`` to the end of the chain (see the module doc): the newest valid
        version and the number the next one takes."""
        n = doc.n + 1
        while True:
            got = self._newer_or_damaged(n, doc)
            if got is None:
                # a hole where a damaged version was removed by hand: the chain goes on
                # if the version after it names ``doc``
                after = self._newer_or_damaged(n + 1, doc)
                if not isinstance(after, LedgerDoc) or after.prev != doc.digest:
                    break
                n, got = n + 1, after
            if isinstance(got, LedgerDoc) and self._follows(got, doc):
                doc = got
            n += 1
        self._remember(doc)
        self.damaged = {k: d for k, d in self.damaged.items() if k >= doc.n}
        return doc, n

    def _remember(self, doc: LedgerDoc) -> None:
        """Keep ``doc`` as the newest known, unless a thread already knows a newer one."""
        with self._lock:
            if self._doc is None or doc.n >= self._doc.n:
                self._doc = doc

    def _newer_or_damaged(self, n: int, doc: LedgerDoc) -> LedgerDoc | Damaged | None:
        """``_version(n)``; one of a newer format is the newer members' chain if it names
        ``doc`` (``NewerLedger``: this member cannot follow it), else damage."""
        try:
            return self._version(n)
        except NewerLedger as exc:
            if exc.prev != doc.digest:
                return self._set_aside(n, f"{exc}, naming another predecessor")
            raise LedgerError(f"ledger version {self.root / version_path(n)} has {exc}: "
                              "upgrade this member") from exc

    def _follows(self, new: LedgerDoc, doc: LedgerDoc) -> bool:
        """Whether ``new``, found after ``doc``, continues the chain (else it is set
        aside).  A version of format 1 names no predecessor: it follows one of format 1."""
        if new.format >= 2 and new.prev == doc.digest or new.format == doc.format == 1:
            return True
        why = (f"format {new.format} after a version of format {doc.format}"
               if new.format < doc.format else
               f"prev: names another predecessor than version {doc.n} (a copy or a gap)")
        self._set_aside(new.n, why)
        return False

    def _start(self) -> tuple[LedgerDoc | None, int]:
        """Where a reader without a version starts (``_choose_start``).  The damage it met
        below that version is damage the chain went past: the members set it aside
        already, so it is said at debug level only."""
        found: list[Damaged] = []
        doc, after = self._choose_start(found)
        for damaged in found:
            self._say(damaged, known=doc is not None and damaged.n < doc.n)
        return doc, after

    def _choose_start(self, found: list[Damaged]) -> tuple[LedgerDoc | None, int]:
        """The newest valid version that names the newest valid version below it with at
        most one free number between them (as ``_follow`` goes on over one hole), or has
        none below it; without one, the number after every version listed.  The versions
        set aside on the way are added to ``found``, not said."""
        numbers = self._listed()
        after = (numbers[0] + 1) if numbers else 1
        candidates: list[LedgerDoc | NewerLedger] = []
        for n in numbers[:START_CANDIDATES]:
            try:
                got = self._version(n, found)
            except NewerLedger as exc:
                exc.n = n
                candidates.append(exc)
                continue
            if isinstance(got, LedgerDoc):
                candidates.append(got)
        for i, doc in enumerate(candidates):
            below = next((c for c in candidates[i + 1:] if isinstance(c, LedgerDoc)), None)
            if isinstance(doc, NewerLedger):
                if below is None or doc.prev == below.digest:
                    raise LedgerError(f"ledger version {self.root / version_path(doc.n)} "
                                      f"has {doc}: upgrade this member")
                self._set_aside(doc.n, f"{doc}, naming no version below it", found=found)
                continue
            free = doc.n - below.n - 1 - sum(below.n < k < doc.n for k in numbers) \
                if below is not None else 0
            if below is None or free <= 1 and (
                    doc.prev == below.digest or doc.format == below.format == 1):
                return doc, after
            self._set_aside(doc.n, f"prev: does not follow version {below.n} (a copy ahead "
                            f"of the chain, {free} free numbers between them)", found=found)
        return None, after

    def _version(self, n: int, found: list[Damaged] | None = None
                 ) -> LedgerDoc | Damaged | None:
        """Version ``n`` (None: there is none; ``Damaged``: it is set aside, and added to
        ``found`` when given, else said).  A read error is not damage: ``LedgerError``
        (the next poll tries again)."""
        rel = version_path(n)
        try:
            st = lstat_beneath(self.root, rel)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise LedgerError(f"cannot read ledger version {self.root / rel}: {exc}") from exc
        identity = (st.st_mode, st.st_ino, st.st_size, st.st_mtime_ns)
        known = self.damaged.get(n)
        if known is not None and known.identity == identity:
            return known
        try:
            raw = read_small_file(self.root, rel, MAX_LEDGER_BYTES + 1)
            doc = parse_version(raw)
            if doc.n != n:
                raise LedgerDamage("n", f"says it is version {doc.n}")
        except FileNotFoundError:
            return None
        except NotAChunkFile as exc:
            return self._set_aside(n, exc.strerror or "not a regular file", identity, found)
        except LedgerDamage as exc:
            return self._set_aside(n, str(exc), identity, found)
        except OSError as exc:
            raise LedgerError(f"cannot read ledger version {self.root / rel}: {exc}") from exc
        return doc

    def _set_aside(self, n: int, why: str, identity: tuple[int, int, int, int] | None = None,
                   found: list[Damaged] | None = None) -> Damaged:
        if identity is None:
            with contextlib.suppress(OSError):
                st = lstat_beneath(self.root, version_path(n))
                identity = (st.st_mode, st.st_ino, st.st_size, st.st_mtime_ns)
        damaged = Damaged(n, self.root / version_path(n), why, identity or (0, 0, 0, 0))
        if self.damaged.get(n) != damaged:
            if found is not None:
                found.append(damaged)
            else:
                self._say(damaged, known=False)
        self.damaged[n] = damaged
        return damaged

    def _say(self, damaged: Damaged, known: bool) -> None:
        """One warning per damaged version and process (``_DamageSaid``); ``known``: the
        chain went past it before this chain started (debug level, not counted here)."""
        if not known and _DAMAGE_SAID.first(self.root, damaged):
            logger.warning("NVMe tier: ledger version %s is damaged (%s); it is set aside "
                           "and the ledger goes on at the next version from the last valid "
                           "one.", damaged.path, damaged.why)
        else:
            logger.debug("NVMe tier: ledger version %s is damaged (%s); set aside already.",
                         damaged.path, damaged.why)

    # -- files -----------------------------------------------------------------------

    def _exists(self, n: int) -> bool:
        try:
            lstat_beneath(self.root, version_path(n))
            return True
        except FileNotFoundError:
            return False

    def _listed(self) -> list[int]:
        """Every version number listed, newest first."""
        numbers: list[int] = []
        for entry in scandir_beneath(self.root, LEDGER_DIR):
            if is_epoch_name(entry.name) and entry.is_dir(follow_symlinks=False):
                numbers += [n for e in scandir_beneath(self.root, f"{LEDGER_DIR}/{entry.name}")
                            if (n := version_number(e.name)) is not None]
        return sorted(numbers, reverse=True)

    def _publish(self, doc: LedgerDoc, base: LedgerDoc | None) -> bool:
        """Write ``doc`` as version ``doc.n`` (computed from ``base``); False when that
        number is taken.  What this member's own parser would refuse is never written."""
        raw = doc.to_json()
        try:
            parse_version(raw)
        except LedgerError as exc:
            raise LedgerError(f"{self.root}: this member's next ledger version would be "
                              f"refused ({exc}); not written") from None
        tmp = ledger_temp_path(self.member)
        fd = create_beneath(self.root, tmp, self._file_mode)
        try:
            try:
                view = memoryview(raw)
                while view:
                    view = view[os.write(fd, view):]
                if self._durable:
                    os.fsync(fd)
            finally:
                os.close(fd)
            try:
                link_beneath(self.root, tmp, version_path(doc.n))
            except FileNotFoundError:
                # No epoch directory: a new epoch's, made only while the version it follows
                # exists (so never one that was retired); else this writer fell behind.
                if base is None or epoch_of(base.n) == epoch_of(doc.n) or \
                        not self._exists(base.n):
                    return False
                makedirs_beneath(self.root, epoch_dir(epoch_of(doc.n)), self._dir_mode)
                link_beneath(self.root, tmp, version_path(doc.n))
        except FileExistsError:
            return False
        finally:
            remove_quietly(self.root, tmp)
        doc.digest = digest_of(raw)
        self._remember(doc)
        return True

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
