"""How many GiB/s one process can move through an L2 adapter: GIL-held and CPU time per GiB.

On a big server (32-128 cores, several NVMe drives) one ``lmcache server`` process moves
every chunk through one Python interpreter, so what bounds it is how long each GiB holds
the GIL (ceiling = 1 / GIL-s per GiB), not how many cores there are.  This measures it for
``NVMeL2Adapter``, LMCache's ``fs_native`` (C++ workers) and ``fs`` (Python), all with
O_DIRECT, driven by LMCache's own ``bench_store`` / ``bench_load`` in steady state.

Each measurement is a fresh child process holding one adapter:

* **store**: every round stores fresh keys (4 tasks in flight, 16 MiB of objects per
  task, or one object per task when objects are larger); the keys of the round before the
  last are deleted through the adapter, so the directory stays small;
* **load**: a working set is stored first (not measured), then loaded over and over into
  other L1 buffers; every byte loaded in the first round of each pass over the working
  set is compared with what was stored.

After two warm-up rounds the child runs ``--seconds`` of rounds and reports:

* GiB/s (bytes over the loop's wall time);
* CPU-s/GiB: ``getrusage`` of the whole child (every thread: the adapter's, LMCache's,
  native workers'); with our native engine also the checksum's share, timed by the engine
  itself (thread CPU clock around one hash call in eight, scaled to all bytes hashed);
  and by thread from the kernel's run time of each (``--paired`` prints that table too:
  which CPU is the bench's thread, the adapter's Python threads, its native workers);
* GIL-s/GiB and GIL acquisitions per chunk, exactly: the child runs with ``gilmeter.so``
  preloaded (``gilmeter.c``, beside this script), which sees every take and drop of the GIL
  under its mutex, per thread.  "main" is the bench's own thread (LMCache's bench loop,
  which also calls the adapter's ``submit_*``); the rest is the adapter's threads.  GIL
  CPU-s/GiB is the holders' own CPU time while they held it: on this 2-vCPU machine a
  holder is often descheduled while holding (wall time counts that); with a core for every
  thread, as on a big server, the two agree;
* GIL-releasing calls per chunk made under the adapter's own frames, from a separate
  traced child (``sys.setprofile`` in every thread, a few rounds): blocking system calls of
  ``os``/``select``/``time``, ``Condition.wait``, hashing, the ``openat2`` ctypes call, plus
  the exact count our native engine keeps of its own releases (split into the wakes of
  idle workers and the rest);
* Python calls per chunk (functions and built-ins, every thread, from the same traced
  child): the Python work per chunk, counted rather than timed, so it does not move with
  the machine's noise; split by thread in the JSON.  A call's cost varies (a built-in that
  parses a batch is not a ``len``), so it is a guide to where the GIL time goes, not a
  measure of it.

The filesystem matters for the CPU figures: ext4 *without* a journal (``journal_task``
under ``/sys/fs/ext4/<dev>/`` says ``<none>``) skips every inode deleted in the last minute
when it allocates one (``recently_deleted``), so file creation costs more kernel CPU with
every run of a create-and-delete loop like this one.  Measure on the filesystem the cache
will use, or on a journaled ext4 or XFS image (``docs/benchmarks.md``).

py-spy's ``--gil`` sampling was the first tool tried: on this 2-vCPU machine it saw less
than half of the GIL-held time the meter measures in a controlled test (its samples land
when a CPU is free, i.e. when threads just blocked), so it is not used for the figures.

Medians over ``--runs`` (systems in rotated order each run), then a Markdown table::

    sudo LMCACHE_TRACK_USAGE=false python bench/instruments/bench_ceiling.py /path/on/the/drive

``--paired`` measures the same figures differently: a child per size and op holds every
system, prepares each, then measures windows of ``--seconds`` (2) per system, taking the
systems in turn (order rotated each window); ``--windows`` in all, half of them in a second
child that creates the systems in the reverse order (of two identical adapters in one
process, the one created first measured 7-13 % more GIL time per GiB: the halves cancel
that).  Each window of ours has a window of
``fs_native`` next to it, on the same machine state, in the same process, so the ratio of a
pair cancels what moves between runs and processes (on this 2-vCPU machine single runs of
the separate mode span 1.0-1.8x); the table gives each figure's median for both and the
median of the per-window ratios with their range.  The other systems' threads sit idle in
the process meanwhile (they hold no GIL); no traced child in this mode::

    sudo LMCACHE_TRACK_USAGE=false python bench/instruments/bench_ceiling.py /path/on/the/drive \
        --paired --systems nvme,fs_native

``--baseline REVISION`` (with ``--paired``) also builds this package as of a git revision
into a temporary directory, imports it as ``lmcache_nvme_backend_base`` (system ``base``)
beside this tree's, and gives every ratio against it: what a change does, in pairs, without
the drift between runs.  Run it once on an unchanged tree (``--baseline HEAD``) to see the
spread that means nothing::

    sudo LMCACHE_TRACK_USAGE=false python bench/instruments/bench_ceiling.py /path/on/the/drive \
        --paired --baseline main --systems nvme --sizes-mb 16

Needs CPython 3.11 or 3.12 on Linux and a C compiler (for the meter).
"""

