"""NVMeL2Adapter against LMCache's ``fs_native`` and ``fs`` (O_DIRECT), paired, in one process.

The three L2 adapters of ``lmcache server`` are driven by LMCache's own
``lmcache bench l2`` code (``bench_store`` / ``bench_load``), in one process, on
one filesystem.  Each paired round, for every object size:

1. every system, in a rotated order, stores the round's fresh keys (the same
   bytes for all: random, a new seed per round) into its own directory;
2. the page cache is dropped (``sync; echo 3 > /proc/sys/vm/drop_caches``, root);
3. every system, in the same order, loads those keys cold into zeroed buffers,
   and every loaded byte is compared with what was stored;
4. the keys are deleted through each adapter (the directories stay small).

Per round it records GB/s (bytes over LMCache's own round timing) and CPU
seconds per GiB moved (``getrusage`` of the whole process around each
operation: the adapters' worker threads are in it).  It prints, per size and
direction, the median of the per-round ratios ours/baseline with their
spread, and writes everything as JSON.  A noisy disk moves all systems of one
round together; the paired ratio cancels most of it.

    sudo LMCACHE_TRACK_USAGE=false python bench/bench_l2_paired.py /path/on/the/drive

``bench/bench_l2.py`` (separate processes, ``lmcache bench l2`` as a user runs
it, with fio) gives the absolute figures; this one gives the comparison.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from common import (
    GIB,
    Side,
    adapter_params,
    add_drop_caches_option,
    cpu_seconds,
    drop_caches,
    fill_store_buffers,
    open_side,
    round_keys,
)

SYSTEMS = ("nvme", "fs_native", "fs")
BASELINES = ("fs_native", "fs")


def run_op(side: Side, op: str, shape: dict[str, int], round_index: int) -> dict[str, Any]:
    """``inner`` LMCache bench rounds of one operation; for loads every byte is compared."""
    import torch
    from lmcache.cli.commands.bench.l2_adapter_bench.runner import bench_load, bench_store

    seconds = 0.0
    cpu = 0.0
    found = 0
    verified = 0
    for inner in range(shape["inner"]):
        keys = round_keys(shape, round_index, inner)
        bench = bench_store if op == "store" else bench_load
        objs = side.store_objs if op == "store" else side.load_objs
        cpu_before = cpu_seconds()  # the adapter's work only: not the byte comparison below
        result = bench(side.adapter, in_flight=shape["in_flight"], num_keys=shape["num_keys"],
                       data_size=shape["size"], rounds=1, keys_for_round=lambda _r, k=keys: k,
                       objs_for_round=lambda _r, o=objs: o, log=lambda _msg: None)
        cpu += cpu_seconds() - cpu_before
        seconds += sum(result.round_durations) if not result.timed_out_rounds else float("nan")
        found += sum(result.success_counts)
        if op == "load":
            verified += sum(torch.equal(s.raw_data, lo.raw_data)
                            for stored, loaded in zip(side.store_objs, side.load_objs,
                                                      strict=True)
                            for s, lo in zip(stored, loaded, strict=True))
    moved = shape["inner"] * shape["in_flight"] * shape["num_keys"] * shape["size"]
    expected = shape["inner"] * shape["in_flight"] * shape["num_keys"]
    return {"system": side.system, "op": op, "round": round_index, "seconds": seconds,
            "gbps": moved / seconds / 1e9 if seconds else 0.0, "cpu_s": cpu,
            "cpu_s_per_gib": cpu / (moved / GIB), "found": found, "expected": expected,
            "verified": verified if op == "load" else expected}


def delete_round(side: Side, shape: dict[str, int], round_index: int) -> None:
    for inner in range(shape["inner"]):
        side.adapter.delete([k for batch in round_keys(shape, round_index, inner)
                             for k in batch])


def summarize(runs: list[dict[str, Any]], size_mb: int) -> list[str]:
    def per_round(system: str, op: str, metric: str) -> list[float]:
        ordered = sorted((r for r in runs if r["system"] == system and r["op"] == op),
                         key=lambda r: r["round"])
        return [r[metric] for r in ordered]

    def spread(values: list[float]) -> str:
        return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"

    lines = []
    for op in ("store", "load"):
        ours = per_round("nvme", op, "gbps")
        ours_cpu = per_round("nvme", op, "cpu_s_per_gib")
        cells = [f"{size_mb} MiB", op]
        for system in SYSTEMS:
            cells.append(spread(per_round(system, op, "gbps")))
        for base in BASELINES:
            ratios = [a / b for a, b in zip(ours, per_round(base, op, "gbps"), strict=True) if b]
            cells.append(f"**{statistics.median(ratios):.2f}x** "
                         f"({min(ratios):.2f}-{max(ratios):.2f})")
        for system in SYSTEMS:
            cells.append(f"{statistics.median(per_round(system, op, 'cpu_s_per_gib')):.2f}")
        cpu_ratio = [a / b for a, b in zip(ours_cpu, per_round("fs_native", op,
                                                                "cpu_s_per_gib"), strict=True)]
        cells.append(f"{statistics.median(cpu_ratio):.2f}x")
        ok = all(r["found"] == r["expected"] == r["verified"] for r in runs if r["op"] == op)
        cells.append("yes" if ok else "NO")
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def run_sizes_apart(args: argparse.Namespace) -> int:
    """Each object size in a fresh process of its own, then one table.

    O_DIRECT moves data straight between the drive and the adapters' buffers, and a
    queue takes a bounded number of memory segments per request (virtio-blk: 254):
    buffers allocated after an earlier size's were freed get more scattered pages,
    which slowed the second size of one process by up to half.  A process per size
    gives every size freshly allocated buffers.
    """
    import subprocess
    import tempfile

    tables: list[str] = []
    runs: list[dict[str, Any]] = []
    where = ""
    for size in args.sizes_mb.split(","):
        with tempfile.NamedTemporaryFile(suffix=".json") as out:
            cmd = [sys.executable, __file__, str(args.path), "--sizes-mb", size, "--one-size",
                   "--rounds", str(args.rounds), "--round-mb", str(args.round_mb),
                   "--in-flight", str(args.in_flight), "--task-mb", str(args.task_mb),
                   "--nvme-params", args.nvme_params, "--json", out.name,
                   "--drop-caches" if args.drop_caches else "--no-drop-caches"]
            subprocess.run(cmd, check=True)
            doc = json.loads(Path(out.name).read_text())
        runs += doc["runs"]
        tables += doc["table"][2:]
        where = doc["where"]
    table = TABLE_HEAD + tables
    print("\n" + where.replace("paired rounds", "paired rounds, one process per size")
          + "\n" + "\n".join(table))
    if args.json is not None:
        args.json.write_text(json.dumps({"where": where, "args": vars(args) | {
            "path": str(args.path), "json": str(args.json)}, "runs": runs, "table": table},
            indent=1))
    return 0


TABLE_HEAD = ["| object | op | nvme GB/s | fs_native GB/s | fs GB/s | nvme/fs_native | nvme/fs "
              "| CPU-s/GiB nvme | fs_native | fs | CPU nvme/fs_native | all keys found and "
              "verified |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("path", type=Path, help="a directory on the filesystem to test")
    parser.add_argument("--sizes-mb", default="2,16", help="object sizes in MiB (default 2,16)")
    parser.add_argument("--rounds", type=int, default=7, help="paired rounds (default 7)")
    parser.add_argument("--round-mb", type=int, default=256,
                        help="MiB stored and loaded per system per round (default 256)")
    parser.add_argument("--in-flight", type=int, default=4, help="tasks in flight (default 4)")
    parser.add_argument("--task-mb", type=int, default=16,
                        help="MiB of objects per task (default 16, as bench_l2.py)")
    parser.add_argument("--nvme-params", default="{}",
                        help="extra adapter_params for NVMeL2Adapter (JSON)")
    parser.add_argument("--json", type=Path, help="write every run and the table here")
    add_drop_caches_option(parser)
    parser.add_argument("--one-size", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if not args.one_size and "," in args.sizes_mb:
        return run_sizes_apart(args)
    os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")
    os.environ.setdefault("DO_NOT_TRACK", "1")
    os.environ.setdefault("LMCACHE_LOG_LEVEL", "WARNING")
    # LMCache's bench fills and zeroes its buffers with torch; torch's OpenMP threads then
    # spin for a while after each fill (about a quarter of all CPU samples on 2 cores),
    # taking the cores the adapters under test need.  Passive waiting keeps harness work
    # from competing with them; it changes nothing the adapters do.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    nvme_params = adapter_params(args.nvme_params)
    cold = args.drop_caches and drop_caches()
    if args.drop_caches and not cold:
        print("warning: not root, cannot drop the page cache: loads are not cold",
              file=sys.stderr)
    table = list(TABLE_HEAD)
    runs: list[dict[str, Any]] = []
    for size_mb in (int(s) for s in args.sizes_mb.split(",")):
        size = size_mb << 20
        num_keys = max(1, args.task_mb // size_mb)
        per_inner = args.in_flight * num_keys * size_mb
        shape = {"size": size, "num_keys": num_keys, "in_flight": args.in_flight,
                 "inner": max(1, args.round_mb // per_inner)}
        sides = [open_side(system, args.path, shape, nvme_params) for system in SYSTEMS]
        size_runs: list[dict[str, Any]] = []
        try:
            for round_index in range(args.rounds + 1):  # round 0 warms up, unrecorded
                order = sides[round_index % 3:] + sides[: round_index % 3]
                fill_store_buffers(sides, seed=size_mb * 1000 + round_index)
                stores = [run_op(side, "store", shape, round_index) for side in order]
                if cold:
                    drop_caches()
                loads = [run_op(side, "load", shape, round_index) for side in order]
                for side in order:
                    delete_round(side, shape, round_index)
                if round_index == 0:
                    continue
                for r in stores + loads:
                    r["size_mb"] = size_mb
                    size_runs.append(r)
                print(f"{size_mb} MiB round {round_index}: " + ", ".join(
                    f"{r['system']} {r['op']} {r['gbps']:.2f} GB/s"
                    + ("" if r["found"] == r["expected"] == r["verified"] else " FAILED")
                    for r in stores + loads), flush=True)
        finally:
            for side in sides:
                side.adapter.close()
                shutil.rmtree(side.path, ignore_errors=True)
        runs += size_runs
        table += summarize(size_runs, size_mb)
    where = (f"{args.path}, {os.cpu_count()} CPUs, Linux {platform.release()}, "
             f"{args.rounds} paired rounds of {args.round_mb} MiB per system, "
             f"page cache {'dropped' if cold else 'NOT dropped'} before loads")
    print("\n" + where + "\n" + "\n".join(table))
    if args.json is not None:
        args.json.write_text(json.dumps({"where": where, "args": vars(args) | {
            "path": str(args.path), "json": str(args.json)}, "runs": runs,
            "table": table}, indent=1))
    return 0


if __name__ == "__main__":
    started = time.perf_counter()
    status = main()
    print(f"({time.perf_counter() - started:.0f} s)", file=sys.stderr)
    sys.exit(status)
