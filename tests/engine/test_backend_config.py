"""What a user sees when the plugin's configuration is wrong, through LMCache's own launcher."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
from lmcache.v1.config import LMCacheEngineConfig
from support.process import child_env, module_command

from lmcache_nvme_backend import NVMeBackend, NVMeConfigError

PLUGIN_KEYS = {
    "storage_plugin.nvme.module_path": "lmcache_nvme_backend",
    "storage_plugin.nvme.class_name": "NVMeBackend",
}


def engine_config(extra: dict[str, Any]) -> LMCacheEngineConfig:
    return LMCacheEngineConfig.from_dict({
        "chunk_size": 256,
        "local_cpu": True,
        "max_local_cpu_size": 0.1,
        "storage_plugins": ["nvme"],
        "extra_config": {**PLUGIN_KEYS, **extra},
    })


def a_file(tmp_path: Path) -> str:
    path = tmp_path / "not-a-dir"
    path.write_text("x")
    return str(path)


BAD_CONFIGS = [
    (lambda tmp: {"nvme.max_size_gb": 1}, "nvme.path: missing"),
    (lambda tmp: {"nvme.path": a_file(tmp), "nvme.max_size_gb": 1}, "is not a directory"),
    (lambda tmp: {"nvme.path": a_file(tmp) + "/sub", "nvme.max_size_gb": 1},
     "nvme.path: cannot create"),
    (lambda tmp: {"nvme.path": str(tmp / "c"), "nvme.max_size_gb": 0}, "nvme.max_size_gb"),
    (lambda tmp: {"nvme.path": str(tmp / "c"), "nvme.max_size_gb": -5}, "nvme.max_size_gb"),
    (lambda tmp: {"nvme.path": str(tmp / "c")}, "nvme.max_size_gb: missing"),
    (lambda tmp: {"nvme.path": str(tmp / "c"), "nvme.max_size_gb": 1, "nvme.max_sise_gb": 2},
     "nvme.max_sise_gb: unknown setting. did you mean 'nvme.max_size_gb'"),
]


@pytest.mark.parametrize(("extra", "message"), BAD_CONFIGS,
                         ids=["missing-path", "path-is-file", "path-below-file", "zero-size",
                              "negative-size", "missing-size", "unknown-key"])
def test_bad_config_raises_naming_the_key(tmp_path: Path, extra: Any, message: str) -> None:
    config = engine_config(extra(tmp_path))
    with pytest.raises(NVMeConfigError, match=message):
        NVMeBackend(dst_device="cpu", config=config, local_cpu_backend=object())  # type: ignore


@pytest.mark.slow
def test_launcher_failure_is_visible_to_the_user(tmp_path: Path) -> None:
    """LMCache's launcher swallows the exception; the error log line must say what to fix."""
    # LMCache's plugin launcher with nvme.max_size_gb: -1 (support/launcher_child.py)
    proc = subprocess.run(module_command("support.launcher_child", tmp_path / "c"),
                          capture_output=True, text=True, timeout=120, check=True,
                          env=child_env())
    assert "loaded backends: []" in proc.stdout
    error_lines = [line for line in proc.stderr.splitlines() if "NVMe tier NOT loaded" in line]
    assert len(error_lines) == 1
    assert "ERROR" in error_lines[0]
    assert ("nvme.max_size_gb: -1 is out of range. It must be greater than 0. LMCache keeps "
            "running without the NVMe tier until this is fixed.") in error_lines[0]


def test_missing_host_memory_tier_is_explained(tmp_path: Path) -> None:
    config = engine_config({"nvme.path": str(tmp_path / "c"), "nvme.max_size_gb": 1})
    with pytest.raises(NVMeConfigError, match="local_cpu: true"):
        NVMeBackend(dst_device="cpu", config=config, local_cpu_backend=None)
