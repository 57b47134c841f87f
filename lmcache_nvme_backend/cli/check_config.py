"""``lmcache-nvme check-config FILE``: will this LMCache YAML or ``--l2-adapter`` JSON load
the NVMe tier, and is each path ready?  Plugin keys, every setting by the tier's own rules,
each path as ``doctor`` checks it (plus its tree and budget share), token hashing, the GPU
stack for ``NVMeBackend``.  Exit status as ``doctor``; nothing is created.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import asdict
from pathlib import Path
from typing import Any

from ..config import (
    ADAPTER_PARAMS_PREFIX,
    EXTRA_CONFIG_PREFIX,
    GdsMode,
    NVMeSettings,
    SettingsReview,
    adapter_params_of,
)
from ..disk.mounts import mount_for
from ..disk.probe import probe_path
from ..store.access import user_name
from .check import FAIL, INFO, PASS, SKIP, WARN, WORST_FOR, Check, exit_status, print_report
from .common import print_json
from .doctor import (
    add_gpu_and_json_options,
    check_lmcache,
    check_token_hashing,
    gpu_stack,
    load_lmcache_config,
)
from .path_checks import (
    check_alignment,
    check_direct_io,
    check_filesystem,
    check_free_space,
    check_path,
    check_tree,
)

MODULE = "lmcache_nvme_backend"
# LMCache YAML list key -> (extra_config key prefix of its plugins, our class for it)
IN_PROCESS_HOOKS = {"storage_plugins": ("storage_plugin", "NVMeBackend"),
                    "remote_storage_plugins": ("remote_storage_plugin", "NVMeConnector")}
L2_CLASS = "NVMeL2Adapter"
L2_KIND, YAML_KIND = "lmcache server --l2-adapter JSON", "LMCache YAML"
# LMCache's defaults for the host memory tier NVMeBackend stages chunks in.
LMCACHE_LOCAL_CPU_DEFAULT, LMCACHE_MAX_LOCAL_CPU_SIZE_DEFAULT = True, 5.0
SKIP_DIRECT_IO = Check("O_DIRECT", SKIP, "nvme.direct_io: off (buffered I/O)")


def add_parser(sub: Any) -> argparse.ArgumentParser:
    p: argparse.ArgumentParser = sub.add_parser(
        "check-config", help="check an LMCache YAML or L2 adapter JSON before deploying it",
        description="Check FILE, an LMCache YAML (storage_plugins / remote_storage_plugins) "
                    "or the --l2-adapter JSON of lmcache server, as the NVMe tier will read "
                    "it: the plugin keys, every nvme.* setting (all problems at once), each "
                    "path (exists or can be created, usable by this user, filesystem, "
                    "O_DIRECT, free space for max_size_gb, alignment), token hashing, and "
                    "for NVMeBackend the GPU stack. Creates nothing. Run it as the user the "
                    "server runs as.",
        epilog="exit status: 0 nothing to fix (PASS, INFO, SKIP), 1 warnings, 2 failures "
               "(argparse usage errors also exit 2; a file that cannot be read exits 1)")
    p.add_argument("file", metavar="FILE", type=Path,
                   help="LMCache YAML (LMCACHE_CONFIG_FILE) or L2 adapter JSON")
    add_gpu_and_json_options(p)
    p.set_defaults(func=run)
    return p


def is_l2_adapter(doc: dict[str, Any]) -> bool:
    """An ``--l2-adapter`` JSON object rather than an LMCache YAML."""
    return "adapter_params" in doc or "class_name" in doc or doc.get("type") == "plugin"


def yaml_hooks(config: dict[str, Any]) -> tuple[list[Check], set[str]]:
    """The plugin checks of an LMCache YAML and the classes of ours it loads."""
    extra = config.get("extra_config") or {}
    if not isinstance(extra, dict):
        return [Check("hook", FAIL, "extra_config is not a mapping",
                      "give extra_config as a YAML mapping of keys to values")], set()
    checks: list[Check] = []
    loaded: set[str] = set()
    for list_key, (prefix, ours) in IN_PROCESS_HOOKS.items():
        names = config.get(list_key) or []
        names = [names] if isinstance(names, str) else list(names)
        for name in names:
            module = extra.get(f"{prefix}.{name}.module_path")
            cls = extra.get(f"{prefix}.{name}.class_name")
            keys = f"{prefix}.{name}.module_path / .class_name"
            if module is None or cls is None:
                checks.append(Check("hook", FAIL, f"{list_key} lists '{name}' but extra_config "
                                    f"lacks {keys}: LMCache skips it",
                                    f"add {prefix}.{name}.module_path: {MODULE} and "
                                    f"{prefix}.{name}.class_name: {ours}"))
            elif module != MODULE:
                checks.append(Check("hook", INFO, f"{list_key} '{name}' loads {module}.{cls}, "
                                    "not this tier (not checked)"))
            elif cls != ours:
                checks.append(Check("hook", FAIL, f"{list_key} '{name}' names class '{cls}'; "
                                    f"the class for {list_key} is {ours}",
                                    f"set {prefix}.{name}.class_name: {ours}"))
            else:
                loaded.add(ours)
                checks.append(Check("hook", PASS, f"{list_key} '{name}' loads {MODULE}.{ours}"))
        for key, value in extra.items():
            parts = str(key).split(".")
            if (len(parts) == 3 and parts[0] == prefix and parts[2] == "module_path"
                    and value == MODULE and parts[1] not in names):
                checks.append(Check("hook", WARN, f"{key} is set, but {list_key} does not list "
                                    f"'{parts[1]}': LMCache never loads it",
                                    f"add '{parts[1]}' to {list_key}"))
    if not loaded:
        checks.append(Check("hook", FAIL, "no NVMe tier in this config: neither "
                            "storage_plugins nor remote_storage_plugins loads "
                            f"{MODULE}",
                            f"add storage_plugins: [nvme] with storage_plugin.nvme.module_path: "
                            f"{MODULE} and storage_plugin.nvme.class_name: NVMeBackend under "
                            "extra_config (examples/lmcache-nvme.yaml)"))
    if "NVMeBackend" in loaded:
        checks.append(check_local_cpu(config))
    return checks, loaded


def check_local_cpu(config: dict[str, Any]) -> Check:
    """NVMeBackend stages chunks in LMCache's host memory tier: it must be on."""
    local_cpu = config.get("local_cpu", LMCACHE_LOCAL_CPU_DEFAULT)
    size = config.get("max_local_cpu_size", LMCACHE_MAX_LOCAL_CPU_SIZE_DEFAULT)
    try:
        size_gb = float(size)
    except (TypeError, ValueError):
        size_gb = 0.0
    if local_cpu is True and size_gb > 0:
        return Check("local_cpu", PASS, f"LMCache's host memory tier is on ({size_gb:g} GB)")
    return Check("local_cpu", FAIL, f"local_cpu: {local_cpu}, max_local_cpu_size: {size}: "
                 "NVMeBackend stages chunks in LMCache's host memory tier and does not load "
                 "without it", "set local_cpu: true and max_local_cpu_size > 0")


