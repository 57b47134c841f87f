"""The faults the shared-mode fault harness (``support.fault_harness``) injects into a
running cache directory, each drawn from a seeded ``random.Random``.

A fault is a context manager: entering it does the damage and yields what it did (one
line for the log); leaving it undoes what can be undone (a filler file removed, a brick
resumed, a foreign lease no longer renewed).  Damage to files stays: the members must
heal it.  Planted files in ``shared/evicting/`` hold no bytes (empty files, FIFOs, links),
so that what the budget bounds is the members' doing alone.  A fault that finds nothing
to damage (no journal yet, a version number taken by a member meanwhile) raises
``NothingToDamage``; the harness counts it as skipped.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import stat
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from lmcache_nvme_backend.disk.coordination import (
    EVICTING_DIR,
    LEDGER_DIR,
    MEMBERS_DIR,
    evicting_name,
    is_epoch_name,
    lease_member,
    parse_journal_name,
    version_number,
)
from lmcache_nvme_backend.store.shared.leases import Lease

from .ledger_files import ledger_damage, newest, plant, renewed_lease, successor
from .mounts import fill_bytes


class NothingToDamage(Exception):
    """The fault found nothing of its kind to damage right now."""


@dataclass(frozen=True)
class Target:
    """What the faults reach: the cache directory (through a mount where there is one),
    the budget, a directory on the cache's filesystem outside the cache for a filler
    (None: no full-filesystem fault), the brick's process (None: not GlusterFS), and a
    file outside the cache that planted links point at (it must never change)."""

    cache: Path
    budget: int
    filler_dir: Path | None
    brick_pid: int | None
    outside: Path


Fault = Callable[[Target, random.Random], contextlib.AbstractContextManager[str]]


def _member_files(target: Target, keep: Callable[[str], object]) -> list[Path]:
    try:
        names = sorted(os.listdir(target.cache / MEMBERS_DIR))
    except OSError:
        names = []
    return [target.cache / MEMBERS_DIR / name for name in names if keep(name)]


def _regular(paths: list[Path]) -> list[Path]:
    kept = []
    for path in paths:
        with contextlib.suppress(OSError):
            if stat.S_ISREG(os.lstat(path).st_mode):
                kept.append(path)
    return kept


def _pick(rng: random.Random, paths: list[Path], what: str) -> Path:
    if not paths:
        raise NothingToDamage(f"no {what}")
    return rng.choice(paths)


def _fake_member(rng: random.Random, host: str = "faulthost") -> str:
    return f"{host}-{rng.randrange(2, 1 << 22)}-{rng.getrandbits(32):08x}"


@contextlib.contextmanager
def damaged_ledger_version(target: Target, rng: random.Random) -> Iterator[str]:
    """The next ledger version, damaged one of the ways members must set aside, or a valid
    copy five numbers ahead (a gap).  Where the members took that number meanwhile (on a
    busy GlusterFS directory making the damaged copy takes a second or two, some 50
    versions) it goes further ahead each time: damaged and a gap, met by the members a
    few seconds later."""
    kinds = {**ledger_damage(target.budget),
             "five ahead": lambda root, n: plant(root, *successor(root, ahead=5))}
    kind = rng.choice(sorted(kinds))
    n = newest(target.cache)[1]
    for ahead in range(8):  # members may take the number first: a little further on
        try:
            path = kinds[kind](target.cache, n)
            break
        except FileExistsError:  # taken while the damage was made (seconds on GlusterFS)
            n = _listed_versions(target.cache) + 1 + 64 * ahead
            time.sleep(rng.uniform(0.0, 0.05))
    else:
        raise NothingToDamage(f"every next version number was taken meanwhile (last {n})")
    yield f"ledger version {path.name}: {kind}" + (f" ({ahead} tries)" if ahead else "")


def _listed_versions(cache: Path) -> int:
    """The largest version number the ledger's directories list."""
    ledger = cache / LEDGER_DIR
    numbers = [version_number(name) for epoch in os.listdir(ledger) if is_epoch_name(epoch)
               for name in os.listdir(ledger / epoch)]
    return max((n for n in numbers if n is not None), default=0)


@contextlib.contextmanager
def journal_junk(target: Target, rng: random.Random) -> Iterator[str]:
    """Junk bytes (some with line ends) appended to a member's journal."""
    path = _pick(rng, _regular(_member_files(target, parse_journal_name)), "journal")
    junk = rng.randbytes(rng.randrange(1, 4096))
    if rng.random() < 0.5:
        junk = junk.replace(b"\n", b"") + b"\n"
    with open(path, "ab") as f:
        f.write(junk)
    yield f"journal {path.name}: {len(junk)} junk bytes appended"


@contextlib.contextmanager
def journal_truncated(target: Target, rng: random.Random) -> Iterator[str]:
    """A member's journal cut short (anywhere, possibly mid-line or to nothing)."""
    path = _pick(rng, _regular(_member_files(target, parse_journal_name)), "journal")
    size = path.stat().st_size
    keep = rng.randrange(0, size + 1)
    os.truncate(path, keep)
    yield f"journal {path.name}: truncated from {size} to {keep} bytes"


