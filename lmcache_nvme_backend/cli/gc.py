"""``lmcache-nvme gc PATH...``: enforce a byte budget, clear namespaces, remove stale temp files.

Safe while a server uses the directory: gc only unlinks files (a running store sees a miss),
never directories or NAMESPACE files (a writer may be about to use them).  It deletes by
recency alone: pins only a running server knows, so when they matter stop it first.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from ..disk.layout import STALE_TEMP_S
from ..disk.safe_fs import NotAChunkFile
from .cache import CacheFile, CacheRoot, relative, require_namespace, same_file
from .common import (
    GIB,
    CLIError,
    add_namespace_option,
    add_output_options,
    cache_dir_command,
    human_bytes,
    non_negative_float,
    positive_float,
    print_json,
)


def add_parser(sub: Any) -> argparse.ArgumentParser:
    p = cache_dir_command(
        sub, "gc", "enforce a byte budget, clear a namespace, remove stale temp files",
        "Delete chunk files to enforce a byte budget (least recently used first: manifest "
        "recency, else file time), clear whole namespaces, and remove temporary files of dead "
        "writers. Only unlinks files, so it is safe while a server uses the directory (it "
        "sees a miss).",
        "exit status: 0 success, 1 PATH is not a cache directory or a namespace is unknown, "
        "2 usage error",
        paths_help="cache directory (nvme.path); with several paths the budget is split "
                   "evenly, as the store does")
    p.add_argument("--max-size-gb", type=non_negative_float, metavar="GB",
                   help="delete least recently used chunk files until the chunk files take "
                        "at most this many GiB (headers and padding counted)")
    add_namespace_option(p, "delete every chunk file of this namespace")
    p.add_argument("--temp", action="store_true",
                   help="remove temporary files of writers that are dead (same host) or "
                        "older than --temp-age-s")
    p.add_argument("--temp-age-s", type=positive_float, default=STALE_TEMP_S,
                   metavar="S", help="a temp file older than this is stale whoever wrote it "
                                     f"(default {STALE_TEMP_S:.0f})")
    p.add_argument("--purge-quarantine", action="store_true",
                   help="delete the files in <PATH>/quarantine/")
    add_output_options(p, dry_run="deleted")
    p.set_defaults(func=run)
    return p


def _unlink(root: CacheRoot, path: Path, expect: CacheFile | None, dry_run: bool) -> bool:
    """Delete one file of the tree (never through a link); False when it vanished or
    changed since it was listed."""
    if expect is not None and not same_file(path, expect):
        return False
    if dry_run:
        return True
    try:
        root.unlink(path)
    except (FileNotFoundError, NotAChunkFile):
        return False
    return True


def gc_root(root: CacheRoot, args: argparse.Namespace, budget: int | None) -> dict[str, Any]:
    report: dict[str, Any] = {"path": str(root.path), "dry_run": args.dry_run}
    if args.namespace:
        cleared = []
        for name in args.namespace:
            try:
                ns_id = root.resolve_namespace(name)
            except CLIError:  # present on another path only
                cleared.append({"namespace": name, "id": None, "files": 0, "bytes": 0})
                continue
            removed = [f for f in root.scan(ns_id) if _unlink(root, f.path, f, args.dry_run)]
            cleared.append({"namespace": name, "id": ns_id, "files": len(removed),
                            "bytes": sum(f.size for f in removed)})
        report["namespaces"] = cleared
    if args.temp:
        now = time.time()
        removed_tmp, kept, nbytes = 0, 0, 0
        for tmp in root.layout.iter_temp_files():
            try:
                st = tmp.path.lstat()
            except OSError:
                continue
            if tmp.is_stale(args.temp_age_s, now):
                if _unlink(root, tmp.path, None, args.dry_run):
                    removed_tmp += 1
                    nbytes += st.st_size
            else:
                kept += 1
        report["temp_files"] = {"removed": removed_tmp, "bytes": nbytes, "kept_live": kept}
    if args.purge_quarantine:
        done = [(p, s) for p, s in root.quarantined() if _unlink(root, p, None, args.dry_run)]
        report["quarantine"] = {"removed": len(done), "bytes": sum(s for _, s in done)}
    if budget is not None:
        # least recently used first (manifest recency, else file mtime): the order the store
        # rebuilds at restart, so gc evicts what the server would have evicted
        files = sorted(root.scan(), key=lambda f: (f.last_access_ns, f.digest))
        total = sum(f.size for f in files)
        removed_files: list[CacheFile] = []
        for f in files:
            if total <= budget:
                break
            if _unlink(root, f.path, f, args.dry_run):
                removed_files.append(f)
            total -= f.size  # vanished or replaced: gone from the budget's view either way
        report["budget"] = {
            "budget_bytes": budget, "removed": len(removed_files),
            "removed_bytes": sum(f.size for f in removed_files),
            "remaining_bytes": total, "remaining_files": len(files) - len(removed_files),
            "removed_paths": [relative(root, f.path) for f in removed_files[:1000]],
        }
    return report


def print_report(rep: dict[str, Any]) -> None:
    verb = "would remove" if rep["dry_run"] else "removed"
    print(f"{rep['path']}:{' (dry run)' if rep['dry_run'] else ''}")
    for ns in rep.get("namespaces", []):
        where = ns["id"] or "not on this path"
        print(f"  namespace {ns['namespace']} ({where}): {verb} {ns['files']} chunk files "
              f"({human_bytes(ns['bytes'])})")
    if "temp_files" in rep:
        t = rep["temp_files"]
        print(f"  temp files: {verb} {t['removed']} ({human_bytes(t['bytes'])}); "
              f"{t['kept_live']} belong to live writers and were kept")
    if "quarantine" in rep:
        q = rep["quarantine"]
        print(f"  quarantine: {verb} {q['removed']} files ({human_bytes(q['bytes'])})")
    if "budget" in rep:
        b = rep["budget"]
        print(f"  budget {human_bytes(b['budget_bytes'])}: {verb} {b['removed']} least recently "
              f"used chunk files ({human_bytes(b['removed_bytes'])}); "
              f"{human_bytes(b['remaining_bytes'])} in {b['remaining_files']} files remain")


def run(args: argparse.Namespace) -> int:
    if not (args.max_size_gb is not None or args.namespace or args.temp
            or args.purge_quarantine):
        args.parser.error("nothing to do: give --max-size-gb, --namespace, --temp or "
                          "--purge-quarantine")
    roots = [CacheRoot(p) for p in args.paths]
    for name in args.namespace:  # fail on an unknown namespace before deleting anything
        require_namespace(roots, name)
    budget = None if args.max_size_gb is None else int(args.max_size_gb * GIB) // len(roots)
    reports = [gc_root(r, args, budget) for r in roots]
    if args.json:
        print_json({"command": "gc", "roots": reports})
        return 0
    for rep in reports:
        print_report(rep)
    return 0
