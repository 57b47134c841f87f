"""``bench --vs-fio``: fio with the engine's block size, direct flag and total queue depth
(``BenchConfig.in_flight``), reading the engine's chunk files (hard links) or writing as
many of the same size (``offset`` skips the header).
"""

from __future__ import annotations

import json
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...disk.format import HEADER_SIZE
from ...io.buffers import HUGE_PAGE
from ..common import CLIError
from .model import PERCENTILES, BenchConfig, DirStats, RunResult


def find_fio(explicit: str | None) -> str:
    """Path of the fio binary, or a ``CLIError`` that says how to install it."""
    binary = shutil.which(explicit or "fio")
    if binary is None:
        raise CLIError(f"fio not found ({explicit or 'fio'} is not on PATH). Install it "
                       "(Debian/Ubuntu: apt-get update && apt-get install -y fio; RHEL: "
                       "dnf install fio) or point --fio-binary at it, or leave out --vs-fio.")
    return binary


def fio_version(binary: str) -> str:
    try:
        out = subprocess.run([binary, "--version"], capture_output=True, text=True,
                             timeout=30, check=False)
        return out.stdout.strip() or out.stderr.strip()
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"


@dataclass(frozen=True)
class FioShape:
    """How fio's parallelism is laid out: ``numjobs`` jobs of ``iodepth`` each."""

    numjobs: int
    iodepth: int
    ioengine: str
    mem: str = "malloc"

    @property
    def total(self) -> int:
        return self.numjobs * self.iodepth


def fio_shape(cfg: BenchConfig, numjobs: int | None, ioengine: str, nfiles: int) -> FioShape:
    """Split the engine's in-flight count into fio jobs (default: one per I/O in flight):
    as many as divide it and have at least one file each."""
    qd = cfg.in_flight()
    jobs = numjobs if numjobs is not None else qd
    jobs = max(1, min(jobs, qd, nfiles))
    while qd % jobs:
        jobs -= 1
    return FioShape(jobs, qd // jobs, ioengine)


def free_huge_pages() -> int:
    """Free pages in the 2 MiB hugetlb pool (0 when there is none)."""
    try:
        return int(Path("/sys/kernel/mm/hugepages/hugepages-2048kB/free_hugepages").read_text())
    except (OSError, ValueError):
        return 0


def choose_fio_mem(requested: str, cfg: BenchConfig, numjobs: int, iodepth: int,
                   free_pages: int) -> tuple[str, str | None]:
    """fio's ``mem=`` and, when it differs from the engine's buffers, a note saying so:
    ``auto`` matches the engine's huge pages (2 MiB and up) with ``shmhuge`` where it can."""
    if requested != "auto":
        return requested, None
    if cfg.bs < HUGE_PAGE:
        return "malloc", None
    per_job = -(-(cfg.bs * iodepth + HUGE_PAGE) // HUGE_PAGE)
    if per_job * numjobs <= free_pages:
        return "shmhuge", None
    return "malloc", (
        f"fio gets 4 KiB-page buffers (mem=malloc) while the engine's {cfg.bs >> 20} MiB "
        "buffers use huge pages, which matters on drives with a DMA segment limit; for "
        f"equal buffers give the hugetlb pool {per_job * numjobs} free 2 MiB pages "
        f"(echo {per_job * numjobs} > /proc/sys/vm/nr_hugepages) or pass --fio-mem")


def fio_files(fio_dir: Path, n: int, numjobs: int) -> list[Path]:
    """fio's names for ``n`` files (``filename_format``): file ``i`` is job ``i % numjobs``'s;
    reads go through hard links of these names (fio cannot list thousands of paths)."""
    return [fio_dir / f"job{i % numjobs}.{i // numjobs}" for i in range(n)]


def build_jobfile(cfg: BenchConfig, shape: FioShape, fio_dir: Path, nfiles: int) -> str:
    """The fio job file: one section per job, each on its own ``nrfiles`` files."""
    lines = [
        "[global]",
        f"ioengine={shape.ioengine}",
        f"mem={shape.mem}",
        f"direct={int(cfg.direct)}",
        f"bs={cfg.bs}",
        f"rw={cfg.rw}",
        f"directory={str(fio_dir).replace(':', chr(92) + ':')}",
        "filename_format=$jobname.$filenum",
        f"offset={HEADER_SIZE}",
        f"filesize={HEADER_SIZE + cfg.bs}",
        "fallocate=none",
        "group_reporting=1",
        "lat_percentiles=1",
        "percentile_list=50:90:99:99.9",
        "invalidate=0" if cfg.direct else "invalidate=1",
    ]
    if cfg.random_order:
        lines.append("file_service_type=random")
    if cfg.rw == "rw":
        lines.append("rwmixread=50")
    if cfg.runtime:
        lines += ["time_based=1", f"runtime={cfg.runtime:g}"]
    for job in range(shape.numjobs):  # file i is job i % numjobs's, as in fio_files
        lines += ["", f"[job{job}]", f"nrfiles={len(range(job, nfiles, shape.numjobs))}",
                  f"iodepth={shape.iodepth}"]
    return "\n".join(lines) + "\n"


def run_fio(binary: str, jobfile: Path, cfg: BenchConfig, shape: FioShape) -> RunResult:
    """Run one fio job file and parse its JSON output into a ``RunResult``."""
    try:
        proc = subprocess.run([binary, "--output-format=json", str(jobfile)],
                              capture_output=True, text=True, check=False,
                              timeout=(cfg.runtime or 0) + 3600)
    except subprocess.TimeoutExpired as exc:
        raise CLIError("fio did not finish within an hour") from exc
    if proc.returncode != 0:
        tail = " | ".join((proc.stderr or proc.stdout).strip().splitlines()[-5:])
        raise CLIError(f"fio failed (exit {proc.returncode}): {tail[:800]}")
    start = proc.stdout.find("{")  # fio may print warning lines before its JSON
    if start < 0:
        raise CLIError("fio printed no JSON: " + proc.stdout[:300])
    try:
        doc: dict[str, Any] = json.loads(proc.stdout[start:])
    except json.JSONDecodeError as exc:
        raise CLIError(f"cannot parse fio's JSON output: {exc}") from exc
    result = RunResult("fio", cfg, extra={"fio": {"numjobs": shape.numjobs, "mem": shape.mem,
                                                  "iodepth": shape.iodepth,
                                                  "ioengine": shape.ioengine}})
    for direction in ("read", "write"):
        section = doc["jobs"][0].get(direction) or {}
        if section.get("io_bytes"):
            result.dirs[direction] = _dir_stats(direction, section)
    if not result.dirs:
        raise CLIError("fio reported no I/O; its output: " + proc.stdout[:500])
    return result


def _dir_stats(direction: str, section: dict[str, Any]) -> DirStats:
    nbytes = int(section["io_bytes"])
    bw = float(section["bw_bytes"]) or 1.0
    lat = section.get("lat_ns") or section.get("clat_ns") or {}
    pct = lat.get("percentile", {})
    lat_ms = {f"p{p:g}": pct[f"{p:f}"] / 1e6 for p in PERCENTILES if f"{p:f}" in pct}
    lat_ms.update({k: lat[k] / 1e6 for k in ("max", "mean") if k in lat})
    return DirStats(direction, nbytes, nbytes / bw, int(section.get("total_ios", 0)), lat_ms)
