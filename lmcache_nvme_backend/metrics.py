"""Prometheus metrics and a periodic one-line summary of the NVMe tier (docs/metrics.md).

The store only counts; the counters are read at scrape time, so the hot path never touches
prometheus_client.  Every open tier is exported (labels: adapter, cache directory) by one
collector in the default registry; ``nvme.metrics_port`` also serves it on the first free
port from the one configured, ``nvme.stats_log_interval_s`` logs what changed.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, NamedTuple

from prometheus_client import REGISTRY, Metric, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from .config import GIB, MIB
from .store.stats import READ_PATHS, WRITE_LATENCY, HistogramSnapshot, path_counter, read_latency

if TYPE_CHECKING:
    from .store.chunk_store import ChunkStore
    from .store.roots import RootInfo

logger = logging.getLogger("lmcache_nvme_backend")  # LMCache's handler prints it

PREFIX = "lmcache_nvme"
PORT_TRIES = 64  # metrics_port, metrics_port + 1, ...: one per rank on a node


class MetricSpec(NamedTuple):
    """One exported metric: its name (without prefix and ``_total``), kind, help, and
    ``sources``: label value (``""`` unlabelled) -> key of the tier's ``stats()`` snapshot
    (histograms: of its ``histograms()``)."""

    name: str
    kind: str  # "counter", "gauge" or "histogram"
    help: str
    sources: dict[str, str]
    label: str = ""  # the label whose values are the keys of ``sources``


def _per_path(what: str) -> dict[str, str]:
    return {path: path_counter(path, what) for path in READ_PATHS}


def _unlabelled(kind: str, name: str, help_text: str, key: str | None = None) -> MetricSpec:
    """A metric of the snapshot's ``key`` (default: its name)."""
    return MetricSpec(name, kind, help_text, {"": key or name})


_counter = functools.partial(_unlabelled, "counter")
_gauge = functools.partial(_unlabelled, "gauge")