from __future__ import annotations

import argparse
import collections
import importlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

# bench/ for common.py, the shared helpers (gilmeter.py is beside this script)
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))
import gilmeter  # noqa: E402
from common import (  # noqa: E402
    BASELINE,
    GIB,
    IN_FLIGHT,
    NVME_PACKAGES,
    TASK_MB,
    Driver,
    adapter_params,
    build_baseline,
    cpu_seconds,
)

SYSTEMS = ("nvme", "fs_native", "fs")
# Whose frames count as "the adapter's own" in a trace.
ADAPTER_FILES = {
    **{system: (package + "/",) for system, package in NVME_PACKAGES.items()},
    "fs_native": ("l2_adapters/native_connector_l2_adapter.py",
                  "l2_adapters/fs_native_l2_adapter.py"),
    "fs": ("l2_adapters/fs_l2_adapter.py",),
}
# Built-in calls that release the GIL for their duration (and take it back after).
RELEASING = {
    "posix." + name for name in (
        "open", "close", "read", "write", "pread", "pwrite", "preadv", "pwritev", "readv",
        "writev", "fstat", "stat", "lstat", "rename", "replace", "unlink", "remove", "mkdir",
        "rmdir", "fsync", "fdatasync", "fchmod", "listdir", "scandir", "statvfs", "fstatvfs",
        "access", "posix_fadvise")
} | {"time.sleep", "select.select", "select.poll.poll", "select.epoll.poll",
     "_xxhash.xxh3_64_intdigest", "_xxhash.xxh3_64_digest", "_xxhash.xxh64_intdigest",
     "_xxhash.xxh3_128_hexdigest"}
RELEASING_PY = {"Condition.wait", "_Openat2.__call__"}


def thread_group(name: str) -> str:
    """A thread's name without its number (``nvme-writer-3`` -> ``nvme-writer``)."""
    return name.rstrip("0123456789").rstrip("-_ ") or name


def native_module(system: str) -> Any:
    """The native engine's Python module of one of our systems (each package loads its own
    copy of the extension); None for other systems or when it is not loaded."""
    if system not in NVME_PACKAGES:
        return None
    try:
        native = importlib.import_module(NVME_PACKAGES[system] + ".io.native")
    except ImportError:
        return None
    return native if native.available() else None


def native_counters(system: str) -> dict[str, float]:
    """The native engine's own counters (GIL releases, hashing) of one of our systems."""
    native = native_module(system)
    return native.counters() if native is not None else {}


def hash_cpu_s(system: str, before: dict[str, float], after: dict[str, float]) -> float:
    """The checksum's CPU seconds between two ``native_counters`` readings (a baseline build
    from before the engine sampled its hash timing counts ``hash_cpu_ns`` exactly)."""
    if "hash_cpu_ns" in after:
        return (after["hash_cpu_ns"] - before.get("hash_cpu_ns", 0)) / 1e9
    return native_module(system).hash_cpu_ns(before, after) / 1e9


# -- child ---------------------------------------------------------------------------------