def l2_hook(doc: dict[str, Any]) -> tuple[list[Check], dict[str, Any] | None]:
    """The plugin checks of an ``--l2-adapter`` JSON object and its ``adapter_params``."""
    checks = []
    if doc.get("type") != "plugin":
        checks.append(Check("hook", FAIL, f"type is {doc.get('type')!r}; the tier is an L2 "
                            "adapter of type 'plugin'", 'set "type": "plugin"'))
    if doc.get("module_path") != MODULE or doc.get("class_name") != L2_CLASS:
        checks.append(Check("hook", FAIL, f"module_path {doc.get('module_path')!r} / class_name "
                            f"{doc.get('class_name')!r} do not load this tier",
                            f'set "module_path": "{MODULE}", "class_name": "{L2_CLASS}"'))
    params = doc.get("adapter_params", {})
    if not isinstance(params, dict):
        checks.append(Check("hook", FAIL, "adapter_params is not a JSON object",
                            'give e.g. "adapter_params": {"path": "/mnt/nvme0/lmcache", '
                            '"max_size_gb": 500}'))
        return checks, None
    if not checks:
        checks.append(Check("hook", PASS, f"type plugin loads {MODULE}.{L2_CLASS}"))
    return checks, adapter_params_of(params)


def settings_checks(review: SettingsReview, given: int) -> list[Check]:
    """One FAIL per problem, or one PASS."""
    if review.settings is not None:
        return [Check("settings", PASS, f"{given} setting(s) given, all valid; with the "
                      f"defaults: {len(review.settings.paths)} path(s), max_size_gb "
                      f"{review.settings.max_size_gb:g}")]
    return [Check("setting", FAIL, str(error)) for error in review.errors]  # names the fix