METRICS: tuple[MetricSpec, ...] = (
    _counter("lookups", "Lookups (contains) asked of the tier."),
    _counter("hits", "Lookups that found a published chunk."),
    _counter("misses", "Lookups that found nothing."),
    _counter("served_chunks", "Chunks served, all read paths.", "read_chunks"),
    _counter("served_bytes", "Payload bytes served, all read paths.", "read_bytes"),
    MetricSpec("read_chunks", "counter", "Chunks read, by read path (host-bounce reads also "
               "count their host leg under posix).", _per_path("chunks"), label="path"),
    MetricSpec("read_bytes", "counter", "Payload bytes read, by read path.",
               _per_path("bytes"), label="path"),
    MetricSpec("read_throughput_bytes_per_second", "gauge",
               "Average read throughput since start, by read path (bytes / time in reads); "
               "use rate() of read_bytes_total over read_latency_seconds_sum for a window.",
               _per_path("gbps"), label="path"),
    _counter("read_seconds", "Time spent in read calls, all paths."),
    _counter("read_failures", "Chunks asked for and not served (missing, invalid, I/O error)."),
    _counter("deadline_misses", "Chunks answered as misses because their read passed "
             "nvme.io_deadline_s (their path goes out of service)."),
    _counter("late_reads_discarded", "Chunks whose read ended after its deadline (discarded, "
             "never copied into the caller's buffer)."),
    _counter("writes_enqueued", "Chunks accepted into the write-back queue."),
    _counter("writes", "Chunk files written and published.", "writes_completed"),
    _counter("write_bytes", "Payload bytes written."),
    _counter("write_failures", "Writes that failed with an I/O error."),
    _counter("duplicate_puts", "Stores skipped because the chunk was stored or queued."),
    MetricSpec("dropped_writes", "counter",
               "Writes dropped, by reason: queue_full (queue_full_policy drop), capacity "
               "(budget held by pinned chunks, or the filesystem full), oversize.",
               {"queue_full": "queue_full_drops", "capacity": "capacity_drops",
                "oversize": "oversize_drops"}, label="reason"),
    _counter("queue_full_waits", "Store calls that waited for room (queue_full_policy wait)."),
    _counter("evictions", "Chunks evicted (LRU) to stay within the budget."),
    _counter("evicted_bytes", "Bytes on disk freed by evictions."),
    _counter("checksum_failures", "Reads whose payload failed its checksum (never served)."),
    _counter("invalid_files", "Chunk files rejected (bad header, wrong key, short, foreign)."),
    _counter("quarantined_files", "Rejected files moved aside for inspection."),
    _counter("special_files", "Links, directories or special files found at a chunk path "
             "(never followed or read; a miss)."),
    _counter("recovered_entries", "Chunks found on disk at start."),
    _counter("removed_temp_files", "Unpublished temp files removed at start."),
    _counter("shared_adopted", "Shared mode: chunks other members published, learned from "
             "their journals."),
    _counter("shared_vanished", "Shared mode: index entries other members deleted."),
    _counter("shared_transfers", "Shared mode: chunks of other members this member evicted "
             "(their bytes moved to its share)."),
    _counter("shared_takeovers", "Shared mode: dead members whose share this member took over "
             "(as janitor)."),
    _counter("shared_reconciles", "Shared mode: walks of the tree that recounted the orphans "
             "(as janitor)."),
    _counter("shared_journal_refused", "Shared mode: lines of other members' journals "
             "refused (a field out of its bounds, a bad checksum); skipped."),
    _counter("shared_journals_set_aside", "Shared mode: journal files set aside unread (not a "
             "regular file, or larger than a journal may be)."),
    _counter("ledger_updates", "Shared mode: versions of the directory's ledger this member "
             "wrote."),
    _counter("ledger_conflicts", "Shared mode: ledger updates redone because another member "
             "wrote a version first."),
    _counter("ledger_damaged", "Shared mode: versions of the directory's ledger this member "
             "set aside as damaged (unreadable, out of range, a special file, off the chain)."),
    _counter("gpu_checksum_failures", "GPU path: GPU-side checksum mismatches (never served)."),
    _counter("gpu_unverified_fallbacks", "GPU path: files without a GPU checksum, read "
             "through the host."),
    _counter("gpu_pool_fallbacks", "GPU path: pool full, served in host memory."),
    _counter("gpu_read_errors", "GPU path: kvikio/cuFile errors or short reads."),
    _counter("gpu_checksums_recorded", "Chunk files written with a GPU checksum."),
    _counter("device_write_copies", "GPU memory objects copied to host memory to be written."),
    _gauge("entries", "Chunks in the index."),
    _gauge("used_bytes", "Bytes on disk of published chunks (header and padding included)."),
    _gauge("reserved_bytes", "Bytes reserved by writes in progress."),
    _gauge("capacity_bytes", "Byte budget (max_size_gb) over all paths."),
    _gauge("retired_bytes", "Removed chunk files kept on disk for writes of their size to "
           "overwrite (nvme.recycle_mb), beside the budget."),
    _gauge("directory_budget_bytes", "Shared mode: the directory's one byte budget for all its "
           "members (the ledger's; over all paths)."),
    _gauge("member_bytes", "Shared mode: bytes of the chunk files this member owns."),
    _gauge("member_cap_bytes", "Shared mode: this member's share of the directory's budget."),
    _gauge("orphan_bytes", "Shared mode: bytes counted for chunks no live member owns."),
    _gauge("members_live", "Shared mode: live members of the directory (this one included)."),
    _gauge("members_dead", "Shared mode: members that stopped renewing their lease and are "
           "not yet taken over."),
    _gauge("janitor_stalled", "Shared mode: 1 while the member due to be janitor is passed "
           "over because its janitor thread made no round for 5 s while its lease moved."),
    _gauge("write_queue_chunks", "Chunks waiting to be written.", "pending_writes"),
    _gauge("write_queue_bytes", "Host memory held by queued writes.", "queue_bytes"),
    _gauge("roots_offline", "Cache directories taken out of service after I/O errors."),
    _gauge("roots_hung", "Cache directories out of service after a read passed its deadline "
           "(back when the filesystem answers a probe and the late I/O ended)."),
    _gauge("deadline_roots", "Cache directories whose reads have a deadline "
           "(nvme.io_deadline_s; auto: those on network filesystems)."),
    _gauge("direct_io_roots", "Cache directories using O_DIRECT."),
    _gauge("gpu_pool_bytes", "GPU pool size (CUDA workers with a pool)."),
    _gauge("gpu_pool_objects_lent", "GPU pool memory objects lent to LMCache."),
)

