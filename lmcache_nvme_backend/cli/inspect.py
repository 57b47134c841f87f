"""``lmcache-nvme inspect PATH...``: entries and bytes per namespace, and an age histogram.

Read-only.  Age is the time since last access as the manifest records it, else since the
file was written.  In shared mode also the budget and each member's share and state, from
the newest ledger and the leases: a member on this host is alive while its process is, one
on another host if its lease counter moved over ``HEARTBEAT_S`` (only then does it wait).
"""

from __future__ import annotations

import argparse
import contextlib
import time
from pathlib import Path
from typing import Any

from ..disk.coordination import LEDGER_DIR, host_tag, member_host_pid
from ..disk.layout import TEMP_INFIX
from ..disk.manifest import MANIFEST_NAME
from ..store.shared.leases import HEARTBEAT_S, Lease, on_this_host_and_gone, read_leases
from ..store.shared.ledger import LIVE, LedgerChain, LedgerError
from .cache import CacheRoot, namespace_row, relative
from .common import add_output_options, cache_dir_command, human_age, human_bytes, print_json

AGE_BUCKETS: tuple[tuple[str, float], ...] = (
    ("< 1 min", 60.0), ("< 1 hour", 3600.0), ("< 1 day", 86400.0), ("< 1 week", 7 * 86400.0),
    ("< 30 days", 30 * 86400.0), (">= 30 days", float("inf")))
READER = "inspect-0-00000000"  # the ledger chain needs a member id; this one never writes
#: A member's report field and the lease attribute it comes from (None without a lease).
LEASE_FIELDS = (("owned_bytes", "owned_bytes"), ("owned_chunks", "owned_chunks"),
                ("in_flight_bytes", "reserved"), ("newest_read_age_s", "newest_read_age_s"),
                ("oldest_read_age_s", "oldest_read_age_s"), ("lease_seq", "seq"))


def add_parser(sub: Any) -> argparse.ArgumentParser:
    p = cache_dir_command(
        sub, "inspect", "list and size a cache directory",
        "Entries and bytes on disk per namespace (model and build), temporary and quarantined "
        "files, a histogram of time since last access, and for a directory in shared mode "
        "its budget, each member's share and the dead members. Read-only; safe while a "
        "server uses the directory.",
        "exit status: 0 success, 1 PATH is not a cache directory, 2 usage error")
    add_output_options(p)
    p.set_defaults(func=run)
    return p


def inspect_root(root: CacheRoot, now_ns: int) -> dict[str, Any]:
    """The report for one root, as a JSON-ready dict."""
    files = root.scan()
    names = root.layout.namespace_names()
    per_ns: dict[str, dict[str, Any]] = {ns_id: _namespace(ns_id, name)
                                         for ns_id, name in names.items()}
    buckets: list[dict[str, Any]] = [
        {"bucket": label, "max_age_s": None if limit == float("inf") else limit,
         "files": 0, "bytes": 0} for label, limit in AGE_BUCKETS]
    ages = []
    for f in files:
        ns = per_ns.get(f.ns_id) or per_ns.setdefault(f.ns_id, _namespace(f.ns_id, ""))
        ns["files"] += 1
        ns["bytes"] += f.size
        age_s = max(0.0, (now_ns - f.last_access_ns) / 1e9)
        ages.append(age_s)
        for bucket, (_, limit) in zip(buckets, AGE_BUCKETS, strict=True):
            if age_s < limit:
                bucket["files"] += 1
                bucket["bytes"] += f.size
                break
    temp = list(root.layout.iter_temp_files())
    temp_bytes = 0
    for t in temp:
        with contextlib.suppress(OSError):
            temp_bytes += t.path.lstat().st_size
    quarantined = root.quarantined()
    manifest_path = root.layout.index_dir / MANIFEST_NAME
    try:
        manifest_age = time.time() - manifest_path.lstat().st_mtime
    except OSError:
        manifest_age = None
    return {
        "path": str(root.path),
        "files": len(files),
        "bytes": sum(f.size for f in files),
        "namespaces": sorted(per_ns.values(), key=lambda n: (-n["bytes"], n["id"])),
        "age_histogram": buckets,
        "oldest_access_age_s": max(ages, default=None),
        "newest_access_age_s": min(ages, default=None),
        "files_in_manifest": sum(f.in_manifest for f in files),
        "manifest": {"present": manifest_path.is_file(),
                     "entries": len(root.manifest(len(files))), "age_s": manifest_age},
        "temp_files": {"count": len(temp), "bytes": temp_bytes,
                       "pattern": f"<digest>.kv{TEMP_INFIX}<host>-<pid>-<thread>"},
        "quarantine": {"count": len(quarantined), "bytes": sum(s for _, s in quarantined)},
        "special_entries": [{"path": relative(root, p), "kind": kind}
                            for p, kind in root.layout.iter_special_entries()],
        "shared": shared_report(root.path),
    }


