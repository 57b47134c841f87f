"""``lmcache-nvme bench``: fio-style benchmark of the backend's own I/O engine.

The subcommand is :func:`add_parser` (from ``command.py``), like every other
command module of :mod:`lmcache_nvme_backend.cli`.  Modules, by concern:

* ``command.py``: arguments, validation, running the configurations (and ``--vs-fio``)
* ``model.py``: ``BenchConfig``, ``DirStats``, ``RunResult``: a configuration and its results
* ``iobench.py``: the bench workspace and the timed runs through the POSIX engine
* ``gpu_reads.py``: ``--dest gpu``, reads into CUDA tensors through kvikio
* ``fio.py``: the same configuration as an fio job, and fio's results
* ``report.py``: text and JSON output, the comparison with fio, the sweep's recommendation
* ``plot.py``: ``--plot`` charts (matplotlib)
"""

from __future__ import annotations

from .command import add_parser

__all__ = ["add_parser"]
