"""NVMe / GPUDirect Storage tier for LMCache.

LMCache loads the plugin classes from this package by name::

    storage_plugin.nvme.module_path: lmcache_nvme_backend
    storage_plugin.nvme.class_name: NVMeBackend

and likewise ``NVMeConnector`` (``remote_storage_plugins``) and ``NVMeL2Adapter``
(``lmcache server --l2-adapter``, type ``plugin``).

The storage core (``format``, ``layout``, ``posix_io``, ``store``) does not
import LMCache or torch; the adapters are imported lazily so that the core and
the settings can be used (and tested) on their own.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .config import NVMeConfigError, NVMeSettings

__version__ = "0.1.0"
__all__ = ["NVMeBackend", "NVMeConfigError", "NVMeConnector", "NVMeL2Adapter",
           "NVMeL2AdapterConfig", "NVMeSettings", "__version__"]

if TYPE_CHECKING:
    from .adapters.backend import NVMeBackend
    from .adapters.connector import NVMeConnector
    from .adapters.l2_adapter import NVMeL2Adapter, NVMeL2AdapterConfig


def __getattr__(name: str) -> Any:
    if name == "NVMeBackend":
        from .adapters.backend import NVMeBackend

        return NVMeBackend
    if name in ("NVMeL2Adapter", "NVMeL2AdapterConfig"):
        from .adapters import l2_adapter

        return getattr(l2_adapter, name)
    if name == "NVMeConnector":
        from .adapters.connector import NVMeConnector

        return NVMeConnector
    raise AttributeError(f"module 'lmcache_nvme_backend' has no attribute {name!r}")
