"""Every store test runs with both I/O engines: the native batch engine and the Python one
it speeds up (``nvme.native_io``); the two must behave the same."""

from __future__ import annotations

import pytest
from support.prerequisites import missing_prerequisite

from lmcache_nvme_backend.io import native


@pytest.fixture(params=["on", "off"], ids=["native", "python"])
def native_io(request: pytest.FixtureRequest) -> str:
    if request.param == "on" and not native.available():
        missing_prerequisite(native.unavailable_reason())
    return str(request.param)