class MeteredDriver(Driver):
    """``common.Driver`` with what this script measures around its rounds."""

    def run(self, op: str, seconds: float | None, rounds: int | None,
            before: Any = None) -> dict[str, Any]:
        """Warm up, call ``before()``, then rounds for ``seconds`` (or ``rounds`` rounds)."""
        self.prepare(op)
        if before is not None:
            before()
        return self.measure(op, seconds, rounds)

    def measure(self, op: str, seconds: float | None, rounds: int | None) -> dict[str, Any]:
        """Rounds for ``seconds`` (or ``rounds`` rounds) after ``prepare``, and what they
        cost: every figure is of the whole process over those rounds."""
        measured_from = self.index
        native_before = native_counters(self.system)
        main_id = threading.get_native_id()
        gil0, main0 = gilmeter.read(), gilmeter.read_thread(main_id)
        by_thread0, cpu_by_thread0 = gil_by_thread(), cpu_by_thread(main_id)
        cpu0, wall0 = cpu_seconds(), time.perf_counter()
        while (seconds is not None and time.perf_counter() - wall0 < seconds) or \
                (rounds is not None and self.index - measured_from < rounds):
            self.step(op)
        wall = time.perf_counter() - wall0
        cpu = cpu_seconds() - cpu0
        gil1, main1 = gilmeter.read(), gilmeter.read_thread(main_id)
        by_thread1, cpu_by_thread1 = gil_by_thread(), cpu_by_thread(main_id)
        native_after = native_counters(self.system)
        n_rounds = self.index - measured_from
        chunks = n_rounds * self.chunks_per_round
        gib = n_rounds * self.bytes_per_round / GIB
        native = {k: native_after[k] - native_before.get(k, 0) for k in native_after}
        return {"system": self.system, "op": op, "size_mb": self.shape["size"] >> 20,
                "rounds": n_rounds, "chunks": chunks, "wall_s": wall, "gib": gib,
                "gibps": gib / wall, "cpu_s_per_gib": cpu / gib,
                "hash_cpu_s_per_gib": (hash_cpu_s(self.system, native_before, native_after) / gib
                                       if native else None),
                "native_gil_releases": native.get("gil_releases"),
                "native_wake_releases": native.get("wake_releases"),
                "gil_s_per_gib": (gil1[0] - gil0[0]) / gib,
                "gil_cpu_s_per_gib": (gil1[2] - gil0[2]) / gib,
                "gil_main_s_per_gib": (main1[0] - main0[0]) / gib,
                "gil_main_cpu_s_per_gib": (main1[2] - main0[2]) / gib,
                "gil_acquisitions_per_chunk": (gil1[1] - gil0[1]) / chunks,
                "gil_s_per_gib_by_thread": per_gib_by_thread(by_thread0, by_thread1, gib),
                "cpu_s_per_gib_by_thread": per_gib_by_thread(cpu_by_thread0, cpu_by_thread1,
                                                             gib),
                "all_ok": self.ok, "verified": self.verified}


def per_gib_by_thread(before: dict[str, float], after: dict[str, float],
                      gib: float) -> dict[str, float]:
    """Seconds per GiB each thread (by name) spent between two readings, largest first."""
    spent = {name: (seconds - before.get(name, 0.0)) / gib for name, seconds in after.items()}
    return dict(sorted(spent.items(), key=lambda kv: -kv[1]))


def cpu_by_thread(main_id: int) -> dict[str, float]:
    """CPU seconds of every thread of this process, Python's and native ones (the kernel's
    exact run time, ``/proc/self/task/*/schedstat``), summed by name with numbers
    stripped: the bench's own thread is ``MainThread``, other Python threads go by their
    Python name, threads Python does not know by their OS name and ``(native)``
    (``fs_native``'s workers share the process's name).  A thread that ended between two
    readings drops out of the second: compare readings of a steady state only."""
    python_names = {thread.native_id: thread_group(thread.name)
                    for thread in threading.enumerate() if thread.native_id is not None}
    python_names[main_id] = "MainThread"
    cpu: dict[str, float] = collections.defaultdict(float)
    for task in Path("/proc/self/task").iterdir():
        try:
            ran_ns = int((task / "schedstat").read_text().split()[0])
            os_name = (task / "comm").read_text().strip()
        except (OSError, ValueError, IndexError):
            continue
        name = python_names.get(int(task.name)) or f"{thread_group(os_name)} (native)"
        cpu[name] += ran_ns / 1e9
    return dict(cpu)


def gil_by_thread() -> dict[str, float]:
    """GIL-held seconds of this process's Python threads, summed by name (numbers
    stripped: ``nvme-l2-lookup_0`` and ``_1`` are one row)."""
    held: dict[str, float] = collections.defaultdict(float)
    for thread in threading.enumerate():
        if thread.native_id is not None:
            held[thread_group(thread.name)] += gilmeter.read_thread(thread.native_id)[0]
    return dict(held)


