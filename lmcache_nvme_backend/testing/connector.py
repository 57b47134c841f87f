"""``CopyingCPUConnector``: LMCache's GPU connector interface over CPU tensors, copying bytes.

LMCache has no CPU connector that moves data (``MockGPUConnector`` does nothing); this
one makes ``engine.store()`` / ``engine.retrieve()`` byte-exact round trips on CPU.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from lmcache.v1.gpu_connector import GPUConnectorInterface
from lmcache.v1.memory_management import MemoryFormat, MemoryObj


class CopyingCPUConnector(GPUConnectorInterface):
    """Copies token ranges between LMCache's memory objects and the ``kvcaches=<tensor>``
    every ``store`` / ``retrieve`` call passes (LMCache forwards the call's keyword
    arguments): ``[2, num_layers, num_tokens, hidden_dim]`` covering the whole prompt, so
    tokens ``[start, end)`` are ``kvcaches[:, :, start:end]``."""

    def __init__(self, num_layers: int, hidden_dim: int, dtype: torch.dtype) -> None:
        self.num_layers = num_layers
        self.hidden_dim = hidden_dim
        self.dtype = dtype

    def get_shape(self, num_tokens: int) -> torch.Size:
        """Shape of one memory object holding ``num_tokens`` tokens (KV_2LTD)."""
        return torch.Size([2, self.num_layers, num_tokens, self.hidden_dim])

    def _chunk_views(self, memory_obj: MemoryObj, start: int, end: int,
                     kwargs: Mapping[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        """Return (memory object tensor, matching slice of ``kwargs['kvcaches']``)."""
        kvcaches = kwargs.get("kvcaches")
        if not isinstance(kvcaches, torch.Tensor):
            raise TypeError("CopyingCPUConnector needs kvcaches=<CPU tensor> in the call")
        expected = (2, self.num_layers, self.hidden_dim)
        actual = (kvcaches.shape[0], kvcaches.shape[1], kvcaches.shape[3])
        if kvcaches.dim() != 4 or actual != expected or kvcaches.dtype != self.dtype:
            raise ValueError(
                f"kvcaches must be [2, {self.num_layers}, tokens, {self.hidden_dim}] "
                f"{self.dtype}, got {tuple(kvcaches.shape)} {kvcaches.dtype}")
        if not 0 <= start < end <= kvcaches.shape[2]:
            raise ValueError(f"token range [{start}, {end}) outside kvcaches "
                             f"({kvcaches.shape[2]} tokens)")
        fmt = memory_obj.get_memory_format()
        if fmt != MemoryFormat.KV_2LTD:
            raise ValueError(f"CopyingCPUConnector handles KV_2LTD only, got {fmt}")
        chunk = memory_obj.tensor
        if chunk is None:
            raise RuntimeError("memory object has no tensor (invalidated?)")
        if chunk.shape != self.get_shape(end - start) or chunk.dtype != self.dtype:
            raise ValueError(f"memory object is {tuple(chunk.shape)} {chunk.dtype}, "
                             f"expected {tuple(self.get_shape(end - start))} {self.dtype}")
        return chunk, kvcaches[:, :, start:end]

    def from_gpu(self, memory_obj: MemoryObj, start: int, end: int, **kwargs: Any) -> None:
        """Copy tokens ``[start, end)`` of ``kvcaches`` into ``memory_obj``."""
        chunk, region = self._chunk_views(memory_obj, start, end, kwargs)
        chunk.copy_(region)

    def to_gpu(self, memory_obj: MemoryObj, start: int, end: int, **kwargs: Any) -> None:
        """Copy ``memory_obj`` into tokens ``[start, end)`` of ``kvcaches``."""
        chunk, region = self._chunk_views(memory_obj, start, end, kwargs)
        region.copy_(chunk)

    def batched_from_gpu(self, memory_objs: Sequence[MemoryObj], starts: Sequence[int],
                         ends: Sequence[int], **kwargs: Any) -> None:
        """Apply :meth:`from_gpu` to each (memory object, start, end)."""
        for memory_obj, start, end in zip(memory_objs, starts, ends, strict=True):
            self.from_gpu(memory_obj, start, end, **kwargs)

    def batched_to_gpu(self, memory_objs: Sequence[MemoryObj] | None = None,
                       starts: Sequence[int] | None = None, ends: Sequence[int] | None = None,
                       **kwargs: Any) -> None:
        """Apply :meth:`to_gpu` to each (memory object, start, end)."""
        if memory_objs is None or starts is None or ends is None:
            raise TypeError("CopyingCPUConnector does not support layerwise retrieval")
        for memory_obj, start, end in zip(memory_objs, starts, ends, strict=True):
            self.to_gpu(memory_obj, start, end, **kwargs)
