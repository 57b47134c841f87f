"""I/O engines (layer 2): move chunk bytes between files and memory.

``posix`` reads and writes chunk files with O_DIRECT and aligned buffers into host
memory; ``kvikio`` reads payloads into GPU memory with kvikio (GDS or its compat
mode).  Engines know the file layout, not keys, indexes or capacity.
"""
