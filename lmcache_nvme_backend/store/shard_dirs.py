"""A new namespace's shard directories, made in the background when it is first written.

Chunk files live in 256 shard directories per namespace (``disk/layout.py``).  Each is
made when missing by the first write that lands in it, on that writer's path: for the
first few hundred chunks of a new namespace a ``mkdir``, an ``open`` and a ``chmod`` more
per chunk, with the directory's inode and block allocated in the journal, while the
writes of a cache that has served for a while find every directory there.  So when a
write makes a namespace's directory, one short-lived thread at the write-back's low CPU
priority makes all its shard directories at once (with the native engine in one release
of the GIL, ``native.make_dirs``); the writes that come meanwhile make theirs as before
(a directory made twice is found there).  The rules are the writers': every component
made beneath the root with exactly ``nvme.dir_mode``, no link followed.

Only trees with one shard level get them: a tree of the older layout with two levels
(``LEGACY_SHARD_LEVELS``) would need 65,536 directories per namespace, and keeps making
its leaves as writes reach them.
"""

from __future__ import annotations

import errno
import logging
import os
import threading

from ..disk.layout import SHARD_LEVELS, RootLayout
from ..disk.safe_fs import makedirs_beneath, root_descriptor
from ..io import native
from .writeback import lower_thread_cpu_priority

logger = logging.getLogger(__name__)


class ShardDirMaker:
    """Makes the shard directories of the namespaces a store's writes create."""

    def __init__(self, dir_mode: int, use_native: bool) -> None:
        self._dir_mode = dir_mode
        self._use_native = use_native
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._closed = False

    def namespace_made(self, layout: RootLayout, ns_id: str) -> None:
        """A write just made namespace ``ns_id``'s directory on ``layout``'s root: make its
        shard directories on a thread of their own (nothing, once closed)."""
        if layout.shard_levels != SHARD_LEVELS:
            return
        with self._lock:
            if self._closed:
                return
            self._threads = [t for t in self._threads if t.is_alive()]
            thread = threading.Thread(target=self._make, args=(layout, ns_id),
                                      name="nvme-shard-dirs", daemon=True)
            self._threads.append(thread)
            thread.start()

    def _make(self, layout: RootLayout, ns_id: str) -> None:
        lower_thread_cpu_priority()
        rels = layout.shard_rels(ns_id)
        try:
            if self._use_native:
                # a descriptor of its own: the kept one may be replaced while this runs
                root_fd = os.dup(root_descriptor(layout.root_str))
                try:
                    errors = native.make_dirs([(root_fd, rel) for rel in rels], self._dir_mode)
                finally:
                    os.close(root_fd)
                failed = [(rel, err) for rel, err in zip(rels, errors, strict=True) if err]
            else:
                failed = []
                for rel in rels:
                    try:
                        makedirs_beneath(layout.root, rel, self._dir_mode)
                    except OSError as exc:
                        failed.append((rel, exc.errno or errno.EIO))
        except OSError as exc:  # the root itself is gone: the writes will say so
            logger.debug("NVMe tier: shard directories of %s not made: %s", ns_id, exc)
            return
        if failed:  # each write makes its own directory, and reports what stops it
            rel, err = failed[0]
            logger.debug("NVMe tier: %d shard directories not made in %s, e.g. %s: %s",
                         len(failed), layout.root, rel, os.strerror(err))

    def close(self) -> None:
        """Wait for the directories being made (a few milliseconds of work each)."""
        with self._lock:
            self._closed = True
            threads, self._threads = self._threads, []
        for thread in threads:
            thread.join()