class Tracer:
    """Counts calls that release the GIL, made under the adapter's frames, in every thread."""

    def __init__(self, adapter_files: tuple[str, ...]) -> None:
        self.adapter_files = adapter_files
        self.counts: collections.Counter[str] = collections.Counter()
        self.calls: collections.Counter[str] = collections.Counter()  # every call, by thread
        self.active = False

    def _under_adapter(self, frame: Any) -> bool:
        while frame is not None:
            name = frame.f_code.co_filename
            if any(part in name for part in self.adapter_files):
                return True
            frame = frame.f_back
        return False

    def hook(self, frame: Any, event: str, arg: Any) -> None:
        if not self.active:
            return
        if event in ("call", "c_call"):
            self.calls[thread_group(threading.current_thread().name)] += 1
        if event == "c_call":
            owner = getattr(arg, "__self__", None)
            module = getattr(arg, "__module__", None) or type(owner).__module__
            name = f"{module}.{getattr(arg, '__qualname__', '?')}"
            if name not in RELEASING:
                return
        elif event == "call":
            name = frame.f_code.co_qualname
            if name not in RELEASING_PY:
                return
            frame = frame.f_back
        else:
            return
        if self._under_adapter(frame):
            self.counts[name] += 1

    def install(self) -> None:
        sys.setprofile(self.hook)
        threading.setprofile(self.hook)


def child(args: argparse.Namespace) -> int:
    nvme_params = adapter_params(args.nvme_params)
    gilmeter.start()
    tracer = Tracer(ADAPTER_FILES[args.system]) if args.trace else None
    if tracer is not None:
        tracer.install()  # before the adapter starts its threads
    driver = MeteredDriver(args.system, args.size_mb, args.dir, nvme_params, args.task_mb,
                           args.in_flight)
    try:
        if tracer is not None:
            result = driver.run(args.op, None, args.trace,
                                before=lambda: setattr(tracer, "active", True))
            tracer.active = False
            result["trace"] = dict(tracer.counts)
            result["python_calls"] = dict(tracer.calls)
        else:
            result = driver.run(args.op, args.seconds, None)
        print("RESULT " + json.dumps(result), flush=True)
    finally:
        driver.close()
    return 0


#: The adapter calls LMCache's bench makes on its own thread (``--methods`` times them).
BENCH_CALLS = ("submit_store_task", "pop_completed_store_tasks", "delete", "submit_load_task",
               "query_load_result", "submit_lookup_and_lock_task",
               "query_lookup_and_lock_result", "submit_unlock")


class MethodMeter:
    """GIL-held seconds of the calling thread inside each of an adapter's methods.

    The meter closes a hold only when the GIL is released, so each call is bracketed by
    ``time.sleep(0)`` (a release): one extra GIL round trip per call, counted in the call's
    figure: a bracketed no-op held the GIL 37 µs per call on a busy 2-vCPU machine (each
    acquisition starts cold), about 1 µs per chunk at 32 chunks per call, all of it at one.
    Nested brackets inflate the outer call more; time one level per run."""

    def __init__(self, adapter: Any, methods: Sequence[str]) -> None:
        self.held: dict[str, float] = collections.defaultdict(float)
        for name in methods:  # dotted: a method of an object the adapter holds
            *path, method = name.split(".")
            owner = adapter
            for attribute in path:
                owner = getattr(owner, attribute, None)
            if owner is not None and hasattr(owner, method):
                setattr(owner, method, self._wrap(name, getattr(owner, method)))

    def _wrap(self, name: str, method: Any) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            me = threading.get_native_id()
            time.sleep(0)
            before = gilmeter.read_thread(me)[0]
            try:
                return method(*args, **kwargs)
            finally:
                time.sleep(0)
                self.held[name] += gilmeter.read_thread(me)[0] - before
        return timed


def paired_child(args: argparse.Namespace) -> int:
    """Every system in this one process, measured in short windows taken in turn (the order
    rotated each window), so that each window of one has a neighbour of the other on the
    same machine state: the ratio of a pair cancels the drift between processes and runs."""
    nvme_params = adapter_params(args.nvme_params)
    gilmeter.start()
    systems = args.systems.split(",")
    drivers = [MeteredDriver(system, args.size_mb, args.dir, nvme_params, args.task_mb,
                             args.in_flight) for system in systems]
    methods = args.methods.split(",") if args.methods else BENCH_CALLS
    meters = {id(d): MethodMeter(d.side.adapter, methods) for d in drivers
              if args.methods is not None}
    try:
        for driver in drivers:
            driver.prepare(args.op)
        for window in range(args.windows):
            shift = window % len(drivers)
            for driver in drivers[shift:] + drivers[:shift]:
                meter = meters.get(id(driver))
                before = dict(meter.held) if meter else {}
                result = driver.measure(args.op, args.seconds, None)
                result["window"] = window
                if meter is not None:
                    result["main_gil_us_per_chunk_by_method"] = {
                        name: (held - before.get(name, 0.0)) / result["chunks"] * 1e6
                        for name, held in meter.held.items()}
                print("RESULT " + json.dumps(result), flush=True)
    finally:
        for driver in drivers:
            driver.close()
    return 0


