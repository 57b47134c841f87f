"""``lmcache-nvme check-config FILE``: an LMCache YAML or an L2 adapter JSON checked as the
tier reads it, every problem named, a non-zero exit on any error, and nothing created."""

from __future__ import annotations

import json
import os
import pwd
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from support.cli import RunCLI
from support.paths import EXAMPLE_YAML, REMOTE_EXAMPLE_YAML
from support.prerequisites import missing_prerequisite
from support.process import child_env, module_command
from support.stores import StoreFactory

OTHER_USER = "nobody"
# Small enough that free space never warns on a test machine.
TINY = {"nvme.max_size_gb": 0.001, "nvme.min_free_gb": 0}


def lmcache_yaml(tmp_path: Path, extra: dict[str, Any], **top: Any) -> Path:
    """An in-process LMCache YAML with the NVMe backend and ``extra`` nvme.* keys."""
    config = {"chunk_size": 256, "pre_caching_hash_algorithm": "sha256_cbor",
              "local_cpu": True, "max_local_cpu_size": 1, "storage_plugins": ["nvme"],
              "extra_config": {"storage_plugin.nvme.module_path": "lmcache_nvme_backend",
                               "storage_plugin.nvme.class_name": "NVMeBackend", **extra},
              **top}
    path = tmp_path / "lmcache.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def l2_json(tmp_path: Path, params: dict[str, Any], **top: Any) -> Path:
    doc = {"type": "plugin", "module_path": "lmcache_nvme_backend",
           "class_name": "NVMeL2Adapter", "adapter_params": params, **top}
    path = tmp_path / "l2.json"
    path.write_text(json.dumps(doc))
    return path


def check(run_cli: RunCLI, file: Path, *args: str) -> tuple[int, dict[str, Any]]:
    proc = run_cli("check-config", file, "--skip-gpu", "--json", *args)
    assert proc.stdout, proc.stderr
    report = json.loads(proc.stdout)
    assert report["exit_status"] == proc.returncode
    return proc.returncode, report


def failures(report: dict[str, Any]) -> list[str]:
    return [c["detail"] for c in report["checks"] if c["status"] == "fail"]


def statuses(report: dict[str, Any]) -> dict[str, str]:
    return {c["name"]: c["status"] for c in report["checks"]}


def snapshot(root: Path) -> set[tuple[str, int]]:
    """Every entry under ``root`` with its mode: a created file or directory shows."""
    return {(str(p.relative_to(root)), p.lstat().st_mode) for p in root.rglob("*")}


def test_a_valid_config_passes_and_creates_nothing(run_cli: RunCLI, tmp_path: Path) -> None:
    target = tmp_path / "later" / "cache"
    config = lmcache_yaml(tmp_path, {"nvme.path": str(target), **TINY})
    before = snapshot(tmp_path)
    status, report = check(run_cli, config)
    assert status == 0, report
    assert statuses(report)["hook"] == "pass" and statuses(report)["settings"] == "pass"
    assert statuses(report)["path"] == "info"  # created by the tier at start
    assert statuses(report)["O_DIRECT"] in ("pass", "warn")
    assert snapshot(tmp_path) == before, "check-config created or changed a file"


def test_a_misspelt_key_is_named_with_a_suggestion(run_cli: RunCLI, tmp_path: Path) -> None:
    config = lmcache_yaml(tmp_path, {"nvme.path": str(tmp_path / "c"),
                                     "nvme.max_size_gbb": 5, "nvme.min_free_gb": 0})
    status, report = check(run_cli, config)
    assert status == 2
    bad = failures(report)
    assert any(d.startswith("nvme.max_size_gbb: unknown setting. did you mean "
                            "'nvme.max_size_gb'?") for d in bad), bad
    assert any(d.startswith("nvme.max_size_gb: missing.") for d in bad), bad
    assert not (tmp_path / "c").exists()


