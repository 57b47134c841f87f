"""The native I/O engine alone: what writing and reading chunks costs, without LMCache.

LMCache's benches (``bench_l2.py``, ``bench_ceiling.py``) measure the tier as users run it,
and their spread between runs (10 % and more on a virtual disk) hides a change of a few
per cent in the engine.  This drives ``io.native.NativeEngine`` directly, as the store does
(its default thread counts and task size), in batches of 4 chunks of ``--sizes-mb`` MiB:

* **write**: each batch writes 4 new chunk files (O_DIRECT, exact mode, renamed into
  place); the files of the batch before last are removed through the engine, as the store
  removes them (a revision that keeps removed files for reuse, ``nvme.recycle_mb``, does
  so here too), so the directory stays small;
* **read**: a working set of ``--files`` chunks is written first (not measured), then read
  4 at a time, in turn, into page-aligned buffers; every read must verify (status OK).

Each measurement is a fresh child process running batches for ``--seconds``; it reports
GiB/s, user and system CPU seconds per GiB (``getrusage``: every thread), the checksum's
share (the engine's own sampled timing), CPU outside the checksum, voluntary and
involuntary context switches per chunk, the chunks the engine moved while hashing
(``overlapped_writes`` / ``overlapped_reads`` per chunk) and the chunks written into a
removed file kept for reuse (``recycled_writes`` per chunk).

``--baseline REVISION`` builds this package as of a git revision (as ``bench_ceiling.py``
does) and runs it as system ``base`` in alternating children, order rotated each
repetition; the table gives each figure's median and the median of its per-repetition
ratio to ``base``, with the range::

    LMCACHE_TRACK_USAGE=false python bench/bench_native_io.py /path/on/the/drive \\
        --baseline HEAD~1 --sizes-mb 2,16 --repeat 5

Needs the native extension (a C compiler at install) and a filesystem with O_DIRECT.
"""

from __future__ import annotations

import argparse
import importlib
import json
import mmap
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from bench_ceiling import NVME_PACKAGES, build_baseline  # this directory

BATCH = 4  # chunks per batch: LMCache's benches keep 4 tasks in flight
MIB = 1 << 20
FIGURES = ("gibps", "user_s_per_gib", "sys_s_per_gib", "hash_s_per_gib",
           "cpu_outside_hash_s_per_gib", "voluntary_switches_per_chunk",
           "involuntary_switches_per_chunk", "overlapped_per_chunk", "recycled_per_chunk")


# -- child ---------------------------------------------------------------------------------


class EngineDriver:
    """One package's native engine on ``root``, chunks of ``size`` bytes."""

    def __init__(self, package: str, root: Path, size: int) -> None:
        self.native = importlib.import_module(package + ".io.native")
        config = importlib.import_module(package + ".config")
        if not self.native.available():
            raise SystemExit(f"{package}: {self.native.unavailable_reason()}")
        settings = config.NVMeSettings.from_params({"path": str(root), "max_size_gb": 64})
        recycling: dict[str, Any] = {}
        if hasattr(settings, "recycle_bytes"):  # removed files kept for reuse, as the store does
            layout = importlib.import_module(package + ".disk.layout")
            recycling = {"recycle_bytes": settings.recycle_bytes,
                         "recycle_suffix": layout.temp_name("", layout.RETIRED_FILES_WRITER)}
        self.engine = self.native.NativeEngine(settings.io_threads, 4, settings.task_size_bytes,
                                               **recycling)
        self.root = root
        self.root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
        self.size = size
        self.meta = json.dumps({"nbytes": size}).encode()
        self.sources = [self._buffer(seed) for seed in range(BATCH)]
        self.dests = [mmap.mmap(-1, size) for _ in range(BATCH)]
        self.done = threading.Event()
        self.batch: Any = None

    def _buffer(self, seed: int) -> mmap.mmap:
        buf = mmap.mmap(-1, self.size)  # page aligned, as LMCache's aligned L1 buffers
        block = bytes((seed * 31 + i) % 251 for i in range(4096))
        for off in range(0, self.size, 4096):
            buf[off:off + 4096] = block[: min(4096, self.size - off)]
        return buf

    def _finished(self, batch: Any) -> None:
        self.batch = batch
        self.done.set()

    def write(self, names: list[str]) -> None:
        items = [(self.root_fd, "d", f"w{i}.tmp", name, memoryview(self.sources[i]),
                  name.encode(), b"bench", self.meta, None, True, 0o644, 0o755, 0, ())
                 for i, name in enumerate(names)]
        self.done.clear()
        self.engine.submit_write(items, self._finished)
        self.done.wait()
        if self.batch.statuses != bytes([self.native.OK] * len(items)):
            raise SystemExit(f"a write failed: {self.batch.details}")

    def remove(self, names: list[str]) -> None:
        """Remove chunks as the store does: through the engine (which may keep the files
        for the next writes of their size)."""
        errors = self.engine.unlink([(self.root_fd, f"d/{name}") for name in names])
        if any(errors):
            raise SystemExit(f"a removal failed: {errors}")

    def read(self, names: list[str]) -> None:
        items = [(self.root_fd, f"d/{name}", memoryview(self.dests[i]), self.size, True,
                  name.encode(), self.meta) for i, name in enumerate(names)]
        statuses, details = self.engine.read(items)
        if statuses != bytes([self.native.OK] * len(items)):
            raise SystemExit(f"a read did not verify: {details}")

    def close(self) -> None:
        self.engine.close()
        os.close(self.root_fd)