# -- parent --------------------------------------------------------------------------------


def run_child(args: argparse.Namespace, system: str, size_mb: int, op: str,
              trace: int = 0) -> dict[str, Any]:
    (result,) = child_results(args, ["--system", system], size_mb, op, trace)
    return result


def child_results(args: argparse.Namespace, which: list[str], size_mb: int, op: str,
                  trace: int = 0, systems: Sequence[str] | None = None,
                  windows: int | None = None) -> list[dict[str, Any]]:
    """Run a child (``which``: ``--system S``, or ``--paired`` with ``systems`` in the order
    it creates them, ``windows`` each) and collect its results."""
    cmd = [sys.executable, __file__, str(args.path), "--child", *which,
           *(["--methods", args.methods] if args.methods is not None else []),
           "--systems", ",".join(systems) if systems else args.systems,
           "--windows", str(windows or args.windows),
           "--size-mb", str(size_mb), "--op", op, "--dir", str(args.path),
           "--seconds", str(args.seconds), "--nvme-params", args.nvme_params,
           "--task-mb", str(args.task_mb), "--in-flight", str(args.in_flight),
           "--trace", str(trace)]
    env = dict(os.environ, LMCACHE_TRACK_USAGE="false", DO_NOT_TRACK="1",
               LMCACHE_DISABLE_BANNER="1", LMCACHE_LOG_LEVEL="WARNING",
               OMP_WAIT_POLICY="PASSIVE", LD_PRELOAD=str(args.meter))
    if args.baseline_dir is not None:  # where ``--baseline`` built the other revision
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(args.baseline_dir),
                                                          env.get("PYTHONPATH")]))
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, env=env, timeout=3600)
    results = [json.loads(line[len("RESULT "):]) for line in proc.stdout.splitlines()
               if line.startswith("RESULT ")]
    if not results or proc.returncode != 0:
        raise RuntimeError(f"{' '.join(which)} {op} {size_mb} MiB: child exited "
                           f"({proc.returncode}) with {len(results)} results")
    return results


def trace(args: argparse.Namespace, system: str, size_mb: int, op: str) -> dict[str, Any]:
    result = run_child(args, system, size_mb, op, trace=args.trace_rounds)
    chunks = result["chunks"]
    calls = sum(result["trace"].values())
    native = result.get("native_gil_releases") or 0
    wakes = result.get("native_wake_releases") or 0
    what = {k: round(v / chunks, 2) for k, v in sorted(result["trace"].items(),
                                                         key=lambda kv: -kv[1])}
    if native:
        what["native engine: waking idle workers"] = round(wakes / chunks, 2)
        what["native engine: waiting, unlink, reads"] = round((native - wakes) / chunks, 2)
    per_thread = {k: round(v / chunks, 1) for k, v in sorted(
        result["python_calls"].items(), key=lambda kv: -kv[1])}
    return {"releases_per_chunk": (calls + native) / chunks, "what": what,
            "python_calls_per_chunk": sum(result["python_calls"].values()) / chunks,
            "python_calls_by_thread": per_thread}


def med(values: list[float]) -> str:
    return f"{statistics.median(values):.3f}" if values else "n/a"


