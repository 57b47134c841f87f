"""SGLang 0.5.18-0.5.20 on a CPU device: the stream function its ``LMCRadixCache`` needs.

``LMCRadixCache.__init__`` creates its load and store streams with
``torch.get_device_module(device).Stream(device=device)``, which ``torch.cpu.Stream`` does
not accept (``TypeError: Stream.__init__() got an unexpected keyword argument 'device'``),
and enters them through ``stream.device``, which it lacks.  :func:`install` gives SGLang a
function that returns a CPU stream with both; other devices get SGLang's own behaviour.
Run by SGLang's environment only (it imports SGLang).
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
