"""One version of a shared root's ledger: its fields, and its parser for untrusted bytes.

Every member can write every file of a shared directory, so a version is parsed as input
from a stranger: the file is bounded (``MAX_LEDGER_BYTES``), so are the counts of accounts
and of entries per account, and every number is an integer in its range (no NaN, no
negative cap beyond ``-budget``, no negative orphans).  What fails is a ``LedgerDamage``
naming the field; the chain (``ledger.py``) sets that version aside.  A member runs its
own versions through the same parser before it publishes them.

The budget a version grants is ``effective_budget``: the smallest of the recorded budget
and the budgets its live members are configured with, so no file can raise the budget
beyond what the running members were given (docs/deployment.md, "Members that disagree").
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field

from ...disk.coordination import MEMBER_RE, parse_evicting_name
from ...disk.layout import DIGEST_RE

# 1: the first shared mode; 2: versions name their predecessor (``prev``), so a copy
# planted ahead of the chain is refused, and member caps are clamped at 0 in the pool.
LEDGER_FORMAT = 2
LIVE, DEAD, DEPARTED = "live", "dead", "departed"
_STATES = (LIVE, DEAD, DEPARTED)
MAX_LEDGER_BYTES = 16 << 20
MAX_ACCOUNTS = 4096
MAX_ENTRIES = 65536  # ``freed`` or ``evicting`` entries of one account
MAX_BYTES = 1 << 60  # any byte count: budget, cap, orphans
MAX_CHUNK_BYTES = 1 << 36  # the size of one chunk file named in a ``freed`` entry
MAX_NUMBER = 10**16 - 1  # version numbers, sequence numbers, generations
_PREV_RE = re.compile(r"^[0-9a-f]{32}$")


class LedgerError(Exception):
    """The ledger cannot be read or changed (damaged, unwritable, or always contended)."""


class LedgerDamage(LedgerError):
    """A version that is not one this code would write: which field, and why."""

    def __init__(self, field_name: str, why: str) -> None:
        super().__init__(f"{field_name}: {why}")
        self.field = field_name


class NewerLedger(LedgerError):
    """A version of a newer format than this code writes (a newer member's)."""

    def __init__(self, found: int, prev: str) -> None:
        super().__init__(f"format {found}, this version of the package writes format "
                         f"{LEDGER_FORMAT}")
        self.found = found
        self.prev = prev
        self.n = 0  # the version's number, once known


def digest_of(raw: bytes) -> str:
    """The name of a version's bytes, as its successor's ``prev`` gives it."""
    return hashlib.blake2b(raw, digest_size=16).hexdigest()


@dataclass
class Account:
    """One member's share of the budget."""

    cap: int
    state: str = LIVE
    budget: int = 0  # the budget this member was configured with (the effective budget)
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
    prev: str = ""  # ``digest_of`` the version this one was computed from ("" for none)
    digest: str = field(default="", compare=False)  # of this version's bytes (not stored)

    def effective_budget(self, limit: int | None = None) -> int:
        """The budget this version grants: the smallest of the recorded one, those its
        live members are configured with, and ``limit`` (the asking member's own)."""
        budgets = [a.budget for a in self.accounts.values() if a.state == LIVE and a.budget]
        return min([self.budget, *budgets, *([limit] if limit else [])])

    def pool(self, limit: int | None = None) -> int:
        """Bytes of the budget no account holds (negative: over-committed).  A negative
        cap frees nothing for others: it is counted as 0."""
        return self.effective_budget(limit) - self.orphans_cap - \
            sum(max(0, a.cap) for a in self.accounts.values())

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
        return parse_version(self.to_json())

    def to_json(self) -> bytes:
        accounts = {
            m: {"cap": a.cap, "state": a.state, "budget": a.budget,
                "chunk_format": a.chunk_format, "freed": [list(f) for f in a.freed],
                "next": a.next_seq, "evicting": a.evicting}
            for m, a in sorted(self.accounts.items())}
        return json.dumps({"format": self.format, "n": self.n, "prev": self.prev,
                           "budget": self.budget, "budget_by": self.budget_by,
                           "orphans": {"cap": self.orphans_cap, "gen": self.orphans_gen},
                           "accounts": accounts}, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> LedgerDoc:
        return parse_version(raw)


def parse_version(raw: bytes) -> LedgerDoc:
    """A version's bytes as a ``LedgerDoc`` (``LedgerDamage`` naming the field that fails,
    ``NewerLedger`` for a newer format)."""
    if len(raw) > MAX_LEDGER_BYTES:
        raise LedgerDamage("size", f"{len(raw)} bytes, more than {MAX_LEDGER_BYTES}")
    try:
        top = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise LedgerDamage("json", f"not JSON ({str(exc)[:80]})") from None
    doc = _obj(top, "the version")
    fmt = _int(doc.get("format"), "format", 1, MAX_NUMBER)
    prev = doc.get("prev", "")
    if fmt > LEDGER_FORMAT:
        raise NewerLedger(fmt, prev if isinstance(prev, str) else "")
    n = _int(doc.get("n"), "n", 1, MAX_NUMBER)
    if fmt >= 2 and not (isinstance(prev, str) and (_PREV_RE.match(prev) or prev == "")):
        raise LedgerDamage("prev", "not the digest of a version")
    budget = _int(doc.get("budget"), "budget", 0, MAX_BYTES)
    budget_by = doc.get("budget_by")
    if not isinstance(budget_by, str) or len(budget_by) > 64:
        raise LedgerDamage("budget_by", "not a member id")
    orphans = _obj(doc.get("orphans"), "orphans")
    raw_accounts = _obj(doc.get("accounts"), "accounts")
    if len(raw_accounts) > MAX_ACCOUNTS:
        raise LedgerDamage("accounts", f"{len(raw_accounts)} accounts, more than "
                           f"{MAX_ACCOUNTS}")
    accounts = {member: _account(member, a, budget) for member, a in raw_accounts.items()}
    return LedgerDoc(n, budget, budget_by, accounts,
                     _int(orphans.get("cap"), "orphans.cap", 0, MAX_BYTES),
                     _int(orphans.get("gen"), "orphans.gen", 0, MAX_NUMBER), fmt,
                     prev if isinstance(prev, str) else "", digest_of(raw))


def _account(member: str, raw: object, budget: int) -> Account:
    where = f"accounts.{member[:40]!r}"
    if not MEMBER_RE.match(member):
        raise LedgerDamage(where, "not a member id")
    a = _obj(raw, where)
    state = a.get("state")
    if state not in _STATES:
        raise LedgerDamage(f"{where}.state", f"not one of {', '.join(_STATES)}")
    # a cap goes below 0 only by a few chunks (taken while a trim is due)
    cap = _int(a.get("cap"), f"{where}.cap", -budget, MAX_BYTES)
    next_seq = _int(a.get("next"), f"{where}.next", 1, MAX_NUMBER)
    freed = [_freed(f, f"{where}.freed", next_seq) for f in _list(a.get("freed"),
                                                                  f"{where}.freed")]
    if any(x[0] >= y[0] for x, y in zip(freed, freed[1:], strict=False)):
        raise LedgerDamage(f"{where}.freed", "sequence numbers not increasing")
    evicting = [name for name in _list(a.get("evicting"), f"{where}.evicting")
                if isinstance(name, str) and parse_evicting_name(name)]
    if len(evicting) != len(_list(a.get("evicting"), f"{where}.evicting")):
        raise LedgerDamage(f"{where}.evicting", "not the name of a claimed victim")
    return Account(cap, state, _int(a.get("budget"), f"{where}.budget", 0, MAX_BYTES),
                   _int(a.get("chunk_format"), f"{where}.chunk_format", 0, 1 << 16),
                   freed, next_seq, evicting)


def _freed(raw: object, where: str, next_seq: int) -> tuple[int, str, int]:
    if not isinstance(raw, list) or len(raw) != 3:
        raise LedgerDamage(where, "not a [seq, digest, size] entry")
    seq, digest, size = raw
    if not isinstance(digest, str) or not DIGEST_RE.match(digest):
        raise LedgerDamage(where, "not a chunk digest")
    return (_int(seq, f"{where}.seq", 1, next_seq - 1), digest,
            _int(size, f"{where}.size", 0, MAX_CHUNK_BYTES))


def _obj(value: object, where: str) -> dict[str, object]:
    if not isinstance(value, dict):
        raise LedgerDamage(where, "not an object")
    return value


def _list(value: object, where: str) -> list[object]:
    if not isinstance(value, list):
        raise LedgerDamage(where, "not a list")
    if len(value) > MAX_ENTRIES:
        raise LedgerDamage(where, f"{len(value)} entries, more than {MAX_ENTRIES}")
    return value


def _int(value: object, where: str, low: int, high: int) -> int:
    """An integer in ``[low, high]`` (a float, NaN, a string or a bool is damage)."""
    if type(value) is not int:
        raise LedgerDamage(where, f"not an integer: {str(value)[:40]}")
    if not low <= value <= high:
        raise LedgerDamage(where, f"{value} is outside [{low}, {high}]")
    return value
