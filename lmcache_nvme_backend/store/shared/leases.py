"""Leases of the members of a shared root, and who is alive, judged without shared clocks.

Each member rewrites ``shared/members/<member>.lease`` (temp + rename) every
``HEARTBEAT_S`` with a counter that goes up by one each time.  Another member judges it
by its *own* monotonic clock: a lease whose counter has not moved for ``LEASE_S`` is
dead, so clocks of different nodes never need to agree (only to tick at about the same
rate).  A member on this host whose process is gone is dead at once.

A member also stops writing by itself once it has failed to renew its lease for
``LEASE_S / 2`` (a stalled or disconnected member fences itself off before anyone can
take its share over).

A lease also carries ``janitor_rounds``, which the member's janitor thread moves on every
round whether or not it is the janitor.  A member whose lease moves while that counter
has not for ``JANITOR_STALL_S`` (a janitor stuck in a round, a lease rewritten by a stuck
or foreign process, a member of a version without the counter) is *stalled*: it stays a
member, but the others pass it over when they choose the janitor.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from ...disk.coordination import (
    MEMBERS_DIR,
    host_tag,
    lease_member,
    lease_path,
    lease_temp_path,
    member_host_pid,
)
from ...disk.layout import pid_alive, this_host
from ...disk.safe_fs import (
    create_beneath,
    read_small_file,
    remove_quietly,
    rename_beneath,
    scandir_beneath,
)

logger = logging.getLogger(__name__)

HEARTBEAT_S = 1.0
LEASE_S = 10.0
JANITOR_STALL_S = 5.0
MAX_LEASE_BYTES = 64 << 10
_JSON_TYPES: dict[str, tuple[type, ...]] = {"int": (int,), "str": (str,), "bool": (bool,),
                                            "float | None": (int, float)}


@dataclass
class Lease:
    """What a member says about itself (``lmcache-nvme inspect`` shows it)."""

    member: str
    host: str = ""  # the host name as temp file names carry it
    pid: int = 0
    seq: int = 0
    budget: int = 0  # bytes this member was configured with for this root
    chunk_format: int = 0
    ledger_format: int = 0
    owned_bytes: int = 0  # bytes of chunk files this member owns
    owned_chunks: int = 0
    cap: int = 0
    reserved: int = 0
    read_only: bool = False
    # time since the most and least recent read of a chunk it owns (durations: no clock
    # is compared across nodes)
    newest_read_age_s: float | None = None
    oldest_read_age_s: float | None = None
    janitor_rounds: int = 0  # moved by the member's janitor thread on every round

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> Lease | None:
        """A lease as written, or None for anything else (fields of the wrong type are
        dropped, unknown ones ignored)."""
        try:
            doc = json.loads(raw)
        except (ValueError, RecursionError):
            return None
        if not isinstance(doc, dict) or not isinstance(doc.get("member"), str):
            return None
        kept: dict[str, Any] = {
            f.name: value for f in fields(cls)
            if type(value := doc.get(f.name)) in _JSON_TYPES.get(str(f.type), ())}
        return cls(**kept)


def new_lease(member: str) -> Lease:
    return Lease(member, host=this_host(), pid=os.getpid())


def write_lease(root: Path, lease: Lease, file_mode: int) -> None:
    """Replace this member's lease in one rename (readers see the old or the new one)."""
    tmp = lease_temp_path(lease.member)
    remove_quietly(root, tmp)  # left by a write that failed half-way
    fd = create_beneath(root, tmp, file_mode)
    try:
        os.write(fd, lease.to_json())
    finally:
        os.close(fd)
    try:
        rename_beneath(root, tmp, lease_path(lease.member))
    except BaseException:
        remove_quietly(root, tmp)
        raise


def read_leases(root: Path) -> dict[str, Lease]:
    """Every readable lease of the root, by member."""
    leases: dict[str, Lease] = {}
    for entry in scandir_beneath(root, MEMBERS_DIR):
        member = lease_member(entry.name)
        if member is None:
            continue
        with contextlib.suppress(OSError, ValueError):
            lease = Lease.from_json(read_small_file(root, f"{MEMBERS_DIR}/{entry.name}",
                                                    MAX_LEASE_BYTES))
            if lease is not None and lease.member == member:
                leases[member] = lease
    return leases


def remove_member_files(root: Path, member: str) -> None:
    """A departed or dead member's lease (and its temp)."""
    remove_quietly(root, lease_path(member))
    remove_quietly(root, lease_temp_path(member))


def on_this_host_and_gone(member: str) -> bool:
    """Whether ``member`` ran on this host and its process no longer exists."""
    host, pid = member_host_pid(member)
    return host == host_tag() and not pid_alive(pid)


class Liveness:
    """Which members are alive, by this process's monotonic clock (see the module doc)."""

    def __init__(self, lease_s: float = LEASE_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.lease_s = lease_s
        self._clock = clock
        self._seen: dict[str, tuple[int, float]] = {}  # member -> (seq, when it moved)
        self._rounds: dict[str, tuple[int, float]] = {}  # member -> (janitor_rounds, when)

    def observe(self, leases: dict[str, Lease]) -> None:
        """Note each lease's counters; a counter that moved renews the member."""
        now = self._clock()
        for member, lease in leases.items():
            for seen, value in ((self._seen, lease.seq), (self._rounds, lease.janitor_rounds)):
                last = seen.get(member)
                if last is None or last[0] != value:
                    seen[member] = (value, now)

    def janitor_stalled(self, member: str) -> bool:
        """Whether ``member``'s janitor thread has not moved for ``JANITOR_STALL_S`` while
        its lease was seen (see the module doc)."""
        rounds = self._rounds.get(member)
        return rounds is not None and self._clock() - rounds[1] >= JANITOR_STALL_S

    def alive(self, member: str) -> bool:
        """Alive: its process exists (this host) and its lease moved within ``lease_s``
        (a member never seen is given ``lease_s`` from the first time it is asked about)."""
        if on_this_host_and_gone(member):
            return False
        now = self._clock()
        seen = self._seen.setdefault(member, (-1, now))
        return now - seen[1] < self.lease_s

    def silent_for(self, member: str) -> float | None:
        """Seconds since the member's lease last moved (None: never seen)."""
        seen = self._seen.get(member)
        return None if seen is None else self._clock() - seen[1]

    def forget(self, member: str) -> None:
        self._seen.pop(member, None)
        self._rounds.pop(member, None)
