"""Interpreter instructions per chunk through an L2 adapter: a count that does not drift.

``bench_ceiling.py`` measures what a big server pays, GIL-held seconds per GiB, but on a
shared machine one window of it moves by 10-30 % against the next, so a change worth a
few percent takes many pairs to see.  This counts, under valgrind's callgrind, the machine
instructions the CPython interpreter itself executes (``libpython``, or the ``python``
executable when the interpreter is linked into it) per chunk, in steady state, in every
thread: LMCache's bench loop, the adapter's Python, its completion threads.  Native code
the interpreter calls (our engine's checksums, LMCache's C++ workers, the kernel) is not
in it.  The same build and inputs give the same count within about 0.1 %, whatever else
the machine does, so one run per system says what a change did.

It is a proxy for the GIL time, not the GIL time: an instruction that misses the cache
costs more than one that hits, and GIL-held seconds also count system calls made with the
GIL held and a holder descheduled.  Use it to A/B a change of the Python path; judge the
result with ``bench_ceiling.py``.

Each measurement is a child process under callgrind holding one adapter, driven as
``bench_ceiling.py`` drives it (``common.Driver``: LMCache's ``bench_store`` /
``bench_load``; a store round also deletes the keys of the round before last): the working
set and the warm-up rounds run uninstrumented, then ``--rounds`` rounds are counted
(``cgcontrol.c``'s client requests start and dump the count)::

    LMCACHE_TRACK_USAGE=false python bench/instruments/bench_instructions.py /path/on/the/drive \\
        --systems nvme,fs_native --sizes-mb 2,16

``--keep DIR`` keeps each cell's callgrind dump there: ``callgrind_annotate
DIR/cg-nvme-2-store.out`` lists the interpreter's C functions by instructions (where a
Python change moved them).  ``--baseline REVISION`` also counts this package as of a git
revision (system ``base``, built into a temporary directory as ``bench_ceiling.py
--baseline`` builds it).  ``--opcodes N`` says where the work is: a traced child per cell
(``sys.settrace`` with opcode events in every thread, no valgrind) counts the Python opcodes
of the same rounds by module and function, and lists the N functions that run the most.
Needs valgrind with its headers (Debian package ``valgrind``), a C compiler, CPython 3.11
on Linux; each child takes about half a minute.
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
import sysconfig
import tempfile
import threading
from pathlib import Path
from typing import Any

# bench/ for common.py, the shared helpers
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))
from common import (  # noqa: E402
    IN_FLIGHT,
    REPO_ROOT,
    TASK_MB,
    Driver,
    adapter_params,
    build_baseline,
)

HERE = Path(__file__).resolve().parent
CONTROL_SOURCE = HERE / "cgcontrol.c"
CALLGRIND_HEADER = Path("/usr/include/valgrind/callgrind.h")
REFERENCE = "fs_native"


def build_control(out_dir: Path) -> Path:
    """Compile ``cgcontrol.c`` into ``out_dir``; returns the library's path."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise SystemExit("no C compiler (cc) to build cgcontrol.c")
    if not CALLGRIND_HEADER.exists():
        raise SystemExit(f"{CALLGRIND_HEADER} is missing: install valgrind's headers "
                         "(Debian package valgrind)")
    lib = out_dir / "cgcontrol.so"
    subprocess.run([compiler, "-O1", "-shared", "-fPIC", "-o", str(lib), str(CONTROL_SOURCE)],
                   check=True)
    return lib


def interpreter_objects() -> set[str]:
    """The files the interpreter's own code lives in: ``libpython`` when it is shared, and
    the executable."""
    names = {os.path.realpath(sys.executable)}
    libdir, library = sysconfig.get_config_var("LIBDIR"), sysconfig.get_config_var("LDLIBRARY")
    if libdir and library:
        names.add(os.path.realpath(os.path.join(libdir, library)))
    return names


