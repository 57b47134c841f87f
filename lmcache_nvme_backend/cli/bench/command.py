"""``lmcache-nvme bench PATH``: the arguments, and single runs, ``--sweep`` (threads x queue
depth, advised by ``tuning.py``) and ``--vs-fio`` (interleaved with fio on the same files).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import os
import platform
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ...config import NVMeSettings
from ...disk.format import file_size_for
from ...disk.mounts import mount_for
from ...io import native
from ...io.posix import probe_direct_io
from ..common import (
    GIB,
    MIB,
    CLIError,
    int_list_arg,
    positive_float,
    positive_int,
    print_json,
    short_size,
    size_arg,
    size_list_arg,
)
from . import fio, report
from .gpu_reads import check_gpu_destination
from .iobench import EngineBench, drop_page_cache, remove_files
from .model import RW_MODES, WRITE_MODES, BenchConfig, RunResult
from .plot import plot_runs, plot_sweep, require_matplotlib
from .tuning import Setting, advice_doc, advise

MAX_BUFFER_BYTES = 8 * GIB
# what a mode returns: its --json document, and what prints its text report
Outcome = tuple[dict[str, Any], Callable[[], None]]


def add_parser(sub: Any) -> argparse.ArgumentParser:
    p: argparse.ArgumentParser = sub.add_parser(
        "bench",
        help="fio-style benchmark of the backend's I/O engine on a drive or directory",
        description=(
            "Benchmark the backend's own I/O engine (O_DIRECT, aligned buffers, chunk files "
            "in the backend's format) on PATH. Files go to a private subdirectory of PATH "
            "that is removed afterwards. Bandwidth counts payload bytes; one chunk file of "
            "--bs bytes is one I/O."),
        epilog=(
            "examples:\n"
            "  lmcache-nvme bench /mnt/nvme0 --rw read --bs 16M --size 4G\n"
            "  lmcache-nvme bench /mnt/nvme0 --rw read --bs 2M --sweep --plot sweep.png\n"
            "  lmcache-nvme bench /mnt/nvme0 --rw write --bs 16M --vs-fio --repeat 5\n"
            "exit status: 0 success, 1 the benchmark could not run, 2 usage error"),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("path", metavar="PATH", type=Path,
                   help="directory on the drive to test (created if missing)")
    p.add_argument("--rw", choices=RW_MODES, default="read",
                   help="I/O pattern: sequential or random (file order) reads or writes, or "
                        "rw (half reads, half writes, concurrently) (default: read)")
    p.add_argument("--bs", type=size_arg, default=16 * MIB, metavar="SIZE",
                   help="chunk payload size = block size, a multiple of 4k "
                        "(e.g. 2M, 16M; default 16M)")
    p.add_argument("--size", type=size_arg, default=1 * GIB, metavar="SIZE",
                   help="bytes per pass: size/bs chunk files (default 1G)")
    p.add_argument("--threads", "--numjobs", type=positive_int, default=8, metavar="N",
                   help="reads: the engine's read threads (nvme.io_threads); writes: its "
                        "writer threads (nvme.write_threads) (default 8)")
    p.add_argument("--iodepth", type=positive_int, default=8, metavar="N",
                   help="reads: chunks per engine read call, the batch LMCache hands the "
                        "backend (default 8)")
    p.add_argument("--callers", type=positive_int, default=1, metavar="N",
                   help="reads: concurrent engine read callers, each with its own batch, like "
                        "several requests retrieving at once (NVMeBackend runs 2; default 1)")
    p.add_argument("--engine", choices=("native", "python"),
                   help="the I/O engine timed: the compiled one or the Python one "
                        "(default: the one the store runs, native when it is built)")
    p.add_argument("--task-size", type=size_arg, default=64 * MIB, metavar="SIZE",
                   help="the engine's piece size for large chunks (nvme.task_size_mb; "
                        "default 64M)")
    p.add_argument("--direct", action=argparse.BooleanOptionalAction, default=True,
                   help="O_DIRECT (default) or buffered I/O through the page cache")
    p.add_argument("--dest", choices=("host", "gpu"), default="host",
                   help="read destination: aligned host memory, or a CUDA tensor through "
                        "kvikio (GDS or kvikio's compat mode) (default: host)")
    p.add_argument("--runtime", type=positive_float, metavar="SECONDS",
                   help="run for this long (repeating passes) instead of one pass")
    p.add_argument("--repeat", type=positive_int, metavar="N",
                   help="repetitions per configuration; the median is reported "
                        "(default 1; 3 with --sweep, in interleaved rounds, for the spread "
                        "its advice is judged against; 6 with --vs-fio: an even count lets "
                        "each tool go first equally often)")
    p.add_argument("--checksum", action="store_true",
                   help="no effect, kept for old command lines: the engines always hash "
                        "what they write and verify what they read, as in the store")
    p.add_argument("--drop-caches", action="store_true",
                   help="sync and drop the page cache before every read run (root only); "
                        "file metadata is then reloaded untimed, as fio does in its setup")
    sweep = p.add_argument_group("sweep")
    sweep.add_argument("--sweep", action="store_true",
                       help="run every combination of --sweep-threads x --sweep-iodepth "
                            "(x --sweep-task-size), and the defaults, --repeat times, and "
                            "print the settings to use: a change from the defaults only "
                            "when it beats them beyond the run-to-run spread")
    sweep.add_argument("--sweep-threads", type=int_list_arg, metavar="LIST",
                       default=[1, 2, 4, 8, 16],
                       help="threads to sweep (default 1,2,4,8,16)")
    sweep.add_argument("--sweep-iodepth", type=int_list_arg, metavar="LIST", default=[1, 4, 16],
                       help="read batch sizes to sweep (default 1,4,16; writes ignore it)")
    sweep.add_argument("--sweep-task-size", type=size_list_arg, metavar="LIST",
                       help="task sizes to sweep, e.g. 1M,4M,16M (default: --task-size)")
    vs = p.add_argument_group("fio comparison")
    vs.add_argument("--vs-fio", action="store_true",
                    help="also run fio with the same parameters on the same files, "
                         "interleaved, and print the ratio of medians")
    vs.add_argument("--fio-binary", metavar="PATH", help="fio executable (default: fio)")
    vs.add_argument("--fio-numjobs", type=positive_int, metavar="N",
                    help="fio jobs; each gets queue depth in_flight/N (default: one job "
                         "per in-flight I/O, iodepth 1)")
    vs.add_argument("--fio-mem", default="auto", metavar="MEM",
                    help="fio's mem= (buffer memory). auto: shmhuge (hugetlb pool) when "
                         "--bs >= 2M and the pool has room, to match the engine's huge-page "
                         "buffers, else malloc (default auto)")
    vs.add_argument("--fio-ioengine", default="libaio", metavar="ENGINE",
                    help="fio ioengine (default libaio)")
    out = p.add_argument_group("output")
    out.add_argument("--json", action="store_true", help="print JSON instead of text")
    out.add_argument("--plot", type=Path, metavar="PNG",
                     help="write a PNG chart (needs matplotlib: the [plot] extra)")
    out.add_argument("--progress", action="store_true",
                     help="show the progress bar even when stderr is not a terminal")
    out.add_argument("--keep", action="store_true",
                     help="keep the bench files (PATH/.lmcache-nvme-bench-<pid>)")
    p.set_defaults(func=run)
    return p


def _validate(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    for name in ("bs", "task_size"):
        if getattr(args, name) % 4096:
            parser.error(f"argument --{name.replace('_', '-')}: must be a multiple of 4k "
                         f"(4096 bytes), got {getattr(args, name)}")
    if args.sweep_task_size and any(t % 4096 for t in args.sweep_task_size):
        parser.error("argument --sweep-task-size: every size must be a multiple of 4k")
    if args.size < args.bs:
        parser.error(f"argument --size: {short_size(args.size)} is smaller than --bs "
                     f"{short_size(args.bs)}")
    if args.dest == "gpu" and args.rw not in ("read", "randread"):
        parser.error("argument --dest: gpu applies to reads (--rw read or randread); the "
                     "backend writes from host memory")
    if args.dest == "gpu" and args.vs_fio:
        parser.error("argument --vs-fio: not available with --dest gpu")
    if args.vs_fio and args.sweep:
        parser.error("argument --vs-fio: cannot be combined with --sweep; compare one "
                     "configuration at a time")
    if args.drop_caches and os.geteuid() != 0:
        parser.error("argument --drop-caches: needs root (it writes /proc/sys/vm/drop_caches)")
    depth = max([args.iodepth, *(args.sweep_iodepth if args.sweep else [])]) * args.callers
    if depth * args.bs > MAX_BUFFER_BYTES:
        parser.error(f"argument --iodepth: {depth} x {short_size(args.bs)} buffers (iodepth x "
                     f"callers) exceed {short_size(MAX_BUFFER_BYTES)} of host memory")


def default_setting(args: argparse.Namespace) -> Setting:
    """What the tier runs without tuning lines: ``nvme.io_threads`` (reads) or one writer
    per path (writes), and ``nvme.task_size_mb`` when task sizes are swept."""
    defaults: dict[str, Any] = {f.name: f.default for f in dataclasses.fields(NVMeSettings)}
    return Setting(int(defaults["io_threads"]) if args.rw not in WRITE_MODES else 1,
                   int(float(defaults["task_size_mb"]) * MIB) if args.sweep_task_size
                   else args.task_size)


def _configs(args: argparse.Namespace) -> list[BenchConfig]:
    base = dict(rw=args.rw, bs=args.bs, size=args.size, direct=args.direct, dest=args.dest,
                runtime=args.runtime, checksum=args.checksum, callers=args.callers)
    if not args.sweep:
        return [BenchConfig(threads=args.threads, iodepth=args.iodepth,
                            task_size=args.task_size, **base)]
    default = default_setting(args)  # always measured: the advice is judged against it
    tasks = sorted({*(args.sweep_task_size or [args.task_size]), default.task_size})
    threads = sorted({*args.sweep_threads, default.threads})
    depths = args.sweep_iodepth if args.rw not in WRITE_MODES else [args.iodepth]
    return [BenchConfig(threads=t, iodepth=d, task_size=ts, **base)
            for ts, t, d in itertools.product(tasks, threads, depths)]


def run(args: argparse.Namespace) -> int:
    parser: argparse.ArgumentParser = args.parser
    _validate(args, parser)
    if args.dest == "gpu":
        check_gpu_destination()
    if args.plot is not None:
        require_matplotlib()
    if args.engine == "native" and not native.available():
        raise CLIError(f"--engine native: {native.unavailable_reason()}")
    native_io = {"native": "on", "python": "off"}.get(args.engine, "auto")
    engine_name = "python" if native_io == "off" or not native.available() else "native"
    fio_binary = fio.find_fio(args.fio_binary) if args.vs_fio else ""
    repeat = args.repeat or (6 if args.vs_fio else 3 if args.sweep else 1)
    path: Path = args.path.absolute()
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise CLIError(f"cannot create PATH '{path}': {exc.strerror}") from exc
    if not path.is_dir():
        raise CLIError(f"PATH '{path}' is not a directory")
    mount = mount_for(path)
    fstype = mount.fstype if mount else "unknown"
    if args.direct and not probe_direct_io(path):
        raise CLIError(f"'{path}' ({fstype}) does not support O_DIRECT; run with --no-direct "
                       "(page cache in the data path), or benchmark a local ext4/xfs path")
    configs = _configs(args)
    need = max(c.nchunks for c in configs) * file_size_for(args.bs) * (2 if args.vs_fio else 1)
    free = shutil.disk_usage(path).free
    if need + 64 * MIB > free:
        raise CLIError(f"not enough free space in '{path}': the benchmark needs "
                       f"{need / GIB:.2f} GiB, {free / GIB:.2f} GiB are free; use a smaller "
                       "--size")
    progress = args.progress or sys.stderr.isatty()
    where = (f"{path} ({fstype}"
             + (f" on {mount.device}" if mount and mount.device.startswith("/dev/") else "")
             + f"), {os.cpu_count()} CPUs, Linux {platform.release()}, {engine_name} I/O "
             "engine")
    if not args.direct and configs[0].reads and not args.drop_caches and not args.json:
        print("note: buffered reads of files just written are served from the page cache; "
              "add --drop-caches (root) for cold reads", file=sys.stderr)

    bench = EngineBench(path, args.bs, args.keep, progress, native_io)
    try:
        n_read = max(c.chunk_counts()[0] for c in configs)
        if n_read:
            bench.layout_read_set(n_read, threads=max(4, args.threads), direct=args.direct)
        if args.vs_fio:
            doc, show = _run_vs_fio(args, configs[0], bench, fio_binary, repeat, where)
        else:
            doc, show = _run_configs(args, configs, bench, repeat, where)
    finally:
        bench.close()
    if args.json:
        print_json(doc)
        return 0
    show()
    if args.plot is not None:
        print(f"plot written to {args.plot}")
    return 0


def _run_configs(args: argparse.Namespace, configs: list[BenchConfig], bench: EngineBench,
                 repeat: int, where: str) -> Outcome:
    """A single configuration, or the points of a sweep and its advice."""
    groups: list[list[RunResult]] = [[] for _ in configs]
    for _ in range(repeat):  # rounds over every point: drift spreads over all of them
        for cfg, runs in zip(configs, groups, strict=True):
            if args.drop_caches and cfg.reads:
                drop_page_cache(bench.read_paths(cfg))
            runs.append(bench.run(cfg))
    medians = [report.median_run(runs) for runs in groups]
    results = [{"config": m.config.label(), "median": m.to_json(),
                "runs": [r.to_json() for r in runs]} for m, runs in zip(medians, groups,
                                                                          strict=True)]
    if not args.sweep:
        if args.plot is not None:
            plot_runs(groups[0], [], args.plot, where)
        return (report.json_doc(args.plot, where=where, repeat=repeat, results=results),
                lambda: report.print_summary(groups[0], where))
    advice = advise(groups, default_setting(args))
    if args.plot is not None:
        plot_sweep(medians, groups, args.plot, where)
    return (report.json_doc(args.plot, where=where, repeat=repeat, results=results,
                            recommendation=advice_doc(advice, configs[0].reads)),
            lambda: report.print_sweep(medians, groups, where, advice))


def _run_vs_fio(args: argparse.Namespace, cfg: BenchConfig, bench: EngineBench,
                fio_binary: str, repeat: int, where: str) -> Outcome:
    """The engine and fio on the same files, in interleaved repetitions."""
    fio_dir = bench.dir / "fio"
    fio_dir.mkdir()
    nfiles = cfg.nchunks  # as many files as the engine reads and writes in a pass
    shape = fio.fio_shape(cfg, args.fio_numjobs, args.fio_ioengine, nfiles)
    mem, mem_note = fio.choose_fio_mem(args.fio_mem, cfg, shape.numjobs, shape.iodepth,
                                       fio.free_huge_pages())
    shape = dataclasses.replace(shape, mem=mem)
    if mem_note and not args.json:
        print(f"note: {mem_note}", file=sys.stderr)
    files = fio.fio_files(fio_dir, nfiles, shape.numjobs)
    if cfg.rw in ("read", "randread"):
        # fio reads the very files the engine reads (hard links to the same inodes)
        for src, dst in zip(bench.chunk_set("r", nfiles).paths, files, strict=True):
            os.link(src, dst)
    jobfile = fio_dir / "job.fio"
    job = fio.build_jobfile(cfg, shape, fio_dir, nfiles)
    jobfile.write_text(job)
    ours: list[RunResult] = []
    theirs: list[RunResult] = []
    for rep in range(repeat):
        for tool in ("ours", "fio") if rep % 2 == 0 else ("fio", "ours"):
            if args.drop_caches and cfg.reads:
                drop_page_cache(bench.read_paths(cfg))
            if tool == "ours":
                ours.append(bench.run(cfg))
            else:
                if bench.progress_enabled:
                    print(f"fio repetition {rep + 1}/{repeat} ...", file=sys.stderr)
                theirs.append(fio.run_fio(fio_binary, jobfile, cfg, shape))
                if cfg.writes and cfg.rw != "rw":
                    remove_files(files)
    comparison = report.compare(ours, theirs)
    if args.plot is not None:
        plot_runs(ours, theirs, args.plot, where)
    version = fio.fio_version(fio_binary)
    fio_doc = {"version": version, **dataclasses.asdict(shape), "mem_note": mem_note,
               "jobfile": job}
    doc = report.json_doc(args.plot, mode="vs-fio", where=where, repeat=repeat,
                          config=cfg.label(), fio=fio_doc,
                          ours=[r.to_json() for r in ours],
                          fio_runs=[r.to_json() for r in theirs], comparison=comparison)
    fio_desc = (f"{version}, numjobs={shape.numjobs} iodepth={shape.iodepth} "
                f"ioengine={shape.ioengine} mem={shape.mem} (total queue depth {shape.total})")
    return doc, lambda: report.print_vs_fio(ours, theirs, where, fio_desc, repeat, cfg,
                                            comparison)