def test_every_bad_value_is_reported_at_once(run_cli: RunCLI, tmp_path: Path) -> None:
    config = lmcache_yaml(tmp_path, {"nvme.path": str(tmp_path / "c"), **TINY,
                                     "nvme.io_threads": 0, "nvme.fsync": "sometimes",
                                     "nvme.file_mode": "0000", "nvme.write_queue_mb": "lots"})
    status, report = check(run_cli, config)
    assert status == 2
    bad = failures(report)
    for start in ("nvme.io_threads: 0 is out of range. It must be at least 1.",
                  "nvme.fsync: 'sometimes' is not a valid choice. Use one of: none, data, full.",
                  "nvme.file_mode: 0o0 is not usable.",
                  "nvme.write_queue_mb: 'lots' is not a number."):
        assert any(d.startswith(start) for d in bad), (start, bad)
    assert not (tmp_path / "c").exists()


def test_a_path_that_cannot_exist_fails_naming_why(run_cli: RunCLI, tmp_path: Path) -> None:
    config = lmcache_yaml(tmp_path, {"nvme.path": "/proc/lmcache-nvme", **TINY})
    status, report = check(run_cli, config)
    assert status == 2
    (detail,) = failures(report)
    assert detail.startswith("/proc/lmcache-nvme does not exist, and it cannot be created: "
                             "/proc is on proc, a kernel filesystem that holds no files")
    file = tmp_path / "a-file"
    file.write_text("x")
    config = lmcache_yaml(tmp_path, {"nvme.path": str(file), **TINY})
    status, report = check(run_cli, config)
    assert status == 2
    assert failures(report) == [f"nvme.path: '{file}' exists and is not a directory. Point "
                                "it at a directory (it is created if missing)."]
    config = lmcache_yaml(tmp_path, {"nvme.path": str(file / "cache"), **TINY})
    status, report = check(run_cli, config)
    assert status == 2
    assert failures(report) == [f"nvme.path: cannot create '{file / 'cache'}': Not a "
                                "directory. Create it yourself or choose a writable location."]


def test_direct_io_on_and_a_budget_that_does_not_fit(run_cli: RunCLI, tmp_path: Path) -> None:
    config = lmcache_yaml(tmp_path, {"nvme.path": str(tmp_path), "nvme.max_size_gb": 10**7,
                                     "nvme.direct_io": "off"})
    status, report = check(run_cli, config)
    assert statuses(report)["O_DIRECT"] == "skip"
    assert statuses(report)["free space"] in ("warn", "fail") and status >= 1


def test_several_paths_are_each_checked(run_cli: RunCLI, tmp_path: Path) -> None:
    paths = [tmp_path / "a", tmp_path / "b"]
    paths[0].mkdir()
    config = lmcache_yaml(tmp_path, {"nvme.path": [str(p) for p in paths], **TINY})
    status, report = check(run_cli, config)
    assert status == 0, report
    names = statuses(report)
    for p in paths:
        assert f"path ({p})" in names and f"free space ({p})" in names
    assert names[f"path ({paths[0]})"] == "pass" and names[f"path ({paths[1]})"] == "info"


@pytest.mark.parametrize(("top", "extra", "expected"), [
    ({}, {"storage_plugin.nvme.module_path": None},
     "storage_plugins lists 'nvme' but extra_config lacks storage_plugin.nvme.module_path"),
    ({}, {"storage_plugin.nvme.class_name": "NVMeConnector"},
     "storage_plugins 'nvme' names class 'NVMeConnector'; the class for storage_plugins is "
     "NVMeBackend"),
    ({"storage_plugins": []}, {}, "no NVMe tier in this config"),
    ({"local_cpu": False}, {}, "local_cpu: False, max_local_cpu_size: 1: NVMeBackend stages"),
    ({"pre_caching_hash_algorithm": "sha265_cbor"}, {},
     "pre_caching_hash_algorithm 'sha265_cbor' is not a hash LMCache knows, so it falls back "
     "to 'builtin' (Python's hash()); did you mean 'sha256_cbor'?"),
], ids=["no-module-key", "wrong-class", "no-tier", "no-local-cpu", "hash-typo"])
def test_hook_and_hashing_mistakes_are_failures(run_cli: RunCLI, tmp_path: Path,
                                                top: dict[str, Any], extra: dict[str, Any],
                                                expected: str) -> None:
    config_path = lmcache_yaml(tmp_path, {"nvme.path": str(tmp_path), **TINY}, **top)
    config = yaml.safe_load(config_path.read_text())
    for key, value in extra.items():
        if value is None:
            del config["extra_config"][key]
        else:
            config["extra_config"][key] = value
    config_path.write_text(yaml.safe_dump(config))
    status, report = check(run_cli, config_path)
    assert status == 2
    assert any(d.startswith(expected) for d in failures(report)), failures(report)