def self_cost_by_object(dump: Path) -> collections.Counter[str]:
    """Instructions by object file (each function's own, callees excluded) in a callgrind
    dump: the cost lines of ``fn`` blocks, not the inclusive line after each ``calls=``."""
    names: dict[str, str] = {}
    by_object: collections.Counter[str] = collections.Counter()
    current = ""
    after_call = False
    summary = None
    with dump.open(errors="replace") as lines:
        for line in lines:
            if line.startswith(("summary:", "totals:")):
                summary = int(line.split()[1])
            elif line.startswith(("ob=", "cob=")):
                m = re.match(r"c?ob=\((\d+)\)(?: (.*))?", line.rstrip("\n"))
                if m is not None:
                    if m.group(2) is not None:
                        names[m.group(1)] = m.group(2)
                    if line.startswith("ob="):
                        current = names[m.group(1)]
                elif line.startswith("ob="):
                    current = line[3:].strip()
            elif line.startswith("calls="):
                after_call = True
            elif line[:1].isdigit() or line[:1] in "+-*":
                if after_call:
                    after_call = False
                    continue
                fields = line.split()
                if len(fields) >= 2:
                    by_object[current] += int(fields[1])
    if summary is not None and summary != sum(by_object.values()):  # the parse checks itself
        raise SystemExit(f"{dump}: the functions' own costs add up to "
                         f"{sum(by_object.values())}, the dump's total is {summary}")
    return by_object


# -- child -----------------------------------------------------------------------------------


class OpcodeCounter:
    """Python opcodes executed per function (``file:function``, or per line,
    ``file:function:line``, with ``by_line``), in every thread, while ``active`` (installed
    before the adapter starts its threads, so theirs count too)."""

    def __init__(self, by_line: bool = False) -> None:
        self.counts: collections.Counter[str] = collections.Counter()
        self.active = False
        self.by_line = by_line

    def trace(self, frame: Any, event: str, arg: Any) -> Any:
        if not self.active:
            return self.trace  # a frame already running is counted from its next line on
        frame.f_trace_opcodes = True
        code = frame.f_code
        where = f"{_short(code.co_filename)}:{code.co_name}"
        counts = self.counts

        def local(frame: Any, event: str, arg: Any) -> Any:
            if event == "opcode":
                counts[where] += 1
            return local

        def local_line(frame: Any, event: str, arg: Any) -> Any:
            if event == "opcode":
                counts[f"{where}:{frame.f_lineno}"] += 1
            return local_line

        if self.by_line:
            return local_line

        return local

    def install(self) -> None:
        sys.settrace(self.trace)
        threading.settrace(self.trace)


def _short(filename: str) -> str:
    """A source file's name from its package on (``lmcache_nvme_backend/store/writer.py``)."""
    for marker in ("site-packages/", str(REPO_ROOT) + "/"):
        if marker in filename:
            return filename.split(marker, 1)[1]
    return filename


def child(args: argparse.Namespace) -> int:
    """Under callgrind: prepare one adapter uninstrumented, count ``--rounds`` rounds (with
    ``--opcodes``, not under callgrind: the Python opcodes of those rounds instead)."""
    import ctypes

    counter = OpcodeCounter(args.lines) if args.opcodes else None
    if counter is not None:
        counter.install()
    driver = Driver(args.system, args.size_mb, args.dir, adapter_params(), args.task_mb,
                    args.in_flight)
    try:
        driver.prepare(args.op)
        control = ctypes.CDLL(str(args.control)) if counter is None else None
        if control is not None:
            control.cg_measure_start()
        else:
            counter.active = True  # type: ignore[union-attr]
        for _ in range(args.rounds):
            driver.step(args.op)
        if control is not None:
            control.cg_measure_dump()
        else:
            counter.active = False  # type: ignore[union-attr]
        print("RESULT " + json.dumps({"chunks": args.rounds * driver.chunks_per_round,
                                      "all_ok": driver.ok, "verified": driver.verified,
                                      "opcodes": dict(counter.counts) if counter else {}}),
              flush=True)
    finally:
        driver.close()
    return 0


# -- parent ----------------------------------------------------------------------------------


def shape_args(args: argparse.Namespace) -> list[str]:
    """A child's LMCache bench shape: the parent's ``--task-mb`` and ``--in-flight``."""
    return ["--task-mb", str(args.task_mb), "--in-flight", str(args.in_flight)]


