"""Namespace directories removed under a running store (``lmcache-nvme forget``).

``forget`` renames ``ns/<ns16>`` away in one step, then empties it (left for a minute so its
inode is not reused).  A thread (``nvme-namespaces``) looks every ``CHECK_S`` at the
directory of each namespace the index holds or a writer took up (one ``fstatat`` relative
to the root's kept descriptor) and compares its device and inode with the ones first seen
(at start, or in the first round it was there: one removed before that, or removed and made
again, goes unnoticed and its chunks are forgotten as their reads miss).  A directory gone,
or made again, takes every entry of that namespace on that root out of the index, and the
removal listeners hear of them.  Without shared mode their files are removed too
(``Room.unlink``: a writer may have put some into the new directory); in shared mode every
member forgets them, as a failed read does, and stops counting the ones it owns.
"""

from __future__ import annotations

import logging
import os
import stat
import threading
from typing import TYPE_CHECKING

from .catalog import Catalog
from .roots import Roots, RootState

if TYPE_CHECKING:
    from .room import Room
    from .shared.tree import SharedTree

logger = logging.getLogger(__name__)

CHECK_S = 1.0
MAX_REMEMBERED = 4096  # directories remembered of namespaces no longer in the index
#: A namespace directory's (st_dev, st_ino); None when it is not there or not a directory.
Identity = tuple[int, int] | None
_UNSEEN = (-1, -1)  # a namespace not looked at yet on that root


class NamespaceWatch:
    """Drops the entries of namespaces whose directory was removed or replaced."""

    def __init__(self, catalog: Catalog, roots: Roots, room: Room,
                 shared: SharedTree | None = None, interval_s: float = CHECK_S) -> None:
        self._catalog = catalog
        self._roots = roots
        self._room = room
        self._shared = shared
        self._interval_s = interval_s
        # (root, namespace id) -> the directory as first seen
        self._seen: dict[tuple[int, str], Identity] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="nvme-namespaces",
                                        daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _loop(self) -> None:
        while not self._stop.wait(self._interval_s):
            try:
                self.check()
            except Exception:  # a background step must never end the thread
                logger.exception("NVMe tier: the check of namespace directories failed")

    def check(self) -> int:
        """One round over every root; how many entries left the index."""
        return sum(self._check_root(root) for root in self._roots)

    def _check_root(self, root: RootState) -> int:
        names = self._catalog.namespaces(root.index)
        if not names:
            return 0
        try:
            fd = root.descriptor()  # the store's own, kept open: no open per round
        except (OSError, ValueError):  # the cache directory itself is gone: reads say so
            return 0
        now = {ns_id: _identity(fd, f"ns/{ns_id}") for ns_id in names}
        dropped = 0
        seen = self._seen
        for ns_id, current in now.items():
            key = (root.index, ns_id)
            before = seen.get(key, _UNSEEN)
            if current is not None and before in (_UNSEEN, None, current):
                seen[key] = current  # first seen, there again, or as it was
                continue
            if before is None:
                continue  # gone, and its entries dropped when that was first seen
            dropped += self._drop(root, ns_id)
            seen[key] = current  # gone, or made again: entries published there from now on
        if len(seen) > MAX_REMEMBERED:  # namespaces that left the index long ago
            self._seen = {k: v for k, v in seen.items()
                          if k[0] != root.index or k[1] in now}
        return dropped

    def _drop(self, root: RootState, ns_id: str) -> int:
        entries = self._catalog.drop_namespace(root.index, ns_id)
        if not entries:
            return 0
        if self._shared is not None:
            self._shared.forgotten(entries)
        else:
            self._room.unlink(entries)
        self._catalog.notify_removed(entries)
        logger.info("NVMe tier: the directory of namespace %s in %s was removed (lmcache-nvme "
                    "forget) or replaced; its %d chunks (%.1f MiB) are no longer served.",
                    ns_id, root.layout.root, len(entries),
                    sum(e.size for e in entries) / 2**20)
        return len(entries)


def _identity(root_fd: int, rel: str) -> Identity:
    try:
        st = os.stat(rel, dir_fd=root_fd, follow_symlinks=False)
    except OSError:
        return None
    return (st.st_dev, st.st_ino) if stat.S_ISDIR(st.st_mode) else None
