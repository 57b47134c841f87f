"""What ``lmcache-nvme bench`` measures: the backend's own I/O engine on real chunk files.

Every timed I/O goes through :class:`~lmcache_nvme_backend.io.posix.PosixIOEngine`
(``write_chunk`` + the store's atomic rename for writes, ``read_chunks`` for
reads) on files in the backend's chunk format (4 KiB header, aligned padded
payload, sharded directories from :class:`~lmcache_nvme_backend.disk.layout.RootLayout`),
with page-aligned :class:`~lmcache_nvme_backend.io.posix.AlignedBuffer` memory.

Vocabulary (``docs/cli.md`` has the long form):

* ``bs``: payload bytes of one chunk file; one chunk is one I/O in the counts.
* ``threads``: reads: the engine's I/O thread pool (``nvme.io_threads``);
  writes: concurrent writer threads (``nvme.write_threads``).
* ``iodepth``: reads: chunks per ``read_chunks`` call (the batch LMCache hands
  the backend).  At most ``min(threads, pieces of the batch)`` reads are in
  flight, where a chunk is ``ceil(bs / task_size)`` I/Os (the header rides with the
  first).
* ``callers``: reads: threads calling ``read_chunks`` concurrently, each with its
  own batch (several requests retrieving at once; ``NVMeBackend`` runs two).
* latency: what the caller sees.  A read chunk completes when its batch returns;
  a written chunk when ``write_chunk`` and the rename return.
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ...disk.format import HEADER_SIZE, TensorMeta, decode_header, encode_header, file_size_for
from ...disk.format import payload_checksum as compute_checksum
from ...disk.layout import RootLayout, key_digest, namespace_id
from ...io.posix import AlignedBuffer, PosixIOEngine, ReadRequest
from ..common import MIB, CLIError, Progress

READ_MODES = ("read", "randread")
WRITE_MODES = ("write", "randwrite")
RW_MODES = (*READ_MODES, *WRITE_MODES, "rw")
BENCH_NAMESPACE = "lmcache-nvme-bench"
PERCENTILES = (50.0, 90.0, 99.0, 99.9)
FILE_MODE = 0o600


@dataclass(frozen=True)
class BenchConfig:
    """One benchmark configuration (one point of a sweep)."""

    rw: str
    bs: int
    size: int
    threads: int
    iodepth: int
    task_size: int
    direct: bool
    dest: str = "host"
    runtime: float | None = None
    checksum: bool = False
    callers: int = 1

    @property
    def nchunks(self) -> int:
        return max(1, self.size // self.bs)

    @property
    def random_order(self) -> bool:
        return self.rw.startswith("rand")

    @property
    def reads(self) -> bool:
        return self.rw in READ_MODES or self.rw == "rw"

    @property
    def writes(self) -> bool:
        return self.rw in WRITE_MODES or self.rw == "rw"

    def chunk_counts(self) -> tuple[int, int]:
        """(chunks read, chunks written) per pass; ``rw`` splits them half and half."""
        n = self.nchunks
        if self.rw == "rw":
            return max(1, n // 2), max(1, n - n // 2)
        return (n, 0) if self.reads else (0, n)

    def split_threads(self) -> tuple[int, int]:
        """(read pool threads, writer threads) for this mode."""
        if self.rw == "rw":
            readers = max(1, self.threads // 2)
            return readers, max(1, self.threads - readers)
        return (self.threads, 0) if self.reads else (0, self.threads)

    def pieces_per_chunk(self) -> int:
        """I/Os the engine issues for one chunk (the header rides with the first piece)."""
        return -(-self.bs // self.task_size)

    def in_flight(self) -> int:
        """Most I/Os the engine keeps in flight in this configuration.

        This is the queue depth fio is given in ``--vs-fio`` (numjobs x iodepth).
        """
        readers, writers = self.split_threads()
        total = writers
        if readers:
            pieces = self.iodepth * self.pieces_per_chunk()
            # read_chunks runs a batch of at most two pieces inline, one at a time
            total += self.callers if pieces <= 2 else min(readers, self.callers * pieces)
        return max(1, total)

    def label(self) -> dict[str, Any]:
        return {"rw": self.rw, "bs": self.bs, "size": self.nchunks * self.bs,
                "threads": self.threads, "iodepth": self.iodepth, "task_size": self.task_size,
                "direct": self.direct, "dest": self.dest, "runtime": self.runtime,
                "checksum": self.checksum, "callers": self.callers,
                "in_flight": self.in_flight()}


@dataclass
class DirStats:
    """Result of one direction (read or write) of one run, ours or fio's."""

    direction: str
    bytes: int
    seconds: float
    ios: int
    lat_ms: dict[str, float]

    @property
    def bw_bytes(self) -> float:
        return self.bytes / self.seconds if self.seconds > 0 else 0.0

    @property
    def iops(self) -> float:
        return self.ios / self.seconds if self.seconds > 0 else 0.0

    def to_json(self) -> dict[str, Any]:
        return {"direction": self.direction, "bytes": self.bytes,
                "seconds": round(self.seconds, 6), "ios": self.ios,
                "bw_bytes": round(self.bw_bytes), "bw_mib_s": round(self.bw_bytes / MIB, 1),
                "bw_gb_s": round(self.bw_bytes / 1e9, 3), "iops": round(self.iops, 1),
                "lat_ms": {k: round(v, 3) for k, v in self.lat_ms.items()}}

    @classmethod
    def from_latencies(cls, direction: str, nbytes: int, seconds: float,
                       latencies_s: list[float]) -> DirStats:
        lat = np.asarray(latencies_s, dtype=np.float64) * 1e3
        pct: dict[str, float] = {}
        if len(lat):
            for p, v in zip(PERCENTILES, np.percentile(lat, PERCENTILES), strict=True):
                pct[f"p{p:g}"] = float(v)
            pct["max"] = float(lat.max())
            pct["mean"] = float(lat.mean())
        return cls(direction, nbytes, seconds, len(lat), pct)