def test_the_remote_hook_and_a_forgotten_plugin_name(run_cli: RunCLI, tmp_path: Path) -> None:
    config = {"chunk_size": 256, "pre_caching_hash_algorithm": "sha256_cbor",
              "remote_storage_plugins": ["nvme"],
              "extra_config": {"remote_storage_plugin.nvme.module_path": "lmcache_nvme_backend",
                               "remote_storage_plugin.nvme.class_name": "NVMeConnector",
                               "storage_plugin.disk.module_path": "lmcache_nvme_backend",
                               "nvme.path": str(tmp_path), **TINY}}
    path = tmp_path / "remote.yaml"
    path.write_text(yaml.safe_dump(config))
    status, report = check(run_cli, path)
    assert status == 1, report  # the forgotten storage_plugins entry warns
    hooks = {c["status"]: c["detail"] for c in report["checks"] if c["name"] == "hook"}
    assert set(hooks) == {"pass", "warn"}
    assert hooks["pass"] == "remote_storage_plugins 'nvme' loads lmcache_nvme_backend.NVMeConnector"
    assert "does not list 'disk': LMCache never loads it" in hooks["warn"]
    assert "kvikio" not in statuses(report)  # no GPU read path in the remote connector


def test_an_l2_adapter_json_is_checked_with_its_field_names(run_cli: RunCLI,
                                                            tmp_path: Path) -> None:
    good = l2_json(tmp_path, {"path": str(tmp_path / "c"), "max_size_gb": 0.001,
                              "min_free_gb": 0})
    status, report = check(run_cli, good)
    assert status == 0, report
    assert report["kind"] == "lmcache server --l2-adapter JSON"
    assert statuses(report)["token hashing"] == "pass"
    bad = l2_json(tmp_path, {"path": str(tmp_path / "c"), "max_size_gb": -1,
                             "queue_full_policy": "block"}, class_name="NVMeBackend")
    status, report = check(run_cli, bad)
    assert status == 2
    detail = failures(report)
    assert any("do not load this tier" in d for d in detail)
    assert any(d.startswith("adapter_params.max_size_gb: -1 is out of range.") for d in detail)
    assert any(d.startswith("adapter_params.queue_full_policy: 'block' is not a valid choice.")
               for d in detail)
    assert not (tmp_path / "c").exists()


@pytest.mark.parametrize("example", [EXAMPLE_YAML, REMOTE_EXAMPLE_YAML], ids=lambda p: p.name)
def test_the_shipped_examples_have_no_failure(run_cli: RunCLI, tmp_path: Path,
                                              example: Path) -> None:
    config = yaml.safe_load(example.read_text())
    config["extra_config"]["nvme.path"] = str(tmp_path / "cache")
    path = tmp_path / example.name
    path.write_text(yaml.safe_dump(config))
    status, report = check(run_cli, path)
    assert failures(report) == []
    assert status in (0, 1)  # a 100 GB budget may not fit this machine's disk: a warning


