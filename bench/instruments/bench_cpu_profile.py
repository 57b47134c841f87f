"""Where an L2 adapter's CPU goes, outside the GIL as well: perf samples per GiB by category.

``bench_ceiling.py`` gives CPU-s/GiB of a whole process and the checksum's share of it;
this says where the rest goes: the interpreter, the checksum, libc, and the kernel by the
system call that entered it (``openat2``, ``mkdirat``, ``renameat``, ``unlinkat``,
``close``, ...; ``?<function>`` where the call chain does not name the system call, as for
``pwritev``'s page pinning).  For each system a child holds one adapter, driven by
LMCache's ``bench_store`` / ``bench_load`` exactly as ``bench_ceiling.py`` drives it
(stores delete the keys of the round before last); it prepares and warms up with perf
paused, then runs ``--seconds`` of rounds with ``perf record -F 1999 -g`` sampling every
thread of the process (perf's ``--control`` fifo switches it on and off), and reports the
GiB it moved.  The table is samples per GiB (at 1999 Hz: 1 sample ~ 0.5 ms of CPU), one
column per system, run one after the other (separate processes: the categories move less
between runs than the totals do; compare within a run).

    sudo LMCACHE_TRACK_USAGE=false python bench/instruments/bench_cpu_profile.py /path/on/drive \\
        --systems nvme,fs_native --size-mb 2 --op store

Needs ``perf`` (linux-tools) and root (or ``kernel.perf_event_paranoid`` <= 1) for
kernel call chains.  ``--fill-shards`` makes every shard directory of our namespace before
measuring (a cache that is no longer young).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# bench/ for common.py, the shared helpers
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))
from common import GIB, IN_FLIGHT, TASK_MB, Driver, adapter_params, cpu_seconds  # noqa: E402

HASH_SYMBOLS = ("accumulate_", "scramble_", "xxh3_")
CALL_RE = re.compile(r"(?:__x64_sys_|__do_sys_|do_sys_)(\w+)")


def child(args: argparse.Namespace) -> int:
    """Prepare one adapter with perf paused, then measure ``--seconds`` of rounds."""
    driver = Driver(args.system, args.size_mb, args.dir, adapter_params(args.nvme_params),
                    args.task_mb, args.in_flight)
    driver.prepare(args.op)
    if args.fill_shards:
        fill_shards(args.dir)

    def perf(command: str) -> None:
        with open(args.control, "w") as control:
            control.write(command + "\n")
        with open(args.control + ".ack") as ack:
            ack.readline()

    perf("enable")
    start, cpu0 = time.perf_counter(), cpu_seconds()
    first = driver.index
    while time.perf_counter() - start < args.seconds:
        driver.step(args.op)
    cpu, rounds = cpu_seconds() - cpu0, driver.index - first
    perf("disable")
    gib = rounds * driver.bytes_per_round / GIB
    print(json.dumps({"gib": gib, "cpu_s_per_gib": cpu / gib, "all_ok": driver.ok}))
    driver.close()
    return 0 if driver.ok else 1


def fill_shards(directory: Path) -> None:
    """Every shard directory of each namespace of our roots, as in a cache long in use."""
    from lmcache_nvme_backend.disk.layout import MARKER_NAME, RootLayout

    for marker in directory.glob(f"**/{MARKER_NAME}"):
        layout = RootLayout.of(marker.parent)
        shards = [f"{a:02x}" for a in range(256)]
        if layout.shard_levels == 2:
            shards = [f"{a}/{b:02x}" for a in shards for b in range(256)]
        for ns in layout.iter_namespace_ids():
            ns_dir = layout.namespaces_dir / ns
            mode = ns_dir.stat().st_mode & 0o7777
            for shard in shards:
                os.makedirs(ns_dir / shard, mode=mode, exist_ok=True)


def category(frames: list[str]) -> str:
    """A sample's category from its call chain (leaf first), as ``perf script`` prints it."""
    leaf = frames[0]
    if "[kernel" not in leaf:
        dso = leaf.rsplit("(", 1)[-1].rstrip(")").rsplit("/", 1)[-1]
        if "_native" in dso:
            return "user: checksum" if any(s in leaf for s in HASH_SYMBOLS) else \
                "user: our engine"
        if "libpython" in dso:
            return "user: interpreter"
        return "user: " + dso.split(".so")[0]
    for frame in frames:
        found = CALL_RE.search(frame)
        if found:
            return "kernel: " + found.group(1)
    leaf_function = leaf.split()[1] if len(leaf.split()) > 1 else leaf
    if any("do_syscall_64" in frame for frame in frames):
        return "kernel: ?" + leaf_function
    return "kernel: other"