def measure(package: str, op: str, root: Path, size_mb: int, seconds: float,
            files: int) -> dict[str, Any]:
    """Batches of ``op`` for ``seconds`` after two warm-up batches; the figures."""
    driver = EngineDriver(package, root, size_mb * MIB)
    (root / "d").mkdir(exist_ok=True)
    names = [f"c{i}.kv" for i in range(files)]
    if op == "read":
        for start in range(0, files, BATCH):
            driver.write(names[start:start + BATCH])
    batches = 0

    def step() -> None:
        nonlocal batches
        if op == "write":
            driver.write([f"b{batches}-{i}.kv" for i in range(BATCH)])
            if batches >= 2:
                driver.remove([f"b{batches - 2}-{i}.kv" for i in range(BATCH)])
        else:
            start = batches * BATCH % files
            driver.read(names[start:start + BATCH])
        batches += 1

    for _ in range(2):
        step()
    counters0, usage0 = driver.native.counters(), resource.getrusage(resource.RUSAGE_SELF)
    measured_from, started = batches, time.perf_counter()
    while time.perf_counter() - started < seconds:
        step()
    wall = time.perf_counter() - started
    counters1, usage1 = driver.native.counters(), resource.getrusage(resource.RUSAGE_SELF)
    driver.close()
    chunks = (batches - measured_from) * BATCH
    gib = chunks * size_mb / 1024
    user, system = usage1.ru_utime - usage0.ru_utime, usage1.ru_stime - usage0.ru_stime
    hashed = driver.native.hash_cpu_ns(counters0, counters1) / 1e9
    overlapped = f"overlapped_{op}s"
    return {"gibps": gib / wall, "user_s_per_gib": user / gib, "sys_s_per_gib": system / gib,
            "hash_s_per_gib": hashed / gib,
            "cpu_outside_hash_s_per_gib": (user + system - hashed) / gib,
            "voluntary_switches_per_chunk": (usage1.ru_nvcsw - usage0.ru_nvcsw) / chunks,
            "involuntary_switches_per_chunk": (usage1.ru_nivcsw - usage0.ru_nivcsw) / chunks,
            "overlapped_per_chunk": (counters1.get(overlapped, 0)
                                     - counters0.get(overlapped, 0)) / chunks,
            "recycled_per_chunk": (counters1.get("recycled_writes", 0)
                                   - counters0.get("recycled_writes", 0)) / chunks,
            "chunks": chunks}


# -- parent --------------------------------------------------------------------------------


