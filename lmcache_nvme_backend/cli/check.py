"""One line of a ``doctor`` or ``check-config`` report: a named check, its status, what it
found and the fix; and the text report of a list of them."""

from __future__ import annotations

from dataclasses import dataclass

PASS, INFO, WARN, FAIL, SKIP = "pass", "info", "warn", "fail", "skip"
EXIT_FOR = {PASS: 0, INFO: 0, SKIP: 0, WARN: 1, FAIL: 2}
WORST_FOR = {0: PASS, 1: WARN, 2: FAIL}


@dataclass
class Check:
    """One line of the report."""

    name: str
    status: str
    detail: str
    fix: str = ""


def exit_status(checks: list[Check]) -> int:
    """0 nothing to fix (PASS, INFO, SKIP), 1 a warning, 2 a failure: the worst check."""
    return max(EXIT_FOR[c.status] for c in checks)


def print_report(title: str, checks: list[Check], note: str) -> None:
    """``title``, one line per check (and its fix), then the result line with ``note``."""
    status = exit_status(checks)
    print(title)
    width = max(len(c.name) for c in checks)
    for c in checks:
        print(f"  {c.status.upper():<4}  {c.name:<{width}}  {c.detail}")
        if c.fix and c.status in (INFO, WARN, FAIL):
            print(f"  {'':<4}  {'':<{width}}  {'fix' if c.status != INFO else 'if needed'}: "
                  f"{c.fix}")
    counts = {s: sum(c.status == s for c in checks) for s in (PASS, INFO, WARN, FAIL, SKIP)}
    print(f"result: {WORST_FOR[status].upper()} ({counts[PASS]} passed, {counts[INFO]} "
          f"informational, {counts[WARN]} warnings, {counts[FAIL]} failures, {counts[SKIP]} "
          f"skipped; {note}); exit status {status}")
