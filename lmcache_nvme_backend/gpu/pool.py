"""The GPU buffer pool: device memory ``NVMeBackend`` lends to LMCache as memory objects."""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..config import MIB
from ..disk.format import TensorMeta, padded_length

if TYPE_CHECKING:
    import torch
    from lmcache.v1.memory_management import MemoryObj

logger = logging.getLogger("lmcache_nvme_backend")


class GpuBufferPool:
    """Device memory lent to LMCache as memory objects (LMCache's ``GPUMemoryAllocator``);
    one returns to the pool when its last holder lets go.  LMCache's host tier keeps what a
    lower tier returns, so a full pool asks ``reclaim`` to drop its oldest entries nobody
    else holds, then tries again; None: the caller serves the chunk in host memory."""

    def __init__(self, size: int, device: str, *,
                 fit: Callable[[MemoryObj, int], MemoryObj | None], register: bool = False,
                 reclaim: Callable[[Any, MemoryObj], bool] | None = None,
                 max_reclaims: int = 64) -> None:
        """``fit`` sizes an allocated object to a payload (``memory_objects.fit_to_payload``)."""
        from lmcache.v1.memory_allocators.gpu_memory_allocator import GPUMemoryAllocator

        self.size = size
        self.allocator = GPUMemoryAllocator(size, device=device, align_bytes=4096)
        self.tensor: torch.Tensor = self.allocator.tensor
        self.device = self.tensor.device
        self._fit = fit
        self._reclaim = reclaim
        self._max_reclaims = max_reclaims
        self._lock = threading.Lock()
        self._lent: OrderedDict[int, tuple[Any, MemoryObj]] = OrderedDict()
        self.registered = False
        if register:
            try:
                import kvikio

                kvikio.memory_register(self.tensor)
                self.registered = True
            except Exception as exc:  # LMCache's CuFileMemoryAllocator dies here; we go on
                logger.warning("NVMe tier: cuFile registration of the %d MiB GPU pool failed "
                               "(%s); reading without it (cuFile uses its own bounce "
                               "buffers).", size // MIB, exc)

    def allocate(self, meta: TensorMeta, tag: Any = None) -> MemoryObj | None:
        obj = self._allocate(meta)
        if obj is None and self._reclaim is not None and self._reclaim_some():
            obj = self._allocate(meta)
        if obj is None or (obj := self._fit(obj, meta.nbytes)) is None:
            return None
        with self._lock:
            self._lent[id(obj)] = (tag, obj)
        return obj

    def _allocate(self, meta: TensorMeta) -> MemoryObj | None:
        import torch
        from lmcache.v1.memory_management import MemoryFormat

        shapes = [torch.Size(s) for s in meta.shapes]
        dtypes = [getattr(torch, d) for d in meta.dtypes]
        fmt = MemoryFormat(meta.fmt)
        if len(shapes) == 1:
            return self.allocator.allocate(shapes[0], dtypes[0], fmt)
        return self.allocator.allocate(shapes, dtypes, fmt)

    def _reclaim_some(self) -> bool:
        """Let the oldest lent objects go where only LMCache's host tier still holds them."""
        assert self._reclaim is not None
        freed = False
        with self._lock:
            candidates = list(self._lent.items())[: self._max_reclaims * 4]
        tried = 0
        for ident, (tag, obj) in candidates:
            if obj.get_ref_count() <= 0:
                with self._lock:
                    self._lent.pop(ident, None)
                freed = True
                continue
            if tried >= self._max_reclaims:
                break
            tried += 1
            if self._reclaim(tag, obj):
                with self._lock:
                    self._lent.pop(ident, None)
                freed = freed or obj.get_ref_count() <= 0
        return freed

    def slot(self, obj: MemoryObj, length: int) -> torch.Tensor:
        """The pool bytes behind ``obj``: ``length`` of them (padding of the slot included)."""
        start = int(obj.metadata.address)
        return self.tensor[start : start + length]

    def capacity_for(self, obj: MemoryObj, payload_len: int) -> int:
        """Bytes to read into ``obj``: the padded payload when its slot has the room."""
        padded = padded_length(payload_len)
        return padded if obj.get_physical_size() >= padded else payload_len

    def lent(self) -> int:
        with self._lock:
            for ident in [i for i, (_, o) in self._lent.items() if o.get_ref_count() <= 0]:
                del self._lent[ident]
            return len(self._lent)

    def close(self) -> None:
        if self.registered:
            try:
                import kvikio

                kvikio.memory_deregister(self.tensor)
            except Exception as exc:
                logger.debug("cuFile deregistration failed: %s", exc)
            self.registered = False
        close = getattr(self.allocator, "close", None)
        if callable(close):
            close()
