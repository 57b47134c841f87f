"""NVMe / GPUDirect Storage tier for LMCache.

LMCache loads the plugin classes from this package by name (``storage_plugin.nvme.
class_name: NVMeBackend``; likewise ``NVMeConnector`` and ``NVMeL2Adapter``).  The names
in ``__all__`` are the public Python API (``docs/api.md``), stable from 0.2 on.  The
storage core (``disk``, ``io``, ``store``) imports neither LMCache nor torch; the
adapters are imported only when first used.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .config import NVMeConfigError, NVMeSettings
from .disk.format import TensorMeta
from .store import ChunkRead, ChunkStore, ChunkWrite, SubmitResult
from .store.access import check_paths

__version__ = "0.2.0"
__all__ = [
    "ChunkRead", "ChunkStore", "ChunkWrite", "NVMeBackend", "NVMeConfigError", "NVMeConnector",
    "NVMeL2Adapter", "NVMeL2AdapterConfig", "NVMeSettings", "SubmitResult", "TensorMeta",
    "__version__", "check_paths",
]

if TYPE_CHECKING:
    from .adapters.backend import NVMeBackend
    from .adapters.connector import NVMeConnector
    from .adapters.l2_adapter import NVMeL2Adapter, NVMeL2AdapterConfig

_ADAPTERS = {"NVMeBackend": "backend", "NVMeConnector": "connector",
             "NVMeL2Adapter": "l2_adapter", "NVMeL2AdapterConfig": "l2_adapter"}


def __getattr__(name: str) -> Any:
    """Import an adapter (and with it LMCache and torch) when it is first asked for."""
    module = _ADAPTERS.get(name)
    if module is None:
        raise AttributeError(f"module 'lmcache_nvme_backend' has no attribute {name!r}")
    return getattr(importlib.import_module(f".adapters.{module}", __name__), name)
