"""What ``lmcache-nvme bench`` measures: the backend's own I/O engine on real chunk files.

Every timed I/O goes through :class:`~lmcache_nvme_backend.io.posix.PosixIOEngine`
(``write_chunk`` + the store's atomic rename for writes, ``read_chunks`` for
reads) on files in the backend's chunk format (4 KiB header, aligned padded
payload, sharded directories from :class:`~lmcache_nvme_backend.disk.layout.RootLayout`),
with page-aligned :class:`~lmcache_nvme_backend.io.buffers.AlignedBuffer` memory.

This module holds the bench workspace (``Workspace``) and the timed runs
(``EngineBench``); ``model.py`` defines what a configuration and a result are
(and the vocabulary: ``bs``, ``threads``, ``iodepth``, ``callers``, latency),
``gpu_reads.py`` the ``--dest gpu`` reads.
"""

from __future__ import annotations

import contextlib
import errno
import os
import random
import shutil
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ...disk.format import TensorMeta, encode_header
from ...disk.format import payload_checksum as compute_checksum
from ...disk.layout import RootLayout, key_digest, namespace_id
from ...disk.validate import Expected, judge_chunk
from ...io.buffers import AlignedBuffer
from ...io.posix import PosixIOEngine, ReadRequest
from ..common import MIB, CLIError, Progress
from .model import BenchConfig, DirStats, RunResult, Timed, read_batches

BENCH_NAMESPACE = "lmcache-nvme-bench"
FILE_MODE = 0o600


def drop_page_cache(keep_metadata_of: Iterable[Path] = ()) -> None:
    """``sync; echo 3 > /proc/sys/vm/drop_caches`` (root only), then ``stat`` the given files.

    Dropping caches also drops dentries and inodes, which makes every later
    open a metadata read.  fio loads its files' metadata in its untimed setup
    phase; stat-ing the engine's files here (untimed) puts both on equal terms,
    so the timed runs compare the data path.
    """
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
    except OSError as exc:
        raise CLIError(f"cannot drop the page cache ({exc.strerror}); run as root on a host "
                       "(or a privileged container), or leave out --drop-caches") from exc
    for path in keep_metadata_of:
        os.stat(path)


class Workspace:
    """A private bench directory under PATH holding chunk files in the backend's format.

    It is a cache root of its own (``<PATH>/.lmcache-nvme-bench-<pid>``), so a
    real cache in PATH is never touched, and it is removed at the end.
    """

    def __init__(self, path: Path, bs: int, keep: bool = False) -> None:
        self.dir = path / f".lmcache-nvme-bench-{os.getpid()}"
        self.keep = keep
        self.layout = RootLayout(self.dir)
        self.ns_id = namespace_id(BENCH_NAMESPACE)
        self.bs = bs
        self.dir.mkdir(parents=True, exist_ok=False)
        self.payload = AlignedBuffer(bs)
        rng = np.random.default_rng(0x4C4D43)
        np.frombuffer(self.payload.view, dtype=np.uint8)[:bs] = rng.integers(
            0, 256, bs, dtype=np.uint8)
        self.checksum = compute_checksum(self.payload.view[:bs])
        self.meta = TensorMeta(shapes=((bs,),), dtypes=("uint8",), fmt=0, nbytes=bs)
        self.sets: dict[str, ChunkSet] = {}

    def chunk_set(self, tag: str, n: int) -> ChunkSet:
        """``n`` chunk names (keys, paths, headers) of one set; directories pre-created."""
        existing = self.sets.get(tag)
        if existing is not None and len(existing.paths) == n:
            return existing
        keys = [f"{BENCH_NAMESPACE}@1@0@{tag}{i:08x}@uint8" for i in range(n)]
        paths = [self.layout.chunk_path(self.ns_id, key_digest(k)) for k in keys]
        for parent in {p.parent for p in paths}:
            parent.mkdir(parents=True, exist_ok=True)
        headers = [encode_header(k, BENCH_NAMESPACE, self.meta, self.bs, self.checksum)
                   for k in keys]
        self.sets[tag] = ChunkSet(keys, paths, headers)
        return self.sets[tag]

    def remove_files(self, paths: list[Path]) -> None:
        for p in paths:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(p)

    def close(self) -> None:
        self.payload.close()
        if not self.keep:
            shutil.rmtree(self.dir, ignore_errors=True)


