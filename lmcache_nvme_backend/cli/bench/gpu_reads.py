"""``bench --dest gpu``: reads straight into CUDA tensors through kvikio (cuFile/GDS when
the stack allows it, else its compat mode; ``lmcache-nvme doctor`` says which).  torch
and kvikio are imported only here, and only for this mode."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

from ...disk.format import HEADER_SIZE
from ...gpu.select import kvikio_install_hint, torch_cuda_version
from ...io.posix import read_header
from ..common import CLIError, Progress
from .model import BenchConfig, Timed, read_batches


def check_gpu_destination() -> None:
    """Raise a ``CLIError`` that says what is missing when ``--dest gpu`` cannot run."""
    problems = []
    try:
        import torch

        if not torch.cuda.is_available():
            build = torch.version.cuda or "none (CPU-only build)"
            problems.append(f"no CUDA GPU is visible to torch (torch {torch.__version__}, "
                            f"CUDA build: {build}, torch.cuda.is_available() is False)")
    except ImportError:
        problems.append("torch is not installed")
    try:
        import kvikio  # noqa: F401
    except Exception as exc:
        problems.append(f"kvikio cannot be imported ({exc}); "
                        f"{kvikio_install_hint(torch_cuda_version())}")
    if problems:
        raise CLIError("--dest gpu needs a CUDA GPU and kvikio: " + "; ".join(problems)
                       + ". Use --dest host here, and run `lmcache-nvme doctor PATH` on the "
                       "GPU machine.")


def timed_gpu_reads(paths: list[Path], cfg: BenchConfig, threads: int,
                    progress: Progress) -> Timed:
    """Headers read on the host (``io.posix.read_header``), payloads by kvikio straight
    into CUDA tensors, with no host copy."""
    import kvikio  # availability checked by check_gpu_destination
    import kvikio.defaults
    import torch

    with contextlib.suppress(Exception):  # another kvikio version: keep its defaults
        kvikio.defaults.set("num_threads", threads)
        kvikio.defaults.set("task_size", cfg.task_size)
    bufs = [torch.empty(cfg.bs, dtype=torch.uint8, device="cuda")
            for _ in range(cfg.iodepth)]
    timed = Timed()
    started = time.perf_counter()
    for batch in read_batches(len(paths), cfg, started):
        t0 = time.perf_counter()
        reads = []
        for j, i in enumerate(batch):
            read_header(paths[i], cfg.direct)
            f = kvikio.CuFile(paths[i], "r")
            reads.append((f, f.pread(bufs[j], cfg.bs, file_offset=HEADER_SIZE)))
        for f, fut in reads:
            got = fut.get()
            f.close()
            if got != cfg.bs:
                raise CLIError(f"kvikio read {got} of {cfg.bs} bytes")
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        timed.latencies.extend([t1 - t0] * len(batch))
        timed.nbytes += cfg.bs * len(batch)
        progress.advance(cfg.bs * len(batch))
    timed.seconds = time.perf_counter() - started
    return timed
