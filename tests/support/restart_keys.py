"""The restart-hits tests' pieces: the README's LMCache YAML, and fresh engine processes
(``support.engine_child keys``) started as a user's shell would, without PYTHONHASHSEED."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

import yaml

from .paths import REPO_ROOT
from .process import child_env, module_command

LOAD_WARNING = "chunk keys will change at every restart"
RUN_WARNING = "were on disk at start, but none of the first"


def readme_yaml() -> dict[str, Any]:
    """The LMCache YAML block of the README's vLLM section."""
    blocks = re.findall(r"```yaml\n(.*?)```", (REPO_ROOT / "README.md").read_text(), re.S)
    configs = [yaml.safe_load(b) for b in blocks]
    (config,) = [c for c in configs if isinstance(c, dict) and "storage_plugins" in c]
    return config  # type: ignore[no-any-return]


def run_keys_child(phase: str, yaml_path: Path, cache_dir: Path, *extra: str,
                   python: Path | None = None) -> tuple[dict[str, Any], str]:
    """One fresh process of ``support.engine_child keys``: its JSON report and its log."""
    env = child_env()
    env.pop("PYTHONHASHSEED", None)  # what a user's shell has unless told otherwise
    proc = subprocess.run(module_command("support.engine_child", "keys", phase, yaml_path,
                                         cache_dir, *extra, python=python),
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr
