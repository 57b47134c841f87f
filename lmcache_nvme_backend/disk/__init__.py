"""On-disk truth (layer 1): the chunk file format, the directory layout, the manifest.

``format`` encodes and decodes the 4 KiB header; ``validate`` is the one judge of a
chunk file every reader uses; ``layout`` turns digests into paths; ``manifest``
snapshots an index; ``gpusum`` is the checksum a GPU can compute where a payload
lands; ``safe_fs`` and ``resolve`` open, make and remove files beneath a cache root
without following a link; ``probe`` checks a cache directory.  Nothing here does I/O on
chunk payloads or knows about LMCache.
"""
