"""The example YAMLs as the engine tests run them, and what they look up in an engine."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lmcache.v1.cache_engine import LMCacheEngine

from lmcache_nvme_backend.adapters.connector import NVMeConnector
from lmcache_nvme_backend.testing.engine import storage_tiers

from .paths import EXAMPLE_YAML, REMOTE_EXAMPLE_YAML

__all__ = ["CHUNK", "EXAMPLE_YAML", "NUM_CHUNKS", "REMOTE_EXAMPLE_YAML", "REMOTE_TIER",
           "connector_of", "example_config_overrides", "remote_overrides"]

CHUNK = 256  # tokens per LMCache chunk in the example YAMLs
NUM_CHUNKS = 10  # the store / evict / restart test's prompt
REMOTE_TIER = "RemoteBackend-nvme"


def example_config_overrides(cache_dir: Path) -> dict[str, Any]:
    """The example YAML as a user copies it, with only the cache path and sizes for a test box."""
    return {"max_local_cpu_size": 0.5,
            "extra_config": {"nvme.path": str(cache_dir), "nvme.max_size_gb": 1,
                             "nvme.min_free_gb": 0}}


def remote_overrides(cache_dir: Path, shared: bool = True) -> dict[str, Any]:
    """The remote example YAML as a user copies it, with the path and sizes for a test box."""
    return {"max_local_cpu_size": 0.5,
            "extra_config": {"nvme.path": str(cache_dir), "nvme.max_size_gb": 1,
                             "nvme.min_free_gb": 0, "nvme.shared": shared}}


def connector_of(engine: LMCacheEngine) -> NVMeConnector:
    """The NVMeConnector behind the engine's remote tier."""
    backend: Any = storage_tiers(engine)[REMOTE_TIER]
    conn = backend.connection._connector  # RemoteBackend -> InstrumentedRemoteConnector
    assert isinstance(conn, NVMeConnector)
    return conn
