"""``lmcache-nvme bench``: fio-style benchmark of the backend's own I/O engine (``command``
runs it; ``iobench`` times the engine; ``fio``, ``tuning``, ``plot``, ``gpu_reads``: options)."""

from __future__ import annotations

from .command import add_parser

__all__ = ["add_parser"]
