"""What ``lmcache-nvme bench`` measures: the store's I/O engine (``io.engine_for``) in the
store's shapes (a read batch one read share, each written chunk a write share), on chunk
files in the backend's format from page-aligned buffers, hashed and verified as in the store.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import os
import random
import shutil
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import numpy as np

from ...disk.format import TensorMeta, text_bytes
from ...disk.layout import RootLayout, key_digest, namespace_id, temp_name
from ...disk.safe_fs import dir_mode_for
from ...disk.validate import Expected, judge_chunk
from ...io import engine_for
from ...io.buffers import AlignedBuffer
from ...io.engine import FAILED, Batch, ChunkEngine
from ...io.files import read_failure
from ..common import MIB, CLIError, Progress
from .gpu_reads import timed_gpu_reads
from .model import BenchConfig, DirStats, RunResult, Timed, read_batches

BENCH_NAMESPACE = "lmcache-nvme-bench"
FILE_MODE = 0o600
_O_PATH = getattr(os, "O_PATH", os.O_RDONLY)
T = TypeVar("T")


def drop_page_cache(keep_metadata_of: Iterable[Path] = ()) -> None:
    """``sync; echo 3 > /proc/sys/vm/drop_caches`` (root only), then ``stat`` the given files
    untimed (fio loads its files' metadata in its setup: the runs compare data paths)."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
    except OSError as exc:
        raise CLIError(f"cannot drop the page cache ({exc.strerror}); run as root on a host "
                       "(or a privileged container), or leave out --drop-caches") from exc
    for path in keep_metadata_of:
        os.stat(path)


def in_threads(name: str, bodies: list[Callable[[], T]],
               errors: list[BaseException]) -> list[T]:
    """Each body on a thread of its own, and what each returned; the first exception (in
    ``errors``, which bodies may watch to stop early) is raised once all have ended."""
    results: dict[int, T] = {}

    def guarded(k: int) -> None:
        try:
            results[k] = bodies[k]()
        except BaseException as exc:  # re-raised after every thread ends
            errors.append(exc)

    threads = [threading.Thread(target=guarded, args=(k,), name=f"{name}-{k}")
               for k in range(len(bodies))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return [results[k] for k in range(len(bodies))]


@dataclass
class ChunkSet:
    """Names of a set of bench chunk files: keys (as the header holds them), digests, paths."""

    keys: list[bytes]
    digests: list[str]
    paths: list[Path]


def remove_files(paths: list[Path]) -> None:
    for p in paths:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(p)


class EngineBench:
    """Timed runs with the backend's I/O engine (``native_io`` as ``nvme.native_io``) in a
    cache root of its own, ``<PATH>/.lmcache-nvme-bench-<pid>``, removed unless ``keep``."""

    def __init__(self, path: Path, bs: int, keep: bool, progress_enabled: bool,
                 native_io: str = "auto") -> None:
        self.dir = path / f".lmcache-nvme-bench-{os.getpid()}"
        self.keep = keep
        self.progress_enabled = progress_enabled
        self.native_io = native_io
        self._write_pass = 0
        self.layout = RootLayout(self.dir)
        self.ns_id = namespace_id(BENCH_NAMESPACE)
        self.bs = bs
        self.dir.mkdir(parents=True, exist_ok=False)
        self.root_fd = os.open(self.dir, _O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        self.payload = AlignedBuffer(bs)
        np.frombuffer(self.payload.view, dtype=np.uint8)[:bs] = np.random.default_rng(
            0x4C4D43).integers(0, 256, bs, dtype=np.uint8)
        self.meta = TensorMeta(shapes=((bs,),), dtypes=("uint8",), fmt=0, nbytes=bs)
        self.sets: dict[str, ChunkSet] = {}

    def close(self) -> None:
        self.payload.close()
        os.close(self.root_fd)
        if not self.keep:
            shutil.rmtree(self.dir, ignore_errors=True)

    def chunk_set(self, tag: str, n: int) -> ChunkSet:
        """``n`` chunk names (keys, digests, paths) of one set; directories pre-created."""
        existing = self.sets.get(tag)
        if existing is not None and len(existing.paths) == n:
            return existing
        keys = [f"{BENCH_NAMESPACE}@1@0@{tag}{i:08x}@uint8" for i in range(n)]
        digests = [key_digest(k) for k in keys]
        paths = [self.layout.chunk_path(self.ns_id, d) for d in digests]
        for parent in {p.parent for p in paths}:
            parent.mkdir(parents=True, exist_ok=True)
        self.sets[tag] = ChunkSet([text_bytes(k) for k in keys], digests, paths)
        return self.sets[tag]

    def layout_read_set(self, n: int, threads: int, direct: bool) -> None:
        """Write the files reads will read (untimed; reused by every read run)."""
        progress = Progress(self.progress_enabled, n * self.bs, "laying out")
        engine = engine_for(self.native_io, 1, threads, 4 * MIB)
        try:
            self._write_files(engine, self.chunk_set("r", n), list(range(n)), threads, direct,
                              None, progress, Timed())
        finally:
            engine.close()
            progress.close()

    def read_paths(self, cfg: BenchConfig) -> list[Path]:
        """The files the reads of ``cfg`` open."""
        return self.chunk_set("r", cfg.chunk_counts()[0]).paths

    def run(self, cfg: BenchConfig) -> RunResult:
        """One timed run of ``cfg``.  Read files must have been laid out."""
        readers, writers = cfg.split_threads()
        n_read, n_write = cfg.chunk_counts()
        total = cfg.runtime if cfg.runtime else (n_read + n_write) * cfg.bs
        progress = Progress(self.progress_enabled, total,
                            f"{cfg.rw} T={cfg.threads} QD={cfg.iodepth}",
                            unit="seconds" if cfg.runtime else "bytes")
        # One engine for both sides, as a store has: its writers let reads in flight go first.
        engine = engine_for(self.native_io, max(1, readers), max(1, writers), cfg.task_size)
        sides: dict[str, Callable[[], Timed]] = {}
        if n_read:
            sides["read"] = lambda: self._timed_reads(cfg, engine, n_read, progress)
        if n_write:
            sides["write"] = lambda: self._timed_writes(cfg, engine, writers, n_write,
                                                        progress)
        try:
            started = time.perf_counter()
            outcome = in_threads("bench-side", list(sides.values()), [])
            elapsed = time.perf_counter() - started
        finally:
            engine.close()
            progress.close()
        # Mixed runs report both directions over the common wall time, as fio does.
        return RunResult("lmcache-nvme", cfg, {
            d: DirStats.from_latencies(d, t.nbytes, elapsed if cfg.rw == "rw" else t.seconds,
                                       t.latencies) for d, t in zip(sides, outcome, strict=True)})

    def _timed_reads(self, cfg: BenchConfig, engine: ChunkEngine, n: int,
                     progress: Progress) -> Timed:
        chunks = self.chunk_set("r", n)
        if cfg.dest == "gpu":
            return timed_gpu_reads(chunks.paths, cfg, cfg.split_threads()[0], progress)
        bufs = [AlignedBuffer(cfg.bs) for _ in range(cfg.callers * cfg.iodepth)]
        timed = Timed()
        lock = threading.Lock()
        errors: list[BaseException] = []

        def caller(mine: list[AlignedBuffer], batches: Iterator[list[int]]) -> None:
            while True:
                with lock:
                    batch = next(batches, None)
                if batch is None or errors:
                    return
                share = (self.root_fd, self.layout.chunk_naming(self.ns_id), cfg.direct,
                         self.bs, self.meta.to_json(), [chunks.digests[i] for i in batch],
                         [buf.view for buf in mine[: len(batch)]],
                         [chunks.keys[i] for i in batch])
                t0 = time.perf_counter()
                result = engine.read([share])
                t1 = time.perf_counter()
                if result.details:
                    raise self._read_error(chunks, batch, result)
                with lock:
                    timed.latencies.extend([t1 - t0] * len(batch))
                    timed.nbytes += cfg.bs * len(batch)
                    progress.advance(cfg.bs * len(batch))

        try:
            started = time.perf_counter()
            batches = read_batches(n, cfg, started)
            in_threads("bench-caller", [functools.partial(caller, bufs[k :: cfg.callers], batches)
                                        for k in range(cfg.callers)], errors)
            timed.seconds = time.perf_counter() - started
        finally:
            for b in bufs:
                b.close()
        return timed

    def _read_error(self, chunks: ChunkSet, batch: list[int], result: Batch) -> CLIError:
        """What the first chunk of a read batch that was not served says."""
        index, err, header, computed = result.details[0]
        path = chunks.paths[batch[index]]
        if header is None:
            return CLIError(f"read of {path} failed: {read_failure(path, err)}")
        verdict = judge_chunk(header, Expected(key=chunks.keys[batch[index]].decode(),
                                               payload_len=self.bs, meta=self.meta),
                              lambda h: h.payload_checksum == computed)
        return CLIError(f"{verdict.reason} in {path}: the bench file changed under the "
                        "benchmark or the drive returned wrong data")

    def _timed_writes(self, cfg: BenchConfig, engine: ChunkEngine, writers: int, n: int,
                      progress: Progress) -> Timed:
        """Write ``n`` new chunk files per pass; passes repeat until ``runtime`` if given,
        the previous pass's files deleted in between, off the clock."""
        timed = Timed()
        deadline = time.perf_counter() + cfg.runtime if cfg.runtime else None
        chunks = self.chunk_set("w", n)
        while True:
            self._write_pass += 1
            remove_files(chunks.paths)
            order = list(range(n))
            if cfg.random_order:
                random.Random(self._write_pass).shuffle(order)
            t0 = time.perf_counter()
            self._write_files(engine, chunks, order, writers, cfg.direct, deadline, progress,
                              timed)
            timed.seconds += time.perf_counter() - t0
            if deadline is None or time.perf_counter() >= deadline:
                break
        remove_files(chunks.paths)
        return timed

    def _write_files(self, engine: ChunkEngine, chunks: ChunkSet, order: list[int],
                     in_flight: int, direct: bool, deadline: float | None,
                     progress: Progress, timed: Timed) -> None:
        """Publish the files in ``order``, ``in_flight`` at a time, each a write share of its
        own, counted in ``timed`` (latency: from submission to its batch's hand-back)."""
        lock = threading.Lock()
        slots = threading.Semaphore(in_flight)
        errors: list[int] = []
        naming = self.layout.write_naming(self.ns_id, temp_name("", writer=0))
        namespace, meta = text_bytes(BENCH_NAMESPACE), self.meta.to_json()
        payload = self.payload.view[: self.bs]

        def done(started: float, result: Batch) -> None:
            try:
                with lock:
                    if result.statuses[0] == FAILED:
                        errors.append(result.details[0][2])
                        return
                    timed.latencies.append(time.perf_counter() - started)
                    timed.nbytes += self.bs
                    progress.advance(self.bs)
            finally:
                slots.release()

        try:
            for i in order:
                if errors or (deadline is not None and time.perf_counter() >= deadline):
                    break
                slots.acquire()
                try:
                    engine.submit_write([(self.root_fd, naming, namespace, meta, direct,
                                          FILE_MODE, dir_mode_for(FILE_MODE), 0, (),
                                          [chunks.digests[i]], [payload], [chunks.keys[i]],
                                          None)], functools.partial(done, time.perf_counter()))
                except BaseException:
                    slots.release()
                    raise
        finally:
            for _ in range(in_flight):  # every write handed back
                slots.acquire()
            payload.release()
        if errors:
            exc = OSError(errors[0], os.strerror(errors[0]))
            if errors[0] == errno.ENOSPC:
                raise CLIError("the filesystem is full; use a smaller --size") from exc
            raise CLIError(f"write failed: {exc}") from exc