def _namespace(ns_id: str, name: str) -> dict[str, Any]:
    return {**namespace_row(ns_id, name), "files": 0, "bytes": 0}


def shared_report(root: Path) -> dict[str, Any] | None:
    """The shared-budget part of ``inspect``'s report (None: not a shared directory)."""
    if not (root / LEDGER_DIR).is_dir():
        return None
    chain = LedgerChain(root, READER, 0o600, 0o700)
    try:
        doc = chain.latest()
    except (LedgerError, OSError) as exc:
        return {"error": f"cannot read the ledger: {exc}"}
    if doc is None:
        return None
    leases = read_leases(root)
    moving, again = _moving(root, leases, [m for m, a in doc.accounts.items() if a.state == LIVE])
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
            "budget_configured": account.budget or None, "share_bytes": account.cap,
            **{key: getattr(lease, attr) if lease else None for key, attr in LEASE_FIELDS},
            "read_only": lease.read_only if lease else False,
        })
    return {"budget_bytes": doc.effective_budget(), "budget_set_by": doc.budget_by,
            "ledger_version": doc.n, "ledger_format": doc.format,
            "orphan_bytes": doc.orphans_cap, "free_bytes": doc.pool(),
            "held_bytes": sum(a.cap for a in doc.accounts.values()), "members": members,
            "damaged_versions": [{"version": d.n, "path": str(d.path), "why": d.why}
                                 for d in sorted(chain.damaged.values(), key=lambda d: d.n)],
            "janitor_stalled": _stalled_janitors(leases, again, doc.live())}


def _stalled_janitors(before: dict[str, Lease], after: dict[str, Lease],
                      live: list[str]) -> list[str]:
    """Live members whose lease moved while ``inspect`` waited but whose janitor thread
    did not (``leases.py``): the others pass them over as janitor."""
    return sorted(m for m in live if m in before and m in after
                  and after[m].seq != before[m].seq
                  and after[m].janitor_rounds == before[m].janitor_rounds)


def _moving(root: Path, leases: dict[str, Lease], live: list[str]
            ) -> tuple[dict[str, bool], dict[str, Lease]]:
    """Whether each live account's member is alive (see the module doc), and the leases
    as read after the wait (the first reading when there was none)."""
    alive = {m: not on_this_host_and_gone(m) for m in live}
    remote = [m for m in live if member_host_pid(m)[0] != host_tag()]
    again: dict[str, Lease] = leases
    if any(m in leases for m in remote):
        time.sleep(2.5 * HEARTBEAT_S)
        again = read_leases(root)
    for member in remote:
        alive[member] = member in leases and member in again and \
            again[member].seq != leases[member].seq
    return alive, again


