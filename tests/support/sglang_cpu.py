"""SGLang on a CPU device: what its LMCache paths need there and do not have.

* SGLang 0.5.18-0.5.20: the stream function its ``LMCRadixCache`` needs (:func:`install`).
  ``LMCRadixCache.__init__`` creates its load and store streams with
  ``torch.get_device_module(device).Stream(device=device)``, which ``torch.cpu.Stream`` does
  not accept (``TypeError: Stream.__init__() got an unexpected keyword argument 'device'``),
  and enters them through ``stream.device``, which it lacks.  :func:`install` gives SGLang a
  function that returns a CPU stream with both; other devices get SGLang's own behaviour.
* SGLang 0.5.21+ with LMCache 0.5.6's ``UnifiedLMCacheMPConnector`` and LMCache's
  shared-memory transfer (``lmcache.mp.mp_transfer_mode: lmcache_driven``, the only CPU
  transfer that takes more than one KV group): the connector registers *block views* of
  SGLang's pool tensors, and LMCache's CPU registration (``migrate_to_shm_and_wrap``) copies
  each view's memory into POSIX shared memory and re-points only the tensor it was handed
  ("only the tensors handed in are re-pointed").  SGLang's own ``k_buffer`` / ``v_buffer``
  tensors keep the old memory: the server then stores what the pools held at registration
  and loads into memory SGLang never reads, without an error.  :func:`share_pools` hands
  SGLang's tensors to that same LMCache function first, so that the views made from them
  later already share the server's memory.  GPUs are not affected (CUDA IPC maps the pools
  where they are).

Run by SGLang's environment only (it imports SGLang and LMCache).
"""
from __future__ import annotations

from typing import Any

import torch


class CpuStream(torch.cpu.Stream):
    """A CPU stream with the ``device`` SGLang's stream functions read."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device = device


def create_device_stream(device: Any) -> Any:
    device = device if isinstance(device, torch.device) else torch.device(device)
    if device.type == "cpu":
        return CpuStream(device)
    return torch.get_device_module(device).Stream(device=device)


def install() -> None:
    """Replace SGLang's ``create_device_stream`` where ``LMCRadixCache`` looks it up."""
    from sglang.srt.mem_cache.storage.lmcache import lmc_radix_cache
    from sglang.srt.utils import common

    common.create_device_stream = create_device_stream
    lmc_radix_cache.create_device_stream = create_device_stream


def share_pools(tensors: list[torch.Tensor]) -> None:
    """Move SGLang's KV pool tensors into POSIX shared memory before LMCache's unified
    connector registers views of them (LMCache's own function, which re-points the tensors
    it is given)."""
    from lmcache.v1.platform.devices.cpu.shm import migrate_to_shm_and_wrap

    for tensor in tensors:
        migrate_to_shm_and_wrap(tensor)


def pools_shared(pools: list[torch.Tensor], registered: list[torch.Tensor]) -> bool:
    """Whether each of SGLang's pool tensors is the memory LMCache registered for it (the
    connector registers them in the same order)."""
    return len(pools) == len(registered) and all(
        pool.data_ptr() == view.data_ptr() for pool, view in zip(pools, registered, strict=True))
