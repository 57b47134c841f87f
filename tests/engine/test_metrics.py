"""Prometheus metrics and the periodic stats line (lmcache_nvme_backend/metrics.py)."""

from __future__ import annotations

import logging
import socket
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from lmcache.v1.cache_engine import LMCacheEngine
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families
from support.chunks import CHUNK as CHUNK_SIZE
from support.chunks import put
from support.engines import CHUNK, EXAMPLE_YAML, example_config_overrides
from support.paths import DOCS_DIR
from support.process import free_port
from support.stores import StoreFactory

from lmcache_nvme_backend import metrics
from lmcache_nvme_backend.adapters.backend import NVMeBackend
from lmcache_nvme_backend.config import NVMeConfigError, NVMeSettings
from lmcache_nvme_backend.disk.format import file_size_for
from lmcache_nvme_backend.metrics import PREFIX, TierObserver, metric_names, stats_line
from lmcache_nvme_backend.store import Counter
from lmcache_nvme_backend.store.stats import LATENCY_BUCKETS_S, READ_PATHS, StoreStats, path_counter
from lmcache_nvme_backend.testing.engine import (
    CopyingCPUConnector,
    build_engine,
    chunk_keys,
    destroy_engine,
    evict_from_cpu,
    load_config,
    lower_tier_name,
    make_kv,
    make_prompt,
    retrieve_prompt,
    store_prompt,
    wait_until_in_tier,
)

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def parse(text: str) -> Samples:
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def registry_samples() -> Samples:
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in REGISTRY.collect() for s in family.samples}


def value(samples: Samples, name: str, cache_dir: Path | str, **labels: str) -> float:
    """The sample of ``name`` for the tier on ``cache_dir`` (0 if absent, like Prometheus)."""
    for (sample, sample_labels), v in samples.items():
        got = dict(sample_labels)
        if sample == name and got.get("cache_dir") == str(cache_dir) and all(
                got.get(k) == want for k, want in labels.items()):
            return v
    return 0.0


@pytest.fixture
def fresh_endpoint(monkeypatch: pytest.MonkeyPatch) -> None:
    """Forget the process-wide endpoint an earlier test started, so this one starts its own."""
    monkeypatch.setattr(metrics, "_served_port", None)


@pytest.fixture
def engine_with_metrics(tmp_path: Path, fresh_endpoint: None
                        ) -> Iterator[tuple[LMCacheEngine, CopyingCPUConnector, int]]:
    port = free_port()
    overrides = example_config_overrides(tmp_path / "nvme")
    overrides["extra_config"]["nvme.metrics_port"] = port
    engine, connector = build_engine(load_config(EXAMPLE_YAML, overrides),
                                     instance_id="metrics-engine")
    yield engine, connector, port
    destroy_engine("metrics-engine")


def test_scraped_counters_follow_a_store_and_retrieve_through_the_engine(
        engine_with_metrics: tuple[LMCacheEngine, CopyingCPUConnector, int],
        tmp_path: Path) -> None:
    engine, connector, port = engine_with_metrics
    cache_dir = tmp_path / "nvme"
    backend = engine.storage_manager.storage_backends[lower_tier_name(engine)]  # type: ignore[union-attr]
    assert isinstance(backend, NVMeBackend)
    assert backend._observer.metrics_port == port

    def scrape() -> Samples:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
            return parse(resp.read().decode())

    before = scrape()
    assert value(before, f"{PREFIX}_writes_total", cache_dir) == 0
    assert value(before, f"{PREFIX}_capacity_bytes", cache_dir) == 2**30

    tokens = make_prompt(4 * CHUNK, seed=5)
    kv = make_kv(connector, len(tokens), seed=6)
    keys = chunk_keys(engine, tokens)
    store_prompt(engine, tokens, kv)
    wait_until_in_tier(engine, "nvme", keys, timeout_s=60)
    evict_from_cpu(engine, keys)
    got = retrieve_prompt(engine, tokens, connector)
    assert bool(got.ret_mask.all())
    kv_bytes = kv.numel() * kv.element_size()

    after = scrape()
    assert value(after, f"{PREFIX}_writes_total", cache_dir) == 4
    assert value(after, f"{PREFIX}_write_bytes_total", cache_dir) == kv_bytes
    assert value(after, f"{PREFIX}_write_latency_seconds_count", cache_dir) == 4
    assert value(after, f"{PREFIX}_entries", cache_dir) == 4
    assert value(after, f"{PREFIX}_used_bytes", cache_dir) >= kv_bytes + 4 * 4096
    assert value(after, f"{PREFIX}_hits_total", cache_dir) >= 4
    assert value(after, f"{PREFIX}_read_chunks_total", cache_dir, path="posix") == 4
    assert value(after, f"{PREFIX}_read_bytes_total", cache_dir, path="posix") == kv_bytes
    assert value(after, f"{PREFIX}_read_chunks_total", cache_dir, path="kvikio-gds") == 0
    read_calls = value(after, f"{PREFIX}_read_latency_seconds_count", cache_dir, path="posix")
    assert read_calls >= 1
    assert value(after, f"{PREFIX}_read_latency_seconds_bucket", cache_dir, path="posix",
                 le="+Inf") == read_calls
    assert value(after, f"{PREFIX}_read_throughput_bytes_per_second", cache_dir,
                 path="posix") > 0
    assert value(after, f"{PREFIX}_checksum_failures_total", cache_dir) == 0
    assert value(after, f"{PREFIX}_dropped_writes_total", cache_dir, reason="queue_full") == 0
    assert value(after, f"{PREFIX}_write_queue_chunks", cache_dir) == 0