@contextlib.contextmanager
def lease_damaged(target: Target, rng: random.Random) -> Iterator[str]:
    """A member's lease overwritten in place: junk, cut short, or emptied (its member
    writes the next one within a second)."""
    path = _pick(rng, _regular(_member_files(target, lease_member)), "lease")
    raw = path.read_bytes()
    how = rng.choice(["junk", "truncated", "empty"])
    new = {"junk": rng.randbytes(64), "truncated": raw[: len(raw) // 2], "empty": b""}[how]
    with open(path, "r+b") as f:
        f.truncate(0)
        f.write(new)
    yield f"lease {path.name}: {how}"


@contextlib.contextmanager
def foreign_lease(target: Target, rng: random.Random) -> Iterator[str]:
    """A lease of a member no one runs (another host), with fields of odd values: a
    budget of one byte or a thousand budgets, a negative count."""
    member = _fake_member(rng)
    lease = Lease(member, host="faulthost", pid=rng.randrange(2, 1 << 22),
                  seq=rng.choice([0, -5, 1 << 40]),
                  budget=rng.choice([1, target.budget * 1000, -target.budget]),
                  ledger_format=rng.choice([0, 1, 2, 99]))
    path = target.cache / MEMBERS_DIR / f"{member}.lease"
    path.write_bytes(lease.to_json())
    yield f"lease {path.name}: foreign, budget {lease.budget}, format {lease.ledger_format}"


@contextlib.contextmanager
def special_member_file(target: Target, rng: random.Random) -> Iterator[str]:
    """A FIFO, directory or link (to a file outside the cache) at a journal's or a
    lease's name of a member no one runs."""
    member = _fake_member(rng)
    name = rng.choice([f"{member}.1.journal", f"{member}.lease"])
    path = target.cache / MEMBERS_DIR / name
    kind = rng.choice(["fifo", "directory", "symlink"])
    _make_special(path, kind, target.outside)
    yield f"{path.name}: a {kind}"


@contextlib.contextmanager
def planted_claim(target: Target, rng: random.Random) -> Iterator[str]:
    """An eviction claim no member made: in a live member's or an unknown member's
    evicting directory, naming a chunk of any size (up to 1 TiB), as an empty file, a
    FIFO or a link to a file outside the cache."""
    evicting = target.cache / EVICTING_DIR
    claimers = [p.name for p in _member_files(target, lease_member)]
    claimer = rng.choice([*(name[: -len(".lease")] for name in claimers),
                          _fake_member(rng)])
    size = rng.choice([4096, 1 << 20, 1 << 40])
    name = evicting_name(f"{rng.getrandbits(128):032x}", size, rng.choice(["", claimer]))
    path = evicting / claimer / name
    path.parent.mkdir(parents=True, exist_ok=True)
    kind = rng.choice(["empty", "fifo", "symlink"])
    _make_special(path, kind, target.outside)
    yield f"claim {claimer}/{name}: {kind}"


def _make_special(path: Path, kind: str, outside: Path) -> None:
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "directory":
        path.mkdir()
    elif kind == "symlink":
        path.symlink_to(outside)
    else:
        path.touch()


@contextlib.contextmanager
def older_member(target: Target, rng: random.Random) -> Iterator[str]:
    """A member of an older version of the package (ledger format 1) running on another
    host for as long as the fault is held (its lease renewed; afterwards it is silent,
    as a crashed one is)."""
    member = _fake_member(rng, "oldnode")
    with renewed_lease(target.cache, member, 1, target.budget):
        yield f"older member {member} (ledger format 1) running"


@contextlib.contextmanager
def full_filesystem(target: Target, rng: random.Random) -> Iterator[str]:
    """The cache's filesystem filled to its last block (by a file outside the cache)
    for as long as the fault is held."""
    if target.filler_dir is None:
        raise NothingToDamage("no filesystem of its own to fill")
    filler = fill_bytes(target.filler_dir)
    try:
        yield f"filesystem full ({filler.stat().st_size >> 20} MiB filler)"
    finally:
        filler.unlink()


@contextlib.contextmanager
def stopped_brick(target: Target, rng: random.Random) -> Iterator[str]:
    """The GlusterFS brick process stopped (``SIGSTOP``) for as long as the fault is held;
    always resumed."""
    if target.brick_pid is None:
        raise NothingToDamage("no brick")
    os.kill(target.brick_pid, signal.SIGSTOP)
    try:
        yield f"brick {target.brick_pid} stopped"
    finally:
        os.kill(target.brick_pid, signal.SIGCONT)


# Faults that last only as long as they are held (the others are done when entered).
HELD: dict[str, Fault] = {"older member": older_member, "full filesystem": full_filesystem,
                          "stopped brick": stopped_brick}
DAMAGE: dict[str, Fault] = {
    "ledger version": damaged_ledger_version,
    "journal junk": journal_junk,
    "journal truncated": journal_truncated,
    "lease damaged": lease_damaged,
    "foreign lease": foreign_lease,
    "special member file": special_member_file,
    "planted claim": planted_claim,
}
FAULTS: dict[str, Fault] = {**DAMAGE, **HELD}
