"""GPU read path: chunk payloads from NVMe straight into GPU memory objects.

On a CUDA worker ``NVMeBackend`` serves retrieved chunks as memory objects in
a GPU buffer pool of its own (``nvme.gpu_pool_mb``).  How a payload gets there
depends on ``nvme.gds_mode`` and on what this machine offers:

``kvikio-gds``
    kvikio's ``CuFile.pread`` with cuFile/GPUDirect Storage: the drive DMAs
    the 4 KiB-aligned payload into the pool, no host copy.
``kvikio-compat``
    the same call when kvikio runs in its compat mode (no cuFile/GDS here):
    kvikio reads through its own pinned bounce buffers with its thread pool.
``host-bounce``
    the POSIX engine reads into host memory (O_DIRECT, xxh3 verified), then
    one device copy into the pool.  ``nvme.gds_mode: off`` and every fallback.
``posix``
    host memory objects, as on CPU workers (or ``nvme.gpu_pool_mb: 0``).

``select_read_path`` decides from a ``GpuProbe`` (plain detected facts), so
every branch is tested without a GPU; ``nvme.gds_mode: on`` turns each reason
not to use GDS into an ``NVMeConfigError`` that names the key.

Integrity without a host copy: the writer records ``gpusum``'s checksum in the
header and the reader computes it with torch on the device where the payload
landed; a mismatch is a miss, counted and quarantined like an xxh3 mismatch.
A file without that checksum (written before the GPU path was on) is read
through ``host-bounce`` so that xxh3 verifies it: nothing unverified is served.

kvikio, torch and LMCache are imported only when a GPU path is built: this
module imports on any machine.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from .config import MIB, NVMeConfigError, NVMeSettings
from .format import HEADER_SIZE, FormatError, TensorMeta, decode_header, padded_length
from .gpusum import DeviceWeights, device_checksum, to_unsigned
from .memory_objects import fit_to_payload
from .posix_io import PosixIOEngine, ShortFileError
from .stats import PATH_HOST_BOUNCE, PATH_KVIKIO_COMPAT, PATH_KVIKIO_GDS, PATH_POSIX
from .store import ChunkRead, ChunkStore, ReadPlan

if TYPE_CHECKING:
    import torch
    from lmcache.v1.memory_management import MemoryObj

logger = logging.getLogger("lmcache_nvme_backend")

KVIKIO_PATHS = (PATH_KVIKIO_GDS, PATH_KVIKIO_COMPAT)
# Fallback warnings: the first, then one every this many.
WARN_EVERY = 1000


# -- what this machine offers --------------------------------------------------


@dataclass(frozen=True)
class GpuProbe:
    """Facts about the GPU I/O stack, detected once (``detect``) or written by a test."""

    cuda_devices: int = 0  # GPUs torch can use; 0 when CUDA is not usable
    cuda_error: str | None = None  # why CUDA is not usable
    kvikio_version: str | None = None  # None: kvikio cannot be imported
    kvikio_error: str | None = None
    libcufile_version: str | None = None  # None: kvikio cannot load libcufile
    compat_mode_preferred: bool | None = None  # kvikio's verdict; None without kvikio
    compat_mode_setting: str | None = None  # kvikio's compat_mode setting (KVIKIO_COMPAT_MODE)
    nvidia_fs: bool = False  # the nvidia-fs kernel module is loaded

    @classmethod
    def detect(cls) -> GpuProbe:
        """Ask torch and kvikio; never raises (a failure is a fact like any other)."""
        cuda_devices, cuda_error = 0, None
        try:
            import torch

            if torch.cuda.is_available():
                cuda_devices = torch.cuda.device_count()
            else:
                cuda_error = ("torch.cuda.is_available() is False (torch CUDA build: "
                              f"{torch.version.cuda or 'none'})")
        except Exception as exc:  # a broken torch install is a fact too
            cuda_error = f"torch: {exc}"
        kv_version = kv_error = cufile = setting = None
        compat: bool | None = None
        try:
            import kvikio
            import kvikio.defaults

            kv_version = str(getattr(kvikio, "__version__", "?"))
        except Exception as exc:
            kv_error = str(exc) or type(exc).__name__
        if kv_version is not None:
            try:
                import kvikio.cufile_driver

                found = kvikio.cufile_driver.libcufile_version()
                if found and tuple(found) != (0, 0):
                    cufile = ".".join(str(p) for p in found)
            except Exception as exc:
                logger.debug("kvikio cannot load libcufile: %s", exc)
            try:
                compat = bool(kvikio.defaults.is_compat_mode_preferred())
                raw = kvikio.defaults.get("compat_mode")
                setting = getattr(raw, "name", str(raw))
            except Exception as exc:
                logger.debug("kvikio compat mode query failed: %s", exc)
                compat = True
        return cls(cuda_devices=cuda_devices, cuda_error=cuda_error, kvikio_version=kv_version,
                   kvikio_error=kv_error, libcufile_version=cufile,
                   compat_mode_preferred=compat, compat_mode_setting=setting,
                   nvidia_fs=os.path.exists("/proc/driver/nvidia-fs/version"))


@dataclass(frozen=True)
class PathDecision:
    """The read path chosen, why, and (``nvme.gds_mode: on``) why it must not start."""

    path: str
    reason: str
    refusal: str | None = None


def is_cuda_device(dst_device: str) -> bool:
    return str(dst_device).startswith("cuda")


def select_read_path(mode: str, dst_device: str, pool_bytes: int,
                     probe: GpuProbe) -> PathDecision:
    """Pure decision: which path reads chunks for this worker, under ``nvme.gds_mode``."""
    strict = mode == "on"
    if not is_cuda_device(dst_device):
        refusal = (f"nvme.gds_mode: 'on' but this LMCache worker's device is '{dst_device}', so "
                   "there is no GPU to read into. Set nvme.gds_mode to 'auto' (or 'off') on "
                   "CPU-only workers.") if strict else None
        return PathDecision(PATH_POSIX, f"destination device is {dst_device}", refusal)
    if pool_bytes <= 0:
        refusal = ("nvme.gpu_pool_mb: 0 leaves no GPU memory to read into, but nvme.gds_mode is "
                   "'on'. Give the pool room (e.g. 2048) or set nvme.gds_mode to 'auto'."
                   ) if strict else None
        return PathDecision(PATH_POSIX, "nvme.gpu_pool_mb is 0: chunks are served in host "
                            "memory and LMCache copies them to the GPU", refusal)
    if mode == "off":
        return PathDecision(PATH_HOST_BOUNCE, "nvme.gds_mode is 'off'")
    no_gpu = probe.cuda_devices <= 0
    problems: list[str] = []
    if no_gpu:
        problems.append(f"no usable CUDA GPU ({probe.cuda_error or 'no device'})")
    if probe.kvikio_version is None:
        problems.append(f"kvikio cannot be imported ({probe.kvikio_error or 'not installed'}; "
                        "pip install kvikio-cu13)")
    elif probe.libcufile_version is None:
        problems.append("kvikio cannot load libcufile, so there is no cuFile (install "
                        "nvidia-cufile / the GDS packages)")
    elif probe.compat_mode_preferred:
        problems.append(
            f"kvikio reports compat mode (compat_mode={probe.compat_mode_setting}), so cuFile/"
            f"GDS will not be used (nvidia-fs module loaded: "
            f"{'yes' if probe.nvidia_fs else 'no'}; in a container /run/udev must be "
            "mounted; KVIKIO_COMPAT_MODE must not be ON)")
    if strict:
        if problems:
            return PathDecision(PATH_KVIKIO_GDS, "nvme.gds_mode is 'on'", refusal=(
                "nvme.gds_mode: 'on' (strict) but " + "; ".join(problems) + ". Fix the GDS "
                "setup (lmcache-nvme doctor checks each part), or set nvme.gds_mode to 'auto' "
                "to accept kvikio's compat mode or the host path."))
        return PathDecision(PATH_KVIKIO_GDS, f"cuFile {probe.libcufile_version} with GDS "
                            "(nvme.gds_mode 'on')")
    if no_gpu or probe.kvikio_version is None:
        return PathDecision(PATH_HOST_BOUNCE, "; ".join(problems))
    if problems:
        return PathDecision(PATH_KVIKIO_COMPAT, "; ".join(problems))
    return PathDecision(PATH_KVIKIO_GDS, f"cuFile {probe.libcufile_version}, kvikio "
                        f"{probe.kvikio_version}, compat mode off")


def chunk_bytes_of(metadata: Any) -> int | None:
    """Bytes of one full KV chunk for LMCache's metadata (None when it does not say)."""
    shape = getattr(metadata, "kv_shape", None)
    dtype = getattr(metadata, "kv_dtype", None)
    if not shape or dtype is None:
        return None
    size = int(getattr(dtype, "itemsize", 0) or 0)
    for dim in shape:
        size *= int(dim)
    return size or None


