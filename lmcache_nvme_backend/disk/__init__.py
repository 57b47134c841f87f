"""On-disk truth (layer 1): the chunk file format and its validation, the directory layout,
the manifest, and link-safe file operations beneath a cache root.  Nothing here does I/O on
chunk payloads or knows about LMCache.
"""
