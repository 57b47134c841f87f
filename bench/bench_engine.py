"""Compare LMCache storage tiers through a real ``LMCacheEngine`` on CPU.

Configurations (``--configs``, comma separated):

* ``host-only``  -- ``LocalCPUBackend`` alone: the ``store()`` latency baseline;
  its retrieve column is a hot read from host memory, for reference.
* ``local-disk`` -- LMCache's built-in ``LocalDiskBackend`` below host memory.
* ``nvme``       -- this project's tier, loaded through ``storage_plugins``
  (needs ``lmcache_nvme_backend`` importable, e.g. ``pip install -e .``).

All engines live in one process and every repetition visits every
configuration, in a rotated order, so slow drift of this noisy virtual disk hits
all of them alike.  Per repetition and configuration the benchmark measures

(a) ``engine.store()`` call latency over ``--stores`` distinct prompts stored
    back to back, or ``--store-gap-ms`` apart (lower tiers persist them in the
    background; the time until all of them are persisted gives the sustained
    write rate), and the time the lower tier's put hook takes inside each call
    ("tier put": the tier's own cost on the store path), then
(b) a cold retrieve: one ``--retrieve-tokens`` prompt is stored, persisted,
    evicted from host memory, the page cache is dropped (``--drop-caches``),
    and ``engine.retrieve()`` is timed; the bytes are verified afterwards.

Reported: store p50/p99 over all calls, and medians over repetitions of the
persist rate and the retrieve rate (GB = 1e9 bytes of KV payload), plus the
per-repetition paired ratio of each tier's retrieve rate to ``local-disk``.
LMCache logs at WARNING here unless ``LMCACHE_LOG_LEVEL`` says otherwise (its
INFO line per store would otherwise be inside the timed call).
"""

from __future__ import annotations

import os

os.environ.setdefault("LMCACHE_LOG_LEVEL", "WARNING")

import argparse  # noqa: E402
import importlib.metadata  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from collections.abc import Sequence  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
import yaml  # noqa: E402
from lmcache.utils import CacheEngineKey  # noqa: E402
from lmcache.v1.cache_engine import LMCacheEngine  # noqa: E402

import lmcache_nvme_backend.testing.engine as harness  # noqa: E402

CONFIG_NAMES = ("host-only", "local-disk", "nvme")
BASELINE = "local-disk"
GB = 1e9
# Disjoint seed ranges: a prompt stored in (a) must never reappear in (b), or
# (b) would retrieve the KV stored in (a) under the same chunk keys.
STORE_SEED_BASE = 1_000_000_000
RETRIEVE_SEED_BASE = 2_000_000_000


