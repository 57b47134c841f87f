"""Counters and latency histograms of the NVMe tier, and their ``stats()`` snapshot."""

from __future__ import annotations

import bisect
import threading
from collections import Counter
from dataclasses import dataclass

# Where a chunk read went (docs/gpu.md): host memory through the POSIX engine,
# GPU memory through kvikio (GDS or kvikio's compat mode), or GPU memory through
# a host read and a device copy.  Each has _chunks, _bytes and _seconds counters
# and a _gbps gauge in the snapshot.
READ_PATHS = ("posix", "kvikio-gds", "kvikio-compat", "host-bounce")
PATH_POSIX, PATH_KVIKIO_GDS, PATH_KVIKIO_COMPAT, PATH_HOST_BOUNCE = READ_PATHS


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


# Upper bounds (seconds) of the latency histogram buckets: a 2 MiB chunk from a fast
# drive takes well under a millisecond, a batch of large chunks from a busy one seconds.
LATENCY_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                     1.0, 2.5, 5.0, 10.0)

WRITE_LATENCY = "write"


def read_latency(path: str) -> str:
    """Name of the read latency histogram of one read path."""
    return f"read_{path}"


HISTOGRAMS = (WRITE_LATENCY, *(read_latency(p) for p in READ_PATHS))


@dataclass(frozen=True)
class HistogramSnapshot:
    """Observations per bucket of ``LATENCY_BUCKETS_S`` (the last one is +Inf), their sum."""

    bucket_counts: tuple[int, ...]
    sum_s: float

    @property
    def count(self) -> int:
        return sum(self.bucket_counts)

    def cumulative(self) -> list[tuple[str, int]]:
        """``(upper bound, observations <= it)`` pairs, Prometheus style, ending at ``+Inf``."""
        bounds = [*(repr(b) for b in LATENCY_BUCKETS_S), "+Inf"]
        total, out = 0, []
        for bound, n in zip(bounds, self.bucket_counts, strict=True):
            total += n
            out.append((bound, total))
        return out


class StoreStats:
    """Thread-safe monotonically increasing counters and latency histograms.

    Gauges (index size, queue depth) are the store's and are read at snapshot time.
    Histograms: ``write`` is the time to write and publish one chunk file;
    ``read_<path>`` the time of one read call (a batch of chunks) on that path.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter({name: 0 for name in COUNTERS})
        self._buckets = {name: [0] * (len(LATENCY_BUCKETS_S) + 1) for name in HISTOGRAMS}
        self._sums = dict.fromkeys(HISTOGRAMS, 0.0)

    def add(self, name: str, amount: float = 1) -> None:
        if name not in self._counts:
            raise KeyError(f"unknown counter {name}")
        with self._lock:
            self._counts[name] += amount  # type: ignore[assignment]

    def observe(self, histogram: str, seconds: float) -> None:
        """Add one latency observation to ``histogram`` (one of ``HISTOGRAMS``)."""
        with self._lock:
            self._observe(histogram, seconds)

    def _observe(self, histogram: str, seconds: float) -> None:
        self._buckets[histogram][bisect.bisect_left(LATENCY_BUCKETS_S, seconds)] += 1
        self._sums[histogram] += seconds

    def record_read(self, path: str, chunks: int, nbytes: int, seconds: float) -> None:
        """One read call on ``path`` that served ``chunks`` chunks of ``nbytes`` in total."""
        with self._lock:
            self._counts[path_counter(path, "chunks")] += chunks
            self._counts[path_counter(path, "bytes")] += nbytes
            self._counts[path_counter(path, "seconds")] += seconds  # type: ignore[assignment]
            self._observe(read_latency(path), seconds)

    def record_write(self, nbytes: int, seconds: float) -> None:
        """One chunk file written and published."""
        with self._lock:
            self._counts["writes_completed"] += 1
            self._counts["write_bytes"] += nbytes
            self._counts["write_seconds"] += seconds  # type: ignore[assignment]
            self._observe(WRITE_LATENCY, seconds)

    def histograms(self) -> dict[str, HistogramSnapshot]:
        with self._lock:
            return {name: HistogramSnapshot(tuple(self._buckets[name]), self._sums[name])
                    for name in HISTOGRAMS}

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
