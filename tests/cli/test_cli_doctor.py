"""``lmcache-nvme doctor``: one line per check, exit status from the worst result."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from support.cli import RunCLI
from support.mounts import ext4_image
from support.paths import EXAMPLE_YAML

EXIT_FOR = {"pass": 0, "info": 0, "skip": 0, "warn": 1, "fail": 2}
GPU_CHECKS = {"kvikio", "kvikio compat mode", "libcufile", "nvidia-fs", "/run/udev", "GPU"}


def checks_of(stdout: str) -> dict[str, dict[str, str]]:
    return {c["name"]: c for c in json.loads(stdout)["checks"]}


def test_exit_status_is_the_worst_check(run_cli: RunCLI, tmp_path: Path) -> None:
    proc = run_cli("doctor", tmp_path, "--json")
    checks = checks_of(proc.stdout)
    assert {"path", "filesystem", "O_DIRECT", "free space", "alignment", "lmcache", "kvikio",
            "GPU"} <= set(checks)
    assert checks["path"]["status"] == "pass"
    assert checks["O_DIRECT"]["status"] in ("pass", "warn")
    assert proc.returncode == max(EXIT_FOR[c["status"]] for c in checks.values())
    for check in checks.values():
        if check["status"] in ("info", "warn", "fail"):
            assert check["fix"], f"{check['name']} has no fix: {check}"


def test_gpu_checks_are_informational_unless_asked_for(run_cli: RunCLI, tmp_path: Path) -> None:
    """A healthy CPU-only machine exits 0: GPU problems are INFO by default (scripts with
    set -e keep going), warnings and failures with --gpu."""
    default = checks_of(run_cli("doctor", tmp_path, "--json").stdout)
    host = {n: c for n, c in default.items() if n not in GPU_CHECKS}
    for name in GPU_CHECKS & set(default):
        assert default[name]["status"] in ("pass", "info"), default[name]
    proc = run_cli("doctor", tmp_path)
    assert proc.returncode == max(EXIT_FOR[c["status"]] for c in host.values())
    assert "GPU checks informational (--gpu makes them count)" in proc.stdout

    strict = run_cli("doctor", tmp_path, "--gpu", "--json")
    report = json.loads(strict.stdout)
    assert report["gpu_strict"] is True
    gpu = {c["name"]: c for c in report["checks"] if c["name"] in GPU_CHECKS}
    for name, check in gpu.items():
        assert check["status"] != "info", name
        if default[name]["status"] == "info":  # the same problem, now counted
            assert check["status"] in ("warn", "fail")
            if name != "kvikio":  # kvikio says "not needed" only when it is not
                assert check["detail"] == default[name]["detail"]
    assert strict.returncode == max(EXIT_FOR[c["status"]] for c in report["checks"])


@pytest.mark.parametrize("value", ['"on"', "on"], ids=["quoted", "yaml-boolean"])
def test_a_config_with_strict_gds_makes_gpu_checks_count(run_cli: RunCLI, tmp_path: Path,
                                                         value: str) -> None:
    config = tmp_path / "lmcache.yaml"
    config.write_text("chunk_size: 256\npre_caching_hash_algorithm: sha256_cbor\n"
                      f"extra_config:\n  nvme.gds_mode: {value}\n")
    report = json.loads(run_cli("doctor", tmp_path, "--config", config, "--json").stdout)
    assert report["gpu_strict"] is True
    assert checks_of(json.dumps(report))["token hashing"]["status"] == "pass"


def test_a_config_with_an_invalid_gds_mode_is_named(run_cli: RunCLI, tmp_path: Path) -> None:
    config = tmp_path / "lmcache.yaml"
    config.write_text("chunk_size: 256\nextra_config:\n  nvme.gds_mode: sometimes\n")
    proc = run_cli("doctor", tmp_path, "--config", config)
    assert proc.returncode == 1
    assert "nvme.gds_mode: 'sometimes' is not a valid choice" in proc.stderr


def test_kvikio_absent_names_the_extra_for_this_torch(run_cli: RunCLI, tmp_path: Path) -> None:
    blocker = tmp_path / "no-kvikio"
    (blocker / "kvikio").mkdir(parents=True)  # a package that fails to import, as if absent
    (blocker / "kvikio" / "__init__.py").write_text("raise ImportError('No module kvikio')\n")
    proc = run_cli("doctor", tmp_path, "--json",
                   env={"PYTHONPATH": os.pathsep.join(filter(None, [
                       str(blocker), os.environ.get("PYTHONPATH")]))})
    check = checks_of(proc.stdout)["kvikio"]
    import torch

    from lmcache_nvme_backend.gpu.select import kvikio_install_hint

    assert "No module kvikio" in check["detail"]
    assert check["fix"] == kvikio_install_hint(torch.version.cuda)
    if torch.version.cuda is None:  # this machine: a CPU build needs no GPU extra
        assert check["status"] == "info" and "not needed" in check["detail"]
    else:
        assert '[cu' in check["fix"]
    strict = run_cli("doctor", tmp_path, "--gpu", "--json", env={"PYTHONPATH": os.pathsep.join(
        filter(None, [str(blocker), os.environ.get("PYTHONPATH")]))})
    assert checks_of(strict.stdout)["kvikio"]["status"] == "warn"  # required: a problem


def vllm_stand_in(tmp_path: Path) -> dict[str, str | None]:
    """An environment where ``vllm`` can be found (doctor only looks for it) and
    PYTHONHASHSEED is unset, as in a user's shell on a vLLM server."""
    fake = tmp_path / "fake-vllm"
    (fake / "vllm").mkdir(parents=True)
    (fake / "vllm" / "__init__.py").write_text("")
    return {"PYTHONHASHSEED": None, "PYTHONPATH": os.pathsep.join(filter(None, [
        str(fake), os.environ.get("PYTHONPATH")]))}