def path_checks(review: SettingsReview) -> list[Check]:
    """Each path of a review whose ``path`` parsed, with its share of the budget."""
    paths: tuple[Path, ...] = review.values.get("paths", ())
    max_size_gb = review.values.get("max_size_gb")
    min_free_gb = review.values.get("min_free_gb")
    direct_io = review.values.get("direct_io")
    checks: list[Check] = []
    probed: list[tuple[Path, Path]] = []
    for path in paths:
        mount = mount_for(path)
        probe = probe_path(path)
        first, probe_dir = check_path(probe, mount, missing_status=INFO)
        found = [first, check_filesystem(mount)]
        if probe_dir is not None:
            tree = check_tree(probe)
            found[1:1] = [] if tree is None else [tree]
            found += [SKIP_DIRECT_IO if direct_io == "off" else
                      check_direct_io(probe_dir, required=direct_io == "on"),
                      check_alignment(probe_dir, mount)]
            probed.append((path, probe_dir))
        checks += _named(found, path, len(paths))
    for path, probe_dir in probed:  # several paths on one filesystem share its space
        same_fs = sum(os.stat(d).st_dev == os.stat(probe_dir).st_dev for _, d in probed)
        share = None if max_size_gb is None else max_size_gb / len(paths) * same_fs
        checks += _named([check_free_space(probe_dir, share, min_free_gb)], path, len(paths))
    return checks


def _named(checks: list[Check], path: Path, npaths: int) -> list[Check]:
    """With several paths, each check's name says which path it is about."""
    if npaths == 1:
        return checks
    return [Check(f"{c.name} ({path})", c.status, c.detail, c.fix) for c in checks]


def run_checks(doc: dict[str, Any], skip_gpu: bool, gpu: bool) -> tuple[str, list[Check]]:
    """(kind of file, every check) of a loaded config file."""
    if is_l2_adapter(doc):
        checks, params = l2_hook(doc)
        prefix, hashing = ADAPTER_PARAMS_PREFIX, [Check(
            "token hashing", PASS, "lmcache server hashes tokens with its --hash-algorithm "
            "(blake3 by default): chunk keys are the same after a restart")]
        loaded = {L2_CLASS}
    else:
        checks, loaded = yaml_hooks(doc)
        extra = doc.get("extra_config")
        params = NVMeSettings.extra_config_params(extra if isinstance(extra, dict) else {})
        prefix, hashing = EXTRA_CONFIG_PREFIX, [check_token_hashing(doc, source="this file")]
    gds_strict = False
    if params is not None:
        review = NVMeSettings.review(params, key_prefix=prefix)
        checks += settings_checks(review, len(params)) + path_checks(review)
        gds_strict = review.values.get("gds_mode") is GdsMode.ON
    checks += [check_lmcache(), *hashing]
    if "NVMeBackend" in loaded:  # the only hook with a GPU read path
        checks += gpu_stack(skip_gpu, gpu or gds_strict)
    return (L2_KIND if is_l2_adapter(doc) else YAML_KIND), checks


def run(args: argparse.Namespace) -> int:
    doc = load_lmcache_config(args.file, label="")
    kind, checks = run_checks(doc, args.skip_gpu, args.gpu)
    status = exit_status(checks)
    me = user_name(os.geteuid())
    if args.json:
        print_json({"command": "check-config", "file": str(args.file), "kind": kind,
                    "user": me, "checks": [asdict(c) for c in checks],
                    "worst": WORST_FOR[status], "exit_status": status})
        return status
    note = (f"checked as {me}" if os.geteuid() else
            "checked as root, who may write anywhere: run it as the server's user too")
    print_report(f"lmcache-nvme check-config {args.file} ({kind})", checks, note)
    return status
