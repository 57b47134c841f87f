"""The free-space floor of one cache directory's filesystem (``nvme.min_free_gb``), kept
without asking the kernel on every write."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path


def free_bytes(path: Path) -> int:
    """Bytes an unprivileged writer may still use on ``path``'s filesystem."""
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


class FreeSpaceGuard:
    """Keeps ``min_free`` bytes free on one root's filesystem without a ``statvfs`` per write:
    the kernel is asked again after ``CHECK_BYTES`` written or ``CHECK_S`` passed, and
    whenever the estimate comes within ``CHECK_BYTES`` of the floor (where it is exact)."""

    CHECK_BYTES = 256 << 20
    CHECK_S = 1.0

    def __init__(self, path: Path, min_free: int) -> None:
        self._path = path
        self._min_free = min_free
        self._lock = threading.Lock()
        self._free = 0
        self._written = 0
        self._asked_at = -self.CHECK_S
        self._pending = 0  # bytes of evicted files whose removal is still queued

    def will_free(self, nbytes: int) -> None:
        """Evicted files that a queued write removes before it writes: count them as free."""
        with self._lock:
            self._pending += nbytes
            self._free += nbytes

    def freed(self, nbytes: int) -> None:
        """Those files are gone now (the kernel's next answer includes them)."""
        with self._lock:
            self._pending -= nbytes

    def refresh(self) -> None:
        """Ask the kernel now (after a deletion, or when a write found the disk full)."""
        with self._lock:
            self._asked_at = -self.CHECK_S

    def room_for(self, size: int) -> bool:
        """Whether ``size`` more bytes keep the floor; if so they are counted as written."""
        with self._lock:
            now = time.monotonic()
            if (now - self._asked_at >= self.CHECK_S or self._written >= self.CHECK_BYTES
                    or self._free - size - self.CHECK_BYTES < self._min_free):
                self._free = free_bytes(self._path) + self._pending
                self._asked_at = now
                self._written = 0
            if self._free - size < self._min_free:
                return False
            self._free -= size
            self._written += size
            return True