def test_token_hashing_that_changes_at_restart_is_a_warning(run_cli: RunCLI,
                                                            tmp_path: Path) -> None:
    config = tmp_path / "lmcache.yaml"
    config.write_text("chunk_size: 256\npre_caching_hash_algorithm: builtin\n")
    env = vllm_stand_in(tmp_path)
    proc = run_cli("doctor", tmp_path, "--config", config, "--skip-gpu", "--json", env=env)
    check = checks_of(proc.stdout)["token hashing"]
    assert check["status"] == "warn" and proc.returncode >= 1
    assert "change at every restart" in check["detail"]
    assert "pre_caching_hash_algorithm: sha256_cbor" in check["fix"]
    # the example YAML passes there, and without --config the default is only pointed out
    shipped = run_cli("doctor", tmp_path, "--config", EXAMPLE_YAML, "--skip-gpu", "--json",
                      env=env)
    assert checks_of(shipped.stdout)["token hashing"]["status"] == "pass"
    bare = run_cli("doctor", tmp_path, "--skip-gpu", "--json", env=env)
    assert checks_of(bare.stdout)["token hashing"]["status"] == "info"
    # PYTHONHASHSEED fixed: stable too
    seeded = run_cli("doctor", tmp_path, "--config", config, "--skip-gpu", "--json",
                     env={**env, "PYTHONHASHSEED": "0"})
    assert checks_of(seeded.stdout)["token hashing"]["status"] == "pass"


def test_a_bad_config_file_is_an_error_naming_it(run_cli: RunCLI, tmp_path: Path) -> None:
    missing = run_cli("doctor", tmp_path, "--config", tmp_path / "nope.yaml")
    assert missing.returncode == 1
    assert f"--config {tmp_path / 'nope.yaml'}: cannot read it" in missing.stderr
    bad = tmp_path / "bad.yaml"
    bad.write_text("- just\n- a list\n")
    proc = run_cli("doctor", tmp_path, "--config", bad)
    assert proc.returncode == 1 and "not an LMCache config" in proc.stderr


def test_skip_gpu_leaves_out_the_gds_checks(run_cli: RunCLI, tmp_path: Path) -> None:
    proc = run_cli("doctor", tmp_path, "--skip-gpu", "--json")
    checks = checks_of(proc.stdout)
    assert checks["GPU"]["status"] == "skip" and checks["kvikio"]["status"] == "skip"


