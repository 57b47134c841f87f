"""Running the ``support.*`` entry points in child processes, and a free port for a server."""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Mapping
from pathlib import Path

from .paths import TESTS_DIR


def child_env(base: Mapping[str, str] | None = None, **extra: str) -> dict[str, str]:
    """``base`` (default: this process's environment) plus ``extra``, with ``tests/`` first
    on ``PYTHONPATH`` so that ``python -m support.<name>`` works; the ``PYTHONPATH`` already
    set is kept after it (a worktree's checkout of the package stays the one imported)."""
    env = dict(os.environ if base is None else base, **extra)
    rest = env.get("PYTHONPATH", "")
    env["PYTHONPATH"] = str(TESTS_DIR) + (os.pathsep + rest if rest else "")
    return env


def module_command(module: str, *args: str | Path, python: str | Path | None = None
                   ) -> list[str]:
    """``python -m module args...`` (default: this interpreter)."""
    return [str(python or sys.executable), "-m", module, *map(str, args)]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
