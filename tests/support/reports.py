"""How an end-to-end driver hands its results to the test (one ``E2E-REPORT {json}`` line
on stdout, among whatever the engine logs), and how two first tokens compare."""

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


#: First-token logprobs of a hit may differ from the cold run's by bf16 rounding.
LOGPROB_TOLERANCE = 0.05


def assert_same_first_token(cold: dict[str, Any], hit: dict[str, Any]) -> None:
    """``cold`` and ``hit`` (``{"logprobs": {token: logprob}}``, the top-k of the first
    generated token) agree: the cold top token is among the hit's, and the logprobs of the
    tokens both list are within :data:`LOGPROB_TOLERANCE`."""
    a, b = cold["logprobs"], hit["logprobs"]
    top = max(a, key=a.get)
    assert top in b, f"cold top token {top} missing from the hit's top-{len(b)}"
    common = set(a) & set(b)
    assert len(common) >= len(a) // 2
    worst = max(abs(a[t] - b[t]) for t in common)
    assert worst <= LOGPROB_TOLERANCE, f"first-token logprobs differ by {worst:.4f}"