def run_child(system: str, op: str, path: Path, size_mb: int, args: argparse.Namespace,
              env: dict[str, str]) -> dict[str, Any]:
    work = path / f"native-io-{system}"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    try:
        cmd = [sys.executable, __file__, "--child", NVME_PACKAGES[system], op, str(work),
               str(size_mb), str(args.seconds), str(args.files)]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600,
                              cwd=Path(__file__).parent)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if proc.returncode != 0:
        raise SystemExit(f"{system} {op} {size_mb} MiB failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def table(runs: list[dict[str, Any]], systems: list[str]) -> str:
    head = "| object | op | system | " + " | ".join(FIGURES) + " |"
    lines = [head, "|---|---|---|" + "---|" * len(FIGURES)]
    for size_mb in sorted({r["size_mb"] for r in runs}):
        for op in sorted({r["op"] for r in runs}, reverse=True):
            for system in systems:
                mine = [r for r in runs if (r["size_mb"], r["op"], r["system"]) ==
                        (size_mb, op, system)]
                cells = []
                for figure in FIGURES:
                    value = statistics.median(r[figure] for r in mine)
                    cell = f"{value:.4g}"
                    if system != "base" and "base" in systems:
                        base = {r["rep"]: r[figure] for r in runs if r["system"] == "base"
                                and (r["size_mb"], r["op"]) == (size_mb, op)}
                        ratios = [r[figure] / base[r["rep"]] for r in mine
                                  if base.get(r["rep"])]
                        if ratios:
                            cell += (f", {statistics.median(ratios):.2f}x "
                                     f"[{min(ratios):.2f}–{max(ratios):.2f}]")
                    cells.append(cell)
                lines.append(f"| {size_mb} MiB | {op} | {system} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        package, op, root, size, seconds, files = sys.argv[2:8]
        print(json.dumps(measure(package, op, Path(root), int(size), float(seconds),
                                 int(files))))
        return 0
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("path", type=Path, help="a directory on the filesystem to test")
    parser.add_argument("--sizes-mb", default="2,16", help="chunk sizes in MiB (2,16)")
    parser.add_argument("--ops", default="write,read")
    parser.add_argument("--seconds", type=float, default=5.0, help="per child (5)")
    parser.add_argument("--repeat", type=int, default=5, help="children per system (5)")
    parser.add_argument("--files", type=int, default=32, help="the read working set (32)")
    parser.add_argument("--baseline", metavar="REVISION",
                        help="also run this package as of git REVISION (system 'base')")
    parser.add_argument("--json", type=Path, help="write every run and the table here")
    args = parser.parse_args()
    if args.files % BATCH:
        parser.error(f"--files: a multiple of {BATCH}")
    env = dict(os.environ, LMCACHE_TRACK_USAGE="false")
    systems = ["nvme"]
    if args.baseline:
        packages = build_baseline(args.baseline, Path(tempfile.mkdtemp(prefix="native-io-")))
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(packages),
                                                          env.get("PYTHONPATH")]))
        systems.append("base")
    runs: list[dict[str, Any]] = []
    for size_mb in (int(s) for s in args.sizes_mb.split(",")):
        for op in args.ops.split(","):
            for rep in range(args.repeat):
                for system in systems[rep % len(systems):] + systems[: rep % len(systems)]:
                    result = run_child(system, op, args.path, size_mb, args, env)
                    result.update(system=system, op=op, size_mb=size_mb, rep=rep)
                    runs.append(result)
                    print(f"{size_mb:>3} MiB {op:>5} rep {rep} {system:>4}: "
                          f"{result['gibps']:.2f} GiB/s, CPU outside the checksum "
                          f"{result['cpu_outside_hash_s_per_gib']:.4f} s/GiB", flush=True)
    out = table(runs, systems)
    print(f"\n{args.path}, {os.cpu_count()} CPUs, {args.repeat} children of "
          f"{args.seconds:.0f} s per system, size and op"
          + (f"; base is revision {args.baseline}" if args.baseline else ""))
    print(out)
    if args.json:
        args.json.write_text(json.dumps({"runs": runs, "table": out}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
