"""The e2e tests' environment plumbing (tests/support/vllm_env.py, prerequisites.py),
checked without building vLLM's environment."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from support import vllm_env
from support.prerequisites import missing_prerequisite


def test_a_missing_prerequisite_skips_locally(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match="no vLLM here"):
        missing_prerequisite("no vLLM here")


def test_a_missing_prerequisite_fails_under_ci(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="CI is set.*no vLLM here"):
        missing_prerequisite("no vLLM here")


def test_the_package_dirs_are_the_running_interpreters() -> None:
    dirs = vllm_env.package_dirs()
    assert dirs and all(Path(d).is_dir() for d in dirs)
    import lmcache

    assert any(Path(lmcache.__file__).is_relative_to(d) for d in dirs)


def test_a_venv_with_the_pth_imports_what_the_tests_import(tmp_path: Path) -> None:
    """The mechanism vLLM's environment relies on, in a bare venv: the .pth makes this
    environment's packages (and their own .pth files) importable there, venv or not."""
    root = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True,
                   timeout=120)
    python = root / "bin" / "python"
    (vllm_env._site_packages(python) / vllm_env.PTH_NAME).write_text(
        vllm_env._pth_text(vllm_env.package_dirs()))
    probe = ("import json, sys, lmcache, torch, yaml; print(json.dumps({'prefix': "
             "sys.prefix, 'lmcache': lmcache.__file__}))")
    out = subprocess.run([str(python), "-c", probe], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    report = json.loads(out)
    import lmcache

    assert Path(report["prefix"]) == root
    assert report["lmcache"] == lmcache.__file__


def test_the_environment_is_per_test_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LMCACHE_NVME_VLLM_VENV", raising=False)
    here = vllm_env.venv_dir()
    monkeypatch.setattr(sys, "prefix", "/some/other/venv")
    assert vllm_env.venv_dir() != here
    monkeypatch.setenv("LMCACHE_NVME_VLLM_VENV", "/tmp/mine")
    assert vllm_env.venv_dir() == Path("/tmp/mine")