def check_pool_size(pool_bytes: int, chunk_bytes: int | None, free_bytes: int | None,
                    key_prefix: str = "nvme.") -> None:
    """Refuse pool sizes that cannot work; the message names the key and the fix."""
    key = f"{key_prefix}gpu_pool_mb"
    if chunk_bytes and pool_bytes < padded_length(chunk_bytes):
        need = -(-padded_length(chunk_bytes) // MIB)
        raise NVMeConfigError(
            f"{key}: {pool_bytes / MIB:g} MiB cannot hold one KV chunk of this model "
            f"({chunk_bytes / MIB:.1f} MiB). Set it to at least {need} (several chunks: a "
            "retrieve reads a whole prefix at once), or to 0 to serve chunks in host memory.")
    if free_bytes is not None and pool_bytes > free_bytes:
        raise NVMeConfigError(
            f"{key}: {pool_bytes / MIB:g} MiB is more than the {free_bytes / MIB:.0f} MiB of "
            "GPU memory free now. Lower it: the model, its KV cache and LMCache need that "
            "memory too.")


# -- payload readers -----------------------------------------------------------


@dataclass
class PayloadRead:
    """Read ``length`` bytes at the payload offset of ``path`` into ``dest``."""

    path: Path
    dest: torch.Tensor  # contiguous uint8, at least ``length`` bytes
    length: int
    nread: int = 0
    error: BaseException | None = None


class PayloadReader(Protocol):
    name: str

    def read(self, reads: Sequence[PayloadRead]) -> None:
        """Fill each read's ``dest``, ``nread`` and ``error``; never raises."""


class KvikioPayloadReader:
    """kvikio ``CuFile.pread`` of every payload of a batch at once (kvikio's thread pool).

    ``num_threads`` and ``task_size`` are process-wide kvikio settings: a
    payload larger than the task size is split into tasks read in parallel.
    With ``strict`` kvikio's compat mode is switched off, so a file cuFile
    cannot serve fails loudly instead of going through bounce buffers.
    """

    name = "kvikio"

    def __init__(self, threads: int, task_size: int, strict: bool) -> None:
        import kvikio
        import kvikio.defaults

        self._kvikio = kvikio
        self.task_size = task_size
        settings: dict[str, Any] = {"num_threads": threads, "task_size": task_size}
        if strict:
            settings["compat_mode"] = kvikio.CompatMode.OFF
        kvikio.defaults.set(settings)

    def read(self, reads: Sequence[PayloadRead]) -> None:
        pending = []
        for r in reads:
            try:
                handle = self._kvikio.CuFile(r.path, "r")
            except Exception as exc:
                r.error = _open_error(r.path, exc)
                continue
            try:
                pending.append((r, handle, handle.pread(r.dest[: r.length], r.length,
                                                        HEADER_SIZE, self.task_size)))
            except Exception as exc:
                r.error = exc
                handle.close()
        for r, handle, future in pending:
            try:
                r.nread = int(future.get())
            except Exception as exc:
                r.error = exc
            finally:
                handle.close()


class PosixTensorPayloadReader:
    """``pread`` into CPU tensors: stands in for kvikio where there is no GPU (tests)."""

    name = "posix-tensor"

    def read(self, reads: Sequence[PayloadRead]) -> None:
        for r in reads:
            try:
                fd = os.open(r.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
            except OSError as exc:
                r.error = exc
                continue
            try:
                view = memoryview(r.dest[: r.length].numpy()).cast("B")  # type: ignore[arg-type]
                while r.nread < r.length:
                    n = os.preadv(fd, [view[r.nread :]], HEADER_SIZE + r.nread)
                    if n == 0:
                        break
                    r.nread += n
            except OSError as exc:
                r.error = exc
            finally:
                os.close(fd)


def _open_error(path: Path, exc: BaseException) -> BaseException:
    """kvikio reports a missing file as RuntimeError; the store needs FileNotFoundError."""
    if not path.exists():
        return FileNotFoundError(errno.ENOENT, "chunk file vanished", str(path))
    return exc


# -- the GPU buffer pool -------------------------------------------------------


class GpuBufferPool:
    """Device memory lent to LMCache as memory objects (LMCache's ``GPUMemoryAllocator``).

    Objects are reference counted by LMCache; one returns to the pool when its
    last holder lets go, never earlier.  LMCache's storage manager also puts
    every object a lower tier returns into its host memory tier
    (``LocalCPUBackend``), which would then keep GPU memory indefinitely and
    drain the pool.  When the pool is full, ``allocate`` asks ``reclaim`` to
    drop the oldest such entries that nobody else holds or pins (the chunk is
    still on NVMe), then tries again; if that is not enough it returns None and
    the caller serves the chunk in host memory instead.
    """

    def __init__(self, size: int, device: str, *, register: bool = False,
                 reclaim: Callable[[Any, MemoryObj], bool] | None = None,
                 max_reclaims: int = 64) -> None:
        from lmcache.v1.memory_allocators.gpu_memory_allocator import GPUMemoryAllocator

        self.size = size
        self.allocator = GPUMemoryAllocator(size, device=device, align_bytes=4096)
        self.tensor: torch.Tensor = self.allocator.tensor
        self.device = self.tensor.device
        self._reclaim = reclaim
        self._max_reclaims = max_reclaims
        self._lock = threading.Lock()
        self._lent: OrderedDict[int, tuple[Any, MemoryObj]] = OrderedDict()
        self.registered = False
        if register:
            try:
                import kvikio

                kvikio.memory_register(self.tensor)
                self.registered = True
            except Exception as exc:  # LMCache's CuFileMemoryAllocator dies here; we go on
                logger.warning("NVMe tier: cuFile registration of the %d MiB GPU pool failed "
                               "(%s); reading without it (cuFile uses its own bounce "
                               "buffers).", size // MIB, exc)

    def allocate(self, meta: TensorMeta, tag: Any = None) -> MemoryObj | None:
        obj = self._allocate(meta)
        if obj is None and self._reclaim is not None and self._reclaim_some():
            obj = self._allocate(meta)
        if obj is None or (obj := fit_to_payload(obj, meta.nbytes)) is None:
            return None
        with self._lock:
            self._lent[id(obj)] = (tag, obj)
        return obj

    def _allocate(self, meta: TensorMeta) -> MemoryObj | None:
        import torch
        from lmcache.v1.memory_management import MemoryFormat

        shapes = [torch.Size(s) for s in meta.shapes]
        dtypes = [getattr(torch, d) for d in meta.dtypes]
        fmt = MemoryFormat(meta.fmt)
        if len(shapes) == 1:
            return self.allocator.allocate(shapes[0], dtypes[0], fmt)
        return self.allocator.allocate(shapes, dtypes, fmt)

    def _reclaim_some(self) -> bool:
        """Let the oldest lent objects go where only LMCache's host tier still holds them."""
        assert self._reclaim is not None
        freed = False
        with self._lock:
            candidates = list(self._lent.items())[: self._max_reclaims * 4]
        tried = 0
        for ident, (tag, obj) in candidates:
            if obj.get_ref_count() <= 0:
                with self._lock:
                    self._lent.pop(ident, None)
                freed = True
                continue
            if tried >= self._max_reclaims:
                break
            tried += 1
            if self._reclaim(tag, obj):
                with self._lock:
                    self._lent.pop(ident, None)
                freed = freed or obj.get_ref_count() <= 0
        return freed

    def slot(self, obj: MemoryObj, length: int) -> torch.Tensor:
        """The pool bytes behind ``obj``: ``length`` of them (padding of the slot included)."""
        start = int(obj.metadata.address)
        return self.tensor[start : start + length]

    def capacity_for(self, obj: MemoryObj, payload_len: int) -> int:
        """Bytes to read into ``obj``: the padded payload when its slot has the room."""
        padded = padded_length(payload_len)
        return padded if obj.get_physical_size() >= padded else payload_len

    def lent(self) -> int:
        with self._lock:
            for ident in [i for i, (_, o) in self._lent.items() if o.get_ref_count() <= 0]:
                del self._lent[ident]
            return len(self._lent)

    def close(self) -> None:
        if self.registered:
            try:
                import kvikio

                kvikio.memory_deregister(self.tensor)
            except Exception as exc:
                logger.debug("cuFile deregistration failed: %s", exc)
            self.registered = False
        close = getattr(self.allocator, "close", None)
        if callable(close):
            close()


# -- the reader ----------------------------------------------------------------


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


@dataclass
class _Batch:
    """What one ``read`` call still has to do after its first pass."""

    bounce: list[tuple[int, MemoryObj | None]] = field(default_factory=list)
    host: list[int] = field(default_factory=list)


class GpuChunkReader:
    """Reads stored chunks into GPU pool memory objects by the chosen path."""

    def __init__(self, store: ChunkStore, decision: PathDecision, pool: GpuBufferPool,
                 alloc_host: Callable[[TensorMeta], MemoryObj | None],
                 host_view: Callable[[MemoryObj], memoryview],
                 payload_reader: PayloadReader | None = None, strict: bool = False) -> None:
        if decision.path in KVIKIO_PATHS and payload_reader is None:
            raise ValueError("a kvikio path needs a payload reader")
        self.store = store
        self.decision = decision
        self.pool = pool
        self.strict = strict
        self._alloc_host = alloc_host
        self._host_view = host_view
        self._payloads = payload_reader
        self._header_pool = ThreadPoolExecutor(max(2, store.settings.io_threads),
                                               thread_name_prefix="nvme-gpu-hdr")
        self._headers = PosixIOEngine(store.settings.task_size_bytes, self._header_pool)
        self._weights: DeviceWeights | None = None
        self._warned: dict[str, int] = {}

    @property
    def path(self) -> str:
        return self.decision.path

    def read(self, keys: Sequence[str], metas: Sequence[TensorMeta | None],
             tags: Sequence[Any] | None = None) -> list[MemoryObj | None]:
        """One memory object per key (GPU pool, or host memory as a fallback); None: a miss."""
        tags = list(tags) if tags is not None else list(keys)
        results: list[MemoryObj | None] = [None] * len(keys)
        wanted = [i for i, meta in enumerate(metas) if meta is not None]
        batch = _Batch()
        if self.decision.path in KVIKIO_PATHS:
            self._read_kvikio(keys, tags, wanted, results, batch)
        else:
            batch.bounce = [(i, None) for i in wanted]
        if batch.bounce:
            self._read_bounce(keys, metas, tags, batch.bounce, results, batch)
        if batch.host:
            self._read_host(keys, metas, batch.host, results)
        misses = len(keys) - sum(r is not None for r in results)
        logger.debug("NVMe tier: %d of %d chunks read by %s", len(keys) - misses, len(keys),
                     self.decision.path)
        return results

    # -- kvikio ----------------------------------------------------------------

    def _read_kvikio(self, keys: Sequence[str], tags: Sequence[Any], wanted: list[int],
                     results: list[MemoryObj | None], batch: _Batch) -> None:
        assert self._payloads is not None
        started = time.perf_counter()
        plans = self.store.plan_reads([keys[i] for i in wanted])
        jobs: list[_Job] = []
        for i, plan in zip(wanted, plans, strict=True):
            if plan is None:
                continue
            obj = self.pool.allocate(plan.meta, tags[i])
            if obj is None:
                self._note("gpu_pool_fallbacks", "GPU pool (nvme.gpu_pool_mb) is full; serving "
                           "chunks in host memory")
                batch.host.append(i)
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
        served_bytes = 0
        served = 0
        for job in jobs:
            verdict = self._judge(job)
            if verdict == "ok":
                results[job.index] = job.obj
                served += 1
                served_bytes += job.plan.payload_len
            elif verdict == "bounce":
                batch.bounce.append((job.index, job.obj))
            else:
                job.obj.ref_count_down()
        self._account(self.decision.path, served, served_bytes, time.perf_counter() - started)

    def _read_header(self, job: _Job) -> None:
        try:
            job.header, job.file_size = self._headers.read_header(job.plan.path,
                                                                  job.plan.direct)
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

    def _judge(self, job: _Job) -> str:
        """'ok' (serve), 'bounce' (verify through the host path) or 'miss'."""
        plan, read = job.plan, job.read
        error = job.header_error or read.error
        if error is not None and not isinstance(error, OSError):
            # kvikio/cuFile failed (not the drive): the file may be fine
            self._note("gpu_read_errors", f"kvikio read failed ({error})")
            return "miss" if self.strict else "bounce"
        if error is None and job.file_size < HEADER_SIZE + padded_length(plan.payload_len):
            error = ShortFileError(errno.EIO, "chunk file shorter than its payload",
                                   str(plan.path))
        if error is None and read.nread < plan.payload_len:
            error = ShortFileError(errno.EIO, "kvikio read short", str(plan.path))
        if error is None:
            try:
                if decode_header(job.header).gpu_checksum is None:
                    self._note("gpu_unverified_fallbacks", "chunk files without a GPU checksum "
                               "(written before the GPU path was on) are verified on the host")
                    return "bounce"
            except FormatError:
                pass  # complete_read rejects it with the reason
        mismatch = False

        def payload_ok(header: Any) -> bool:
            nonlocal mismatch
            mismatch = header.gpu_checksum != job.sums
            return not mismatch

        ok = self.store.complete_read(plan, job.header, error, payload_ok)
        if mismatch:
            self.store.stats.add("gpu_checksum_failures")
        if not ok:
            self.store.stats.add("read_failures")
        return "ok" if ok else "miss"

    # -- host read + device copy -------------------------------------------------

    def _read_bounce(self, keys: Sequence[str], metas: Sequence[TensorMeta | None],
                     tags: Sequence[Any], items: list[tuple[int, MemoryObj | None]],
                     results: list[MemoryObj | None], batch: _Batch) -> None:
        import torch

        started = time.perf_counter()
        staged: list[tuple[int, MemoryObj | None, MemoryObj]] = []
        for i, gpu_obj in items:
            meta = metas[i]
            assert meta is not None
            host = self._alloc_host(meta)
            if host is None:
                if gpu_obj is not None:
                    gpu_obj.ref_count_down()
                continue
            staged.append((i, gpu_obj, host))
        if not staged:
            return
        served = self.store.read_into([ChunkRead(keys[i], self._host_view(h))
                                       for i, _, h in staged])
        served_bytes = 0
        count = 0
        copies: list[MemoryObj] = []
        for (i, gpu_obj, host), ok in zip(staged, served, strict=True):
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
                self._note("gpu_pool_fallbacks", "GPU pool (nvme.gpu_pool_mb) is full; serving "
                           "chunks in host memory")
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
        self._account(PATH_HOST_BOUNCE, count, served_bytes, time.perf_counter() - started)

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
        staged = []
        for i in indices:
            meta = metas[i]
            assert meta is not None
            host = self._alloc_host(meta)
            if host is not None:
                staged.append((i, host))
        served = self.store.read_into([ChunkRead(keys[i], self._host_view(h))
                                       for i, h in staged]) if staged else []
        for (i, host), ok in zip(staged, served, strict=True):
            if ok:
                results[i] = host
            else:
                host.ref_count_down()

    # -- bookkeeping ---------------------------------------------------------------

    def _account(self, path: str, chunks: int, nbytes: int, seconds: float) -> None:
        self.store.stats.record_read(path, chunks, nbytes, seconds)
        if chunks:
            logger.debug("NVMe tier: %s read %d chunks, %.1f MiB at %.2f GB/s", path, chunks,
                         nbytes / MIB, nbytes / max(seconds, 1e-9) / 1e9)

    def _note(self, counter: str, message: str) -> None:
        """Count a fallback and log it (the first time, then every WARN_EVERY times)."""
        self.store.stats.add(counter)
        seen = self._warned.get(counter, 0)
        self._warned[counter] = seen + 1
        if seen % WARN_EVERY == 0:
            logger.warning("NVMe tier: %s (%s = %d).", message, counter, seen + 1)

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
    alloc_host: Callable[[TensorMeta], MemoryObj | None],
    host_view: Callable[[MemoryObj], memoryview],
    chunk_bytes: int | None = None,
    reclaim: Callable[[Any, MemoryObj], bool] | None = None,
    probe: GpuProbe | None = None,
    payload_reader: PayloadReader | None = None,
) -> tuple[PathDecision, GpuChunkReader | None]:
    """Choose the read path for ``dst_device`` and build its reader (None: host objects).

    Raises ``NVMeConfigError`` for ``nvme.gds_mode: on`` when GDS cannot run,
    and for a pool that cannot hold a chunk or does not fit in free GPU memory.
    """
    if probe is None:  # a host destination needs no detection (and no kvikio import)
        probe = GpuProbe.detect() if is_cuda_device(dst_device) else GpuProbe()
    decision = select_read_path(settings.gds_mode, dst_device, settings.gpu_pool_bytes, probe)
    if decision.refusal:
        raise NVMeConfigError(decision.refusal)
    if decision.path == PATH_POSIX:
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
    pool = GpuBufferPool(settings.gpu_pool_bytes, dst_device, reclaim=reclaim,
                         register=decision.path == PATH_KVIKIO_GDS and probe.cuda_devices > 0)
    reader = GpuChunkReader(store, decision, pool, alloc_host, host_view, payload_reader,
                            strict=settings.gds_mode == "on")
    # Files written from now on carry the checksum the GPU path verifies.
    store.record_gpu_checksums = kvikio_path
    log = logger.info if decision.path == PATH_KVIKIO_GDS else logger.warning
    log("NVMe tier read path: %s into a %d MiB GPU pool on %s (%s).", decision.path,
        settings.gpu_pool_bytes // MIB, dst_device, decision.reason)
    return decision, reader
