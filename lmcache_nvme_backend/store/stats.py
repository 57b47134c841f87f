"""Counters and latency histograms of the NVMe tier, and their ``stats()`` snapshot.

Every counter has a name in :class:`Counter` (a misspelt one is a type error, not a
``KeyError`` at run time); the snapshot keys (``stats()``, Prometheus) are their values.
"""

from __future__ import annotations

import bisect
import enum
import functools
import operator
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate, compress, groupby, repeat
from typing import TypeVar

from ..config import StrChoice


class ReadPath(StrChoice):
    """Where a chunk read went (docs/gpu.md), each with ``_chunks``, ``_bytes`` and
    ``_seconds`` counters and a ``_gbps`` gauge."""

    POSIX = "posix"
    KVIKIO_GDS = "kvikio-gds"
    KVIKIO_COMPAT = "kvikio-compat"
    HOST_BOUNCE = "host-bounce"


READ_PATHS = tuple(ReadPath)


def path_counter(path: ReadPath | str, what: str) -> str:
    """``path_<path>_<what>`` with dashes as underscores, e.g. ``path_kvikio_gds_bytes``."""
    return f"path_{str(path).replace('-', '_')}_{what}"


class Counter(str, enum.Enum):
    """Every counter the tier moves; the value is its key in the ``stats()`` snapshot."""

    LOOKUPS = "lookups"
    HITS = "hits"
    MISSES = "misses"
    READ_CHUNKS = "read_chunks"
    READ_BYTES = "read_bytes"
    READ_SECONDS = "read_seconds"
    READ_FAILURES = "read_failures"
    WRITES_COMPLETED = "writes_completed"
    WRITE_BYTES = "write_bytes"
    WRITE_SECONDS = "write_seconds"
    WRITE_FAILURES = "write_failures"
    DUPLICATE_PUTS = "duplicate_puts"
    QUEUE_FULL_DROPS = "queue_full_drops"
    QUEUE_FULL_WAITS = "queue_full_waits"
    CAPACITY_DROPS = "capacity_drops"
    OVERSIZE_DROPS = "oversize_drops"
    EVICTIONS = "evictions"
    EVICTED_BYTES = "evicted_bytes"
    CHECKSUM_FAILURES = "checksum_failures"
    INVALID_FILES = "invalid_files"
    QUARANTINED_FILES = "quarantined_files"
    SPECIAL_FILES = "special_files"  # a link, directory or special file at a chunk path
    RECOVERED_ENTRIES = "recovered_entries"
    REMOVED_TEMP_FILES = "removed_temp_files"
    SHARED_ADOPTED = "shared_adopted"  # chunks learned from other members' journals
    SHARED_VANISHED = "shared_vanished"  # entries other members deleted
    SHARED_TRANSFERS = "shared_transfers"  # evicted chunks other members owned
    SHARED_TAKEOVERS = "shared_takeovers"  # dead members taken over (as janitor)
    SHARED_RECONCILES = "shared_reconciles"  # walks of the tree (as janitor)
    DEADLINE_MISSES = "deadline_misses"  # chunks answered as misses at nvme.io_deadline_s
    LATE_READS_DISCARDED = "late_reads_discarded"  # chunks read after their deadline
    SHARED_JOURNAL_REFUSED = "shared_journal_refused"  # journal lines failing a rule
    SHARED_JOURNALS_SET_ASIDE = "shared_journals_set_aside"  # special or oversized journals
    # GPU read path
    GPU_CHECKSUM_FAILURES = "gpu_checksum_failures"  # also counted in checksum_failures
    GPU_UNVERIFIED_FALLBACKS = "gpu_unverified_fallbacks"  # no GPU checksum: host-bounce
    GPU_POOL_FALLBACKS = "gpu_pool_fallbacks"  # GPU pool exhausted: served in host memory
    GPU_READ_ERRORS = "gpu_read_errors"  # kvikio raised or read short
    GPU_CHECKSUMS_RECORDED = "gpu_checksums_recorded"  # chunk files written with one
    DEVICE_WRITE_COPIES = "device_write_copies"  # GPU objects copied to host for write-back


# Upper bounds (seconds) of the latency histogram buckets: a 2 MiB chunk from a fast
# drive takes well under a millisecond, a batch of large chunks from a busy one seconds.
LATENCY_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                     1.0, 2.5, 5.0, 10.0)

WRITE_LATENCY = "write"


def read_latency(path: ReadPath | str) -> str:
    """Name of the read latency histogram of one read path."""
    return f"read_{path}"


HISTOGRAMS = (WRITE_LATENCY, *(read_latency(p) for p in ReadPath))
# A read call's path counters and latency histogram (every call moves them).
_PATH_KEYS = {p: (path_counter(p, "chunks"), path_counter(p, "bytes"), read_latency(p))
              for p in ReadPath}
#: Read and write calls are logged (one list append each, no lock) and folded into the
#: counters and histograms this many at a time, and whenever a value is asked for.
FOLD_EVERY = 256
_bucket_of = functools.partial(bisect.bisect_left, LATENCY_BUCKETS_S)
_path_of = operator.itemgetter(0)
_Call = TypeVar("_Call")
# Counters that are sums the histograms keep anyway (not moved twice): the snapshot's
# key, the histogram, and whether the key is its count of observations or their seconds.
_FROM_HISTOGRAMS = {Counter.WRITES_COMPLETED.value: (WRITE_LATENCY, "count"),
                    Counter.WRITE_SECONDS.value: (WRITE_LATENCY, "sum"),
                    **{path_counter(p, "seconds"): (read_latency(p), "sum") for p in ReadPath}}


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
        return list(zip(bounds, accumulate(self.bucket_counts), strict=True))


