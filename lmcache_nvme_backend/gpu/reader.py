"""GPU read path: chunk payloads from NVMe straight into GPU memory objects (docs/gpu.md).

``kvikio-gds`` and ``kvikio-compat`` read with ``CuFile.pread`` into the pool
(``nvme.gpu_pool_mb``) and verify on the device against the header's ``gpusum`` checksum (a
file without one goes through ``host-bounce``); ``host-bounce`` reads through the POSIX
engine and copies once to the device.  kvikio, torch and LMCache are imported only when a
GPU path is built.
"""

from __future__ import annotations

import enum
import errno
import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..config import MIB, NVMeConfigError, NVMeSettings
from ..disk.format import HEADER_SIZE, ChunkHeader, TensorMeta, padded_length
from ..disk.gpusum import DeviceWeights, device_checksum, to_unsigned
from ..disk.validate import Expected, judge_chunk
from ..io.kvikio import KvikioPayloadReader, PayloadRead, PayloadReader
from ..io.posix import ShortFileError, read_header
from ..store import ChunkRead, ChunkStore, Counter, ReadPath, ReadPlan
from .pool import GpuBufferPool
from .select import (
    KVIKIO_PATHS,
    GpuProbe,
    PathDecision,
    check_pool_size,
    is_cuda_device,
    select_read_path,
)

if TYPE_CHECKING:
    import torch
    from lmcache.v1.memory_management import MemoryObj

logger = logging.getLogger("lmcache_nvme_backend")

# Fallback warnings: the first, then one every this many.
WARN_EVERY = 1000


class Outcome(enum.Enum):
    """What became of one chunk read by kvikio."""

    SERVED = "served"
    BOUNCE = "bounce"  # verify (or read again) through the host path
    MISS = "miss"


@dataclass(frozen=True)
class HostMemory:
    """How the GPU path gets and handles LMCache memory objects (the adapter supplies it):
    ``allocate`` a host object for a chunk, ``view`` an object's bytes, ``fit`` an object to
    a payload length, ``reclaim`` a pool object only LMCache's host tier still holds."""

    allocate: Callable[[TensorMeta], MemoryObj | None]
    view: Callable[[MemoryObj], memoryview]
    fit: Callable[[MemoryObj, int], MemoryObj | None]
    reclaim: Callable[[Any, MemoryObj], bool] | None = None


@dataclass
class _Job:
    index: int
    plan: ReadPlan
    obj: MemoryObj
    read: PayloadRead
    header: bytes = b""
    file_size: int = 0
    header_error: BaseException | None = None
    sums: tuple[int, int] | None = None


