"""``lmcache-nvme doctor``: one line per check, exit status from the worst result."""

from __future__ import annotations

import json
from pathlib import Path

from support.cli import RunCLI

EXIT_FOR = {"pass": 0, "skip": 0, "warn": 1, "fail": 2}


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
        if check["status"] in ("warn", "fail"):
            assert check["fix"], f"{check['name']} has no fix: {check}"


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