@pytest.mark.parametrize("shared", [False, True])
def test_every_counter_and_gauge_of_stats_is_exported(tmp_path: Path, open_store: StoreFactory,
                                                      shared: bool) -> None:
    store = open_store(tmp_path, manifest_interval_s=None, shared=shared)
    try:
        snapshot = store.stats_snapshot()
    finally:
        store.close()
    exported = {key for spec in metrics.METRICS for key in spec.sources.values()}
    # Time per path and per write is the _sum of the latency histograms.
    exported |= {path_counter(p, "seconds") for p in READ_PATHS} | {"write_seconds"}
    gpu_only = {"gpu_pool_bytes", "gpu_pool_objects_lent"}  # the backend's, on CUDA workers
    shared_only = {"directory_budget_bytes", "member_bytes", "member_cap_bytes", "orphan_bytes",
                   "members_live", "members_dead", "ledger_updates", "ledger_conflicts",
                   "ledger_damaged", "janitor_stalled"}
    assert set(snapshot) <= exported
    assert exported - set(snapshot) == gpu_only | (set() if shared else shared_only)


def test_metric_names_follow_prometheus_conventions() -> None:
    names = metric_names()
    assert len(names) == len(set(names))
    for name in names:
        assert name.startswith("lmcache_nvme_") and name == name.lower()
    counters = [m for m in metrics.METRICS if m.kind == "counter"]
    assert all(not m.name.endswith("_total") for m in counters)  # the client appends it
    assert f"{PREFIX}_read_latency_seconds" in names and f"{PREFIX}_used_bytes" in names


def test_documented_metrics_match_the_exported_ones() -> None:
    doc = (DOCS_DIR / "metrics.md").read_text()
    for name in metric_names():
        assert f"`{name}`" in doc, f"{name} is not documented in docs/metrics.md"


def test_each_tier_has_its_own_labels_and_leaves_the_registry_on_close(
        tmp_path: Path, open_store: StoreFactory) -> None:
    stores = [open_store(tmp_path / name, manifest_interval_s=None) for name in ("a", "b")]
    observers = [TierObserver.for_store(f"Tier{i}", s, s.stats_snapshot)
                 for i, s in enumerate(stores)]
    try:
        stores[0].count(Counter.HITS, 3)
        samples = registry_samples()
        assert value(samples, f"{PREFIX}_hits_total", tmp_path / "a", adapter="Tier0") == 3
        assert value(samples, f"{PREFIX}_hits_total", tmp_path / "b", adapter="Tier1") == 0
        assert (f"{PREFIX}_hits_total",
                frozenset({("adapter", "Tier1"), ("cache_dir", str(tmp_path / "b"))})) in samples
    finally:
        observers[0].close()
        samples = registry_samples()
        assert not any(dict(labels).get("cache_dir") == str(tmp_path / "a")
                       for _, labels in samples)
        observers[1].close()
        for store in stores:
            store.close()


def test_latency_histogram_buckets_are_cumulative() -> None:
    stats = StoreStats()
    for seconds in (0.0001, 0.003, 0.003, 20.0):
        stats.record_write(0, seconds)
    hist = stats.histograms()["write"]
    cumulative = dict(hist.cumulative())
    assert hist.count == 4 and hist.sum_s == pytest.approx(20.0061)
    assert cumulative[repr(LATENCY_BUCKETS_S[0])] == 1
    assert cumulative["0.005"] == 3
    assert cumulative[repr(LATENCY_BUCKETS_S[-1])] == 3
    assert cumulative["+Inf"] == 4