@dataclass
class TierRun:
    """One configuration's engine and everything measured on it."""

    name: str
    instance_id: str
    engine: LMCacheEngine
    connector: harness.CopyingCPUConnector
    lower_tier: str | None
    store_latencies_s: list[float] = field(default_factory=list)
    tier_put_s: list[float] = field(default_factory=list)
    persist_gbps: list[float] = field(default_factory=list)
    chunks_not_persisted: int = 0
    retrieve_gbps: list[float] = field(default_factory=list)

    def discard_samples(self) -> None:
        """Forget what warm-up repetitions measured."""
        self.store_latencies_s.clear()
        self.tier_put_s.clear()
        self.persist_gbps.clear()
        self.chunks_not_persisted = 0
        self.retrieve_gbps.clear()


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", default="host-only,local-disk,nvme",
                        help=f"comma-separated subset of {', '.join(CONFIG_NAMES)} "
                             "(default: %(default)s)")
    parser.add_argument("--workdir", type=Path, default=None,
                        help="directory for the disk tiers (default: a temporary directory "
                             "on /tmp, removed afterwards); put it on the drive under test")
    parser.add_argument("--layers", type=int, default=8, help="KV layers (default: %(default)s)")
    parser.add_argument("--heads", type=int, default=4, help="KV heads (default: %(default)s)")
    parser.add_argument("--head-size", type=int, default=128,
                        help="head size (default: %(default)s)")
    parser.add_argument("--chunk-size", type=int, default=256,
                        help="LMCache chunk size in tokens (default: %(default)s)")
    parser.add_argument("--store-tokens", type=int, default=1024,
                        help="tokens per stored prompt in (a) (default: %(default)s)")
    parser.add_argument("--stores", type=int, default=32,
                        help="store() calls per repetition and configuration "
                             "(default: %(default)s)")
    parser.add_argument("--store-gap-ms", type=float, default=0.0,
                        help="pause between store() calls, standing in for the engine's "
                             "forward pass between two stores (default: %(default)s, "
                             "back to back: the CPU-bound worst case)")
    parser.add_argument("--retrieve-tokens", type=int, default=16384,
                        help="tokens of the cold-retrieved prompt in (b) (default: %(default)s)")
    parser.add_argument("--reps", type=int, default=7,
                        help="recorded repetitions (default: %(default)s)")
    parser.add_argument("--warmup-reps", type=int, default=1,
                        help="unrecorded repetitions first: page faults on the host pool, "
                             "first-call costs (default: %(default)s)")
    parser.add_argument("--cpu-gb", type=float, default=1.0,
                        help="max_local_cpu_size per engine (default: %(default)s)")
    parser.add_argument("--disk-gb", type=float, default=8.0,
                        help="disk budget per disk tier (default: %(default)s)")
    parser.add_argument("--nvme", action="append", default=[], metavar="NAME=VALUE",
                        help="extra nvme.<NAME> setting for the nvme config, repeatable "
                             "(e.g. --nvme direct_io=off)")
    parser.add_argument("--drop-caches", action=argparse.BooleanOptionalAction, default=True,
                        help="sync and drop the page cache before each cold retrieve "
                             "(needs root; default: %(default)s)")
    parser.add_argument("--persist-timeout", type=float, default=120.0,
                        help="seconds to wait for a tier to persist stored chunks "
                             "(default: %(default)s)")
    parser.add_argument("--json", type=Path, default=None, metavar="PATH",
                        help="also write settings, raw samples and summary as JSON")
    parser.add_argument("--restarts", type=int, default=3,
                        help="nvme only: fresh processes that reopen the tier after the run "
                             "and time their first cold retrieve against later ones "
                             "(default: %(default)s; 0 skips)")
    parser.add_argument("--restart-child", type=str, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.configs = [name.strip() for name in args.configs.split(",") if name.strip()]
    unknown = sorted(set(args.configs) - set(CONFIG_NAMES))
    if unknown or not args.configs:
        parser.error(f"--configs: unknown {unknown}; choose from {', '.join(CONFIG_NAMES)}")
    for count_arg in ("layers", "heads", "head_size", "chunk_size", "store_tokens", "stores",
                      "retrieve_tokens", "reps"):
        if getattr(args, count_arg) < 1:
            parser.error(f"--{count_arg.replace('_', '-')} must be at least 1")
    for tokens_arg in ("store_tokens", "retrieve_tokens"):
        if getattr(args, tokens_arg) % args.chunk_size:
            parser.error(f"--{tokens_arg.replace('_', '-')} must be a multiple of "
                         "--chunk-size (LMCache drops a trailing partial chunk)")
    if "nvme" in args.configs and importlib.util.find_spec("lmcache_nvme_backend") is None:
        parser.error("config nvme: lmcache_nvme_backend is not importable "
                     "(pip install -e <repo>)")
    args.nvme = dict(parse_setting(item, parser) for item in args.nvme)
    return args


def parse_setting(item: str, parser: argparse.ArgumentParser) -> tuple[str, Any]:
    """``NAME=VALUE`` to a pair; the value is read as YAML (numbers, booleans)."""
    name, sep, raw = item.partition("=")
    if not sep or not name:
        parser.error(f"--nvme expects NAME=VALUE, got {item!r}")
    return name, yaml.safe_load(raw)


def config_overrides(name: str, args: argparse.Namespace, tier_dir: Path) -> dict[str, Any]:
    """LMCache config overrides for one benchmark configuration."""
    overrides: dict[str, Any] = {
        "chunk_size": args.chunk_size,
        "local_cpu": True,
        "max_local_cpu_size": args.cpu_gb,
    }
    if name == "local-disk":
        overrides.update(harness.local_disk_settings(tier_dir, args.disk_gb))
    elif name == "nvme":
        overrides.update(harness.nvme_plugin_settings(tier_dir, args.disk_gb, **args.nvme))
    return overrides


def start_tier(name: str, args: argparse.Namespace, workdir: Path) -> TierRun:
    """Build the engine for one configuration."""
    tier_dir = workdir / name
    tier_dir.mkdir(parents=True, exist_ok=True)
    config = harness.load_config(None, config_overrides(name, args, tier_dir))
    instance_id = f"bench-{name}"
    kv_shape = (args.layers, 2, args.chunk_size, args.heads, args.head_size)
    engine, connector = harness.build_engine(config, instance_id=instance_id, kv_shape=kv_shape)
    try:
        lower_tier = None if name == "host-only" else harness.lower_tier_name(engine)
    except RuntimeError:
        harness.destroy_engine(instance_id)
        raise
    run = TierRun(name, instance_id, engine, connector, lower_tier)
    if lower_tier is not None:
        time_tier_puts(run, harness.storage_tiers(engine)[lower_tier])
    return run


def time_tier_puts(run: TierRun, backend: Any) -> None:
    """Record how long the lower tier's put hook takes inside each store() call."""
    put = backend.batched_submit_put_task

    def timed_put(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return put(*args, **kwargs)
        finally:
            run.tier_put_s.append(time.perf_counter() - started)

    backend.batched_submit_put_task = timed_put


def wait_persisted(run: TierRun, keys: Sequence[CacheEngineKey], timeout_s: float) -> int:
    """Wait until the lower tier holds ``keys``; return how many it lacks at the end."""
    assert run.lower_tier is not None
    try:
        harness.wait_until_in_tier(run.engine, run.lower_tier, keys, timeout_s=timeout_s)
    except TimeoutError:
        return len(keys) - harness.keys_in_tier(run.engine, run.lower_tier, keys)
    return 0


def measure_stores(run: TierRun, rep: int, store_kv: torch.Tensor,
                   args: argparse.Namespace) -> None:
    """(a): time back-to-back store() calls, then how long persisting them took."""
    prompts = [harness.make_prompt(args.store_tokens,
                                   seed=STORE_SEED_BASE + rep * args.stores + i)
               for i in range(args.stores)]
    started = time.perf_counter()
    for tokens in prompts:
        call_started = time.perf_counter()
        harness.store_prompt(run.engine, tokens, store_kv)
        run.store_latencies_s.append(time.perf_counter() - call_started)
        if args.store_gap_ms:
            time.sleep(args.store_gap_ms / 1e3)
    if run.lower_tier is not None:
        keys = [key for tokens in prompts for key in harness.chunk_keys(run.engine, tokens)]
        missing = wait_persisted(run, keys, args.persist_timeout)
        run.chunks_not_persisted += missing
        if not missing:
            elapsed = time.perf_counter() - started
            run.persist_gbps.append(len(prompts) * harness.kv_nbytes(store_kv) / elapsed / GB)
    harness.clear_cpu_tier(run.engine)


def measure_retrieve(run: TierRun, rep: int, args: argparse.Namespace) -> str | None:
    """(b): one cold (or, for host-only, hot) retrieve.

    :returns: why the page cache was kept before a lower-tier read, else None.
    """
    tokens = harness.make_prompt(args.retrieve_tokens, seed=RETRIEVE_SEED_BASE + rep)
    kv = harness.make_kv(run.connector, args.retrieve_tokens, seed=rep)
    keys = harness.chunk_keys(run.engine, tokens)
    harness.store_prompt(run.engine, tokens, kv)
    cache_kept_reason: str | None = None
    if run.lower_tier is not None:
        missing = wait_persisted(run, keys, args.persist_timeout)
        if missing:
            raise RuntimeError(f"{run.name}: {missing} of {len(keys)} chunks of the retrieve "
                               f"prompt were not persisted within {args.persist_timeout} s")
        harness.evict_from_cpu(run.engine, keys)
        cache_kept_reason = (harness.drop_page_cache() if args.drop_caches
                             else "not requested")
    result = harness.retrieve_prompt(run.engine, tokens, run.connector)
    if not bool(result.ret_mask.all()) or not torch.equal(result.kv, kv):
        hits = int(result.ret_mask.sum())
        raise RuntimeError(f"{run.name}: retrieve returned wrong data "
                           f"({hits} of {len(tokens)} tokens hit)")
    run.retrieve_gbps.append(harness.kv_nbytes(kv) / result.seconds / GB)
    harness.clear_cpu_tier(run.engine)
    return cache_kept_reason


def percentile(samples: Sequence[float], fraction: float) -> float:
    """Nearest-rank percentile."""
    ordered = sorted(samples)
    rank = max(1, round(fraction * len(ordered)))
    return ordered[min(rank, len(ordered)) - 1]


def median_or_none(samples: Sequence[float]) -> float | None:
    return statistics.median(samples) if samples else None


def summarize(runs: Sequence[TierRun], page_cache_dropped: bool) -> dict[str, dict[str, Any]]:
    """Per-configuration summary numbers."""
    read_kind = "cold" if page_cache_dropped else "page cache kept"
    baseline = next((run for run in runs if run.name == BASELINE), None)
    summary: dict[str, dict[str, Any]] = {}
    for run in runs:
        ratio = None
        if baseline is not None and run is not baseline and run.lower_tier is not None:
            ratio = median_or_none([mine / theirs for mine, theirs
                                    in zip(run.retrieve_gbps, baseline.retrieve_gbps,
                                           strict=True)])
        summary[run.name] = {
            "store_calls": len(run.store_latencies_s),
            "store_p50_ms": percentile(run.store_latencies_s, 0.50) * 1e3,
            "store_p99_ms": percentile(run.store_latencies_s, 0.99) * 1e3,
            "tier_put_p50_us": (percentile(run.tier_put_s, 0.50) * 1e6 if run.tier_put_s
                                else None),
            "persist_gbps_median": median_or_none(run.persist_gbps),
            "chunks_not_persisted": run.chunks_not_persisted,
            "retrieve_source": "host memory (hot)" if run.lower_tier is None
                               else f"{run.lower_tier} ({read_kind})",
            "retrieve_gbps_median": median_or_none(run.retrieve_gbps),
            "retrieve_gbps_min": min(run.retrieve_gbps),
            "retrieve_gbps_max": max(run.retrieve_gbps),
            f"retrieve_ratio_vs_{BASELINE}": ratio,
        }
    return summary


def markdown_table(summary: dict[str, dict[str, Any]]) -> str:
    """The summary as a markdown table."""
    def number(value: float | None, digits: int) -> str:
        return "-" if value is None else f"{value:.{digits}f}"

    lines = [
        "| config | store p50 ms | store p99 ms | tier put p50 µs | persist GB/s "
        "| not persisted "
        f"| retrieve from | retrieve GB/s (min-max) | vs {BASELINE} |",
        "|---|---:|---:|---:|---:|---:|---|---:|---:|",
    ]
    for name, row in summary.items():
        lines.append(
            f"| {name} | {row['store_p50_ms']:.2f} | {row['store_p99_ms']:.2f} "
            f"| {number(row['tier_put_p50_us'], 0)} "
            f"| {number(row['persist_gbps_median'], 2)} | {row['chunks_not_persisted']} "
            f"| {row['retrieve_source']} | {row['retrieve_gbps_median']:.2f} "
            f"({row['retrieve_gbps_min']:.2f}-{row['retrieve_gbps_max']:.2f}) "
            f"| {number(row[f'retrieve_ratio_vs_{BASELINE}'], 2)} |")
    return "\n".join(lines)


def restart_table(restarts: list[dict[str, Any]]) -> str:
    """First cold retrieve after a restart against the same process's later cold retrieves."""
    lines = ["| restart | tier open s | first retrieve GB/s | later retrieves GB/s (median) "
             "| first / later |", "|---:|---:|---:|---:|---:|"]
    for i, r in enumerate(restarts, 1):
        later = statistics.median(r["later_gbps"])
        lines.append(f"| {i} | {r['open_s']:.2f} | {r['first_gbps']:.2f} | {later:.2f} "
                     f"| {r['first_gbps'] / later:.2f} |")
    return "\n".join(lines)


def run_benchmark(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    """Build all engines, run the interleaved repetitions, and tear everything down."""
    runs: list[TierRun] = []
    cache_kept_reasons: set[str] = set()
    try:
        for name in args.configs:
            runs.append(start_tier(name, args, workdir))
        store_kv = harness.make_kv(runs[0].connector, args.store_tokens, seed=0)
        for rep in range(args.warmup_reps + args.reps):
            if rep == args.warmup_reps:
                for run in runs:
                    run.discard_samples()
                cache_kept_reasons.clear()
            rotation = rep % len(runs)
            for run in runs[rotation:] + runs[:rotation]:
                measure_stores(run, rep, store_kv, args)
                reason = measure_retrieve(run, rep, args)
                if reason is not None:
                    cache_kept_reasons.add(reason)
            if rep < args.warmup_reps:
                progress = f"warm-up repetition {rep + 1}/{args.warmup_reps}"
            else:
                progress = f"repetition {rep + 1 - args.warmup_reps}/{args.reps}"
            print(f"{progress} done", file=sys.stderr, flush=True)
    finally:
        for run in runs:
            harness.destroy_engine(run.instance_id)
    page_cache_dropped = args.drop_caches and not cache_kept_reasons
    connector = runs[0].connector
    chunk_bytes = connector.get_shape(args.chunk_size).numel() * connector.dtype.itemsize
    return {
        "settings": {key: (str(value) if isinstance(value, Path) else value)
                     for key, value in vars(args).items()},
        "chunk_bytes": chunk_bytes,
        "page_cache_dropped": page_cache_dropped,
        "page_cache_note": "; ".join(sorted(cache_kept_reasons)) or None,
        "host": {"python": platform.python_version(), "torch": torch.__version__,
                 "lmcache": importlib.metadata.version("lmcache"),
                 "cpus": os.cpu_count(), "workdir": str(workdir)},
        "summary": summarize(runs, page_cache_dropped),
        "samples": {run.name: {"store_latencies_s": run.store_latencies_s,
                               "tier_put_s": run.tier_put_s,
                               "persist_gbps": run.persist_gbps,
                               "retrieve_gbps": run.retrieve_gbps}
                    for run in runs},
    }


def restart_child(args: argparse.Namespace, seeds: list[int]) -> dict[str, Any]:
    """In a fresh process: reopen the nvme tier and cold-retrieve prompts the run stored.

    The first retrieve pays whatever a restart leaves to the first request; the
    later ones (page cache dropped before each) are this process's steady state.
    """
    assert args.workdir is not None
    started = time.perf_counter()
    run = start_tier("nvme", args, args.workdir)
    opened_s = time.perf_counter() - started
    gbps: list[float] = []
    try:
        for seed in seeds:
            tokens = harness.make_prompt(args.retrieve_tokens, seed=RETRIEVE_SEED_BASE + seed)
            kv = harness.make_kv(run.connector, args.retrieve_tokens, seed=seed)
            if args.drop_caches:
                harness.drop_page_cache()
            result = harness.retrieve_prompt(run.engine, tokens, run.connector)
            if not bool(result.ret_mask.all()) or not torch.equal(result.kv, kv):
                raise RuntimeError(f"restart: prompt {seed} came back wrong or missing "
                                   f"({int(result.ret_mask.sum())} tokens hit)")
            gbps.append(harness.kv_nbytes(kv) / result.seconds / GB)
            harness.clear_cpu_tier(run.engine)
    finally:
        harness.destroy_engine(run.instance_id)
    return {"open_s": opened_s, "first_gbps": gbps[0], "later_gbps": gbps[1:]}


def measure_restarts(args: argparse.Namespace, workdir: Path) -> list[dict[str, Any]]:
    """Run ``--restarts`` fresh processes on the nvme tier the run left behind."""
    shape = ["--configs", "nvme", "--layers", str(args.layers), "--heads", str(args.heads),
             "--head-size", str(args.head_size), "--chunk-size", str(args.chunk_size),
             "--retrieve-tokens", str(args.retrieve_tokens), "--cpu-gb", str(args.cpu_gb),
             "--disk-gb", str(args.disk_gb), "--workdir", str(workdir),
             "--drop-caches" if args.drop_caches else "--no-drop-caches",
             *(arg for name, value in args.nvme.items() for arg in ("--nvme", f"{name}={value}"))]
    results = []
    for i in range(args.restarts):
        seeds = [(args.warmup_reps + i + k) % (args.warmup_reps + args.reps) for k in range(3)]
        cmd = [sys.executable, __file__, *shape, "--restart-child", ",".join(map(str, seeds))]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, check=False)
        if proc.returncode != 0:
            raise RuntimeError(f"restart child failed: {proc.stderr[-2000:]}")
        results.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    return results


def main(argv: Sequence[str] | None = None) -> int:
    harness.disable_telemetry()
    args = parse_args(argv)
    if args.restart_child is not None:
        seeds = [int(s) for s in args.restart_child.split(",")]
        print(json.dumps(restart_child(args, seeds)))
        return 0
    with tempfile.TemporaryDirectory(prefix="bench-engine-") as tmp:
        workdir = args.workdir or Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        report = run_benchmark(args, workdir)
        if "nvme" in args.configs and args.restarts:
            report["restarts"] = measure_restarts(args, workdir)
    mib = report["chunk_bytes"] / 2**20
    print(f"chunk {args.chunk_size} tokens = {mib:.1f} MiB; store prompt {args.store_tokens} "
          f"tokens x {args.stores} per rep; retrieve prompt {args.retrieve_tokens} tokens; "
          f"{args.reps} reps; page cache dropped before cold retrieves: "
          f"{'yes' if report['page_cache_dropped'] else 'no'}"
          + (f" ({report['page_cache_note']})" if report["page_cache_note"] else ""))
    print()
    print(markdown_table(report["summary"]))
    if report.get("restarts"):
        print()
        print(restart_table(report["restarts"]))
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
