"""Fixtures for the command-line tests: the installed ``lmcache-nvme`` script and a real cache."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from support.cli import RunCLI, cache_keys, write_chunks
from support.stores import StoreFactory


@pytest.fixture(scope="session")
def cli_command() -> list[str]:
    """The console script as installed by ``pip install -e .``."""
    script = shutil.which("lmcache-nvme", path=os.path.dirname(sys.executable) + os.pathsep
                          + os.environ.get("PATH", ""))
    assert script is not None, ("the lmcache-nvme console script is not installed; "
                                "run pip install -e '.[test]'")
    return [script]


@pytest.fixture
def run_cli(cli_command: list[str]) -> RunCLI:
    """Run ``lmcache-nvme ARGS`` as a user would; returns the finished process."""

    def run(*args: str | Path, timeout: float = 120,
            env: dict[str, str | None] | None = None) -> subprocess.CompletedProcess[str]:
        """``env``: variables to set on top of this process's (None: unset it)."""
        full = dict(os.environ, LMCACHE_TRACK_USAGE="false", COLUMNS="200")
        for name, value in (env or {}).items():
            if value is None:
                full.pop(name, None)
            else:
                full[name] = value
        return subprocess.run([*cli_command, *map(str, args)], capture_output=True, text=True,
                              timeout=timeout, env=full, check=False)

    return run


@pytest.fixture
def cache_dir(cache_dir: Path, open_store: StoreFactory) -> Path:
    """A cache root written by a real ChunkStore: two namespaces of five chunks each."""
    store = open_store(cache_dir)
    write_chunks(store, cache_keys())
    store.close()
    return cache_dir
