"""I/O engines (layer 2): move chunk bytes between files and memory.

``engine`` is the seam the store talks through: two batch shapes (read and write shares)
and the ``ChunkEngine`` protocol, which ``native`` (compiled, batches without the GIL) and
``python_engine`` (the same in Python) implement; ``engine_for`` picks one, for the store
and the tools alike.  ``posix`` reads and writes chunk files with O_DIRECT and aligned
buffers for the Python engine (and reads headers by path); ``kvikio`` reads payloads into
GPU memory with kvikio (GDS or its compat mode).  Engines know the file layout, not keys,
indexes or capacity.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .engine import ChunkEngine


def engine_for(native_io: str, threads: int, write_threads: int, task_size: int, *,
               recycle_bytes: int = 0, recycle_suffix: str | None = None) -> ChunkEngine:
    """The I/O engine for ``native_io`` (``nvme.native_io``: ``auto``, ``on`` or ``off``):
    the compiled one (``native.py``) when it is built and not ``off``, else the Python one
    (``python_engine.py``); ``on`` without it raises ``RuntimeError`` with the fix.
    ``threads`` readers, ``write_threads`` writers, I/Os of at most ``task_size`` bytes;
    ``recycle_bytes`` and ``recycle_suffix`` go to the compiled engine only."""
    from . import native
    from .python_engine import PythonEngine

    if native_io == "on" or (native_io != "off" and native.available()):
        return native.NativeEngine(threads, write_threads, task_size,
                                   recycle_bytes=recycle_bytes, recycle_suffix=recycle_suffix)
    return PythonEngine(threads, write_threads, task_size)
