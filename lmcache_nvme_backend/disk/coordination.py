"""Names of the files through which the members of a shared cache directory coordinate.

With ``nvme.shared: true`` the processes (*members*) using a cache root keep its one
budget through files below ``<root>/shared/`` (no server)::

    shared/ledger/<epoch>/<n>.json        the ledger: version n of the budget's accounts
    shared/ledger/.tmp-<member>-<rand>    a version being written (then linked as <n>.json)
    shared/members/<member>.lease         heartbeat of a live member (rewritten by rename)
    shared/members/<member>.<gen>.journal what a member published, deleted and read
    shared/evicting/<member>/<digest>.<size>.<owner>  a victim claimed, not yet deleted

Paths are relative to the root.  A member id, ``<host>-<pid>-<8 hex>``, is unique per
process start.
"""

from __future__ import annotations

import os
import re
import secrets

from .layout import DIGEST_RE, this_host

SHARED_DIR = "shared"
LEDGER_DIR = f"{SHARED_DIR}/ledger"
MEMBERS_DIR = f"{SHARED_DIR}/members"
EVICTING_DIR = f"{SHARED_DIR}/evicting"
# Versions of the ledger per epoch directory; old epochs are removed whole, oldest first.
EPOCH_VERSIONS = 256
ORPHANS = "~"  # the owner of chunks no live member counts (in evicting names)

MEMBER_RE = re.compile(r"^[A-Za-z0-9_]{1,32}-[0-9]{1,10}-[0-9a-f]{8}$")
_JOURNAL_RE = re.compile(r"^(?P<mid>[A-Za-z0-9_]{1,32}-[0-9]{1,10}-[0-9a-f]{8})\."
                         r"(?P<gen>[0-9]{1,10})\.journal$")
_VERSION_RE = re.compile(r"^(?P<n>[0-9]{16})\.json$")
_EPOCH_RE = re.compile(r"^[0-9]{8}$")


_HOST_TAG = re.sub(r"[^A-Za-z0-9_]", "_", this_host())[:32]


def host_tag() -> str:
    """This host as member ids name it."""
    return _HOST_TAG


def new_member_id() -> str:
    """A member id for this process: host tag, process id, 32 random bits."""
    return f"{_HOST_TAG}-{os.getpid()}-{secrets.token_hex(4)}"


def member_host_pid(member: str) -> tuple[str, int]:
    """The host tag and process id a member id names."""
    host, pid, _ = member.rsplit("-", 2)
    return host, int(pid)


def epoch_of(n: int) -> int:
    return n // EPOCH_VERSIONS


def epoch_dir(epoch: int) -> str:
    return f"{LEDGER_DIR}/{epoch:08d}"


def version_path(n: int) -> str:
    return f"{epoch_dir(epoch_of(n))}/{n:016d}.json"


def version_number(name: str) -> int | None:
    """The version a ledger file name holds (None: not a version file)."""
    m = _VERSION_RE.match(name)
    return int(m["n"]) if m else None


def is_epoch_name(name: str) -> bool:
    return bool(_EPOCH_RE.match(name))


def ledger_temp_path(member: str) -> str:
    return f"{LEDGER_DIR}/.tmp-{member}-{secrets.token_hex(4)}"


def lease_path(member: str) -> str:
    return f"{MEMBERS_DIR}/{member}.lease"


def lease_temp_path(member: str) -> str:
    return f"{MEMBERS_DIR}/.{member}.lease.tmp"


def journal_path(member: str, gen: int) -> str:
    return f"{MEMBERS_DIR}/{member}.{gen}.journal"


def parse_journal_name(name: str) -> tuple[str, int] | None:
    """(member, generation) of a journal file name; None for any other name."""
    m = _JOURNAL_RE.match(name)
    return (m["mid"], int(m["gen"])) if m else None


def lease_member(name: str) -> str | None:
    """The member whose lease file this name is (None: not a lease)."""
    if not name.endswith(".lease"):
        return None
    member = name[: -len(".lease")]
    return member if MEMBER_RE.match(member) else None


def evicting_dir(member: str) -> str:
    return f"{EVICTING_DIR}/{member}"


def evicting_name(digest: str, size: int, owner: str) -> str:
    """The name a claimed victim takes in its claimer's evicting directory."""
    return f"{digest}.{size}.{owner or ORPHANS}"


def parse_evicting_name(name: str) -> tuple[str, int, str] | None:
    """(digest, size, owner) of an evicting name (owner ``""``: no live member counted it)."""
    parts = name.split(".")
    if len(parts) != 3 or not DIGEST_RE.match(parts[0]) or not parts[1].isdigit():
        return None
    owner = "" if parts[2] == ORPHANS else parts[2]
    if owner and not MEMBER_RE.match(owner):
        return None
    return parts[0], int(parts[1]), owner
