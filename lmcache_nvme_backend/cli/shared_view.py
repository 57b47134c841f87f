"""What ``lmcache-nvme inspect`` shows of a shared directory: its one budget, each member's
share and recency, dead and departed members (docs/deployment.md).

Read-only: the newest ledger version and the members' leases.  Liveness is judged the
way members judge it, without comparing clocks: a member on this host is alive while its
process is; a member on another host is read twice ``HEARTBEAT_S`` apart (only then does
``inspect`` wait), alive if its lease counter moved.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from ..disk.coordination import LEDGER_DIR, host_tag, member_host_pid
from ..store.shared.leases import HEARTBEAT_S, Lease, on_this_host_and_gone, read_leases
from ..store.shared.ledger import LIVE, LedgerChain, LedgerError
from .common import human_age, human_bytes

READER = "inspect-0-00000000"  # the ledger chain needs a member id; this one never writes


def shared_report(root: Path) -> dict[str, Any] | None:
    """The shared-budget part of ``inspect``'s report (None: not a shared directory)."""
    if not (root / LEDGER_DIR).is_dir():
        return None
    try:
        doc = LedgerChain(root, READER, 0o600, 0o700).latest()
    except (LedgerError, OSError) as exc:
        return {"error": f"cannot read the ledger: {exc}"}
    if doc is None:
        return None
    leases = read_leases(root)
    moving = _moving(root, leases, [m for m, a in doc.accounts.items() if a.state == LIVE])
    members = []
    for member, account in sorted(doc.accounts.items()):
        lease = leases.get(member)
        state = account.state
        if state == LIVE and not moving.get(member, True):
            state = "dead (process gone)" if on_this_host_and_gone(member) else \
                "dead (lease not renewed)"
        host, pid = member_host_pid(member)
        members.append({
            "member": member, "host": lease.host if lease else host,
            "pid": lease.pid if lease else pid, "state": state,
            "budget_configured": account.budget or None,
            "share_bytes": account.cap,
            "owned_bytes": lease.owned_bytes if lease else None,
            "owned_chunks": lease.owned_chunks if lease else None,
            "in_flight_bytes": lease.reserved if lease else None,
            "newest_read_age_s": lease.newest_read_age_s if lease else None,
            "oldest_read_age_s": lease.oldest_read_age_s if lease else None,
            "lease_seq": lease.seq if lease else None,
            "read_only": lease.read_only if lease else False,
        })
    return {"budget_bytes": doc.budget, "budget_set_by": doc.budget_by,
            "ledger_version": doc.n, "orphan_bytes": doc.orphans_cap, "free_bytes": doc.pool(),
            "held_bytes": sum(a.cap for a in doc.accounts.values()), "members": members}


def _moving(root: Path, leases: dict[str, Lease], live: list[str]) -> dict[str, bool]:
    """Whether each live account's member is alive (see the module doc)."""
    alive = {m: not on_this_host_and_gone(m) for m in live}
    remote = [m for m in live if member_host_pid(m)[0] != host_tag()]
    again: dict[str, Lease] = {}
    if any(m in leases for m in remote):
        time.sleep(2.5 * HEARTBEAT_S)
        again = read_leases(root)
    for member in remote:
        alive[member] = member in leases and member in again and \
            again[member].seq != leases[member].seq
    return alive


def print_shared(rep: dict[str, Any]) -> None:
    if "error" in rep:
        print(f"  shared budget: {rep['error']}")
        return
    print(f"  shared budget: {human_bytes(rep['budget_bytes'])} for every member (set by "
          f"{rep['budget_set_by']}); members hold {human_bytes(rep['held_bytes'])}, "
          f"orphans {human_bytes(rep['orphan_bytes'])}, free {human_bytes(rep['free_bytes'])}")
    print(f"  {'member':<34} {'state':<26} {'owns':>10} {'share':>10} {'in flight':>10}  "
          "reads (newest / oldest)")
    for m in rep["members"]:
        owns = "-" if m["owned_bytes"] is None else human_bytes(m["owned_bytes"])
        flight = "-" if m["in_flight_bytes"] is None else human_bytes(m["in_flight_bytes"])
        print(f"  {m['member']:<34} {m['state']:<26} {owns:>10} "
              f"{human_bytes(m['share_bytes']):>10} {flight:>10}  "
              f"{human_age(m['newest_read_age_s'], 1)} / {human_age(m['oldest_read_age_s'], 1)}")
