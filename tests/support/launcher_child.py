"""``python -m support.launcher_child CACHE_DIR``: LMCache's storage plugin launcher with
``nvme.max_size_gb: -1`` on CACHE_DIR, as a user's engine would start it; prints the
backends it loaded (tests/engine/test_backend_config.py reads its stdout and stderr)."""

from __future__ import annotations

import asyncio
import sys
from collections import OrderedDict
from typing import Any

from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.storage_backend import storage_plugin_launcher


def main(cache_dir: str) -> None:
    config = LMCacheEngineConfig.from_dict({
        "chunk_size": 256, "local_cpu": True, "max_local_cpu_size": 0.1,
        "storage_plugins": ["nvme"],
        "extra_config": {"storage_plugin.nvme.module_path": "lmcache_nvme_backend",
                         "storage_plugin.nvme.class_name": "NVMeBackend",
                         "nvme.path": cache_dir, "nvme.max_size_gb": -1}})
    backends: OrderedDict[str, Any] = OrderedDict()
    storage_plugin_launcher(config, None, asyncio.new_event_loop(), object(), "cpu",
                            backends)
    print("loaded backends:", list(backends))


if __name__ == "__main__":
    main(sys.argv[1])
