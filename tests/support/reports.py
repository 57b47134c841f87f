"""How an end-to-end driver hands its results to the test: one ``E2E-REPORT {json}`` line
on stdout, among whatever the engine logs."""

from __future__ import annotations

import json
import os
import sys
from typing import Any, NoReturn

PREFIX = "E2E-REPORT "


def emit(report: dict[str, Any]) -> NoReturn:
    """Print the report and end the process at once: the engines' background threads and
    workers must not hold it open."""
    print(PREFIX + json.dumps(report), flush=True)
    sys.stdout.flush()
    os._exit(0)


def find(output: str) -> dict[str, Any] | None:
    """The report in a driver's output, or None."""
    for line in output.splitlines():
        if line.startswith(PREFIX):
            return json.loads(line[len(PREFIX):])  # type: ignore[no-any-return]
    return None