@dataclass
class RunResult:
    """One run of one configuration by one tool (``lmcache-nvme`` or ``fio``)."""

    tool: str
    config: BenchConfig
    dirs: dict[str, DirStats] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)

    def bw_bytes(self) -> float:
        return sum(d.bw_bytes for d in self.dirs.values())

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {"tool": self.tool, "config": self.config.label(),
                               "bw_bytes": round(self.bw_bytes()),
                               "bw_gb_s": round(self.bw_bytes() / 1e9, 3)}
        doc.update({name: d.to_json() for name, d in self.dirs.items()})
        doc.update(self.extra)
        return doc


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
        outcome: dict[str, _Timed] = {}
        errors: list[BaseException] = []

        def side(direction: str, fn: Callable[[], _Timed]) -> Callable[[], None]:
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
                     progress: Progress) -> _Timed:
        if cfg.dest == "gpu":
            return self._timed_gpu_reads(cfg, threads, n, progress)
        chunks = self.ws.chunk_set("r", n)
        bufs = [[AlignedBuffer(cfg.bs) for _ in range(cfg.iodepth)]
                for _ in range(cfg.callers)]
        timed = _Timed()
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
                batches = _batches(n, cfg, started)
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

    def _timed_gpu_reads(self, cfg: BenchConfig, threads: int, n: int,
                         progress: Progress) -> _Timed:
        """kvikio (cuFile/GDS, or kvikio's compat mode) straight into CUDA tensors.

        The header is read on the host (the engine's ``read_header``), the
        payload by kvikio into a CUDA tensor, with no host copy.
        """
        import kvikio  # availability checked by check_gpu_destination
        import kvikio.defaults
        import torch

        chunks = self.ws.chunk_set("r", n)
        try:
            kvikio.defaults.set("num_threads", threads)
            kvikio.defaults.set("task_size", cfg.task_size)
        except Exception:  # another kvikio version: keep its defaults
            pass
        bufs = [torch.empty(cfg.bs, dtype=torch.uint8, device="cuda")
                for _ in range(cfg.iodepth)]
        timed = _Timed()
        with ThreadPoolExecutor(1) as unused_pool:
            header_engine = PosixIOEngine(cfg.task_size, unused_pool)
            started = time.perf_counter()
            for batch in _batches(n, cfg, started):
                t0 = time.perf_counter()
                files = []
                futures = []
                for j, i in enumerate(batch):
                    header_engine.read_header(chunks.paths[i], cfg.direct)
                    f = kvikio.CuFile(chunks.paths[i], "r")
                    files.append(f)
                    futures.append(f.pread(bufs[j], cfg.bs, file_offset=HEADER_SIZE))
                for fut, f in zip(futures, files, strict=True):
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

    def _timed_writes(self, cfg: BenchConfig, threads: int, n: int,
                      progress: Progress) -> _Timed:
        """Write ``n`` new chunk files per pass; passes repeat until ``runtime`` if given.

        Between passes the previous pass's files are deleted, off the clock.
        """
        timed = _Timed()
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


@dataclass
class _Timed:
    """Bytes moved, active seconds and per-chunk latencies of one direction."""

    nbytes: int = 0
    seconds: float = 0.0
    latencies: list[float] = field(default_factory=list)


def _batches(n: int, cfg: BenchConfig, started: float) -> Iterator[list[int]]:
    """Chunk indices in batches of ``iodepth``: one pass, or passes until ``runtime``."""
    rng = random.Random(1)
    deadline = started + cfg.runtime if cfg.runtime else None
    while True:
        order = list(range(n))
        if cfg.random_order:
            rng.shuffle(order)
        for start in range(0, n, cfg.iodepth):
            if deadline is not None and time.perf_counter() >= deadline:
                return
            yield order[start : start + cfg.iodepth]
        if deadline is None:
            return


def _check_chunk(req: ReadRequest) -> None:
    header = decode_header(req.header)
    if compute_checksum(req.dest[: req.payload_len]) != header.payload_checksum:
        raise CLIError(f"payload checksum mismatch in {req.path}: the bench file changed "
                       "under the benchmark or the drive returned wrong data")


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
        problems.append(f"kvikio cannot be imported ({exc}); pip install kvikio-cu13")
    if problems:
        raise CLIError("--dest gpu needs a CUDA GPU and kvikio: " + "; ".join(problems)
                       + ". Use --dest host here, and run `lmcache-nvme doctor PATH` on the "
                       "GPU machine.")


def bench_file_bytes(cfg: BenchConfig) -> int:
    """Bytes the bench files of ``cfg`` occupy on disk (headers and padding included)."""
    return cfg.nchunks * file_size_for(cfg.bs)