def count(args: argparse.Namespace, system: str, size_mb: int, op: str, work: Path,
          control: Path, baseline: Path | None) -> dict[str, Any]:
    """One child under callgrind; its counts per chunk."""
    out = work / f"cg-{system}-{size_mb}-{op}"
    directory = args.path / f"instr-{system}-{size_mb}-{op}"
    shutil.rmtree(directory, ignore_errors=True)
    env = dict(os.environ, PYTHONHASHSEED="0", LMCACHE_TRACK_USAGE="false")
    if baseline is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(baseline),
                                                          env.get("PYTHONPATH")]))
    command = ["valgrind", "--tool=callgrind", "--instr-atstart=no",
               f"--callgrind-out-file={out}.%p", os.path.realpath(sys.executable),
               str(Path(__file__).resolve()), "--child", "--system", system, "--size-mb",
               str(size_mb), "--op", op, "--rounds", str(args.rounds), "--dir",
               str(directory), "--control", str(control), *shape_args(args)]
    r = subprocess.run(command, env=env, capture_output=True, text=True)
    shutil.rmtree(directory, ignore_errors=True)
    found = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
    dumps = sorted(work.glob(f"{out.name}.*.1"))
    if r.returncode != 0 or not found or not dumps:
        raise SystemExit(f"{system} {size_mb} MiB {op}: the child failed "
                         f"(rc {r.returncode}):\n{r.stderr[-3000:]}")
    result = json.loads(found[0][len("RESULT "):])
    by_object = self_cost_by_object(dumps[0])
    interpreter = interpreter_objects()
    chunks = result["chunks"]
    return {"system": system, "size_mb": size_mb, "op": op, "chunks": chunks,
            "all_ok": result["all_ok"], "verified": result["verified"],
            "interpreter_per_chunk": sum(n for ob, n in by_object.items()
                                         if os.path.realpath(ob) in interpreter) / chunks,
            "all_per_chunk": sum(by_object.values()) / chunks,
            "by_object_per_chunk": {Path(ob).name: n / chunks
                                    for ob, n in by_object.most_common(8)}}


def opcodes(args: argparse.Namespace, system: str, size_mb: int, op: str) -> dict[str, Any]:
    """One traced child (no valgrind): Python opcodes per chunk, by module and function."""
    directory = args.path / f"opcodes-{system}-{size_mb}-{op}"
    shutil.rmtree(directory, ignore_errors=True)
    env = dict(os.environ, PYTHONHASHSEED="0", LMCACHE_TRACK_USAGE="false")
    if args.baseline_dir is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(args.baseline_dir),
                                                          env.get("PYTHONPATH")]))
    r = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", "--opcodes",
                        "1", "--system", system, "--size-mb", str(size_mb), "--op", op,
                        "--rounds", str(args.rounds), "--dir", str(directory),
                        *shape_args(args), *(["--lines"] if args.lines else [])],
                       env=env, capture_output=True, text=True)
    shutil.rmtree(directory, ignore_errors=True)
    found = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
    if r.returncode != 0 or not found:
        raise SystemExit(f"{system} {size_mb} MiB {op}: the traced child failed "
                         f"(rc {r.returncode}):\n{r.stderr[-3000:]}")
    result = json.loads(found[0][len("RESULT "):])
    chunks = result["chunks"]
    by_function = collections.Counter({k: v / chunks for k, v in result["opcodes"].items()})
    by_module: collections.Counter[str] = collections.Counter()
    for where, n in by_function.items():
        by_module[where.split(":", 1)[0]] += n
    return {"system": system, "size_mb": size_mb, "op": op,
            "opcodes_per_chunk": sum(by_function.values()),
            "by_module": dict(by_module.most_common()),
            "top_functions": dict(by_function.most_common(args.opcodes))}


def print_opcodes(found: dict[str, Any], top: int) -> None:
    print(f"\n{found['system']} {found['size_mb']} MiB {found['op']}: "
          f"{found['opcodes_per_chunk']:.0f} Python opcodes per chunk")
    for module, n in list(found["by_module"].items())[:top]:
        print(f"  {n:8.1f}  {module}")
    print("  top functions (or lines, with --lines):")
    for where, n in found["top_functions"].items():
        print(f"  {n:8.1f}  {where}")


