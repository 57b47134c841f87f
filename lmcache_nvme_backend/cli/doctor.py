"""``lmcache-nvme doctor PATH``: is this path, and this machine's GPU I/O stack, ready?

The GPU checks are INFO unless ``--gpu`` or ``nvme.gds_mode: on`` in ``--config`` makes them
count.  Nothing is changed but a probe file created and removed in PATH.
"""

from __future__ import annotations

import argparse
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from ..adapters.hashing import FIX as HASHING_FIX
from ..adapters.hashing import RECOMMENDED_ALGORITHM, token_hashing, unknown_algorithm
from ..adapters.lmcache_range import in_range, lmcache_version, supported_range
from ..config import EXTRA_CONFIG_PREFIX, GdsMode, NVMeConfigError, NVMeSettings
from ..disk.mounts import mount_for
from ..disk.probe import probe_path
from .check import FAIL, INFO, PASS, SKIP, WARN, WORST_FOR, Check, exit_status, print_report
from .common import CLIError, add_output_options, non_negative_float, print_json
from .gpu_checks import check_gpu, check_kvikio, check_libcufile, check_nvidia_fs, check_run_udev
from .path_checks import (
    check_alignment,
    check_direct_io,
    check_filesystem,
    check_free_space,
    check_path,
)

GPU_CHECKS = ("kvikio", "libcufile", "nvidia-fs", "/run/udev", "GPU")  # as --skip-gpu lists them


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
                        "pre_caching_hash_algorithm and its nvme.* settings, and "
                        "nvme.gds_mode: on makes the GPU checks count (check-config checks "
                        "the whole file)")
    add_gpu_and_json_options(p)
    p.set_defaults(func=run)
    return p


def add_gpu_and_json_options(p: argparse.ArgumentParser) -> None:
    """``--gpu`` / ``--skip-gpu`` and ``--json``, shared with ``check-config``."""
    gpu = p.add_mutually_exclusive_group()
    gpu.add_argument("--gpu", action="store_true",
                     help="GPU server whose workers read through kvikio/GDS: GPU problems "
                          "are warnings and failures (exit 1/2) instead of INFO")
    gpu.add_argument("--skip-gpu", action="store_true",
                     help="host-only deployment: skip the kvikio/GDS/GPU checks")
    add_output_options(p)


def check_lmcache() -> Check:
    version, spec = lmcache_version(), supported_range()
    fix = f"pip install 'lmcache{spec}'"
    if version is None:
        return Check("lmcache", WARN, "lmcache is not installed", fix)
    if in_range(version, spec):
        return Check("lmcache", PASS, f"lmcache {version} (tested range {spec})")
    return Check("lmcache", WARN, f"lmcache {version} is outside the tested range {spec}", fix)


def check_token_hashing(config: dict[str, Any] | None, source: str = "the --config") -> Check:
    """Do the in-process engines' chunk keys survive a restart (hashing.py)?  ``source``
    names where ``config`` came from."""
    algorithm = (config or {}).get("pre_caching_hash_algorithm")
    unknown = unknown_algorithm(algorithm)
    if unknown is not None:
        return Check("token hashing", FAIL, unknown,
                     f"set pre_caching_hash_algorithm: {RECOMMENDED_ALGORITHM}")
    facts = token_hashing(algorithm)
    where = (source if config is not None else
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


def load_lmcache_config(path: Path, label: str = "--config ") -> dict[str, Any]:
    """The LMCache YAML (or JSON: YAML reads it too) at ``path`` as a mapping; a CLIError
    naming ``label`` and the file when it cannot be read or is not a mapping."""
    import yaml

    try:
        loaded = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise CLIError(f"{label}{path}: cannot read it ({exc.strerror or exc})") from exc
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        raise CLIError(f"{label}{path}: not valid YAML or JSON ({exc})") from exc
    if not isinstance(loaded, dict):
        raise CLIError(f"{label}{path}: not an LMCache config (a YAML mapping of settings "
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


def gpu_stack(skip_gpu: bool, gpu_strict: bool) -> list[Check]:
    """The GPU I/O stack checks: skipped, counted (``gpu_strict``), or informational (a
    problem is INFO: the deployment does not need the GPU path)."""
    if skip_gpu:
        return [Check(name, SKIP, "skipped (--skip-gpu)") for name in GPU_CHECKS]
    gpu = check_kvikio(gpu_strict) + [check_libcufile(), check_nvidia_fs(), check_run_udev(),
                                      check_gpu()]
    return gpu if gpu_strict else [replace(c, status=INFO) if c.status in (WARN, FAIL) else c
                                   for c in gpu]


def run_checks(path: Path, max_size_gb: float | None, min_free_gb: float | None,
               skip_gpu: bool, gpu_strict: bool = False,
               config: dict[str, Any] | None = None) -> list[Check]:
    path = path.absolute()
    mount = mount_for(path)
    first, probe_dir = check_path(probe_path(path, tree=False), mount)
    checks = [first, check_filesystem(mount)]
    if probe_dir is not None:
        checks += [check_direct_io(probe_dir),
                   check_free_space(probe_dir, max_size_gb, min_free_gb),
                   check_alignment(probe_dir, mount)]
    checks += [check_lmcache(), check_token_hashing(config)]
    if config is not None:
        checks.append(check_config_settings(config))
    return checks + gpu_stack(skip_gpu, gpu_strict)


def check_config_settings(config: dict[str, Any]) -> Check:
    """The ``--config``'s ``nvme.*`` settings, by the tier's own rules (``check-config``
    checks the rest of the file and each ``nvme.path``)."""
    extra = config.get("extra_config") or {}
    params = NVMeSettings.extra_config_params(extra if isinstance(extra, dict) else {})
    if not params:
        return Check("settings", SKIP, "the --config has no nvme.* settings")
    errors = NVMeSettings.review(params, key_prefix=EXTRA_CONFIG_PREFIX).errors
    if not errors:
        return Check("settings", PASS, f"its {len(params)} nvme.* settings are valid")
    return Check("settings", FAIL, "; ".join(str(e) for e in errors),
                 "correct them; lmcache-nvme check-config YAML checks the whole file and "
                 "each nvme.path")


def run(args: argparse.Namespace) -> int:
    config = None if args.config is None else load_lmcache_config(args.config)
    gpu_strict = args.gpu or gds_mode_of(config) is GdsMode.ON
    checks = run_checks(args.path, args.max_size_gb, args.min_free_gb, args.skip_gpu,
                        gpu_strict, config)
    status = exit_status(checks)
    gpu_note = ("GPU checks count (--gpu)" if args.gpu else
                "GPU checks count (nvme.gds_mode: on in --config)" if gpu_strict else
                "GPU checks skipped" if args.skip_gpu else
                "GPU checks informational (--gpu makes them count)")
    if args.json:
        print_json({"command": "doctor", "path": str(args.path.absolute()),
                    "checks": [asdict(c) for c in checks], "worst": WORST_FOR[status],
                    "gpu_strict": gpu_strict, "exit_status": status})
        return status
    print_report(f"lmcache-nvme doctor {args.path.absolute()}", checks, gpu_note)
    return status