def table(runs: list[dict[str, Any]], traces: dict[str, dict[str, Any]],
          systems: list[str], sizes: list[int], ops: list[str]) -> list[str]:
    lines = ["| object | op | system | GiB/s | CPU-s/GiB | of which checksum | GIL-s/GiB "
             "| of which main thread | GIL CPU-s/GiB | ceiling GiB/s | GIL vs fs_native "
             "(CPU) | GIL acquisitions / chunk | adapter's releasing calls / chunk "
             "| Python calls / chunk |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for size in sizes:
        for op in ops:
            def pick(system: str, metric: str, op: str = op,
                     size: int = size) -> list[float]:
                return [r[metric] for r in runs if r["system"] == system and
                        r["size_mb"] == size and r["op"] == op and r.get(metric) is not None]

            def ratio(system: str, metric: str) -> str:
                ours, base = pick(system, metric), pick("fs_native", metric)
                return (f"{statistics.median(ours) / statistics.median(base):.2f}x"
                        if ours and base else "n/a")

            for system in systems:
                gil = pick(system, "gil_s_per_gib")
                hashes = pick(system, "hash_cpu_s_per_gib")
                tr = traces.get(f"{system}/{size}/{op}")
                ok = all(r["all_ok"] and r["verified"] for r in runs
                         if r["system"] == system and r["size_mb"] == size and r["op"] == op)
                cells = [f"{size} MiB", op, system, med(pick(system, "gibps")),
                         med(pick(system, "cpu_s_per_gib")), med(hashes) if hashes else "-",
                         med(gil), med(pick(system, "gil_main_s_per_gib")),
                         med(pick(system, "gil_cpu_s_per_gib")),
                         f"{1 / statistics.median(gil):.0f}" if gil else "n/a",
                         f"{ratio(system, 'gil_s_per_gib')} "
                         f"({ratio(system, 'gil_cpu_s_per_gib')})" + ("" if ok else " FAILED"),
                         med(pick(system, "gil_acquisitions_per_chunk")),
                         f"{tr['releases_per_chunk']:.2f}" if tr else "n/a",
                         f"{tr['python_calls_per_chunk']:.0f}" if tr else "n/a"]
                lines.append("| " + " | ".join(cells) + " |")
    return lines


#: Paired figures: (column, how a window's result gives it).
PAIRED_METRICS: list[tuple[str, Callable[[dict[str, Any]], float]]] = [
    ("GIL-s/GiB", lambda r: r["gil_s_per_gib"]),
    ("of which main thread", lambda r: r["gil_main_s_per_gib"]),
    ("GIL CPU-s/GiB", lambda r: r["gil_cpu_s_per_gib"]),
    ("CPU-s/GiB outside the checksum", lambda r: r["cpu_s_per_gib"]
     - (r["hash_cpu_s_per_gib"] or 0.0)),
    ("GiB/s", lambda r: r["gibps"]),
]


def paired_table(results: list[dict[str, Any]], systems: list[str], sizes: list[int],
                 ops: list[str], reference: str = "fs_native") -> list[str]:
    """Per system against ``reference``: each figure's median over the windows for both, and
    the median of the per-window ratios with their range (the pairs' spread)."""
    lines = ["| object | op | system | " + " | ".join(
        f"{name}: median / `{reference}`, ratio [range]" for name, _ in PAIRED_METRICS)
        + " | windows |", "|---|---|---|" + "---|" * (len(PAIRED_METRICS) + 1)]
    for size in sizes:
        for op in ops:
            mine = [r for r in results if r["size_mb"] == size and r["op"] == op]
            base = {r["window"]: r for r in mine if r["system"] == reference}
            for system in systems:
                if system == reference:
                    continue
                pairs = [(r, base[r["window"]]) for r in mine
                         if r["system"] == system and r["window"] in base]
                ok = all(r["all_ok"] and r["verified"] for pair in pairs for r in pair)
                cells = [f"{size} MiB", op, system + ("" if ok else " FAILED")]
                for _, value in PAIRED_METRICS:
                    ratios = [value(a) / value(b) for a, b in pairs if value(b) > 0]
                    cells.append(
                        f"{statistics.median([value(a) for a, _ in pairs]):.4g} / "
                        f"{statistics.median([value(b) for _, b in pairs]):.4g}, "
                        f"{statistics.median(ratios):.2f}x "
                        f"[{min(ratios):.2f}–{max(ratios):.2f}]" if ratios else "n/a")
                cells.append(str(len(pairs)))
                lines.append("| " + " | ".join(cells) + " |")
    return lines


def thread_cpu_table(results: list[dict[str, Any]], systems: list[str], sizes: list[int],
                     ops: list[str]) -> list[str]:
    """--paired: where each system's CPU goes, by thread: CPU-s/GiB, the median over the
    windows (threads under 0.001 left out), and the checksum's share of it where the engine
    times it.  The other systems' threads sit idle in a window, so a window's threads are
    its system's (and the bench's ``MainThread``)."""
    lines = ["| object | op | system | CPU-s/GiB by thread (median over windows) | "
             "of which the checksum |", "|---|---|---|---|---|"]
    for size in sizes:
        for op in ops:
            for system in systems:
                mine = [r for r in results if r["size_mb"] == size and r["op"] == op
                        and r["system"] == system]
                names = dict.fromkeys(name for r in mine for name in r["cpu_s_per_gib_by_thread"])
                medians = {name: statistics.median(r["cpu_s_per_gib_by_thread"].get(name, 0.0)
                                                   for r in mine) for name in names}
                cells = ", ".join(f"{name} {value:.4f}" for name, value in
                                  sorted(medians.items(), key=lambda kv: -kv[1]) if value >= 1e-3)
                hashes = [r["hash_cpu_s_per_gib"] for r in mine if r["hash_cpu_s_per_gib"]]
                lines.append(f"| {size} MiB | {op} | {system} | {cells} | "
                             + (f"{statistics.median(hashes):.4f} |" if hashes else "- |"))
    return lines


def methods_table(results: list[dict[str, Any]], systems: list[str], sizes: list[int],
                  ops: list[str]) -> list[str]:
    """``--methods``: the main thread's GIL-held microseconds per chunk in each adapter
    method, median over the windows, a column per system."""
    lines = ["| object | op | method (main thread) | " + " | ".join(
        f"`{system}` GIL µs / chunk" for system in systems) + " |",
        "|---|---|---|" + "---|" * len(systems)]
    for size in sizes:
        for op in ops:
            mine = [r for r in results if r["size_mb"] == size and r["op"] == op
                    and "main_gil_us_per_chunk_by_method" in r]
            for name in dict.fromkeys(name for r in mine
                                      for name in r["main_gil_us_per_chunk_by_method"]):
                cells = []
                for system in systems:
                    values = [r["main_gil_us_per_chunk_by_method"][name] for r in mine
                              if r["system"] == system
                              and name in r["main_gil_us_per_chunk_by_method"]]
                    cells.append(f"{statistics.median(values):.1f}"
                                 if values and max(values) > 0 else "-")
                if any(cell != "-" for cell in cells):  # a call the op makes
                    lines.append(f"| {size} MiB | {op} | `{name}` | " + " | ".join(cells)
                                 + " |")
    return lines


def paired_parent(args: argparse.Namespace, systems: list[str], sizes: list[int],
                  ops: list[str]) -> int:
    reference = BASELINE if args.baseline else "fs_native"
    if reference not in systems or len(systems) < 2:
        raise SystemExit(f"--paired compares with {reference}: --systems must name it and "
                         "at least one other")
    # Half the windows with the systems created in the order given, half in reverse: of two
    # identical adapters in one process, the one created first measured 7-13 % more GIL time
    # per GiB (``--baseline`` on an unchanged tree), a bias the two halves cancel.
    halves = [(systems, (args.windows + 1) // 2), (systems[::-1], args.windows // 2)]
    results: list[dict[str, Any]] = []
    for size in sizes:
        for op in ops:
            found = []
            for in_order, windows in halves:
                if windows:
                    first = len(found) // len(systems)
                    for r in child_results(args, ["--paired"], size, op, systems=in_order,
                                           windows=windows):
                        found.append({**r, "window": first + r["window"],
                                      "created_first": in_order[0]})
            for r in found:
                print(f"window {r['window']} {size} MiB {r['system']} {op}: "
                      f"{r['gibps']:.2f} GiB/s, GIL {r['gil_s_per_gib']:.4f} s/GiB (main "
                      f"{r['gil_main_s_per_gib']:.4f})" +
                      ("" if r["all_ok"] and r["verified"] else " FAILED"), flush=True)
            results += found
    lines = paired_table(results, systems, sizes, ops, reference)
    lines += [""] + thread_cpu_table(results, systems, sizes, ops)
    if args.methods is not None:
        lines += [""] + methods_table(results, systems, sizes, ops)
    where = (f"{args.path}, {os.cpu_count()} CPUs, two processes per size and op holding "
             f"{', '.join(systems)} (created in that order, and in reverse); {args.windows} "
             f"windows of {args.seconds:g} s each, order rotated"
             + (f"; {BASELINE} is revision {args.baseline}" if args.baseline else ""))
    print("\n" + where + "\n" + "\n".join(lines))
    if args.json is not None:
        args.json.write_text(json.dumps({"where": where, "windows": results, "table": lines},
                                        indent=1))
    return 0 if all(r["all_ok"] and r["verified"] for r in results) else 1


def parent(args: argparse.Namespace) -> int:
    systems = args.systems.split(",")
    sizes = [int(s) for s in args.sizes_mb.split(",")]
    ops = args.ops.split(",")
    args.path.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as build_dir:
        args.meter = gilmeter.build(Path(build_dir))
        if args.paired:
            if args.baseline:
                args.baseline_dir = build_baseline(args.baseline, Path(build_dir))
                systems += [] if BASELINE in systems else [BASELINE]
                args.systems = ",".join(systems)
            return paired_parent(args, systems, sizes, ops)
        traces: dict[str, dict[str, Any]] = {}
        if args.trace_rounds:
            for size in sizes:
                for system in systems:
                    for op in ops:
                        found = traces[f"{system}/{size}/{op}"] = trace(args, system, size, op)
                        print(f"trace {system} {size} MiB {op}: {found}", flush=True)
        runs: list[dict[str, Any]] = []
        for run in range(args.runs):
            for size in sizes:
                order = systems[run % len(systems):] + systems[: run % len(systems)]
                for system in order:
                    for op in ops:
                        r = run_child(args, system, size, op)
                        r["run"] = run
                        runs.append(r)
                        print(f"run {run} {size} MiB {system} {op}: {r['gibps']:.2f} GiB/s, "
                              f"CPU {r['cpu_s_per_gib']:.3f} s/GiB, GIL "
                              f"{r['gil_s_per_gib']:.4f} s/GiB (main "
                              f"{r['gil_main_s_per_gib']:.4f}, CPU "
                              f"{r['gil_cpu_s_per_gib']:.4f}, main CPU "
                              f"{r['gil_main_cpu_s_per_gib']:.4f}), "
                              f"{r['gil_acquisitions_per_chunk']:.1f} acquisitions/chunk; "
                              + ", ".join(f"{name} {v:.4f}" for name, v in
                                          r["gil_s_per_gib_by_thread"].items() if v >= 5e-4)
                              + ("" if r["all_ok"] and r["verified"] else " FAILED"),
                              flush=True)
    lines = table(runs, traces, systems, sizes, ops)
    where = (f"{args.path}, {os.cpu_count()} CPUs, {args.runs} runs of {args.seconds:.0f} s per "
             f"system, size and op; medians")
    print("\n" + where + "\n" + "\n".join(lines))
    if args.json is not None:
        args.json.write_text(json.dumps({"where": where, "runs": runs, "traces": traces,
                                         "table": lines}, indent=1))
    return 0 if all(r["all_ok"] and r["verified"] for r in runs) else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("path", type=Path, help="a directory on the filesystem to test")
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--sizes-mb", default="2,16,64", help="object sizes (default 2,16,64)")
    parser.add_argument("--ops", default="store,load")
    parser.add_argument("--runs", type=int, default=3, help="runs per configuration (3)")
    parser.add_argument("--seconds", type=float,
                        help="measured seconds per run (8), or per window with --paired (2)")
    parser.add_argument("--trace-rounds", type=int, default=4,
                        help="rounds of the traced child that counts GIL round trips (0: none)")
    parser.add_argument("--nvme-params", default="{}",
                        help="extra adapter_params for NVMeL2Adapter (JSON)")
    parser.add_argument("--task-mb", type=int, default=TASK_MB,
                        help=f"MiB of objects per task ({TASK_MB}; at least one object)")
    parser.add_argument("--in-flight", type=int, default=IN_FLIGHT,
                        help=f"tasks in flight per round ({IN_FLIGHT})")
    parser.add_argument("--json", type=Path, help="write every run and the table here")
    parser.add_argument("--paired", action="store_true",
                        help="every system in one process per size and op, measured in "
                             "alternating windows; ratios to fs_native per window pair")
    parser.add_argument("--windows", type=int, default=12,
                        help="--paired: windows per system (12), each --seconds long")
    parser.add_argument("--methods", nargs="?", const="", metavar="CALLS",
                        help="--paired: also the main thread's GIL time in each adapter "
                             "method LMCache's bench calls (adds a GIL round trip per "
                             "call); or in CALLS, methods of objects the adapter holds "
                             "(e.g. store.submit_many: time nested calls one per run)")
    parser.add_argument("--baseline", metavar="REVISION",
                        help="--paired: also hold this package as of git REVISION (built "
                             "here, system 'base') and give every ratio against it: a "
                             "change's effect measured in pairs")
    parser.add_argument("--baseline-dir", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--system", help=argparse.SUPPRESS)
    parser.add_argument("--size-mb", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--op", help=argparse.SUPPRESS)
    parser.add_argument("--dir", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--trace", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.seconds is None:
        args.seconds = 2.0 if args.paired else 8.0
    if args.baseline and not args.paired:
        parser.error("--baseline needs --paired")
    if args.child:
        return paired_child(args) if args.paired else child(args)
    return parent(args)


if __name__ == "__main__":
    sys.exit(main())