@dataclass
class ChunkSet:
    """Names of a set of bench chunk files."""

    keys: list[str]
    paths: list[Path]
    headers: list[bytes]


class EngineBench:
    """Runs configurations against one workspace with the backend's POSIX engine."""

    def __init__(self, ws: Workspace, progress_enabled: bool) -> None:
        self.ws = ws
        self.progress_enabled = progress_enabled
        self._write_pass = 0

    # -- layout -------------------------------------------------------------------

    def layout_read_set(self, n: int, threads: int, direct: bool) -> ChunkSet:
        """Write the files reads will read (untimed; reused by every read run)."""
        chunks = self.ws.chunk_set("r", n)
        missing = [i for i, p in enumerate(chunks.paths) if not p.exists()]
        if missing:
            progress = Progress(self.progress_enabled, len(missing) * self.ws.bs,
                                "laying out")
            self._write_files(chunks, missing, threads, direct, None, progress.update,
                              task_size=4 * MIB, checksum=False)
            progress.close()
        return chunks

    def read_paths(self, cfg: BenchConfig) -> list[Path]:
        """The files the reads of ``cfg`` open (none for pure writes)."""
        n_read = cfg.chunk_counts()[0]
        return self.ws.chunk_set("r", n_read).paths if n_read else []

    # -- runs ---------------------------------------------------------------------

    def run(self, cfg: BenchConfig) -> RunResult:
        """One timed run of ``cfg``.  Read files must have been laid out."""
        result = RunResult("lmcache-nvme", cfg)
        readers, writers = cfg.split_threads()
        n_read, n_write = cfg.chunk_counts()
        total = cfg.runtime if cfg.runtime else (n_read + n_write) * cfg.bs
        progress = Progress(self.progress_enabled, total,
                            f"{cfg.rw} T={cfg.threads} QD={cfg.iodepth}",
                            unit="seconds" if cfg.runtime else "bytes")
        outcome: dict[str, Timed] = {}
        errors: list[BaseException] = []

        def side(direction: str, fn: Callable[[], Timed]) -> Callable[[], None]:
            def body() -> None:
                try:
                    outcome[direction] = fn()
                except BaseException as exc:  # re-raised after both sides finish
                    errors.append(exc)
            return body

        sides = []
        if n_read:
            sides.append(side("read", lambda: self._timed_reads(cfg, readers, n_read,
                                                                progress)))
        if n_write:
            sides.append(side("write", lambda: self._timed_writes(cfg, writers, n_write,
                                                                  progress)))
        started = time.perf_counter()
        workers = [threading.Thread(target=s, name="bench-side") for s in sides]
        for t in workers:
            t.start()
        for t in workers:
            t.join()
        elapsed = time.perf_counter() - started
        progress.close()
        if errors:
            raise errors[0]
        for direction, timed in outcome.items():
            # Mixed runs report both directions over the common wall time, as fio does.
            seconds = elapsed if cfg.rw == "rw" else timed.seconds
            result.dirs[direction] = DirStats.from_latencies(direction, timed.nbytes, seconds,
                                                             timed.latencies)
        return result

    def _timed_reads(self, cfg: BenchConfig, threads: int, n: int,
                     progress: Progress) -> Timed:
        if cfg.dest == "gpu":
            from .gpu_reads import timed_gpu_reads

            return timed_gpu_reads(self.ws.chunk_set("r", n).paths, cfg, threads, progress)
        chunks = self.ws.chunk_set("r", n)
        bufs = [[AlignedBuffer(cfg.bs) for _ in range(cfg.iodepth)]
                for _ in range(cfg.callers)]
        timed = Timed()
        lock = threading.Lock()
        errors: list[BaseException] = []

        def caller(engine: PosixIOEngine, mine: list[AlignedBuffer],
                   batches: Iterator[list[int]]) -> None:
            try:
                while True:
                    with lock:
                        batch = next(batches, None)
                    if batch is None or errors:
                        return
                    reqs = [ReadRequest(chunks.paths[i], cfg.bs, mine[j].view, cfg.direct)
                            for j, i in enumerate(batch)]
                    t0 = time.perf_counter()
                    engine.read_chunks(reqs)
                    t1 = time.perf_counter()
                    for req in reqs:
                        if req.error is not None:
                            raise CLIError(f"read of {req.path} failed: {req.error}")
                        if cfg.checksum:
                            _check_chunk(req)
                    with lock:
                        timed.latencies.extend([t1 - t0] * len(reqs))
                        timed.nbytes += cfg.bs * len(reqs)
                        progress.advance(cfg.bs * len(reqs))
            except BaseException as exc:
                errors.append(exc)

        try:
            with ThreadPoolExecutor(threads, thread_name_prefix="bench-io") as pool:
                engine = PosixIOEngine(cfg.task_size, pool)
                started = time.perf_counter()
                batches = read_batches(n, cfg, started)
                callers = [threading.Thread(target=caller, args=(engine, mine, batches),
                                            name=f"bench-caller-{k}")
                           for k, mine in enumerate(bufs)]
                for t in callers:
                    t.start()
                for t in callers:
                    t.join()
                timed.seconds = time.perf_counter() - started
        finally:
            for mine in bufs:
                for b in mine:
                    b.close()
        if errors:
            raise errors[0]
        return timed

    def _timed_writes(self, cfg: BenchConfig, threads: int, n: int,
                      progress: Progress) -> Timed:
        """Write ``n`` new chunk files per pass; passes repeat until ``runtime`` if given.

        Between passes the previous pass's files are deleted, off the clock.
        """
        timed = Timed()
        deadline = time.perf_counter() + cfg.runtime if cfg.runtime else None
        chunks = self.ws.chunk_set("w", n)
        while True:
            self._write_pass += 1
            self.ws.remove_files(chunks.paths)
            order = list(range(n))
            if cfg.random_order:
                random.Random(self._write_pass).shuffle(order)
            t0 = time.perf_counter()
            written = self._write_files(chunks, order, threads, cfg.direct, deadline,
                                        progress.advance, task_size=cfg.task_size,
                                        checksum=cfg.checksum, latencies=timed.latencies)
            timed.seconds += time.perf_counter() - t0
            timed.nbytes += written * cfg.bs
            if deadline is None or time.perf_counter() >= deadline:
                break
        self.ws.remove_files(chunks.paths)
        return timed

    def _write_files(self, chunks: ChunkSet, order: list[int], threads: int, direct: bool,
                     deadline: float | None, on_done: Callable[[int], None], *,
                     task_size: int, checksum: bool, latencies: list[float] | None = None) -> int:
        """``threads`` writers publish the files in ``order`` (write_chunk + rename)."""
        lock = threading.Lock()
        position = iter(order)
        count = [0]
        errors: list[BaseException] = []
        payload = self.ws.payload.view[: self.ws.bs]

        def writer(engine: PosixIOEngine) -> None:
            lat: list[float] = []
            try:
                while True:
                    with lock:
                        i = next(position, None)
                    if i is None or (deadline is not None and time.perf_counter() >= deadline):
                        break
                    final = chunks.paths[i]
                    tmp = self.ws.layout.temp_path(final)
                    t0 = time.perf_counter()
                    if checksum:  # what the store does per chunk before writing
                        header = encode_header(chunks.keys[i], BENCH_NAMESPACE, self.ws.meta,
                                               self.ws.bs, compute_checksum(payload))
                    else:
                        header = chunks.headers[i]
                    engine.write_chunk(tmp, header, payload, direct=direct, mode=FILE_MODE,
                                       sync_data=False)
                    os.rename(tmp, final)
                    lat.append(time.perf_counter() - t0)
                    with lock:
                        count[0] += 1
                        on_done(self.ws.bs)
            except BaseException as exc:
                errors.append(exc)
            finally:
                if latencies is not None:
                    with lock:
                        latencies.extend(lat)

        # Writes never use the engine's read pool (the store shares one engine the same way).
        with ThreadPoolExecutor(1) as unused_pool:
            engine = PosixIOEngine(task_size, unused_pool)
            workers = [threading.Thread(target=writer, args=(engine,),
                                        name=f"bench-writer-{k}") for k in range(threads)]
            for w in workers:
                w.start()
            for w in workers:
                w.join()
        if errors:
            exc = errors[0]
            if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
                raise CLIError("the filesystem is full; use a smaller --size") from exc
            if isinstance(exc, OSError):
                raise CLIError(f"write failed: {exc}") from exc
            raise exc
        return count[0]


def _check_chunk(req: ReadRequest) -> None:
    verdict = judge_chunk(req.header, Expected(payload_len=req.payload_len),
                          req.payload_matches)
    if not verdict.ok:
        raise CLIError(f"{verdict.reason} in {req.path}: the bench file changed under the "
                       "benchmark or the drive returned wrong data")