def print_shared(rep: dict[str, Any]) -> None:
    if "error" in rep:
        print(f"  shared budget: {rep['error']}")
        return
    print(f"  shared budget: {human_bytes(rep['budget_bytes'])} for every member (set by "
          f"{rep['budget_set_by']}); members hold {human_bytes(rep['held_bytes'])}, "
          f"orphans {human_bytes(rep['orphan_bytes'])}, free {human_bytes(rep['free_bytes'])}")
    for d in rep["damaged_versions"]:
        print(f"  ledger version {d['version']} set aside: {d['path']}: {d['why']}")
    for member in rep["janitor_stalled"]:
        print(f"  member {member}: lease moves but its janitor thread does not (passed over "
              "as janitor)")
    print(f"  {'member':<34} {'state':<26} {'owns':>10} {'share':>10} {'in flight':>10}  "
          "reads (newest / oldest)")
    for m in rep["members"]:
        owns = "-" if m["owned_bytes"] is None else human_bytes(m["owned_bytes"])
        flight = "-" if m["in_flight_bytes"] is None else human_bytes(m["in_flight_bytes"])
        print(f"  {m['member']:<34} {m['state']:<26} {owns:>10} "
              f"{human_bytes(m['share_bytes']):>10} {flight:>10}  "
              f"{human_age(m['newest_read_age_s'], 1)} / {human_age(m['oldest_read_age_s'], 1)}")


def print_report(rep: dict[str, Any]) -> None:
    print(f"{rep['path']}: {rep['files']} chunk files, {human_bytes(rep['bytes'])} on disk "
          f"(headers and padding included), {len(rep['namespaces'])} namespace(s)")
    m = rep["manifest"]
    if m["present"]:
        print(f"  manifest: {m['entries']} entries, saved {human_age(m['age_s'])} ago; "
              f"{rep['files_in_manifest']} of the files are in it")
    else:
        print("  manifest: none yet (recency falls back to file times)")
    if rep["namespaces"]:
        width = max(5, *(len(n["model"]) for n in rep["namespaces"]))
        bwidth = max(5, *(len(n["build"] or "") for n in rep["namespaces"]))
        print(f"  {'model':<{width}}  {'build':<{bwidth}}  {'id':<16}  {'files':>8}  "
              f"{'bytes':>10}")
        for n in rep["namespaces"]:
            print(f"  {n['model'] or '?':<{width}}  {n['build'] or '-':<{bwidth}}  "
                  f"{n['id']:<16}  {n['files']:>8}  {human_bytes(n['bytes']):>10}")
    if rep["shared"] is not None:
        print_shared(rep["shared"])
    print(f"  temporary files: {rep['temp_files']['count']} "
          f"({human_bytes(rep['temp_files']['bytes'])}); quarantined files: "
          f"{rep['quarantine']['count']} ({human_bytes(rep['quarantine']['bytes'])})")
    for sp in rep["special_entries"]:
        print(f"  skipped {sp['path']}: a {sp['kind']} at a chunk file's name (never followed "
              "or read)")
    print(f"  time since last access (newest {human_age(rep['newest_access_age_s'])}, oldest "
          f"{human_age(rep['oldest_access_age_s'])}):")
    most = max([b["files"] for b in rep["age_histogram"]] + [1])
    for b in rep["age_histogram"]:
        bar = "#" * round(30 * b["files"] / most)
        print(f"    {b['bucket']:<10} {b['files']:>8} files {human_bytes(b['bytes']):>10}  {bar}")


def run(args: argparse.Namespace) -> int:
    roots = [CacheRoot(p) for p in args.paths]
    now = time.time_ns()
    reports = [inspect_root(r, now) for r in roots]
    if args.json:
        print_json({"command": "inspect", "roots": reports,
                    "total": {"files": sum(r["files"] for r in reports),
                              "bytes": sum(r["bytes"] for r in reports)}})
        return 0
    for i, rep in enumerate(reports):
        if i:
            print()
        print_report(rep)
    if len(reports) > 1:
        print(f"\ntotal: {sum(r['files'] for r in reports)} chunk files, "
              f"{human_bytes(sum(r['bytes'] for r in reports))}")
    return 0
