"""Overload: store through a real LMCacheEngine faster than the drive can write.

The NVMe tier's writes are throttled to ``--drive-mbps`` while the engine stores distinct
prompts back to back: every batch the store hands its I/O engine first waits, one batch at
a time, for as long as a drive of that rate takes to write its bytes (a slow drive,
reproducible on any machine).  Reported:
``engine.store()`` latency p50 / p99 / max, how many chunks the tier dropped because its
write queue was full (policy ``drop``) or waited for (policy ``wait``), the peak bytes
held by the write queue against its budget (sampled every millisecond), and the
process's peak RSS.

    LMCACHE_TRACK_USAGE=false python bench/bench_overload.py --policy drop
    LMCACHE_TRACK_USAGE=false python bench/bench_overload.py --policy wait
"""

from __future__ import annotations

import os

os.environ.setdefault("LMCACHE_LOG_LEVEL", "WARNING")
os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")
os.environ.setdefault("LMCACHE_DISABLE_BANNER", "1")

import argparse  # noqa: E402
import json  # noqa: E402
import resource  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

from lmcache_nvme_backend.testing.engine import (  # noqa: E402
    build_engine,
    destroy_engine,
    load_config,
    make_kv,
    make_prompt,
    storage_tiers,
)

EXAMPLE_YAML = Path(__file__).resolve().parents[1] / "examples" / "lmcache-nvme.yaml"
PAYLOADS = 10  # a write share's payload column (io/engine.py, WriteShare)


def throttle(store: Any, mbps: float) -> None:
    """Make ``store``'s writes wait for a drive of ``mbps`` MB/s: one batch at a time, a sleep
    in proportion to its payload bytes, then the engine writes it.  The wait runs on a
    thread of its own, as a drive's would: the store call that queued the chunks never
    waits for it, only the write queue's bytes do."""
    drive = threading.Lock()
    # The store's I/O engine behind the seam of io/engine.py, whichever engine it is.
    engine = getattr(store, "engine", None) or store.native_engine
    if engine is None:  # a store whose Python engine writes chunk by chunk, off the seam
        real_write = store.io_engine.write_hashed_to

        def python_write(fd: int, payload: memoryview, *rest: Any, **kw: Any) -> None:
            with drive:
                time.sleep(payload.nbytes / (mbps * 1e6))
            real_write(fd, payload, *rest, **kw)

        store.io_engine.write_hashed_to = python_write
        return
    real_submit = engine.submit_write

    def delayed(shares: Any, on_done: Any) -> None:
        nbytes = sum(view.nbytes for share in shares for view in share[PAYLOADS])
        with drive:
            time.sleep(nbytes / (mbps * 1e6))
        real_submit(shares, on_done)

    def submit(shares: Any, on_done: Any) -> None:
        threading.Thread(target=delayed, args=(shares, on_done), daemon=True).start()

    engine.submit_write = submit


def run(args: argparse.Namespace) -> dict[str, Any]:
    cache = Path(args.path or tempfile.mkdtemp(prefix="nvme-overload-"))
    config = load_config(EXAMPLE_YAML, {
        "max_local_cpu_size": args.cpu_gb,
        "extra_config": {"nvme.path": str(cache), "nvme.max_size_gb": 4, "nvme.min_free_gb": 0,
                         "nvme.write_queue_mb": args.queue_mb,
                         "nvme.queue_full_policy": args.policy}})
    engine, connector = build_engine(config, instance_id="overload")
    try:
        backend = storage_tiers(engine)["nvme"]
        store = backend.store  # type: ignore[attr-defined]
        throttle(store, args.drive_mbps)
        peak_queue = 0
        stop = threading.Event()

        def sample() -> None:
            nonlocal peak_queue
            while not stop.wait(0.001):
                peak_queue = max(peak_queue, store.usage()["queue_bytes"])

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        latencies = []
        chunk_bytes = 0
        started = time.perf_counter()
        for i in range(args.stores):
            tokens = make_prompt(args.tokens, seed=1000 + i)
            kv = make_kv(connector, len(tokens), seed=i)
            chunk_bytes = kv.numel() * kv.element_size() // (args.tokens // 256)
            t0 = time.perf_counter()
            engine.store(tokens, kvcaches=kv)
            latencies.append(time.perf_counter() - t0)
        offered_s = time.perf_counter() - started
        store.flush(120)
        stop.set()
        sampler.join()
        stats = backend.stats()  # type: ignore[attr-defined]
        lat = sorted(latencies)
        result = {
            "policy": args.policy, "drive_mbps": args.drive_mbps, "stores": args.stores,
            "tokens_per_store": args.tokens, "chunk_bytes": chunk_bytes,
            "offered_MBps": round(args.stores * args.tokens // 256 * chunk_bytes / offered_s / 1e6,
                                  1),
            "store_p50_ms": round(statistics.median(lat) * 1e3, 2),
            "store_p99_ms": round(lat[max(0, int(len(lat) * 0.99) - 1)] * 1e3, 2),
            "store_max_ms": round(lat[-1] * 1e3, 2),
            "writes_enqueued": stats["writes_enqueued"],
            "writes_completed": stats["writes_completed"],
            "queue_full_drops": stats["queue_full_drops"],
            "queue_full_waits": stats["queue_full_waits"],
            "queue_budget_bytes": store.settings.write_queue_bytes,
            "queue_peak_bytes": peak_queue,
            "peak_rss_MiB": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
            "cpu_tier_gb": args.cpu_gb,
        }
        return result
    finally:
        destroy_engine("overload")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--policy", choices=("drop", "wait"), default="drop")
    p.add_argument("--drive-mbps", type=float, default=50.0, help="throttled write rate")
    p.add_argument("--queue-mb", type=float, default=32.0, help="nvme.write_queue_mb")
    p.add_argument("--stores", type=int, default=200, help="engine.store() calls")
    p.add_argument("--tokens", type=int, default=1024, help="tokens per prompt (x256)")
    p.add_argument("--cpu-gb", type=float, default=0.5, help="LMCache host-memory tier")
    p.add_argument("--path", default=None, help="cache directory (default: a temp dir)")
    p.add_argument("--json", default=None, help="also write the result here")
    args = p.parse_args()
    result = run(args)
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")


if __name__ == "__main__":
    main()