class GpuChunkReader:
    """Reads stored chunks into GPU pool memory objects by the chosen path."""

    def __init__(self, store: ChunkStore, decision: PathDecision, pool: GpuBufferPool,
                 host: HostMemory, payload_reader: PayloadReader | None = None,
                 strict: bool = False) -> None:
        if decision.path in KVIKIO_PATHS and payload_reader is None:
            raise ValueError("a kvikio path needs a payload reader")
        self.store = store
        self.decision = decision
        self.pool = pool
        self.strict = strict
        self._alloc_host = host.allocate
        self._host_view = host.view
        self._payloads = payload_reader
        self._header_pool = ThreadPoolExecutor(max(2, store.settings.io_threads),
                                               thread_name_prefix="nvme-gpu-hdr")
        self._weights: DeviceWeights | None = None
        self._warned: dict[Counter, int] = {}

    def read(self, keys: Sequence[str], metas: Sequence[TensorMeta | None],
             tags: Sequence[Any] | None = None) -> list[MemoryObj | None]:
        """One memory object per key (GPU pool, or host memory as a fallback); None: a miss."""
        tags = list(tags) if tags is not None else list(keys)
        results: list[MemoryObj | None] = [None] * len(keys)
        wanted = [i for i, meta in enumerate(metas) if meta is not None]
        # left for the host path: (index, pool object) to read and copy; indices the pool refused
        bounce: list[tuple[int, MemoryObj | None]] = []
        host: list[int] = []
        if self.decision.path in KVIKIO_PATHS:
            self._read_kvikio(keys, tags, wanted, results, bounce, host)
        else:
            bounce = [(i, None) for i in wanted]
        if bounce:
            self._read_bounce(keys, metas, tags, bounce, results)
        if host:
            self._read_host(keys, metas, host, results)
        logger.debug("NVMe tier: %d of %d chunks read by %s",
                     sum(r is not None for r in results), len(keys), self.decision.path)
        return results

    def _read_kvikio(self, keys: Sequence[str], tags: Sequence[Any], wanted: list[int],
                     results: list[MemoryObj | None], bounce: list[tuple[int, MemoryObj | None]],
                     host: list[int]) -> None:
        assert self._payloads is not None
        started = time.perf_counter()
        plans = self.store.plan_reads([keys[i] for i in wanted])
        jobs: list[_Job] = []
        for i, plan in zip(wanted, plans, strict=True):
            if plan is None:
                continue
            obj = self.pool.allocate(plan.meta, tags[i])
            if obj is None:
                self._note_pool_full()
                host.append(i)
                continue
            length = self.pool.capacity_for(obj, plan.payload_len)
            jobs.append(_Job(i, plan, obj, PayloadRead(plan.path, self.pool.slot(obj, length),
                                                       length)))
        if not jobs:
            return
        with self.store.reading():
            header_futures = [self._header_pool.submit(self._read_header, job) for job in jobs]
            self._payloads.read([job.read for job in jobs])
            for fut in header_futures:
                fut.result()
        self._checksum(jobs)
        served = served_bytes = 0
        for job in jobs:
            outcome = self._judge(job)
            if outcome is Outcome.SERVED:
                results[job.index] = job.obj
                served += 1
                served_bytes += job.plan.payload_len
            elif outcome is Outcome.BOUNCE:
                bounce.append((job.index, job.obj))
            else:
                job.obj.ref_count_down()
        self._account(self.decision.path, served, served_bytes, time.perf_counter() - started)

    def _read_header(self, job: _Job) -> None:
        try:
            job.header, job.file_size = read_header(job.plan.path, job.plan.direct)
        except OSError as exc:
            job.header_error = exc

    def _checksum(self, jobs: list[_Job]) -> None:
        """GPU checksums of the payloads read, with one synchronization for the batch."""
        import torch

        todo = [j for j in jobs if j.read.error is None and j.header_error is None
                and j.read.nread >= j.plan.payload_len]
        if not todo:
            return
        if self._weights is None:
            self._weights = DeviceWeights(self.pool.device)
        sums = torch.stack([device_checksum(j.read.dest, j.plan.payload_len, self._weights)
                            for j in todo]).cpu().tolist()
        for job, (a, b) in zip(todo, sums, strict=True):
            job.sums = (to_unsigned(a), to_unsigned(b))

    def _judge(self, job: _Job) -> Outcome:
        """Serve the chunk, verify it through the host path, or count a miss."""
        plan, read = job.plan, job.read
        error = job.header_error or read.error
        if error is not None and not isinstance(error, OSError):
            # kvikio/cuFile failed (not the drive): the file may be fine
            self._note(Counter.GPU_READ_ERRORS, f"kvikio read failed ({error})")
            return Outcome.MISS if self.strict else Outcome.BOUNCE
        if error is None and job.file_size < HEADER_SIZE + padded_length(plan.payload_len):
            error = ShortFileError(errno.EIO, "chunk file shorter than its payload",
                                   str(plan.path))
        if error is None and read.nread < plan.payload_len:
            error = ShortFileError(errno.EIO, "kvikio read short", str(plan.path))
        if error is None:
            verdict = judge_chunk(job.header, Expected())  # decode only: complete_read judges
            if verdict.header is not None and verdict.header.gpu_checksum is None:
                self._note(Counter.GPU_UNVERIFIED_FALLBACKS, "chunk files without a GPU "
                           "checksum (written before the GPU path was on) are verified on the "
                           "host")
                return Outcome.BOUNCE
        mismatch = False

        def payload_ok(header: ChunkHeader) -> bool:
            nonlocal mismatch
            mismatch = header.gpu_checksum != job.sums
            return not mismatch

        ok = self.store.complete_read(plan, job.header, error, payload_ok).ok
        if mismatch:
            self.store.count(Counter.GPU_CHECKSUM_FAILURES)
        if not ok:
            self.store.count(Counter.READ_FAILURES)
        return Outcome.SERVED if ok else Outcome.MISS

    def _into_host(self, keys: Sequence[str], metas: Sequence[TensorMeta | None],
                   items: list[tuple[int, MemoryObj | None]],
                   ) -> list[tuple[int, MemoryObj | None, MemoryObj, bool]]:
        """Read the chunks of ``items`` (index, pool object or None) into new host objects:
        (index, pool object, host object, served) of each that got a host object."""
        staged: list[tuple[int, MemoryObj | None, MemoryObj]] = []
        for i, gpu_obj in items:
            meta = metas[i]
            assert meta is not None
            host = self._alloc_host(meta)
            if host is not None:
                staged.append((i, gpu_obj, host))
            elif gpu_obj is not None:
                gpu_obj.ref_count_down()
        served = self.store.read_into([ChunkRead(keys[i], self._host_view(h))
                                       for i, _, h in staged]) if staged else []
        return [(i, g, h, ok) for (i, g, h), ok in zip(staged, served, strict=True)]

    def _read_bounce(self, keys: Sequence[str], metas: Sequence[TensorMeta | None],
                     tags: Sequence[Any], items: list[tuple[int, MemoryObj | None]],
                     results: list[MemoryObj | None]) -> None:
        import torch

        started = time.perf_counter()
        staged = self._into_host(keys, metas, items)
        if not staged:
            return
        count = served_bytes = 0
        copies: list[MemoryObj] = []
        for i, gpu_obj, host, ok in staged:
            meta = metas[i]
            assert meta is not None
            if not ok:
                host.ref_count_down()
                if gpu_obj is not None:
                    gpu_obj.ref_count_down()
                continue
            if gpu_obj is None:
                gpu_obj = self.pool.allocate(meta, tags[i])
            if gpu_obj is None:
                self._note_pool_full()
                results[i] = host  # served, in host memory: LMCache copies it as usual
                continue
            self.pool.slot(gpu_obj, meta.nbytes).copy_(self._host_bytes(host, meta.nbytes),
                                                       non_blocking=True)
            copies.append(host)
            results[i] = gpu_obj
            count += 1
            served_bytes += meta.nbytes
        if copies and self.pool.device.type == "cuda":
            torch.cuda.current_stream(self.pool.device).synchronize()
        for host in copies:
            host.ref_count_down()
        self._account(ReadPath.HOST_BOUNCE, count, served_bytes, time.perf_counter() - started)

    def _host_bytes(self, host: MemoryObj, nbytes: int) -> torch.Tensor:
        """The payload of a host object as a uint8 tensor (pinned, when LMCache's is)."""
        import torch

        raw = getattr(host, "raw_data", None)
        if isinstance(raw, torch.Tensor) and raw.dtype == torch.uint8 and raw.numel() >= nbytes:
            return raw.reshape(-1)[:nbytes]
        return torch.frombuffer(self._host_view(host), dtype=torch.uint8)[:nbytes]

    def _read_host(self, keys: Sequence[str], metas: Sequence[TensorMeta | None],
                   indices: list[int], results: list[MemoryObj | None]) -> None:
        """Pool exhausted: host memory objects, as on a CPU worker."""
        for i, _, host, ok in self._into_host(keys, metas, [(i, None) for i in indices]):
            if ok:
                results[i] = host
            else:
                host.ref_count_down()

    def _account(self, path: ReadPath, chunks: int, nbytes: int, seconds: float) -> None:
        self.store.record_read(path, chunks, nbytes, seconds)
        if chunks:
            logger.debug("NVMe tier: %s read %d chunks, %.1f MiB at %.2f GB/s", path, chunks,
                         nbytes / MIB, nbytes / max(seconds, 1e-9) / 1e9)

    def _note_pool_full(self) -> None:
        self._note(Counter.GPU_POOL_FALLBACKS,
                   "GPU pool (nvme.gpu_pool_mb) is full; serving chunks in host memory")

    def _note(self, counter: Counter, message: str) -> None:
        """Count a fallback and log it (the first time, then every WARN_EVERY times)."""
        self.store.count(counter)
        seen = self._warned.get(counter, 0)
        self._warned[counter] = seen + 1
        if seen % WARN_EVERY == 0:
            logger.warning("NVMe tier: %s (%s = %d).", message, counter.value, seen + 1)

    def gauges(self) -> dict[str, float]:
        return {"gpu_pool_bytes": float(self.pool.size),
                "gpu_pool_objects_lent": float(self.pool.lent())}

    def close(self) -> None:
        self._header_pool.shutdown(wait=True)
        self.pool.close()


