"""Shared mode: one budget for every process on a directory, local and on GlusterFS.

Three measurements (docs/benchmarks.md, "Shared mode"), each on a local directory and on
a GlusterFS volume this script creates on this machine (root; Debian's glusterfs-server
and glusterfs-client, installed on first use) and mounts twice, as two nodes:

``budget``   4 processes (local) or 2 + 2 (one pair per mount) write distinct 1 MiB
             chunks as fast as they can for ``--seconds`` with one ``max_size_gb``,
             reading each other's chunks and comparing every byte; the bytes on disk are
             sampled every 0.5 s with one ``statvfs`` of a filesystem that holds nothing
             else (local: an ext4 image on this disk, loop-mounted; GlusterFS: a brick on a
             tmpfs).  With ``--before DIR`` (a checkout of an earlier version) the same run
             with that version's per-process budgets is shown beside it.
``recency``  the hot-set test: A keeps reading 8 chunks while B floods the directory;
             A's misses, by this version and by ``--before``.
``lookups``  shared-mode lookups per second, 200 chunks, hits and misses, through a
             GlusterFS mount and on a local directory (and ``--before``'s), plus
             ``strace -f -c`` of the process that looks up, and the file system calls its
             looking-up thread makes in the loop.
``cold``     ``--chunks`` chunks written through one process, page cache dropped, read
             by a new process (lookup + read, verified): GB/s, local vs GlusterFS (the
             brick on the same disk as the local directory).

    sudo python bench/bench_shared.py budget --seconds 60 --before ../lmcache-nvme-before
    sudo python bench/bench_shared.py recency --before ../lmcache-nvme-before
    sudo python bench/bench_shared.py lookups --before ../lmcache-nvme-before
    sudo python bench/bench_shared.py cold --chunks 512

Each prints a table and, with ``--json FILE``, keeps the figures.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")

from support.gluster import gluster_volume  # noqa: E402
from support.process import child_env, module_command  # noqa: E402
from support.shared_run import (  # noqa: E402
    DiskSampler,
    Member,
    start_member,
    start_writers,
    stop_all,
)

MIB = 1 << 20


@contextlib.contextmanager
def ext4_image(workdir: Path, size: str = "4G") -> Iterator[Path]:
    """An ext4 filesystem of its own on this disk (an image file, loop-mounted)."""
    image, mnt = workdir / "local.ext4", workdir / "local"
    mnt.mkdir(parents=True)
    subprocess.run(["truncate", "-s", size, str(image)], check=True)
    subprocess.run(["mkfs.ext4", "-q", "-F", str(image)], check=True)
    subprocess.run(["mount", "-o", "loop", str(image), str(mnt)], check=True)
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=False)
        image.unlink(missing_ok=True)


def env_for(before: Path | None) -> dict[str, str]:
    """Children import this checkout, or ``before``'s package first."""
    env = child_env(LMCACHE_TRACK_USAGE="false", LMCACHE_LOG_LEVEL="WARNING")
    if before is not None:
        env["PYTHONPATH"] = f"{REPO / 'tests'}{os.pathsep}{before}"
    return env


# -- budget -------------------------------------------------------------------------------


def budget_run(paths: list[Path], real: Path, filesystem: Path, args: argparse.Namespace,
               before: Path | None) -> dict[str, Any]:
    prefixes = [f"w{i}" for i in range(4)]
    budget = args.budget_mb * MIB
    size = args.size_mb * MIB
    go = Path(tempfile.mkdtemp(prefix="bench-shared-go-")) / "go"
    members: list[Member] = []
    try:
        with DiskSampler(real, filesystem=filesystem) as sampler:
            start_writers(members, paths, prefixes, budget, size, args.seconds, go,
                          env_for(before))
            results = [m.result(timeout_s=args.seconds + 600) for m in members]
    finally:
        stop_all(members)
        shutil.rmtree(go.parent, ignore_errors=True)
    return {"package": results[0]["package"],
            "peak_bytes": sampler.peak, "budget_bytes": budget, "samples": len(sampler.samples),
            "peak_over_budget_chunks": (sampler.peak - budget) / (size + 4096),
            "written_mb_s": sum(r["write_mb_s"] for r in results),
            "peer_served": [r["peer_served"] for r in results],
            "wrong": sum(r["wrong"] for r in results),
            "capacity_drops": sum(r["capacity_drops"] for r in results),
            "ledger_conflicts": sum(r.get("ledger_conflicts", 0) for r in results),
            "members": results}


