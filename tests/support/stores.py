"""The one way tests open a ``ChunkStore``: settings from params, test-friendly defaults.

The ``open_store`` fixture (tests/conftest.py) wraps ``open_store`` here and closes every
store it opened; child processes call ``open_store`` directly.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from lmcache_nvme_backend.config import NVMeSettings
from lmcache_nvme_backend.store.chunk_store import ChunkStore

# No free-space reserve (test directories live on small shared disks) and no periodic
# manifest thread; 1 GiB of budget is far more than any test writes.
TEST_DEFAULTS: dict[str, Any] = {"max_size_gb": 1, "min_free_gb": 0, "manifest_interval_s": 0}

StoreFactory = Callable[..., ChunkStore]


def store_params(*paths: Path | str, **params: Any) -> dict[str, Any]:
    """The settings params for a store on ``paths``: ``TEST_DEFAULTS`` updated by
    ``params``; a param given as None is left out, so the package's default applies."""
    if not paths:
        raise TypeError("store_params needs at least one path")
    merged = {**TEST_DEFAULTS, **params, "path": [str(p) for p in paths]}
    return {k: v for k, v in merged.items() if v is not None}


def store_settings(*paths: Path | str, **params: Any) -> NVMeSettings:
    return NVMeSettings.from_params(store_params(*paths, **params))


def open_store(*paths: Path | str, **params: Any) -> ChunkStore:
    """A ``ChunkStore`` on ``paths`` (see ``store_params``); the caller closes it."""
    return ChunkStore(store_settings(*paths, **params))