def test_an_unreadable_file_is_an_error_naming_it(run_cli: RunCLI, tmp_path: Path) -> None:
    proc = run_cli("check-config", tmp_path / "missing.yaml")
    assert proc.returncode == 1
    assert f"{tmp_path / 'missing.yaml'}: cannot read it" in proc.stderr
    (tmp_path / "list.yaml").write_text("- a\n- b\n")
    proc = run_cli("check-config", tmp_path / "list.yaml")
    assert proc.returncode == 1 and "not an LMCache config" in proc.stderr


def test_the_text_report_ends_with_the_result(run_cli: RunCLI, tmp_path: Path) -> None:
    config = lmcache_yaml(tmp_path, {"nvme.path": str(tmp_path), "nvme.max_size_gbb": 1})
    proc = run_cli("check-config", config, "--skip-gpu")
    assert proc.returncode == 2
    assert "FAIL  setting" in proc.stdout
    assert proc.stdout.strip().splitlines()[-1].startswith("result: FAIL (")


# -- as the service user ------------------------------------------------------------------


@pytest.fixture
def reachable_dir() -> Iterator[Path]:
    if os.geteuid() != 0:
        missing_prerequisite(f"needs root: the test runs check-config as '{OTHER_USER}'")
    path = Path(tempfile.mkdtemp(prefix="lmcache-nvme-check-"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path)


def check_as(user: str, file: Path) -> tuple[int, dict[str, Any]]:
    proc = subprocess.run(module_command("support.other_user", user, "cli", "check-config",
                                         file, "--skip-gpu", "--json"),
                          env=child_env(), capture_output=True, text=True, timeout=120)
    assert proc.stdout, proc.stderr
    return proc.returncode, json.loads(proc.stdout)


def test_a_directory_the_user_cannot_write_is_named_with_its_owner(reachable_dir: Path) -> None:
    locked = reachable_dir / "root-only"
    locked.mkdir(mode=0o755)
    config = lmcache_yaml(reachable_dir, {"nvme.path": str(locked / "cache"), **TINY})
    config.chmod(0o644)
    status, report = check_as(OTHER_USER, config)
    assert status == 2
    (detail,) = failures(report)
    assert detail == (f"{locked / 'cache'} does not exist, and it cannot be created: {locked} "
                      f"is owned by root (uid 0), mode 0755; this user ({OTHER_USER}) may not "
                      "create files in it")


def test_a_tree_made_by_root_fails_as_the_service_user(reachable_dir: Path,
                                                       open_store: StoreFactory) -> None:
    cache = reachable_dir / "cache"
    open_store(cache).close()
    os.chown(cache, pwd.getpwnam(OTHER_USER).pw_uid, -1)
    config = lmcache_yaml(reachable_dir, {"nvme.path": str(cache), **TINY})
    config.chmod(0o644)
    before = snapshot(reachable_dir)
    status, report = check_as(OTHER_USER, config)
    assert status == 2
    (detail,) = failures(report)
    assert detail.startswith("3 directories of the tree cannot be listed and written by "
                             f"{OTHER_USER}, e.g. {cache / 'index'} (owned by root (uid 0), "
                             "mode 0700)")
    fix = next(c["fix"] for c in report["checks"] if c["name"] == "cache tree")
    assert fix.startswith(f"as root: chown -R {OTHER_USER}: {cache}")
    assert snapshot(reachable_dir) == before


def test_a_cache_directory_of_a_newer_layout_fails_naming_its_marker(run_cli: RunCLI,
                                                                     tmp_path: Path) -> None:
    target = tmp_path / "cache"
    target.mkdir()
    (target / "LMCNVME").write_bytes(b"lmcache-nvme-backend cache root, chunk format 1\n"
                                     b"shard_levels 3\n")
    status, report = check(run_cli, lmcache_yaml(tmp_path, {"nvme.path": str(target), **TINY}))
    assert status == 2
    assert statuses(report)["cache tree"] == "fail"
    assert any(f"{target / 'LMCNVME'} says shard_levels 3" in detail
               for detail in failures(report)), report
