"""The project's own configuration: what CI runs, and which warnings the tests hide."""

from __future__ import annotations

import re

import pytest
from support.paths import REPO_ROOT

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

PYTEST_INI = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["tool"]["pytest"][
    "ini_options"]


def readme_commands() -> list[str]:
    text = (REPO_ROOT / "README.md").read_text()
    return [line.strip() for block in re.findall(r"```bash\n(.*?)```", text, re.S)
            for line in block.splitlines() if line.strip().startswith("pip install")]


def test_ci_runs_the_readmes_test_command() -> None:
    ci = (REPO_ROOT / ".ci" / "run").read_text()
    test_command = 'pip install "torch==2.13.0" -e ".[test]" && python -m pytest'
    assert test_command in readme_commands()
    assert ci.strip().splitlines()[-1] == test_command


def test_the_readmes_first_command_installs_no_gpu_extra() -> None:
    assert 'pip install "torch==2.13.0" -e . && python examples/quickstart.py' in \
        readme_commands()


@pytest.mark.parametrize("spec", PYTEST_INI.get("filterwarnings", []))
def test_filtered_warnings_are_third_party_only(spec: str) -> None:
    """Each filter names a third-party module, so warnings raised by this package or its
    tests still show in the summary."""
    action, message, category, module = (spec.split(":", 3) + [""] * 4)[:4]
    assert action == "ignore" and module, f"{spec}: ignore a named third-party module only"
    assert category in ("DeprecationWarning", "FutureWarning", "PendingDeprecationWarning")
    pattern = re.compile(module)
    for ours in ("lmcache_nvme_backend", "lmcache_nvme_backend.adapters._common",
                 "test_project_config", "support.engines", "lmcache"):
        assert not pattern.match(ours), f"{spec} would hide warnings of {ours}"



def test_the_latest_release_in_the_changelog_is_the_package_version() -> None:
    import lmcache_nvme_backend

    headings = re.findall(r"^## \[([^\]]+)\]", (REPO_ROOT / "CHANGELOG.md").read_text(), re.M)
    assert headings[0] == "Unreleased"
    assert headings[1] == lmcache_nvme_backend.__version__
