"""The tree passes the project's linter and type checker (``ruff check .`` and ``mypy``).

Both read their settings from pyproject.toml and run from the repository root, as the
README's development commands do.  They come with the ``[test]`` extra: a missing one
is a failure that says how to install it, not a skip.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest
from support.paths import REPO_ROOT

pytestmark = pytest.mark.timeout(600)


def run_tool(module: str, *args: str) -> subprocess.CompletedProcess[str]:
    if importlib.util.find_spec(module) is None:
        pytest.fail(f"{module} is not installed; run pip install -e '.[test]'", pytrace=False)
    return subprocess.run([sys.executable, "-m", module, *args], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=540, check=False)


def test_ruff_check_is_clean() -> None:
    proc = run_tool("ruff", "check", ".")
    assert proc.returncode == 0, f"ruff check . found problems:\n{proc.stdout}{proc.stderr}"


@pytest.mark.slow  # ~20 s without a .mypy_cache
def test_mypy_is_clean() -> None:
    proc = run_tool("mypy")
    assert proc.returncode == 0, f"mypy found problems:\n{proc.stdout}{proc.stderr}"
