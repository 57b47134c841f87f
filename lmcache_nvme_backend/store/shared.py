"""Shared mode: several processes (or nodes on a shared filesystem) on one directory tree.

Each process keeps its own index, so before a lookup answers, the index is
reconciled with the files: an index hit is confirmed with a ``stat`` (another
process may have evicted the file) and an index miss looks on disk, in the
order a writer would have placed the chunk, for a file another process
published.  A file is adopted only if its header is ours, names this key and
matches the file's size; the payload checksum is still verified on every read.
"""

from __future__ import annotations

import os
import time

from ..disk.layout import namespace_id
from .catalog import Catalog
from .index import IndexEntry
from .reads import ChunkReader
from .roots import Roots
from .stats import Counter, StoreStats


class SharedTree:
    """Keeps one process's index in step with what other processes did to the files."""

    def __init__(self, catalog: Catalog, roots: Roots, reader: ChunkReader,
                 stats: StoreStats) -> None:
        self._catalog = catalog
        self._roots = roots
        self._reader = reader
        self._stats = stats

    def reconcile(self, key: str, digest: str, namespace: str) -> None:
        """Forget ``key`` (``digest``) if its file vanished; adopt it if another process
        wrote it."""
        entry = self._catalog.entry(digest)
        if entry is not None:
            path = self._roots[entry.root].layout.chunk_path(entry.ns_id, digest)
            if os.path.exists(path):
                return
            self._reader.forget(digest)
            self._stats.add(Counter.SHARED_VANISHED)
        self._adopt(key, digest, namespace_id(namespace))

    def _adopt(self, key: str, digest: str, ns_id: str) -> None:
        """Index a chunk file another process published."""
        for root in self._roots.in_placement_order(digest):
            path = root.layout.chunk_path(ns_id, digest)
            verdict = self._reader.judge_header(root, path, key)
            if verdict is None or verdict.header is None or not verdict.ok:
                continue
            size = verdict.header.file_size
            self._catalog.add_if_absent(IndexEntry(digest, ns_id, root.index, size,
                                                   verdict.header.tensor_meta, time.time_ns()))
            self._stats.add(Counter.SHARED_ADOPTED)
            return