def budget(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    versions = [("shared budget (this version)", None)] + \
        ([("per-process budgets (before)", args.before)] if args.before else [])
    work = Path(tempfile.mkdtemp(prefix="bench-shared-"))
    try:
        if "local" in args.where:
            for label, before in versions:
                with ext4_image(work / label.split()[0]) as fs:
                    out[f"local, 4 processes: {label}"] = budget_run(
                        [fs / "cache"], fs / "cache", fs, args, before)
        if "gluster" in args.where:
            with gluster_volume(work / "gluster", brick_fs="4g") as vol:
                for n, (label, before) in enumerate(versions):
                    sub = f"cache{n}"
                    out[f"GlusterFS, 2 + 2 processes: {label}"] = budget_run(
                        [m / sub for m in vol.mounts], vol.on_brick(vol.mounts[0] / sub),
                        vol.brick.parent, args, before)
                    shutil.rmtree(vol.mounts[0] / sub, ignore_errors=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    for label, r in out.items():
        print(f"{label} [{r['package']}]: peak {r['peak_bytes'] / MIB:.1f} MiB on disk for a "
              f"{r['budget_bytes'] / MIB:.0f} MiB budget ({r['peak_over_budget_chunks']:+.1f} "
              f"chunks) over {r['samples']} samples; {r['written_mb_s']:.0f} MB/s written; "
              f"others' chunks served {r['peer_served']}, {r['wrong']} wrong; "
              f"{r['capacity_drops']} writes dropped")
    return out


# -- recency --------------------------------------------------------------------------------


def recency(args: argparse.Namespace) -> dict[str, Any]:
    """tests/robustness/test_robustness_shared_budget.py's hot-set test, run by this
    version and by ``--before``: A keeps reading 8 chunks while B floods."""
    out: dict[str, Any] = {}
    versions = [("this version", None)] + ([("before", args.before)] if args.before else [])
    size, budget = 256 * 1024, 256 * (256 * 1024 + 4096)
    for label, before in versions:
        cache = Path(tempfile.mkdtemp(prefix="bench-shared-")) / "cache"
        members = []
        try:
            hot = start_member("hot", cache, "A", budget, size, args.seconds + 2,
                               extra=["--hot", "8"], env=env_for(before))
            members.append(hot)
            hot.wait_for("HOT")
            flood = start_member("writer", cache, "B", budget, size, args.seconds,
                                 env=env_for(before))
            members.append(flood)
            b, a = flood.result(), hot.result()
        finally:
            stop_all(members)
            shutil.rmtree(cache.parent, ignore_errors=True)
        out[label] = {"package": a["package"], "hot_reads": a["hot_served"],
                      "hot_misses": a["hot_misses"] + a["hot_read_misses"],
                      "flood_chunks": b["written"], "flood_x_budget": b["written"] *
                      (size + 4096) / budget}
        r = out[label]
        print(f"{label} [{r['package']}]: B flooded {r['flood_x_budget']:.1f}x the budget; A "
              f"read its 8 hot chunks {r['hot_reads']} times, missed {r['hot_misses']}")
    return out


# -- lookups --------------------------------------------------------------------------------


def lookups(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    work = Path(tempfile.mkdtemp(prefix="bench-shared-"))
    versions = [("this version", None)] + ([("before", args.before)] if args.before else [])
    try:
        places = [("local", work / "local")]
        with gluster_volume(work / "gluster") as vol:
            places.append(("GlusterFS", vol.mounts[0] / "cache"))
            for where, cache in places:
                for label, before in versions:
                    r = subprocess.run(module_command("support.lookup_rate", cache / label[:4],
                                                      str(args.lookups)),
                                       env=env_for(before), capture_output=True, text=True,
                                       timeout=900)
                    if r.returncode != 0:
                        raise RuntimeError(r.stderr[-2000:])
                    out[f"{where}, {label}"] = json.loads(r.stdout.splitlines()[-1])
            out["strace"] = strace_lookups(work / "strace", args.lookups)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    for label, r in out.items():
        if label != "strace":
            print(f"{label}: {r['hits_per_s']:,.0f} hits/s, {r['misses_per_s']:,.0f} misses/s")
    print(out["strace"]["summary"])
    return out


def strace_lookups(work: Path, n: int) -> dict[str, Any]:
    """``strace -f -c`` of ``support.lookup_loop`` and the looking-up thread's calls."""
    work.mkdir(parents=True)
    log = work / "trace.log"
    r = subprocess.run(["strace", "-f", "-e", "trace=%file,%desc", "-o", str(log),
                        *module_command("support.lookup_loop", work / "cache", str(n))],
                       env=child_env(), capture_output=True, text=True, timeout=600)
    tid = r.stdout.split()[-2]
    lines = log.read_text().splitlines()
    begin = next(i for i, ln in enumerate(lines) if "lookup-loop-begin" in ln)
    end = next(i for i, ln in enumerate(lines) if "lookup-loop-end" in ln)
    mine = [ln for ln in lines[begin + 1:end] if ln.startswith(f"{tid} ")
            and not re.search(r"mmap\(NULL, .*, -1, 0\)|munmap\(", ln)]
    totals = {}
    for count in (0, n):  # the same process without and with the lookups
        traced = subprocess.run(["strace", "-f", "-c", "-e", "trace=%file,%desc",
                                 *module_command("support.lookup_loop", work / f"c{count}",
                                                 str(count))],
                                env=child_env(), capture_output=True, text=True, timeout=600)
        total = re.search(r"100\.00\s+\S+\s+\S+\s+(\d+)", traced.stderr)
        totals[count] = int(total.group(1)) if total else -1
    summary = (f"strace: {n} lookups; file system calls of the looking-up thread inside the "
               f"loop: {len(mine)}; strace -f -c of the whole process (start, 200 writes, "
               f"background threads): {totals[0]} calls with 0 lookups, {totals[n]} with {n}")
    return {"lookups": n, "loop_thread_calls": len(mine), "process_calls": totals,
            "summary": summary}


# -- cold reads ------------------------------------------------------------------------------


def cold(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    work = Path(tempfile.mkdtemp(prefix="bench-shared-", dir=args.dir))
    try:
        with gluster_volume(work / "gluster") as vol:
            for where, cache in (("local", work / "local"),
                                 ("GlusterFS", vol.mounts[0] / "cache")):
                runs = []
                for _ in range(args.repeat):
                    shutil.rmtree(cache, ignore_errors=True)
                    run_child("write", cache, args.chunks)
                    subprocess.run(["sync"], check=True)
                    Path("/proc/sys/vm/drop_caches").write_text("3\n")
                    runs.append(run_child("read", cache, args.chunks))
                out[where] = runs
    finally:
        shutil.rmtree(work, ignore_errors=True)
    for where, runs in out.items():
        rates = sorted(r["gb_s"] for r in runs)
        print(f"{where}: cold reads {rates[len(rates) // 2]:.2f} GB/s median of {len(rates)} "
              f"(runs: {', '.join(f'{x:.2f}' for x in rates)}), "
              f"{runs[0]['chunks']} x {runs[0]['size'] // MIB} MiB, {runs[0]['wrong']} wrong")
    return out


def run_child(role: str, cache: Path, chunks: int) -> dict[str, Any]:
    r = subprocess.run(module_command("support.cold_reads", role, cache, str(chunks)),
                       env=child_env(), capture_output=True, text=True, timeout=900)
    if r.returncode != 0:
        raise RuntimeError(r.stderr[-2000:])
    return json.loads(r.stdout.splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="what", required=True)
    b = sub.add_parser("budget")
    b.add_argument("--seconds", type=float, default=60.0)
    b.add_argument("--budget-mb", type=int, default=64)
    b.add_argument("--size-mb", type=int, default=1)
    b.add_argument("--where", default="local,gluster")
    b.add_argument("--before", type=Path, help="a checkout of an earlier version")
    b.set_defaults(func=budget)
    rc = sub.add_parser("recency")
    rc.add_argument("--seconds", type=float, default=6.0)
    rc.add_argument("--before", type=Path, help="a checkout of an earlier version")
    rc.set_defaults(func=recency)
    lk = sub.add_parser("lookups")
    lk.add_argument("--lookups", type=int, default=200_000)
    lk.add_argument("--before", type=Path, help="a checkout of an earlier version")
    lk.set_defaults(func=lookups)
    c = sub.add_parser("cold")
    c.add_argument("--chunks", type=int, default=512)
    c.add_argument("--repeat", type=int, default=3)
    c.add_argument("--dir", default=None, help="where the local cache and the brick go")
    c.set_defaults(func=cold)
    for p in (b, rc, lk, c):
        p.add_argument("--json", type=Path)
    args = parser.parse_args()
    for name in ("json", "before"):
        if getattr(args, name, None) is not None:
            setattr(args, name, getattr(args, name).absolute())
    os.chdir(tempfile.gettempdir())  # children import their package from PYTHONPATH, not here
    started = time.time()
    result = args.func(args)
    if args.json:
        args.json.write_text(json.dumps({"what": args.what, "started": started,
                                         "result": result}, indent=1, default=str))


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
