"""I/O engines (layer 2): move chunk bytes between files and memory.

``engine`` is the seam the store talks through (read and write shares, the
``ChunkEngine`` protocol), implemented by ``native`` (compiled, batches without the GIL) and
``python_engine``; ``engine_for`` picks one.  ``posix`` does O_DIRECT file I/O for the
Python engine and the tools; ``kvikio`` reads payloads into GPU memory.  Engines know the
file layout, not keys, indexes or capacity.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .engine import ChunkEngine


def engine_for(native_io: str, threads: int, write_threads: int, task_size: int, *,
               recycle_bytes: int = 0, recycle_suffix: str | None = None) -> ChunkEngine:
    """The I/O engine for ``nvme.native_io``: the compiled one when it is built and not
    ``off``, else the Python one (``on`` without it raises ``RuntimeError``).  ``recycle_*``
    go to the compiled engine only."""
    from . import native
    from .python_engine import PythonEngine

    if native_io == "on" or (native_io != "off" and native.available()):
        return native.NativeEngine(threads, write_threads, task_size,
                                   recycle_bytes=recycle_bytes, recycle_suffix=recycle_suffix)
    return PythonEngine(threads, write_threads, task_size)
