"""``lmcache-nvme doctor PATH``: is this path, and this machine's GPU I/O stack, ready?

Each check prints PASS, INFO, WARN, FAIL (or SKIP) with what it found and, when not
PASS, the fix.  Exit status: 0 nothing to fix (PASS, INFO, SKIP), 1 at least one
warning, 2 at least one failure.  The GPU checks (kvikio, libcufile, nvidia-fs,
/run/udev, GPU) are INFO unless the deployment needs them: ``--gpu``, or a
``--config`` whose ``nvme.gds_mode`` is ``on``, makes their problems count.
Nothing is changed except a probe file created and removed in PATH (the same
O_DIRECT probe the backend runs at start).
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
from dataclasses import asdict
from importlib import metadata
from pathlib import Path
from typing import Any

from ..adapters.hashing import FIX as HASHING_FIX
from ..adapters.hashing import RECOMMENDED_ALGORITHM, token_hashing
from ..config import GdsMode, NVMeConfigError, NVMeSettings, min_free_bytes_for
from ..disk.format import ALIGNMENT
from ..io.posix import probe_direct_io
from .check import EXIT_FOR, FAIL, INFO, PASS, SKIP, WARN, Check
from .common import (
    GIB,
    CLIError,
    MountInfo,
    mount_for,
    nearest_existing,
    non_negative_float,
    print_json,
)
from .gpu_checks import check_gpu, check_kvikio, check_libcufile, check_nvidia_fs, check_run_udev

GPU_CHECKS = ("kvikio", "kvikio compat mode", "libcufile", "nvidia-fs", "/run/udev", "GPU")
GOOD_LOCAL_FS = {"ext4", "xfs"}
SHARED_FS = {"lustre", "gpfs", "beegfs", "wekafs", "nfs", "nfs4", "cephfs", "ceph"}
COW_FS = {"btrfs", "zfs", "bcachefs"}
MEMORY_FS = {"tmpfs", "ramfs", "devtmpfs"}
LOW_FREE_GB = 10.0




def add_parser(sub: Any) -> argparse.ArgumentParser:
    p: argparse.ArgumentParser = sub.add_parser(
        "doctor", help="check a path and the GPU/GDS stack for the NVMe tier",
        description="Check PATH (filesystem, O_DIRECT, free space, alignment), LMCache's "
                    "token hashing (do chunk keys survive a restart?) and the GPU I/O stack "
                    "(kvikio and its compat mode, libcufile, nvidia-fs, /run/udev, GPU "
                    "visibility). Each check is PASS, INFO, WARN or FAIL with the fix. The "
                    "GPU checks are informational (INFO) unless --gpu is given or the "
                    "--config sets nvme.gds_mode: on.",
        epilog="exit status: 0 nothing to fix (PASS, INFO, SKIP), 1 warnings, 2 failures "
               "(argparse usage errors also exit 2)")
    p.add_argument("path", metavar="PATH", type=Path, help="the cache directory (nvme.path)")
    p.add_argument("--max-size-gb", type=non_negative_float, metavar="GB",
                   help="the budget you plan (nvme.max_size_gb): warn when it does not fit")
    p.add_argument("--min-free-gb", type=non_negative_float, default=None, metavar="GB",
                   help="the free-space guard (nvme.min_free_gb; default auto: 5%% of the "
                        "filesystem, at most 1 GiB)")
    p.add_argument("--config", type=Path, metavar="YAML",
                   help="the LMCache config the engines use: checks its "
                        "pre_caching_hash_algorithm, and nvme.gds_mode: on makes the GPU "
                        "checks count")
    gpu = p.add_mutually_exclusive_group()
    gpu.add_argument("--gpu", action="store_true",
                     help="GPU server whose workers read through kvikio/GDS: GPU problems "
                          "are warnings and failures (exit 1/2) instead of INFO")
    gpu.add_argument("--skip-gpu", action="store_true",
                     help="host-only deployment: skip the kvikio/GDS/GPU checks")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.set_defaults(func=run)
    return p


# -- path checks ------------------------------------------------------------------------


def check_path(path: Path) -> tuple[Check, Path | None]:
    """Exists (or can be created) and is writable; returns the directory to probe."""
    if path.exists() and not path.is_dir():
        return Check("path", FAIL, f"{path} exists and is not a directory",
                     "point nvme.path at a directory"), None
    probe_dir = path if path.exists() else nearest_existing(path)
    try:
        fd, name = tempfile.mkstemp(prefix=".doctor-probe-", dir=probe_dir)
        os.close(fd)
        os.unlink(name)
    except OSError as exc:
        return Check("path", FAIL, f"{probe_dir} is not writable ({exc.strerror})",
                     "grant the server's user write access, or choose another directory"
                     ), None
    if not path.exists():
        return Check("path", WARN, f"{path} does not exist yet; {probe_dir} is writable "
                     "(checks below ran there)",
                     "nothing to do if this is intended: the backend creates it"), probe_dir
    return Check("path", PASS, f"{path} is a writable directory"), probe_dir


def check_filesystem(mount: MountInfo | None) -> Check:
    if mount is None:
        return Check("filesystem", WARN, "not found in /proc/mounts",
                     "check that /proc is mounted")
    where = f"{mount.fstype} ({mount.device} on {mount.mountpoint})"
    fs = mount.fstype
    if fs in GOOD_LOCAL_FS:
        return Check("filesystem", PASS, where)
    if fs in SHARED_FS:
        return Check("filesystem", PASS, f"{where}: shared filesystem, several processes or "
                     "nodes can use one cache tree")
    if fs in MEMORY_FS:
        return Check("filesystem", WARN, f"{where}: memory, not a drive; the tier would "
                     "duplicate host memory and GDS cannot read from it",
                     "put nvme.path on an NVMe drive formatted ext4 or xfs")
    if fs == "overlay" or fs.startswith("fuse"):
        return Check("filesystem", WARN, f"{where}: container or FUSE filesystem, usually "
                     "without O_DIRECT and slow for large files",
                     "bind-mount a directory of the NVMe drive into the container "
                     "(docker -v /mnt/nvme0/lmcache:/cache) and use that")
    if fs in COW_FS:
        return Check("filesystem", WARN, f"{where}: copy-on-write filesystem; checksumming "
                     "and CoW cost bandwidth, and GDS does not support it",
                     "prefer ext4 or xfs for the cache directory")
    return Check("filesystem", WARN, f"{where}: not a filesystem this backend is tested on",
                 "prefer ext4 or xfs on a local NVMe drive")


def check_direct_io(probe_dir: Path) -> Check:
    try:
        ok = probe_direct_io(probe_dir)
    except OSError as exc:
        return Check("O_DIRECT", FAIL, f"probe failed: {exc.strerror or exc}",
                     "make the directory writable")
    if ok:
        return Check("O_DIRECT", PASS, "supported: reads bypass the page cache")
    return Check("O_DIRECT", WARN, "not supported here: the backend falls back to buffered "
                 "I/O (nvme.direct_io: auto) or refuses to start (on); GPUDirect Storage "
                 "cannot work", "use a local ext4 or xfs filesystem on the NVMe drive")


def check_free_space(probe_dir: Path, max_size_gb: float | None,
                     min_free_gb: float | None) -> Check:
    usage = shutil.disk_usage(probe_dir)
    min_free_gb = min_free_bytes_for(min_free_gb, usage.total) / GIB  # None: auto
    free_gb = usage.free / GIB
    detail = f"{free_gb:.1f} GiB free of {usage.total / GIB:.1f} GiB"
    if free_gb < min_free_gb:
        return Check("free space", FAIL, f"{detail}, below the guard nvme.min_free_gb="
                     f"{min_free_gb:g}: every write would be dropped",
                     "free space on the drive or lower nvme.min_free_gb")
    if max_size_gb is not None and max_size_gb + min_free_gb > free_gb:
        return Check("free space", WARN, f"{detail}; nvme.max_size_gb={max_size_gb:g} plus "
                     f"the guard {min_free_gb:g} GiB does not fit (counting space the cache "
                     "already uses as taken): the free-space guard will evict before the "
                     "budget is reached", "lower nvme.max_size_gb or free space")
    if max_size_gb is None and free_gb < LOW_FREE_GB:
        return Check("free space", WARN, f"{detail}: little room for a cache tier",
                     "use a larger drive or free space")
    return Check("free space", PASS, detail)


def _logical_block_size(mount: MountInfo | None) -> int | None:
    if mount is None or not mount.device.startswith("/dev/"):
        return None
    name = os.path.basename(os.path.realpath(mount.device))
    for candidate in (f"/sys/class/block/{name}/queue/logical_block_size",
                      f"/sys/class/block/{name}/../queue/logical_block_size"):
        try:
            with open(candidate) as f:
                return int(f.read().strip())
        except (OSError, ValueError):
            continue
    return None


def check_alignment(probe_dir: Path, mount: MountInfo | None) -> Check:
    st = os.statvfs(probe_dir)
    lbs = _logical_block_size(mount)
    detail = f"filesystem block size {st.f_bsize} bytes"
    if lbs is not None:
        detail += f", device logical block size {lbs} bytes"
    sizes = [st.f_bsize] + ([lbs] if lbs else [])
    if all(s and ALIGNMENT % s == 0 for s in sizes):
        return Check("alignment", PASS, f"{detail}; chunk payloads are {ALIGNMENT}-byte "
                     "aligned, which O_DIRECT and GDS accept here")
    return Check("alignment", WARN, f"{detail}: larger than the chunk format's {ALIGNMENT}-"
                 "byte alignment, so O_DIRECT reads of payloads may be refused",
                 f"format the filesystem with {ALIGNMENT}-byte blocks (mkfs.xfs -b size=4096, "
                 "mkfs.ext4 -b 4096)")


# -- GPU stack checks -----------------------------------------------------------------


def check_lmcache() -> Check:
    try:
        version = metadata.version("lmcache")
    except metadata.PackageNotFoundError:
        return Check("lmcache", WARN, "lmcache is not installed",
                     "pip install 'lmcache>=0.5.6,<0.6'")
    try:
        parts = tuple(int(x) for x in version.split(".")[:3])
    except ValueError:
        parts = ()
    if parts and (0, 5, 6) <= parts < (0, 6):
        return Check("lmcache", PASS, f"lmcache {version} (tested range >=0.5.6,<0.6)")
    return Check("lmcache", WARN, f"lmcache {version} is outside the tested range "
                 ">=0.5.6,<0.6", "pip install 'lmcache>=0.5.6,<0.6'")


def check_token_hashing(config: dict[str, Any] | None) -> Check:
    """Do the in-process engines' chunk keys survive a restart (hashing.py)?"""
    algorithm = (config or {}).get("pre_caching_hash_algorithm")
    facts = token_hashing(algorithm)
    where = ("the --config" if config is not None else
             "LMCache's default; pass --config YAML to check yours")
    detail = (f"{facts.describe()} ({where}; PYTHONHASHSEED as in this shell; the "
              "multiprocess server hashes with blake3 and is not affected)")
    if facts.stable:
        return Check("token hashing", PASS, detail)
    if config is None:  # the default here; the user's YAML may set sha256_cbor already
        return Check("token hashing", INFO, detail,
                     f"set pre_caching_hash_algorithm: {RECOMMENDED_ALGORITHM} in the LMCache "
                     "config (examples/lmcache-nvme.yaml does)")
    return Check("token hashing", WARN, detail, HASHING_FIX)


