"""The GPU read path of ``NVMeBackend`` (layer 4): ``select`` picks the path, ``pool`` is
the device memory lent to LMCache, ``reader`` reads chunks into it.
"""
