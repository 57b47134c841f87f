"""Counters of the NVMe tier and their ``stats()`` snapshot."""

from __future__ import annotations

import threading
from collections import Counter

# Where a chunk read went (docs/gpu.md): host memory through the POSIX engine,
# GPU memory through kvikio (GDS or kvikio's compat mode), or GPU memory through
# a host read and a device copy.  Each has _chunks, _bytes and _seconds counters
# and a _gbps gauge in the snapshot.
READ_PATHS = ("posix", "kvikio-gds", "kvikio-compat", "host-bounce")


def path_counter(path: str, what: str) -> str:
    """``path_<path>_<what>`` with dashes as underscores, e.g. ``path_kvikio_gds_bytes``."""
    return f"path_{path.replace('-', '_')}_{what}"


_PATH_COUNTERS = tuple(path_counter(p, w) for p in READ_PATHS
                       for w in ("chunks", "bytes", "seconds"))
_GPU_COUNTERS = (
    "gpu_checksum_failures",     # GPU checksum mismatch on the GPU path (also checksum_failures)
    "gpu_unverified_fallbacks",  # files without a GPU checksum, read through host-bounce
    "gpu_pool_fallbacks",        # GPU pool exhausted: served in host memory instead
    "gpu_read_errors",           # kvikio raised or read short
    "gpu_checksums_recorded",    # chunk files written with a GPU checksum
    "device_write_copies",       # GPU memory objects copied to host memory for write-back
)

# Every counter the store moves, so a snapshot always lists all of them.
COUNTERS = (
    "lookups",
    "hits",
    "misses",
    "read_chunks",
    "read_bytes",
    "read_seconds",
    "read_failures",
    "writes_enqueued",
    "writes_completed",
    "write_bytes",
    "write_seconds",
    "write_failures",
    "duplicate_puts",
    "queue_full_drops",
    "queue_full_waits",
    "capacity_drops",
    "oversize_drops",
    "evictions",
    "evicted_bytes",
    "checksum_failures",
    "invalid_files",
    "quarantined_files",
    "recovered_entries",
    "removed_temp_files",
    *_PATH_COUNTERS,
    *_GPU_COUNTERS,
    "shared_adopted",
    "shared_vanished",
)


class StoreStats:
    """Thread-safe monotonically increasing counters (plus gauges read at snapshot time)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter({name: 0 for name in COUNTERS})

    def add(self, name: str, amount: float = 1) -> None:
        if name not in self._counts:
            raise KeyError(f"unknown counter {name}")
        with self._lock:
            self._counts[name] += amount  # type: ignore[assignment]

    def get(self, name: str) -> float:
        with self._lock:
            return self._counts[name]

    def snapshot(self) -> dict[str, float]:
        with self._lock:
            snap: dict[str, float] = dict(self._counts)
        for path in READ_PATHS:
            seconds = snap[path_counter(path, "seconds")]
            snap[path_counter(path, "gbps")] = \
                snap[path_counter(path, "bytes")] / seconds / 1e9 if seconds > 0 else 0.0
        return snap