def load_lmcache_config(path: Path) -> dict[str, Any]:
    """The LMCache YAML given with --config, as a mapping (CLIError naming the file)."""
    import yaml

    try:
        loaded = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise CLIError(f"--config {path}: cannot read it ({exc.strerror or exc})") from exc
    except yaml.YAMLError as exc:
        raise CLIError(f"--config {path}: not valid YAML ({exc})") from exc
    if not isinstance(loaded, dict):
        raise CLIError(f"--config {path}: not an LMCache config (a YAML mapping of settings "
                       "such as chunk_size and extra_config)")
    return loaded


def gds_mode_of(config: dict[str, Any] | None) -> GdsMode | None:
    """The config's ``nvme.gds_mode`` read as the tier reads it (unquoted YAML ``on`` too)."""
    extra = (config or {}).get("extra_config") or {}
    if not isinstance(extra, dict) or "nvme.gds_mode" not in extra:
        return None
    try:
        mode: GdsMode = NVMeSettings.parse_setting("gds_mode", extra["nvme.gds_mode"])
    except NVMeConfigError as exc:
        raise CLIError(f"--config: {exc}") from exc
    return mode


def informational(check: Check) -> Check:
    """A GPU check the deployment does not need: its problem is INFO (exit 0)."""
    if check.status in (WARN, FAIL):
        return Check(check.name, INFO, check.detail, check.fix)
    return check