class StoreStats:
    """Thread-safe monotonic counters and latency histograms (``write``: one chunk file
    written and published; ``read_<path>``: one read call); the counters they sum are read
    from them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[str, float] = dict.fromkeys(
            [c.value for c in Counter if c.value not in _FROM_HISTOGRAMS]
            + [key for p in ReadPath for key in _PATH_KEYS[p][:2]], 0)
        self._buckets = {name: [0] * (len(LATENCY_BUCKETS_S) + 1) for name in HISTOGRAMS}
        self._sums = dict.fromkeys(HISTOGRAMS, 0.0)
        # calls not folded yet (appended by any thread; taken from the front under the lock)
        self._reads: list[tuple[ReadPath, int, int, float, int | None,
                                tuple[int, int] | None]] = []
        self._writes: list[tuple[int, float, int]] = []

    def add(self, counter: Counter, amount: float = 1) -> None:
        with self._lock:
            self._counts[counter] += amount  # a member hashes and compares as its value

    def record_read(self, path: ReadPath, chunks: int, nbytes: int, seconds: float,
                    failures: int | None = None,
                    checked: tuple[int, int] | None = None) -> None:
        """One read call on ``path`` that served ``chunks`` chunks of ``nbytes``; the store's
        own read path also gives its ``failures`` (then ``read_seconds`` counts it too) and
        ``checked``: the ``read_chunks`` and ``read_bytes`` an engine verified itself."""
        reads = self._reads  # every read call: appended inline, folded now and then
        reads.append((path, chunks, nbytes, seconds, failures, checked))
        if len(reads) >= FOLD_EVERY:
            with self._lock:
                self._fold_locked()

    def record_write(self, nbytes: int, seconds: float, count: int = 1) -> None:
        """``count`` chunk files of ``nbytes`` in all written and published, ``seconds`` each."""
        writes = self._writes  # as reads
        writes.append((nbytes, seconds, count))
        if len(writes) >= FOLD_EVERY:
            with self._lock:
                self._fold_locked()

    def _fold_locked(self) -> None:
        """Move the logged calls into the counters and histograms (the lock held; appends
        made meanwhile stay for the next fold)."""
        counts = self._counts
        if self._writes:
            nbytes, seconds, chunks = zip(*_take_logged(self._writes), strict=True)
            counts[Counter.WRITE_BYTES] += sum(nbytes)
            self._observe(WRITE_LATENCY, seconds, chunks)
        if not self._reads:
            return
        for path, calls in groupby(sorted(_take_logged(self._reads), key=_path_of), _path_of):
            _, chunks, nbytes, seconds, failures, checked = zip(*calls, strict=True)
            chunks_key, bytes_key, latency = _PATH_KEYS[path]
            counts[chunks_key] += sum(chunks)
            counts[bytes_key] += sum(nbytes)
            self._observe(latency, seconds, (1,) * len(seconds))
            # the store's own calls (they give failures) also count failures and their time
            counts[Counter.READ_FAILURES] += sum(filter(None, failures))
            counts[Counter.READ_SECONDS] += sum(
                compress(seconds, map(operator.is_not, failures, repeat(None))))
            if verified := list(filter(None, checked)):
                verified_chunks, verified_bytes = zip(*verified, strict=True)
                counts[Counter.READ_CHUNKS] += sum(verified_chunks)
                counts[Counter.READ_BYTES] += sum(verified_bytes)

    def _observe(self, histogram: str, seconds: Sequence[float],
                 weights: Sequence[int]) -> None:
        """Calls that took ``seconds``, each counting as ``weights`` observations."""
        buckets = self._buckets[histogram]
        for bucket, weight in zip(map(_bucket_of, seconds), weights, strict=True):
            buckets[bucket] += weight
        self._sums[histogram] += sum(map(operator.mul, seconds, weights))

    def histograms(self) -> dict[str, HistogramSnapshot]:
        with self._lock:
            self._fold_locked()
            return {name: HistogramSnapshot(tuple(self._buckets[name]), self._sums[name])
                    for name in HISTOGRAMS}

    def get(self, counter: Counter | str) -> float:
        """One counter's value (by member, or by its snapshot key such as a path counter)."""
        key = counter.value if isinstance(counter, Counter) else counter
        with self._lock:
            self._fold_locked()
            return self._from_histogram(key) if key in _FROM_HISTOGRAMS else self._counts[key]

    def _from_histogram(self, key: str) -> float:
        """A counter a histogram keeps (the lock held)."""
        histogram, what = _FROM_HISTOGRAMS[key]
        return sum(self._buckets[histogram]) if what == "count" else self._sums[histogram]

    def snapshot(self) -> dict[str, float]:
        with self._lock:
            self._fold_locked()
            snap: dict[str, float] = dict(self._counts)
            snap.update({key: self._from_histogram(key) for key in _FROM_HISTOGRAMS})
        for path in ReadPath:
            seconds = snap[path_counter(path, "seconds")]
            snap[path_counter(path, "gbps")] = \
                snap[path_counter(path, "bytes")] / seconds / 1e9 if seconds > 0 else 0.0
        return snap


def _take_logged(log: list[_Call]) -> list[_Call]:
    """The calls logged so far, taken off the log (two calls that each hold the GIL: an
    append between them stays for the next fold)."""
    count = len(log)
    taken = log[:count]
    del log[:count]
    return taken