def test_a_file_as_path_fails_with_the_fix(run_cli: RunCLI, tmp_path: Path) -> None:
    file = tmp_path / "not-a-dir"
    file.write_text("x")
    proc = run_cli("doctor", file, "--skip-gpu")
    assert proc.returncode == 2
    assert "FAIL  path" in proc.stdout
    assert "point nvme.path at a directory" in proc.stdout


def test_a_budget_larger_than_the_drive_is_flagged(run_cli: RunCLI, tmp_path: Path) -> None:
    proc = run_cli("doctor", tmp_path, "--skip-gpu", "--max-size-gb", "1000000", "--json")
    check = checks_of(proc.stdout)["free space"]
    assert check["status"] in ("warn", "fail")
    assert "nvme.max_size_gb" in check["detail"]
    assert proc.returncode >= 1


def test_a_missing_directory_is_checked_where_it_would_be_created(run_cli: RunCLI,
                                                                  tmp_path: Path) -> None:
    target = tmp_path / "later" / "cache"
    proc = run_cli("doctor", target, "--skip-gpu", "--json")
    checks = checks_of(proc.stdout)
    assert checks["path"]["status"] == "warn"
    assert "does not exist yet" in checks["path"]["detail"]
    assert not target.exists(), "doctor must not create the cache directory"


def test_bad_option_value_is_a_usage_error(run_cli: RunCLI, tmp_path: Path) -> None:
    proc = run_cli("doctor", tmp_path, "--min-free-gb", "lots")
    assert proc.returncode == 2
    assert "--min-free-gb" in proc.stderr and "'lots' is not a number" in proc.stderr


@pytest.mark.parametrize("journal", [True, False], ids=["journal", "no-journal"])
def test_ext4_without_a_journal_is_noted_with_the_fix(run_cli: RunCLI, tmp_path: Path,
                                                        journal: bool) -> None:
    """Without a journal ext4 skips recently deleted inodes when it creates one, which costs
    the writers kernel CPU under eviction (docs/benchmarks.md): worth knowing, not wrong."""
    with ext4_image(tmp_path / "fs", 64, journal) as fs:
        check = checks_of(run_cli("doctor", fs / "cache", "--json", "--skip-gpu").stdout)[
            "filesystem"]
    if journal:
        assert check["status"] == "pass", check
    else:
        assert check["status"] == "info" and "without a journal" in check["detail"], check
        assert "tune2fs -O has_journal /dev/loop" in check["fix"]


def test_a_path_on_a_kernel_filesystem_says_what_is_wrong(run_cli: RunCLI) -> None:
    proc = run_cli("doctor", "/proc/lmcache-nvme", "--skip-gpu", "--json")
    check = checks_of(proc.stdout)["path"]
    assert check["status"] == "fail" and proc.returncode == 2
    assert check["detail"].startswith("/proc/lmcache-nvme does not exist, and it cannot be "
                                      "created: /proc is on proc, a kernel filesystem that "
                                      "holds no files")
    assert "not writable" not in check["detail"]


def test_a_path_below_a_file_names_the_file(run_cli: RunCLI, tmp_path: Path) -> None:
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    proc = run_cli("doctor", a_file / "cache", "--skip-gpu", "--json")
    check = checks_of(proc.stdout)["path"]
    assert check["status"] == "fail" and proc.returncode == 2
    assert check["detail"] == (f"{a_file / 'cache'} does not exist, and it cannot be created: "
                               f"{a_file} is not a directory")
    assert check["fix"] == "point nvme.path at a directory"


def test_a_config_with_a_misspelt_setting_fails_the_settings_check(run_cli: RunCLI,
                                                                   tmp_path: Path) -> None:
    config = tmp_path / "lmcache.yaml"
    config.write_text(f"chunk_size: 256\nextra_config:\n  nvme.path: {tmp_path}\n"
                      "  nvme.max_size_gbb: 5\n")
    proc = run_cli("doctor", tmp_path, "--config", config, "--skip-gpu", "--json")
    check = checks_of(proc.stdout)["settings"]
    assert check["status"] == "fail" and proc.returncode == 2
    assert "nvme.max_size_gbb: unknown setting. did you mean 'nvme.max_size_gb'?" in \
        check["detail"]
    assert "check-config" in check["fix"]
