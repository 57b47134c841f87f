"""Restart: rebuild a root's index from its directory tree and manifest, and keep the manifest.

The tree says which chunks exist; the manifest (``disk/manifest.py``) adds recency and
tensor metadata.  A chunk file the manifest does not know is indexed with its ``stat`` size
and mtime and learns its metadata from its header on first use.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from ..disk.format import file_size_for
from ..disk.layout import TempFile
from ..disk.manifest import load_manifest, remove_stale_manifest_temps, save_manifest
from .catalog import Catalog
from .index import IndexEntry
from .roots import Roots, RootState, unlink_quietly
from .stats import Counter, StoreStats

logger = logging.getLogger(__name__)

# A manifest row takes ~100 bytes; one more than this per chunk file is not this tree's.
MANIFEST_BYTES_PER_CHUNK = 1024
#: The largest share of one thread's time the periodic snapshot may take (a save costs about
#: 1.5 CPU-s, GIL held, per million chunks: a big index is saved less often).
MANIFEST_CPU_SHARE = 0.01


def recover_root(root: RootState, catalog: Catalog, stats: StoreStats,
                 evict: Callable[[list[IndexEntry]], None], enforce_budget: bool = True) -> None:
    """Index the chunks found in ``root`` (sizes from ``lstat``, recency and metadata from
    the manifest where it matches); with ``enforce_budget``, delete what exceeds the budget
    (LRU first)."""
    started = time.perf_counter()
    located, temps = root.layout.scan()
    remove_stale_temp_files(root, temps, stats)
    records = load_manifest(root.layout.index_dir, max_bytes=manifest_limit(len(located)))
    found: list[IndexEntry] = []
    for loc in located:
        st, rec = loc.stat, records.get(loc.digest)
        if rec is None or rec.ns_id != loc.namespace_id:  # a file the manifest does not know
            found.append(IndexEntry(loc.digest, loc.namespace_id, root.index, st.st_size, None,
                                    st.st_mtime_ns))
            continue
        meta = rec.meta if rec.meta is not None and \
            file_size_for(rec.meta.nbytes) == st.st_size else None
        found.append(IndexEntry(loc.digest, rec.ns_id, root.index, st.st_size, meta,
                                rec.last_access_ns))
    found.sort(key=lambda e: e.last_access_ns)
    over = catalog.add_recovered(root.index, found, enforce_budget)
    evict(over)
    stats.add(Counter.RECOVERED_ENTRIES, len(found) - len(over))
    logger.info("NVMe tier: %s holds %d chunks (%.1f MiB); index rebuilt in %.3f s.",
                root.layout.root, len(found) - len(over),
                catalog.used_bytes(root.index) / 2**20, time.perf_counter() - started)


def manifest_limit(chunk_files: int) -> int:
    """The largest manifest worth reading for a tree of ``chunk_files`` files."""
    return MANIFEST_BYTES_PER_CHUNK * chunk_files + (1 << 20)


def remove_stale_temp_files(root: RootState, temps: list[TempFile], stats: StoreStats) -> None:
    """Remove dead writers' chunk temps (``temps``) and manifest temps."""
    now = time.time()
    for tmp in temps:
        if tmp.is_stale(now=now):
            unlink_quietly(tmp.path, root.layout.root)
            stats.add(Counter.REMOVED_TEMP_FILES)
    stats.add(Counter.REMOVED_TEMP_FILES, remove_stale_manifest_temps(root.layout.index_dir))


def next_save_in(interval_s: float, save_cpu_s: float) -> float:
    """Seconds until the next periodic snapshot (longer after a costly save)."""
    return max(interval_s, save_cpu_s / MANIFEST_CPU_SHARE)


class ManifestKeeper:
    """Saves every root's index snapshot, on demand and on a thread every
    ``nvme.manifest_interval_s`` (within ``MANIFEST_CPU_SHARE``)."""

    def __init__(self, roots: Roots, catalog: Catalog, file_mode: int,
                 interval_s: float) -> None:
        self._roots = roots
        self._catalog = catalog
        self._file_mode = file_mode
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if interval_s > 0:
            self._thread = threading.Thread(target=self._loop, args=(interval_s,),
                                            name="nvme-manifest", daemon=True)
            self._thread.start()

    def save_all(self) -> None:
        """Snapshot every root's index (the catalogue's lock is held only to copy it)."""
        for root in self._roots:
            if root.hung:  # its filesystem does not answer: saved once it is back
                logger.warning("NVMe tier: not saving the manifest of %s: the path is out of "
                               "service (a read passed nvme.io_deadline_s).", root.layout.root)
                continue
            entries = self._catalog.lru_entries(root.index)
            try:
                save_manifest(root.layout.index_dir, entries, self._file_mode)
            except OSError as exc:
                logger.warning("NVMe tier: could not save manifest of %s: %s",
                               root.layout.root, exc)

    def _loop(self, interval_s: float) -> None:
        wait_s = interval_s
        while not self._stop.wait(wait_s):
            started = time.thread_time()
            self.save_all()
            cpu_s = time.thread_time() - started
            wait_s = next_save_in(interval_s, cpu_s)
            if wait_s > interval_s:
                logger.debug("NVMe tier: the manifest took %.2f CPU-s to save; the next in "
                             "%.0f s", cpu_s, wait_s)

    def stop(self) -> None:
        """Stop the periodic thread (the caller saves a final snapshot)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