#: One gauge per cache directory of a tier (label ``root``): name, help, ``RootInfo`` field.
ROOT_GAUGES: tuple[tuple[str, str, str], ...] = (
    ("root_in_service", "1 while the cache directory is in service, 0 while it is out of "
     "service after I/O errors.", "healthy"),
    ("root_direct_io", "1 when the cache directory reads and writes with O_DIRECT.",
     "direct_io"),
    ("root_used_bytes", "Bytes on disk of the directory's published chunks.", "used_bytes"),
    ("root_capacity_bytes", "The directory's share of the byte budget (max_size_gb).",
     "capacity_bytes"),
    ("root_free_bytes", "Free bytes of the directory's filesystem, as an unprivileged writer "
     "sees them, at scrape time.", "free_bytes"),
    ("root_min_free_bytes", "The directory's free-space guard (min_free_gb): writes are "
     "dropped while the filesystem has no more free bytes than this.", "min_free_bytes"),
    ("root_io_deadline_seconds", "The deadline of a read from the directory "
     "(nvme.io_deadline_s; auto: 5 on a network filesystem); 0: none, reads go straight into "
     "the caller's buffers.", "deadline_s"),
)

HISTOGRAMS: tuple[MetricSpec, ...] = (
    MetricSpec("read_latency_seconds", "histogram",
               "Duration of one read call (a batch of chunks), by read path.",
               {path: read_latency(path) for path in READ_PATHS}, label="path"),
    MetricSpec("write_latency_seconds", "histogram",
               "Duration of writing and publishing one chunk file.", {"": WRITE_LATENCY}),
)

_FAMILIES: dict[str, Any] = {"counter": CounterMetricFamily, "gauge": GaugeMetricFamily,
                             "histogram": HistogramMetricFamily}


def metric_names() -> list[str]:
    """Every exported metric family as Prometheus shows it (counters with ``_total``)."""
    names = [f"{PREFIX}_{m.name}" + ("_total" if m.kind == "counter" else "") for m in METRICS]
    return names + [f"{PREFIX}_{name}" for name, *_ in (*ROOT_GAUGES, *HISTOGRAMS)]


