"""``lmcache-nvme bench``: fio-style benchmark of the backend's own I/O engine.

``command.py``: the arguments and the runs; ``model.py``: a configuration and its results;
``iobench.py``: the timed runs through the engine; ``gpu_reads.py``: ``--dest gpu``;
``fio.py``: ``--vs-fio``; ``report.py``: text and JSON; ``tuning.py``: the ``--sweep``'s
advice; ``plot.py``: ``--plot``.
"""

from __future__ import annotations

from .command import add_parser

__all__ = ["add_parser"]