def table(results: list[dict[str, Any]], systems: list[str]) -> str:
    """Interpreter instructions per chunk by system, each against ``fs_native`` (when it
    ran) and this tree's against the baseline revision (when there is one)."""
    pairs = [(s, REFERENCE) for s in systems if s != REFERENCE and REFERENCE in systems]
    if "base" in systems and "nvme" in systems:
        pairs.append(("nvme", "base"))
    head = ("| object | op | " + " | ".join(f"{s}: k instructions / chunk" for s in systems)
            + "".join(f" | {a} / {b}" for a, b in pairs) + " |")
    rows = [head, "|" + "---|" * (2 + len(systems) + len(pairs))]
    cells = {(r["system"], r["size_mb"], r["op"]): r for r in results}
    for size_mb, op in dict.fromkeys((r["size_mb"], r["op"]) for r in results):
        counts = {s: cells[(s, size_mb, op)]["interpreter_per_chunk"] for s in systems}
        rows.append(f"| {size_mb} MiB | {op} | "
                    + " | ".join(f"{counts[s] / 1e3:.1f}" for s in systems)
                    + "".join(f" | {counts[a] / counts[b]:.2f}x" for a, b in pairs) + " |")
    return "\n".join(rows)


def parent(args: argparse.Namespace) -> int:
    if shutil.which("valgrind") is None:
        raise SystemExit("valgrind is not installed (Debian package valgrind)")
    systems = args.systems.split(",")
    if args.baseline and "base" not in systems:
        systems.append("base")
    args.path.mkdir(parents=True, exist_ok=True)
    results = []
    with tempfile.TemporaryDirectory(prefix="bench-instructions-") as tmp:
        work = Path(tmp)
        control = build_control(work)
        baseline = build_baseline(args.baseline, work) if args.baseline else None
        args.baseline_dir = baseline
        for size_mb in (int(s) for s in args.sizes_mb.split(",")):
            for op in args.ops.split(","):
                for system in systems:
                    result = count(args, system, size_mb, op, work, control, baseline)
                    if args.keep is not None:  # the dump, for callgrind_annotate
                        args.keep.mkdir(parents=True, exist_ok=True)
                        for dump in work.glob(f"cg-{system}-{size_mb}-{op}.*.1"):
                            shutil.copy(dump, args.keep / f"cg-{system}-{size_mb}-{op}.out")
                    print(f"{system} {size_mb} MiB {op}: "
                          f"{result['interpreter_per_chunk'] / 1e3:.1f} k interpreter "
                          f"instructions per chunk ({result['chunks']} chunks)", flush=True)
                    results.append(result)
        traced = [opcodes(args, r["system"], r["size_mb"], r["op"]) for r in results] \
            if args.opcodes else []
    print()
    print(table(results, systems))
    for found in traced:
        print_opcodes(found, args.opcodes)
    if args.json:
        args.json.write_text(json.dumps({"baseline": args.baseline, "rounds": args.rounds,
                                         "results": results, "opcodes": traced}, indent=1))
    return 0 if all(r["all_ok"] and r["verified"] for r in results) else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("path", type=Path, nargs="?", help="a directory on the drive")
    parser.add_argument("--systems", default="nvme,fs_native")
    parser.add_argument("--sizes-mb", default="2,16")
    parser.add_argument("--ops", default="store,load")
    parser.add_argument("--rounds", type=int, default=20,
                        help="rounds counted per child (20: 80 chunks at 16 MiB)")
    parser.add_argument("--task-mb", type=int, default=TASK_MB,
                        help=f"MiB of objects per task ({TASK_MB}; at least one object)")
    parser.add_argument("--in-flight", type=int, default=IN_FLIGHT,
                        help=f"tasks in flight per round ({IN_FLIGHT})")
    parser.add_argument("--baseline", metavar="REVISION",
                        help="also count this package as of git REVISION (system 'base')")
    parser.add_argument("--opcodes", type=int, default=0, metavar="N",
                        help="also a traced child per cell (no valgrind): Python opcodes per "
                             "chunk by module, and the N functions that run the most")
    parser.add_argument("--lines", action="store_true",
                        help="with --opcodes: list the N source lines that run the most, "
                             "not functions")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--keep", type=Path, metavar="DIR",
                        help="keep each cell's callgrind dump in DIR (cg-SYSTEM-SIZE-OP.out: "
                             "callgrind_annotate shows where the instructions go, C function "
                             "by C function)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--system", help=argparse.SUPPRESS)
    parser.add_argument("--size-mb", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--op", help=argparse.SUPPRESS)
    parser.add_argument("--dir", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--control", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args)
    if args.path is None:
        parser.error("give a directory on the drive to measure")
    return parent(args)


if __name__ == "__main__":
    sys.exit(main())