def test_a_busy_port_moves_the_endpoint_to_the_next_free_one(fresh_endpoint: None) -> None:
    with socket.socket() as busy:
        busy.bind(("0.0.0.0", 0))
        busy.listen()
        port = busy.getsockname()[1]
        served = metrics.serve_metrics(port)
    assert served is not None and served != port and port < served < port + metrics.PORT_TRIES
    assert metrics.serve_metrics(port) == served  # one endpoint per process
    with urllib.request.urlopen(f"http://127.0.0.1:{served}/metrics", timeout=10) as resp:
        assert resp.status == 200


def test_the_stats_line_says_what_changed() -> None:
    previous = {"lookups": 10, "hits": 5, "path_posix_bytes": 0, "path_posix_seconds": 0,
                "read_chunks": 0, "writes_completed": 2}
    current = {"lookups": 30, "hits": 20, "path_posix_bytes": 40 * 2**20,
               "path_posix_seconds": 0.02, "read_chunks": 20, "writes_completed": 2,
               "write_bytes": 0, "queue_full_drops": 3, "evictions": 1, "pending_writes": 2,
               "queue_bytes": 4 * 2**20, "used_bytes": 2**30, "capacity_bytes": 8 * 2**30,
               "entries": 512}
    line = stats_line(previous, current, 60)
    assert "last 60 s: 15/20 lookups hit (75%)" in line
    assert "read 20 chunks (posix 40.0 MiB at 2.10 GB/s)" in line
    assert "wrote 0 chunks" in line and "dropped 3" in line and "evicted 1" in line
    assert "queue 2 chunks 4.0 MiB" in line and "used 1.00/8.00 GiB in 512 chunks" in line
    assert all(path not in line for path in READ_PATHS[1:])


def test_stats_log_interval_logs_periodic_lines(tmp_path: Path,
                                                open_store: StoreFactory) -> None:
    lines: list[str] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    metrics.logger.addHandler(handler)
    level = metrics.logger.level
    metrics.logger.setLevel(logging.INFO)
    store = open_store(tmp_path, manifest_interval_s=None, stats_log_interval_s=0.05)
    observer = TierObserver.for_store("NVMeBackend", store, store.stats_snapshot)
    try:
        store.count(Counter.LOOKUPS, 4)
        store.count(Counter.HITS, 4)
        deadline = time.monotonic() + 10
        while not any("4/4 lookups hit" in line for line in lines) and \
                time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        observer.close()
        store.close()
        metrics.logger.removeHandler(handler)
        metrics.logger.setLevel(level)
    assert any("4/4 lookups hit (100%)" in line for line in lines)
    assert not observer._logger.is_alive()  # type: ignore[union-attr]


@pytest.mark.parametrize(("key", "raw", "message"), [
    ("metrics_port", 70000, "nvme.metrics_port: 70000 is out of range. It must be at most 65535"),
    ("metrics_port", -1, "nvme.metrics_port: -1 is out of range"),
    ("metrics_port", "9100.5", "nvme.metrics_port: '9100.5' is not a whole number"),
    ("stats_log_interval_s", -5, "nvme.stats_log_interval_s: -5 is out of range"),
])
def test_bad_observability_settings_name_the_key(tmp_path: Path, key: str, raw: object,
                                                 message: str) -> None:
    with pytest.raises(NVMeConfigError, match=message.replace(".", r"\.")):
        NVMeSettings.from_extra_config({"nvme.path": str(tmp_path), "nvme.max_size_gb": 1,
                                        f"nvme.{key}": raw})


def test_each_cache_directory_has_its_own_gauges(tmp_path: Path,
                                                 open_store: StoreFactory) -> None:
    roots = [tmp_path / "d0", tmp_path / "d1"]
    store = open_store(*roots, max_size_gb=2, min_free_gb=0.5, manifest_interval_s=None)
    observer = TierObserver.for_store("Tier", store, store.stats_snapshot)
    try:
        put(store, "key-0")
        assert store.flush(30)
        samples = registry_samples()
        cache_dir = ",".join(str(r) for r in roots)
        used = [value(samples, f"{PREFIX}_root_used_bytes", cache_dir, root=str(r))
                for r in roots]
        assert sorted(used) == [0, file_size_for(CHUNK_SIZE)]
        assert sum(used) == value(samples, f"{PREFIX}_used_bytes", cache_dir)
        for root in roots:
            labels = {"root": str(root)}
            assert value(samples, f"{PREFIX}_root_in_service", cache_dir, **labels) == 1
            assert value(samples, f"{PREFIX}_root_capacity_bytes", cache_dir, **labels) == 2**30
            assert value(samples, f"{PREFIX}_root_min_free_bytes", cache_dir, **labels) == 2**29
            assert value(samples, f"{PREFIX}_root_free_bytes", cache_dir, **labels) > 0
            assert value(samples, f"{PREFIX}_root_direct_io", cache_dir, **labels) in (0, 1)
    finally:
        observer.close()
