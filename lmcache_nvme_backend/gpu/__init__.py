"""The GPU read path of ``NVMeBackend`` (layer 4), between the store and the adapters.

``select`` decides which path a CUDA worker uses (kvikio with GDS, kvikio's compat
mode, host bounce, or host objects) from facts about the machine; ``pool`` is the
device memory lent to LMCache as memory objects; ``reader`` reads chunks into it and
lets the store judge each read.  LMCache's memory-object handling comes in from the
adapter (``reader.HostMemory``), so nothing here imports the adapters.
"""
