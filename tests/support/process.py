"""Running the ``support.*`` entry points in child processes, a free port for a server, and
waiting for a server a test started to answer."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Mapping
from pathlib import Path
from typing import Any

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


def wait_until_answers(url: str, proc: subprocess.Popen[Any], log: Path, what: str,
                       timeout_s: float, poll_s: float = 0.5) -> None:
    """Poll ``url`` until it answers 200.

    :raises AssertionError: ``proc`` (the server, writing to ``log``) exited first, or
        ``timeout_s`` passed; the message names ``what`` and ends with the log's tail.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise AssertionError(f"{what} exited:\n{log.read_text()[-4000:]}")
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not up in {timeout_s:.0f} s:\n"
                                 f"{log.read_text()[-4000:]}")
        time.sleep(poll_s)
