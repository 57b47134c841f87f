"""``lmcache bench l2`` (LMCache's own) on NVMeL2Adapter, ``fs``, ``fs_native``, and fio.

For each object size and repetition, in interleaved order, every system gets a
fresh directory on the same filesystem (``l2bench/<system>``: one parent for every run,
so that each writes the same region of the drive) and runs:

1. ``lmcache bench l2 --only store`` (a fresh process),
2. ``sync; echo 3 > /proc/sys/vm/drop_caches`` (root; not with ``--no-drop-caches``),
3. ``lmcache bench l2 --only load`` in a fresh process (cold reads; this is
   also the restart-recovery check: every stored key must load),

and fio does a write then, after the same cache drop, a read of the same bytes
with the same block size and the same total queue depth (``--fio-jobs`` files
x ``--fio-iodepth``; by default in_flight x keys per task, spread over jobs the
way the adapters spread it over threads).  The Markdown table holds the median
GB/s of each system and the ratios of ours to each baseline.

    sudo LMCACHE_TRACK_USAGE=false python bench/bench_l2.py /path/on/the/drive

``--baseline REVISION`` adds this package as of a git revision (system ``base``, built
into a temporary directory by ``common.build_baseline``) and a column ours / base: a change
measured in the same run, order rotated with the others.

On a virtual disk, write the filesystem's free space once before measuring (a file of
zeros until the disk is full, then removed) and prefer ``--total-mb 4096``: a block written
for the first time costs more there, and the default run is under half a second of
LMCache's timed loop (``docs/development-log.md``, "A bench image written once").

Every ``lmcache bench l2`` uses ``--l1-align-bytes 4096`` (``fs_native`` with
O_DIRECT fails every store silently without it).  Results (raw runs and the
table) go to ``bench/results/l2-<timestamp>.json`` / ``.md`` (``--results DIR``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from common import (
    adapter_json,
    adapter_params,
    add_drop_caches_option,
    build_baseline,
    drop_caches,
)

ENV = dict(os.environ, LMCACHE_TRACK_USAGE="false", DO_NOT_TRACK="1", LMCACHE_DISABLE_BANNER="1",
           LMCACHE_LOG_LEVEL="WARNING")
SYSTEMS = ("nvme", "fs_native", "fs", "fio")


_SECTION = re.compile(r"^-+ (Store|Load|Lookup) -+$")


def parse_bench(text: str) -> dict[str, dict[str, float]]:
    """{"Store": {"Throughput avg (MB/s)": ..., "Total success": ..., ...}, "Load": ...}."""
    out: dict[str, dict[str, float]] = {}
    section = None
    for line in text.splitlines():
        if m := _SECTION.match(line.strip()):
            section = m.group(1)
            out[section] = {}
            continue
        if section and ":" in line:
            name, _, value = line.rpartition(":")
            try:
                out[section][name.strip()] = float(value.strip())
            except ValueError:
                continue
    return out


def run_l2(system: str, path: Path, only: str, args: argparse.Namespace,
           nvme_params: dict[str, Any]) -> dict[str, Any]:
    cmd = ["lmcache", "bench", "l2", "--l2-adapter", adapter_json(system, path, nvme_params),
           "--only", only, "--num-keys", str(args.num_keys), "--in-flight", str(args.in_flight),
           "--data-size-kb", str(args.size_kb), "--rounds", str(args.rounds),
           "--warmup-rounds", "0", "--l1-align-bytes", "4096"]
    started = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=1800)
    wall = time.perf_counter() - started
    op = "Store" if only == "store" else "Load"
    stats = parse_bench(proc.stdout).get(op, {})
    total = args.rounds * args.in_flight * args.num_keys
    return {"system": system, "op": only, "rc": proc.returncode, "wall_s": wall,
            "gbps": stats.get("Throughput avg (MB/s)", 0.0) / 1000.0,
            "success": int(stats.get("Total success", 0)), "expected": total,
            "stderr_tail": proc.stderr[-1500:] if proc.returncode else ""}


def run_fio(path: Path, rw: str, args: argparse.Namespace) -> dict[str, Any]:
    total = args.rounds * args.in_flight * args.num_keys * args.size_kb * 1024
    jobs = args.fio_jobs
    cmd = ["fio", "--name=l2", f"--directory={path}", f"--rw={rw}", f"--bs={args.size_kb}k",
           f"--size={total // jobs}", f"--numjobs={jobs}", f"--iodepth={args.fio_iodepth}",
           "--ioengine=libaio", "--direct=1", "--group_reporting", "--output-format=json",
           "--end_fsync=0"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        return {"system": "fio", "op": "store" if rw == "write" else "load", "rc": proc.returncode,
                "gbps": 0.0, "stderr_tail": proc.stderr[-1500:]}
    job = json.loads(proc.stdout)["jobs"][0]
    side = job["write" if rw == "write" else "read"]
    return {"system": "fio", "op": "store" if rw == "write" else "load", "rc": 0,
            "gbps": side["bw_bytes"] / 1e9, "success": 1, "expected": 1}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("path", type=Path, help="directory on the filesystem to test")
    parser.add_argument("--sizes-mb", default="2,16", help="object sizes in MiB (default 2,16)")
    parser.add_argument("--repeat", type=int, default=3, help="interleaved repetitions")
    parser.add_argument("--total-mb", type=int, default=1024, help="bytes stored per run")
    parser.add_argument("--in-flight", type=int, default=4, help="tasks in flight per round")
    parser.add_argument("--keys-per-task", type=int, default=0,
                        help="keys per task (default: 16 MiB of objects per task)")
    parser.add_argument("--fio-jobs", type=int, default=4, help="fio jobs (files)")
    parser.add_argument("--nvme-params", default="{}",
                        help="extra adapter_params for NVMeL2Adapter (JSON)")
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--baseline", metavar="REVISION",
                        help="also run this package as of git REVISION (system 'base', built "
                             "into a temporary directory); adds nvme/base")
    parser.add_argument("--results", type=Path, default=Path(__file__).parent / "results",
                        help="where the raw runs and the table go (default bench/results)")
    add_drop_caches_option(parser)
    args = parser.parse_args()
    nvme_params = adapter_params(args.nvme_params)
    systems = args.systems.split(",")
    if args.baseline:
        packages = build_baseline(args.baseline, Path(tempfile.mkdtemp(prefix="l2-baseline-")))
        ENV["PYTHONPATH"] = os.pathsep.join(filter(None, [str(packages),
                                                          ENV.get("PYTHONPATH")]))
        systems.append("base")
    unknown = sorted(set(systems) - set(SYSTEMS) - ({"base"} if args.baseline else set()))
    if unknown:
        parser.error(f"--systems: unknown {', '.join(unknown)}; choose from {', '.join(SYSTEMS)}")
    if "fio" in systems and shutil.which("fio") is None:
        parser.error("--systems includes fio, but no fio is on PATH: install it (e.g. "
                     "apt-get install fio) or leave it out with --systems nvme,fs_native,fs")
    if not args.drop_caches:
        print("page cache kept (--no-drop-caches): loads are not cold", file=sys.stderr)
    elif not drop_caches():
        print("warning: not root, cannot drop the page cache: loads are not cold",
              file=sys.stderr)
    runs: list[dict[str, Any]] = []
    # Every run's directory is made inside one parent kept for the whole bench: ext4 places
    # a new top-level directory in a block group of its own choosing (and a file's blocks
    # near its directory), and on a virtual disk the first writes to a region can be 10 %
    # slower than later ones; inside one parent every system writes into the same region.
    parent = args.path / "l2bench"
    parent.mkdir(parents=True, exist_ok=True)
    for size_mb in (int(s) for s in args.sizes_mb.split(",")):
        args.size_kb = size_mb * 1024
        args.num_keys = args.keys_per_task or max(1, 16 // size_mb)
        per_round = args.in_flight * args.num_keys * size_mb
        args.rounds = max(1, args.total_mb // per_round)
        total_qd = args.in_flight * args.num_keys
        args.fio_iodepth = max(1, total_qd // args.fio_jobs)
        for rep in range(args.repeat):
            order = systems[rep % len(systems):] + systems[: rep % len(systems)]
            for system in order:
                work = parent / system
                shutil.rmtree(work, ignore_errors=True)
                work.mkdir(parents=True)
                try:
                    if system == "fio":
                        store = run_fio(work, "write", args)
                        if args.drop_caches:
                            drop_caches()
                        load = run_fio(work, "read", args)
                    else:
                        store = run_l2(system, work, "store", args, nvme_params)
                        if args.drop_caches:
                            drop_caches()
                        load = run_l2(system, work, "load", args, nvme_params)
                finally:
                    shutil.rmtree(work, ignore_errors=True)
                for r in (store, load):
                    r.update(size_mb=size_mb, rep=rep)
                    runs.append(r)
                    ok = r["rc"] == 0 and r.get("success") == r.get("expected")
                    print(f"{size_mb:>3} MiB rep {rep} {system:>9} {r['op']:>5}: "
                          f"{r['gbps']:.2f} GB/s {'ok' if ok else 'FAILED ' + str(r)}",
                          flush=True)
    shutil.rmtree(parent, ignore_errors=True)
    table = summarize(runs, systems, args)
    print(table)
    out = args.results
    out.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    (out / f"l2-{stamp}.json").write_text(json.dumps({"args": vars(args) | {"path": str(
        args.path)}, "runs": runs}, indent=1, default=str))
    (out / f"l2-{stamp}.md").write_text(table)
    return 0


def summarize(runs: list[dict[str, Any]], systems: list[str], args: argparse.Namespace) -> str:
    bases = ["fs_native", "fs", "fio"] + (["base"] if "base" in systems else [])
    lines = ["| object | op | " + " | ".join(f"{s} GB/s" for s in systems)
             + "".join(f" | nvme/{b}" for b in bases) + " | all keys ok |",
             "|---|---|" + "---|" * (len(systems) + len(bases) + 1)]
    for size_mb in sorted({r["size_mb"] for r in runs}):
        for op in ("store", "load"):
            med: dict[str, float] = {}
            ok = True
            for s in systems:
                vals = [r["gbps"] for r in runs if r["size_mb"] == size_mb and r["op"] == op
                        and r["system"] == s]
                ok &= all(r["rc"] == 0 and r.get("success") == r.get("expected") for r in runs
                          if r["size_mb"] == size_mb and r["op"] == op and r["system"] == s)
                med[s] = statistics.median(vals) if vals else float("nan")

            def ratio(base: str, med: dict[str, float] = med) -> str:
                if "nvme" not in med or base not in med or not med[base]:
                    return "-"
                return f"{med['nvme'] / med[base]:.2f}x"

            lines.append(f"| {size_mb} MiB | {op} | "
                         + " | ".join(f"{med[s]:.2f}" for s in systems)
                         + "".join(f" | {ratio(b)}" for b in bases) + " | "
                         + ("yes" if ok else "NO") + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
