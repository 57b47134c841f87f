"""One line of a ``doctor`` report: a named check, its status, what it found and the fix."""

from __future__ import annotations

from dataclasses import dataclass

PASS, INFO, WARN, FAIL, SKIP = "pass", "info", "warn", "fail", "skip"
EXIT_FOR = {PASS: 0, INFO: 0, SKIP: 0, WARN: 1, FAIL: 2}


@dataclass
class Check:
    """One line of the report."""

    name: str
    status: str
    detail: str
    fix: str = ""
