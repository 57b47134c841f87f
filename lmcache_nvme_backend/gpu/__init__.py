"""The GPU read path of ``NVMeBackend`` (layer 4): ``select`` picks the path, ``pool`` is
the device memory lent to LMCache, ``reader`` reads chunks into it.  LMCache's memory
objects are handled through the adapter's ``reader.HostMemory``, so nothing here imports
the adapters.
"""
