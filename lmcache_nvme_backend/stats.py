"""Counters of the NVMe tier and their ``stats()`` snapshot."""

from __future__ import annotations

import threading
from collections import Counter

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
            return dict(self._counts)