def categories(data: Path) -> collections.Counter[str]:
    script = subprocess.run(["perf", "script", "-i", str(data), "-F", "comm,tid,ip,sym,dso"],
                            capture_output=True, text=True, check=True).stdout
    counts: collections.Counter[str] = collections.Counter()
    for block in script.split("\n\n"):
        lines = [line.strip() for line in block.strip().splitlines()]
        if len(lines) >= 2:
            counts[category(lines[1:])] += 1
    return counts


def measure(args: argparse.Namespace, system: str, work: Path) -> dict[str, object]:
    control = work / "control"
    for fifo in (control, Path(f"{control}.ack")):
        fifo.unlink(missing_ok=True)
        os.mkfifo(fifo)
    data = work / f"{system}.data"
    command = [sys.executable, __file__, str(args.dir / system), "--child", "--system", system,
               "--size-mb", str(args.size_mb), "--op", args.op, "--seconds", str(args.seconds),
               "--control", str(control), "--nvme-params", args.nvme_params,
               "--task-mb", str(args.task_mb), "--in-flight", str(args.in_flight)]
    if args.fill_shards:
        command.append("--fill-shards")
    out = subprocess.run(["perf", "record", "-q", "-F", "1999", "-g", "-D", "-1", "--control",
                          f"fifo:{control},{control}.ack", "-o", str(data), "--", *command],
                         capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"{system}: {out.stderr[-2000:]}")
    result = json.loads(out.stdout.strip().splitlines()[-1])
    counts = categories(data)
    return {**result, "per_gib": {k: v / result["gib"] for k, v in counts.items()},
            "total_per_gib": sum(counts.values()) / result["gib"]}


def table(results: dict[str, dict[str, object]], rows: int) -> str:
    systems = list(results)
    keys = sorted({k for r in results.values() for k in r["per_gib"]},  # type: ignore[union-attr]
                  key=lambda k: -max(r["per_gib"].get(k, 0.0)  # type: ignore[union-attr]
                                     for r in results.values()))
    lines = ["| category | " + " | ".join(f"`{s}`" for s in systems) + " |",
             "|---|" + "---:|" * len(systems),
             "| CPU-s/GiB (getrusage) | " + " | ".join(
                 f"{results[s]['cpu_s_per_gib']:.4f}" for s in systems) + " |",
             "| samples/GiB, all | " + " | ".join(
                 f"{results[s]['total_per_gib']:.1f}" for s in systems) + " |"]
    for key in keys[:rows]:
        lines.append(f"| {key} | " + " | ".join(
            f"{results[s]['per_gib'].get(key, 0.0):.1f}" for s in systems) + " |")  # type: ignore[union-attr]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("dir", type=Path, help="a directory on the drive (emptied)")
    parser.add_argument("--systems", default="nvme,fs_native")
    parser.add_argument("--size-mb", type=int, default=2)
    parser.add_argument("--op", choices=("store", "load"), default="store")
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--rows", type=int, default=25)
    parser.add_argument("--fill-shards", action="store_true")
    parser.add_argument("--nvme-params", default="{}")
    parser.add_argument("--task-mb", type=int, default=TASK_MB,
                        help=f"MiB of objects per task ({TASK_MB}; at least one object)")
    parser.add_argument("--in-flight", type=int, default=IN_FLIGHT,
                        help=f"tasks in flight per round ({IN_FLIGHT})")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--system", help=argparse.SUPPRESS)
    parser.add_argument("--control", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args)
    if shutil.which("perf") is None:
        raise SystemExit("perf is not installed (linux-tools for this kernel)")
    results = {}
    with tempfile.TemporaryDirectory() as work:
        for system in args.systems.split(","):
            shutil.rmtree(args.dir / system, ignore_errors=True)
            results[system] = measure(args, system, Path(work))
    print(f"{args.dir}, {args.size_mb} MiB {args.op}, {args.seconds:g} s per system, "
          f"perf samples per GiB moved (1999 Hz)")
    print(table(results, args.rows))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