def run_checks(path: Path, max_size_gb: float | None, min_free_gb: float | None,
               skip_gpu: bool, gpu_strict: bool = False,
               config: dict[str, Any] | None = None) -> list[Check]:
    path = path.absolute()
    first, probe_dir = check_path(path)
    checks = [first]
    mount = mount_for(path)
    checks.append(check_filesystem(mount))
    if probe_dir is not None:
        checks += [check_direct_io(probe_dir),
                   check_free_space(probe_dir, max_size_gb, min_free_gb),
                   check_alignment(probe_dir, mount)]
    checks.append(check_lmcache())
    checks.append(check_token_hashing(config))
    if skip_gpu:
        checks += [Check(name, SKIP, "skipped (--skip-gpu)") for name in GPU_CHECKS
                   if name != "kvikio compat mode"]
    else:
        gpu = check_kvikio(gpu_strict) + [check_libcufile(), check_nvidia_fs(), check_run_udev(),
                                check_gpu()]
        checks += gpu if gpu_strict else [informational(c) for c in gpu]
    return checks


def run(args: argparse.Namespace) -> int:
    config = None if args.config is None else load_lmcache_config(args.config)
    gpu_strict = args.gpu or gds_mode_of(config) is GdsMode.ON
    checks = run_checks(args.path, args.max_size_gb, args.min_free_gb, args.skip_gpu,
                        gpu_strict, config)
    status = max(EXIT_FOR[c.status] for c in checks)
    worst = {0: PASS, 1: WARN, 2: FAIL}[status]
    gpu_note = ("GPU checks count (--gpu)" if args.gpu else
                "GPU checks count (nvme.gds_mode: on in --config)" if gpu_strict else
                "GPU checks skipped" if args.skip_gpu else
                "GPU checks informational (--gpu makes them count)")
    if args.json:
        print_json({"command": "doctor", "path": str(args.path.absolute()),
                    "checks": [asdict(c) for c in checks], "worst": worst,
                    "gpu_strict": gpu_strict, "exit_status": status})
        return status
    print(f"lmcache-nvme doctor {args.path.absolute()}")
    width = max(len(c.name) for c in checks)
    for c in checks:
        print(f"  {c.status.upper():<4}  {c.name:<{width}}  {c.detail}")
        if c.fix and c.status in (INFO, WARN, FAIL):
            print(f"  {'':<4}  {'':<{width}}  {'fix' if c.status != INFO else 'if needed'}: "
                  f"{c.fix}")
    counts = {s: sum(c.status == s for c in checks) for s in (PASS, INFO, WARN, FAIL, SKIP)}
    print(f"result: {worst.upper()} ({counts[PASS]} passed, {counts[INFO]} informational, "
          f"{counts[WARN]} warnings, {counts[FAIL]} failures, {counts[SKIP]} skipped; "
          f"{gpu_note}); exit status {status}")
    return status
