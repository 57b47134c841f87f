"""``doctor``'s checks of the GPU I/O stack: kvikio, libcufile, nvidia-fs, /run/udev, GPU
(read-only)."""

from __future__ import annotations

import contextlib
import ctypes
import glob
import os
import sys
from pathlib import Path

from ..gpu.select import kvikio_install_hint, torch_cuda_version
from .check import INFO, PASS, WARN, Check


def check_kvikio(gpu_strict: bool = False) -> list[Check]:
    """kvikio and its compat mode; without kvikio and with a CPU build of torch that is
    INFO (nothing to read into), unless the GPU path is required (``gpu_strict``)."""
    cuda = torch_cuda_version()
    try:
        import kvikio
        import kvikio.defaults
    except Exception as exc:  # ImportError, or a broken CUDA library underneath
        if cuda is None and not gpu_strict:
            return [Check("kvikio", INFO, f"not installed ({exc}); not needed with this "
                          "torch (a CPU build): reads go through O_DIRECT into host memory",
                          kvikio_install_hint(cuda))]
        return [Check("kvikio", WARN, f"cannot import kvikio ({exc}); the GPU read path "
                      "falls back to host reads plus a copy", kvikio_install_hint(cuda))]
    checks = [Check("kvikio", PASS, f"kvikio {getattr(kvikio, '__version__', '?')} imports")]
    try:
        mode = kvikio.defaults.get("compat_mode")
        compat = bool(kvikio.defaults.is_compat_mode_preferred())
    except Exception as exc:
        checks.append(Check("kvikio compat mode", WARN, f"cannot query it ({exc})",
                            f"upgrade kvikio: {kvikio_install_hint(cuda)}"))
        return checks
    mode_name = getattr(mode, "name", str(mode))
    env = os.environ.get("KVIKIO_COMPAT_MODE")
    setting = f"KVIKIO_COMPAT_MODE={env}" if env else f"compat_mode={mode_name}"
    if compat:
        checks.append(Check("kvikio compat mode", WARN, f"{setting}: kvikio will use its "
                            "compat mode (POSIX reads into host bounce buffers, then a copy "
                            "to the GPU), not GPUDirect Storage",
                            "install GDS (nvidia-fs, libcufile), expose /run/udev in "
                            "containers; see the nvidia-fs and /run/udev lines"))
    else:
        checks.append(Check("kvikio compat mode", PASS, f"{setting}: kvikio will use "
                            "cuFile (GPUDirect Storage)"))
    return checks


def _libcufile_candidates() -> list[str]:
    found = []
    for site in sys.path:
        found += glob.glob(os.path.join(site, "nvidia", "*", "lib", "libcufile.so*"))
    found += glob.glob("/usr/local/cuda*/lib64/libcufile.so*")
    found += glob.glob("/usr/lib/x86_64-linux-gnu/libcufile.so*")
    return sorted({f for f in found if "rdma" not in os.path.basename(f)})


def check_libcufile() -> Check:
    loaded = None
    for name in ("libcufile.so.0", "libcufile.so"):
        with contextlib.suppress(OSError):
            ctypes.CDLL(name)
            loaded = name
            break
    files = _libcufile_candidates()
    version = ""
    with contextlib.suppress(Exception):
        import kvikio.cufile_driver

        major, minor = kvikio.cufile_driver.libcufile_version()
        version = f"version {major}.{minor}"
    if loaded or files:
        where = f"loadable as {loaded}" if loaded else f"found at {files[0]}"
        return Check("libcufile", PASS, " ".join(x for x in (where, version) if x))
    return Check("libcufile", WARN, "libcufile (cuFile, the GDS user library) not found",
                 "pip install nvidia-cufile (or the CUDA toolkit's gds package)")


def check_nvidia_fs() -> Check:
    proc = Path("/proc/driver/nvidia-fs")
    if proc.exists():
        version = ""
        with contextlib.suppress(OSError):
            version = (proc / "version").read_text().split("\n")[0].strip()
        return Check("nvidia-fs", PASS, f"kernel module loaded {version}".strip())
    return Check("nvidia-fs", WARN, "/proc/driver/nvidia-fs is absent: the GDS kernel module "
                 "is not loaded, so cuFile runs in compat mode (unless this GDS release uses "
                 "the kernel's PCI P2PDMA instead)",
                 "install nvidia-gds and modprobe nvidia-fs on the host")


def check_run_udev() -> Check:
    udev = Path("/run/udev")
    try:
        visible = udev.is_dir() and any(udev.iterdir())
    except OSError:
        visible = False
    if visible:
        return Check("/run/udev", PASS, "visible (cuFile can identify the NVMe devices)")
    return Check("/run/udev", WARN, "/run/udev is missing or empty: cuFile cannot identify "
                 "block devices and falls back to compat mode",
                 "in a container, mount it read-only: docker run -v /run/udev:/run/udev:ro")


def check_gpu() -> Check:
    try:
        import torch
    except Exception as exc:
        return Check("GPU", WARN, f"cannot import torch ({exc})", "install torch")
    try:
        if not torch.cuda.is_available():
            build = torch.version.cuda or "none (CPU-only build)"
            return Check("GPU", WARN, f"no CUDA GPU visible to torch {torch.__version__} "
                         f"(CUDA build: {build}); only the host path can run",
                         "install a CUDA build of torch and expose the GPU (nvidia driver, "
                         "docker --gpus all, CUDA_VISIBLE_DEVICES)")
        names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    except Exception as exc:
        return Check("GPU", WARN, f"torch.cuda failed: {exc}", "check the NVIDIA driver")
    return Check("GPU", PASS, f"{len(names)} visible: " + ", ".join(names))
