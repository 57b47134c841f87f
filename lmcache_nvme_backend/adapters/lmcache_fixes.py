"""A fix for LMCache's multiprocess server on CPU, so that SGLang's KV pools can register.

SGLang's connector registers its K and V pools, which the server turns into ``[K layers, V
layers]``: two lists of tensors.  LMCache 0.5.6's CPU cache context calls ``data_ptr()``,
``numel()``, ``element_size()`` and ``dtype`` on each entry, expecting a tensor per layer
(as vLLM registers them), so registration fails (``'list' object has no attribute
'data_ptr'``) and SGLang waits out its 300 s timeout.  The fix gives each list of planes
those members (first plane's pointer, all planes' elements, their element size and dtype:
all the CPU context needs them for), wrapping only that module's reference to LMCache's
layout function: vLLM's tensors and GPU servers are not affected.
"""

from __future__ import annotations

import functools
import importlib
from typing import Any

from ._common import logger

#: Where LMCache's CPU cache context looks up the layout function it calls.
CPU_CONTEXT_MODULE = "lmcache.v1.platform.devices.cpu.cache_context"
LAYOUT_FUNCTION = "normalize_and_discover_per_layer_formats"
_FIXED = "_lmcache_nvme_split_kv_fix"


class KVPlanes(list):
    """One entry of a split K / V layout (a list of tensors) that answers the tensor
    questions ``CPUCacheContext`` asks of every entry."""

    def data_ptr(self) -> int:
        return int(self[0].data_ptr())

    def numel(self) -> int:
        return sum(int(plane.numel()) for plane in self)

    def element_size(self) -> int:
        return int(self[0].element_size())

    @property
    def dtype(self) -> Any:
        return self[0].dtype


def _as_planes(entry: Any) -> Any:
    return KVPlanes(entry) if type(entry) is list and entry else entry


def fix_cpu_split_kv_registration() -> bool:
    """Install the fix in this process (once); False when this LMCache has no CPU context
    to fix."""
    try:
        module = importlib.import_module(CPU_CONTEXT_MODULE)
    except ImportError:
        return False
    original = getattr(module, LAYOUT_FUNCTION, None)
    if original is None:
        return False
    if getattr(original, _FIXED, False):
        return True

    @functools.wraps(original)
    def layout_with_planes(*args: Any, **kwargs: Any) -> tuple[Any, Any]:
        kv_caches, formats = original(*args, **kwargs)
        if type(kv_caches) is list:
            kv_caches = [_as_planes(entry) for entry in kv_caches]
        return kv_caches, formats

    setattr(layout_with_planes, _FIXED, True)
    setattr(module, LAYOUT_FUNCTION, layout_with_planes)
    logger.debug("CPU cache context: split K / V KV pools (SGLang's) can register")
    return True
