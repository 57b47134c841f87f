"""Test-wide environment and fixtures.

The environment (no telemetry, no banner) is set before anything imports LMCache.
Fixtures: ``cache_dir`` (where a test's cache goes) and ``open_store`` (the one store
factory).  Markers: ``gpu`` is given to every test under tests/gpu here.  Every LMCache
engine a test builds is capped in host memory (``support.memory_cap``): one that asks for
more fails the test.
"""

import os

os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")
os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("LMCACHE_DISABLE_BANNER", "1")

import logging  # noqa: E402
from collections.abc import Iterator  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import pytest  # noqa: E402
from support import memory_cap, prerequisites, stores  # noqa: E402

from lmcache_nvme_backend.io import native  # noqa: E402
from lmcache_nvme_backend.store.chunk_store import ChunkStore  # noqa: E402

GPU_DIR = Path(__file__).resolve().parent / "gpu"


def pytest_configure(config: pytest.Config) -> None:
    memory_cap.install(fail=lambda text: pytest.fail(text, pytrace=False))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if GPU_DIR in item.path.parents:
            item.add_marker(pytest.mark.gpu)


@pytest.fixture
def cache_dir(tmp_path: Path) -> Path:
    """The cache root of a test: ``tmp_path / "cache"``, not created.  tests/gpu puts it on
    ``$NVME_GPU_TEST_DIR``; tests/cli fills it with chunk files."""
    return tmp_path / "cache"


# Directories whose tests run once with each I/O engine: the native batch engine and the
# Python one it speeds up must behave the same (``nvme.native_io``).
BOTH_ENGINES = ("store", "robustness")


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "native_io" in metafunc.fixturenames and \
            metafunc.definition.path.parent.name in BOTH_ENGINES:
        metafunc.parametrize("native_io", ["on", "off"], ids=["native", "python"],
                             indirect=True)


@pytest.fixture
def native_io(request: pytest.FixtureRequest) -> str | None:
    """``nvme.native_io`` of the stores ``open_store`` opens: each engine in turn under
    tests/store and tests/robustness, the package's default elsewhere."""
    mode = getattr(request, "param", None)
    if mode == "on" and not native.available():
        prerequisites.missing_prerequisite(native.unavailable_reason())
    return mode


@pytest.fixture
def open_store(tmp_path: Path, native_io: str | None) -> Iterator[stores.StoreFactory]:
    """``open_store(*paths, **params)``: a ChunkStore on ``paths`` (default:
    ``tmp_path / "cache"``) with the test defaults of ``support.stores`` updated by
    ``params`` (None: the package's default).  Every store it opened is closed at
    teardown (closing one again is a no-op)."""
    opened: list[ChunkStore] = []

    def factory(*paths: Path | str, **params: Any) -> ChunkStore:
        params = {"native_io": native_io, **params}
        store = stores.open_store(*(paths or (tmp_path / "cache",)), **params)
        opened.append(store)
        return store

    yield factory
    for store in opened:
        store.close()


@pytest.fixture
def package_log(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    """``caplog`` that also sees this package's records.

    Once LMCache's ``init_logger`` has set up the ``lmcache_nvme_backend`` logger (any
    adapter import does), its records no longer propagate to the root logger where
    ``caplog`` listens, so whether ``caplog`` saw them would depend on test order.
    """
    logger = logging.getLogger("lmcache_nvme_backend")
    logger.addHandler(caplog.handler)
    try:
        yield caplog
    finally:
        logger.removeHandler(caplog.handler)