class TierCollector:
    """Collector in the default registry that exports every open tier of the process."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._tiers: list[TierObserver] = []
        self._registered = False

    def add(self, tier: TierObserver) -> None:
        """Export ``tier`` (the first one registers the collector)."""
        with self._lock:
            if not self._registered:
                REGISTRY.register(self)
                self._registered = True
            self._tiers.append(tier)

    def remove(self, tier: TierObserver) -> None:
        with self._lock:
            if tier in self._tiers:
                self._tiers.remove(tier)

    def describe(self) -> list[Metric]:
        return []  # the registry then never calls collect() at registration

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            tiers = list(self._tiers)
        snapshots = [(t, t.stats(), t.histograms()) for t in tiers]
        roots = [(t, t.roots()) for t in tiers]
        base = ["adapter", "cache_dir"]
        for name, help_text, field in ROOT_GAUGES:
            gauge = GaugeMetricFamily(f"{PREFIX}_{name}", help_text, labels=[*base, "root"])
            for tier, infos in roots:
                for info in infos:
                    value = getattr(info, field)
                    if value is not None:
                        gauge.add_metric([tier.adapter, tier.cache_dir, str(info.path)],
                                         float(value))
            yield gauge
        for spec in (*METRICS, *HISTOGRAMS):
            family = _FAMILIES[spec.kind](f"{PREFIX}_{spec.name}", spec.help,
                                          labels=[*base, spec.label] if spec.label else base)
            for tier, snap, histograms in snapshots:
                for value_label, key in spec.sources.items():
                    labels = [tier.adapter, tier.cache_dir, *([value_label] if spec.label else [])]
                    if spec.kind == "histogram":
                        h = histograms[key]
                        family.add_metric(labels, [(b, float(n)) for b, n in h.cumulative()],
                                          h.sum_s)
                    elif key in snap:
                        family.add_metric(labels, snap[key])
            yield family


_collector = TierCollector()
_served_port: int | None = None
_setup_lock = threading.Lock()


def serve_metrics(port: int) -> int | None:
    """Serve the default registry on the first free port from ``port``; the port, or None
    (logged, never raised).  One endpoint per process: a second call returns its port."""
    global _served_port
    with _setup_lock:
        if _served_port is not None:
            return _served_port
        last_error: OSError | None = None
        for candidate in range(port, min(port + PORT_TRIES, 65536)):
            try:
                start_http_server(candidate)
            except OSError as exc:
                last_error = exc
                continue
            _served_port = candidate
            logger.info("NVMe tier: Prometheus metrics on http://0.0.0.0:%d/metrics", candidate)
            return candidate
        logger.error("NVMe tier: cannot serve metrics on ports %d-%d (%s); set "
                     "nvme.metrics_port to a free port. The metrics stay in the default "
                     "registry.", port, port + PORT_TRIES - 1, last_error)
        return None


def stats_line(previous: dict[str, float], current: dict[str, float], seconds: float) -> str:
    """One line saying what the tier did since ``previous`` and where it stands now."""
    def delta(key: str) -> float:
        return current.get(key, 0.0) - previous.get(key, 0.0)

    lookups, hits = delta("lookups"), delta("hits")
    hit_rate = f" ({hits / lookups:.0%})" if lookups else ""
    paths = []
    for path in READ_PATHS:
        nbytes, secs = delta(path_counter(path, "bytes")), delta(path_counter(path, "seconds"))
        if nbytes:
            paths.append(f"{path} {nbytes / MIB:.1f} MiB at {nbytes / max(secs, 1e-9) / 1e9:.2f}"
                         " GB/s")
    drops = sum(delta(k) for k in ("queue_full_drops", "capacity_drops", "oversize_drops"))
    return (
        f"NVMe tier, last {seconds:.0f} s: {hits:.0f}/{lookups:.0f} lookups hit{hit_rate}; "
        f"read {delta('read_chunks'):.0f} chunks" + (f" ({', '.join(paths)})" if paths else "")
        + f"; wrote {delta('writes_completed'):.0f} chunks, {delta('write_bytes') / MIB:.1f} MiB;"
        f" dropped {drops:.0f}; evicted {delta('evictions'):.0f}; checksum failures "
        f"{delta('checksum_failures'):.0f}; queue {current.get('pending_writes', 0):.0f} chunks "
        f"{current.get('queue_bytes', 0) / MIB:.1f} MiB; used "
        f"{current.get('used_bytes', 0) / GIB:.2f}/{current.get('capacity_bytes', 0) / GIB:.2f} "
        f"GiB in {current.get('entries', 0):.0f} chunks"
    )


class TierObserver:
    """Exports one open tier while it is open: registry, optional endpoint, stats line."""

    def __init__(self, adapter: str, cache_dirs: list[str], metrics_port: int,
                 stats_log_interval_s: float, stats: Callable[[], dict[str, float]],
                 histograms: Callable[[], dict[str, HistogramSnapshot]],
                 roots: Callable[[], list[RootInfo]] = list) -> None:
        self.adapter = adapter
        self.cache_dir = ",".join(cache_dirs)
        self.stats = stats
        self.histograms = histograms
        self.roots = roots
        _collector.add(self)
        self.metrics_port = serve_metrics(metrics_port) if metrics_port else None
        self._stop = threading.Event()
        self._logger: threading.Thread | None = None
        if stats_log_interval_s > 0:
            self._logger = threading.Thread(target=self._log_loop, args=(stats_log_interval_s,),
                                            name="nvme-stats-log", daemon=True)
            self._logger.start()

    @classmethod
    def for_store(cls, adapter: str, store: ChunkStore,
                  stats: Callable[[], dict[str, float]]) -> TierObserver:
        """Observe ``store`` as configured by its settings; ``stats`` is the adapter's."""
        settings = store.settings
        return cls(adapter, [str(p) for p in settings.paths], settings.metrics_port,
                   settings.stats_log_interval_s, stats, store.histograms,
                   store.describe_roots)

    def _log_loop(self, interval_s: float) -> None:
        previous = self.stats()
        while not self._stop.wait(interval_s):
            current = self.stats()
            logger.info("%s", stats_line(previous, current, interval_s))
            previous = current

    def close(self) -> None:
        self._stop.set()
        if self._logger is not None:
            self._logger.join()
        _collector.remove(self)