def build_gpu_reader(
    store: ChunkStore,
    settings: NVMeSettings,
    dst_device: str,
    *,
    host: HostMemory,
    chunk_bytes: int | None = None,
    probe: GpuProbe | None = None,
    payload_reader: PayloadReader | None = None,
) -> tuple[PathDecision, GpuChunkReader | None]:
    """Choose the read path for ``dst_device`` and build its reader (None: host objects);
    ``NVMeConfigError`` for ``gds_mode: on`` without GDS, or a pool of the wrong size."""
    if probe is None:  # a host destination needs no detection (and no kvikio import)
        probe = GpuProbe.detect() if is_cuda_device(dst_device) else GpuProbe()
    decision = select_read_path(settings.gds_mode, dst_device, settings.gpu_pool_bytes, probe)
    if decision.refusal:
        raise NVMeConfigError(decision.refusal)
    if decision.path == ReadPath.POSIX:
        if is_cuda_device(dst_device):
            logger.info("NVMe tier read path: %s (%s).", decision.path, decision.reason)
        return decision, None
    free = None
    if probe.cuda_devices > 0:
        import torch

        free = int(torch.cuda.mem_get_info(torch.device(dst_device))[0])
    check_pool_size(settings.gpu_pool_bytes, chunk_bytes, free)
    kvikio_path = decision.path in KVIKIO_PATHS
    if kvikio_path and payload_reader is None:
        payload_reader = KvikioPayloadReader(settings.kvikio_threads,
                                             settings.kvikio_task_size_bytes,
                                             strict=settings.gds_mode == "on")
    pool = GpuBufferPool(settings.gpu_pool_bytes, dst_device, fit=host.fit,
                         reclaim=host.reclaim,
                         register=decision.path == ReadPath.KVIKIO_GDS and probe.cuda_devices > 0)
    reader = GpuChunkReader(store, decision, pool, host, payload_reader,
                            strict=settings.gds_mode == "on")
    # Files written from now on carry the checksum the GPU path verifies.
    store.set_gpu_checksums(kvikio_path)
    log = logger.info if decision.path == ReadPath.KVIKIO_GDS else logger.warning
    log("NVMe tier read path: %s into a %d MiB GPU pool on %s (%s).", decision.path,
        settings.gpu_pool_bytes // MIB, dst_device, decision.reason)
    return decision, reader
