"""Which read path a CUDA worker uses (docs/gpu.md), from facts about the machine (a
``GpuProbe``), ``nvme.gds_mode`` and the destination device; needs no GPU to test.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass
from typing import Any

from ..config import MIB, NVMeConfigError
from ..disk.format import padded_length
from ..store import ReadPath

logger = logging.getLogger("lmcache_nvme_backend")

KVIKIO_PATHS = (ReadPath.KVIKIO_GDS, ReadPath.KVIKIO_COMPAT)

#: The package's GPU extras (each pulls ``kvikio-cuNN``), by torch's CUDA major.
GPU_EXTRAS = {12: "cu12", 13: "cu13"}


def torch_cuda_version() -> str | None:
    """``torch.version.cuda`` (e.g. ``"13.0"``); None for a CPU build or without torch."""
    try:
        import torch
    except Exception:
        return None
    return getattr(torch.version, "cuda", None) or None


def gpu_extra_for(cuda_version: str | None) -> str | None:
    """The extra (``cu12``, ``cu13``) for a torch built with ``cuda_version``; None for a
    CPU build or a CUDA major without a kvikio wheel."""
    if not cuda_version:
        return None
    try:
        major = int(str(cuda_version).split(".")[0])
    except ValueError:
        return None
    return GPU_EXTRAS.get(major)


def kvikio_install_hint(cuda_version: str | None) -> str:
    """How to get kvikio for a torch built with ``cuda_version`` (``torch_cuda_version()``)."""
    extra = gpu_extra_for(cuda_version)
    if extra is not None:
        return (f'pip install "lmcache-nvme-backend[{extra}]" (kvikio-{extra}, matching torch\'s '
                f"CUDA {cuda_version})")
    if not cuda_version:
        return ("this torch is a CPU build, so there is no GPU to read into; on a GPU server "
                "install the extra matching torch.version.cuda: [cu12] or [cu13]")
    return (f"torch is built for CUDA {cuda_version}, but kvikio wheels exist for CUDA 12 and "
            "13 only (extras [cu12], [cu13]): install a torch built for one of them")


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
    torch_cuda: str | None = None  # torch.version.cuda: which kvikio wheel fits

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
                   nvidia_fs=os.path.exists("/proc/driver/nvidia-fs/version"),
                   torch_cuda=torch_cuda_version())


@dataclass(frozen=True)
class PathDecision:
    """The read path chosen, why, and (``nvme.gds_mode: on``) why it must not start."""

    path: ReadPath
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
        return PathDecision(ReadPath.POSIX, f"destination device is {dst_device}", refusal)
    if pool_bytes <= 0:
        refusal = ("nvme.gpu_pool_mb: 0 leaves no GPU memory to read into, but nvme.gds_mode is "
                   "'on'. Give the pool room (e.g. 2048) or set nvme.gds_mode to 'auto'."
                   ) if strict else None
        return PathDecision(ReadPath.POSIX, "nvme.gpu_pool_mb is 0: chunks are served in host "
                            "memory and LMCache copies them to the GPU", refusal)
    if mode == "off":
        return PathDecision(ReadPath.HOST_BOUNCE, "nvme.gds_mode is 'off'")
    no_gpu = probe.cuda_devices <= 0
    problems: list[str] = []
    if no_gpu:
        problems.append(f"no usable CUDA GPU ({probe.cuda_error or 'no device'})")
    if probe.kvikio_version is None:
        problems.append(f"kvikio cannot be imported ({probe.kvikio_error or 'not installed'}; "
                        f"{kvikio_install_hint(probe.torch_cuda)})")
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
            return PathDecision(ReadPath.KVIKIO_GDS, "nvme.gds_mode is 'on'", refusal=(
                "nvme.gds_mode: 'on' (strict) but " + "; ".join(problems) + ". Fix the GDS "
                "setup (lmcache-nvme doctor checks each part), or set nvme.gds_mode to 'auto' "
                "to accept kvikio's compat mode or the host path."))
        return PathDecision(ReadPath.KVIKIO_GDS, f"cuFile {probe.libcufile_version} with GDS "
                            "(nvme.gds_mode 'on')")
    if no_gpu or probe.kvikio_version is None:
        return PathDecision(ReadPath.HOST_BOUNCE, "; ".join(problems))
    if problems:
        return PathDecision(ReadPath.KVIKIO_COMPAT, "; ".join(problems))
    return PathDecision(ReadPath.KVIKIO_GDS, f"cuFile {probe.libcufile_version}, kvikio "
                        f"{probe.kvikio_version}, compat mode off")


def chunk_bytes_of(metadata: Any) -> int | None:
    """Bytes of one full KV chunk for LMCache's metadata (None when it does not say)."""
    shape = getattr(metadata, "kv_shape", None)
    dtype = getattr(metadata, "kv_dtype", None)
    if not shape or dtype is None:
        return None
    return int(getattr(dtype, "itemsize", 0) or 0) * math.prod(int(d) for d in shape) or None


def check_pool_size(pool_bytes: int, chunk_bytes: int | None, free_bytes: int | None) -> None:
    """Refuse pool sizes that cannot work; the message names the key and the fix."""
    key = "nvme.gpu_pool_mb"
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
