"""I/O engines (layer 2): move chunk bytes between files and memory.

``engine`` is the seam the store talks through: two batch shapes (read and write shares)
and the ``ChunkEngine`` protocol, which ``native`` (compiled, batches without the GIL) and
``python_engine`` (the same in Python) implement.  ``posix`` reads and writes chunk files
with O_DIRECT and aligned buffers into host memory for the tools and the Python engine;
``kvikio`` reads payloads into GPU memory with kvikio (GDS or its compat mode).  Engines
know the file layout, not keys, indexes or capacity.
"""
