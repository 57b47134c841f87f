"""How a test ends when something it needs is missing: a skip with the reason on a
developer's machine, a failure with the reason when ``CI`` is set (so CI never reports
success for tests that did not run)."""

from __future__ import annotations

import os
from typing import NoReturn

import pytest


def missing_prerequisite(reason: str) -> NoReturn:
    """Skip, or fail under ``CI``, with ``reason`` (in a test, a fixture, or at the top of a
    test module: the whole module)."""
    if os.environ.get("CI"):
        pytest.fail(f"prerequisite missing (CI is set, so this is a failure, not a skip): "
                    f"{reason}", pytrace=False)
    pytest.skip(reason, allow_module_level=True)
