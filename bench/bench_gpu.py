"""GPU-destination read throughput of chunk files: kvikio vs host bounce vs LMCache GdsBackend.

Every variant reads the SAME chunk files (this package's format: a 4 KiB
header, then the payload at offset 4096) into CUDA memory:

* ``kvikio``      -- the product path: ``GpuChunkReader`` with the path the
  machine allows (``kvikio-gds``, or ``kvikio-compat``), header check and GPU
  checksum verification included;
* ``kvikio-raw``  -- kvikio ``CuFile.pread`` alone into preallocated CUDA
  buffers (no verification): the I/O ceiling of the kvikio path;
* ``host-bounce`` -- ``GpuChunkReader`` with ``nvme.gds_mode: off``: O_DIRECT
  host read, xxh3, copy to the GPU pool;
* ``gds-true`` / ``gds-false`` -- LMCache's ``GdsBackend`` with ``use_gds``
  true (cuFile via ``cufile-python``) and false (its mmap + cudaMemcpy
  fallback), pointed at the same files (its data files also hold the payload
  at offset 4096; its index entries are filled in directly).

Each repetition visits every variant in a rotated order, the page cache is
dropped before each variant with ``--drop-caches`` (root), and the median GB/s
(1e9 payload bytes per second, one ``batched_get_blocking``-sized batch per
call) is reported with the kvikio / host-bounce ratio.  Without a CUDA GPU the
script says so and exits with status 2.

    python bench/bench_gpu.py --dir /mnt/nvme/bench --chunk-mb 4,16,64 --chunks 64
"""

from __future__ import annotations

import os

os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")
os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("LMCACHE_DISABLE_BANNER", "1")
os.environ.setdefault("LMCACHE_LOG_LEVEL", "WARNING")

import argparse  # noqa: E402
import asyncio  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

VARIANTS = ("kvikio", "kvikio-raw", "host-bounce", "gds-true", "gds-false")


def fail(message: str, status: int = 2) -> None:
    print(f"bench_gpu: {message}", file=sys.stderr)
    raise SystemExit(status)


def require_gpu(cpu_dry_run: bool = False) -> Any:
    try:
        import torch
    except ImportError as exc:
        fail(f"torch is not importable ({exc})")
    if not torch.cuda.is_available() and not cpu_dry_run:
        fail("needs a CUDA GPU: torch.cuda.is_available() is False (torch CUDA build: "
             f"{torch.version.cuda or 'none'}). Nothing was measured. Run it on a GPU "
             "machine (docs/gpu.md gives the command).")
    return torch


def drop_page_cache() -> bool:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


class Variant:
    """Reads the keys of one batch into GPU memory; releases what it returned."""

    def __init__(self, name: str, read: Callable[[list[int]], int],
                 close: Callable[[], None] = lambda: None, note: str = "") -> None:
        self.name, self.read, self.close, self.note = name, read, close, note


def build_variants(names: list[str], store: Any, chunks: Any, args: argparse.Namespace,
                   nbytes: int, torch: Any) -> tuple[list[Variant], dict[str, str]]:
    from lmcache_nvme_backend.gpu.select import GpuProbe, PathDecision, select_read_path
    from lmcache_nvme_backend.io.kvikio import (
        KvikioPayloadReader,
        PayloadRead,
        PosixTensorPayloadReader,
    )
    from lmcache_nvme_backend.store import ReadPath
    from lmcache_nvme_backend.testing.gpu import HostTier, make_reader, release_all

    device = args.device
    pool_bytes = int(args.pool_mb * 2**20)
    failures: dict[str, str] = {}
    built: list[Variant] = []
    probe = GpuProbe.detect()
    host = HostTier(pool_bytes)

    def reader_variant(name: str, decision: Any, payloads: Any) -> Variant:
        reader = make_reader(store, decision, device, pool_bytes, host, payload_reader=payloads,
                             register=decision.path == "kvikio-gds")

        def read(idx: list[int]) -> int:
            bounced = store.counter("path_host_bounce_chunks")
            objs = reader.read([chunks.keys[i] for i in idx], [chunks.metas[i] for i in idx])
            got = sum(o is not None for o in objs)
            release_all(objs)
            if got != len(idx):
                raise RuntimeError(f"{name}: {len(idx) - got} of {len(idx)} chunks not served")
            bounced = store.counter("path_host_bounce_chunks") - bounced
            if decision.path != ReadPath.HOST_BOUNCE and bounced:
                counters = {c: store.counter(c) for c in (
                    "gpu_unverified_fallbacks", "gpu_read_errors", "gpu_pool_fallbacks")}
                raise RuntimeError(f"{name}: {bounced} of {len(idx)} chunks went through the "
                                   f"host, not {decision.path} ({counters})")
            return got * nbytes

        return Variant(name, read, reader.close, f"path {decision.path}: {decision.reason}")

    for name in names:
        try:
            if name == "kvikio" and args.cpu_dry_run:  # plumbing check: pread stands in
                built.append(reader_variant(name, PathDecision("kvikio-compat", "dry run"),
                                            PosixTensorPayloadReader()))
            elif name == "kvikio":
                decision = select_read_path("auto", "cuda:0", pool_bytes, probe)
                if decision.path not in ("kvikio-gds", "kvikio-compat"):
                    raise RuntimeError(f"no kvikio path here: {decision.reason}")
                payloads = KvikioPayloadReader(args.threads, int(args.task_mb * 2**20),
                                               strict=False)
                built.append(reader_variant(name, decision, payloads))
            elif name == "host-bounce":
                bounce = PathDecision(ReadPath.HOST_BOUNCE, "bench")
                built.append(reader_variant(name, bounce, None))
            elif name == "kvikio-raw":
                payloads = PosixTensorPayloadReader() if args.cpu_dry_run else \
                    KvikioPayloadReader(args.threads, int(args.task_mb * 2**20), strict=False)
                padded = -(-nbytes // 4096) * 4096
                bufs = [torch.empty(padded, dtype=torch.uint8, device=device)
                        for _ in range(args.batch)]
                paths = [p.path for p in store.plan_reads(chunks.keys)]

                def raw(idx: list[int], payloads: Any = payloads, bufs: Any = bufs,
                        paths: Any = paths, padded: int = padded) -> int:
                    reads = [PayloadRead(paths[i], bufs[j], padded) for j, i in enumerate(idx)]
                    payloads.read(reads)
                    for r in reads:
                        if r.error is not None or r.nread < nbytes:
                            raise RuntimeError(f"kvikio-raw: {r.error or 'short read'}")
                    if torch.cuda.is_available():
                        torch.cuda.synchronize()
                    return len(idx) * nbytes

                built.append(Variant(name, raw, note="kvikio CuFile.pread only"))
            elif name in ("gds-true", "gds-false"):
                built.append(gds_variant(name == "gds-true", store, chunks, args, nbytes, torch))
        except Exception as exc:  # report and go on: one broken variant must not hide the rest
            failures[name] = f"{type(exc).__name__}: {exc}"
            if args.verbose:
                traceback.print_exc()
    return built, failures


def gds_variant(use_gds: bool, store: Any, chunks: Any, args: argparse.Namespace, nbytes: int,
                torch: Any) -> Variant:
    """LMCache's GdsBackend, its index pointed at our files (payload at offset 4096 too)."""
    from lmcache.utils import CacheEngineKey, DiskCacheMetadata
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.memory_management import MemoryFormat
    from lmcache.v1.storage_backend.gds_backend import GdsBackend

    from lmcache_nvme_backend.disk.gpusum import (
        DeviceWeights,
        device_checksum,
        host_checksum,
        to_unsigned,
    )

    gds_dir = Path(args.dir) / f"gds-backend-{'on' if use_gds else 'off'}"
    gds_dir.mkdir(parents=True, exist_ok=True)
    config = LMCacheEngineConfig.from_dict({
        "chunk_size": 256, "local_cpu": False, "max_local_cpu_size": 1,
        "gds_path": str(gds_dir), "gds_buffer_size": int(args.pool_mb), "use_gds": use_gds,
        "extra_config": {"disk_io_threads": args.threads}})
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    backend = GdsBackend(config, None, loop, dst_device="cuda:0")  # type: ignore[arg-type]
    keys = []
    n_elems = nbytes // 2
    for i, plan in enumerate(store.plan_reads(chunks.keys)):
        key = CacheEngineKey("bench", 1, 0, 10_000 + i, torch.bfloat16)
        keys.append(key)
        backend.hot_cache[key] = DiskCacheMetadata(str(plan.path), nbytes,
                                                   torch.Size([n_elems]), torch.bfloat16,
                                                   None, MemoryFormat.KV_2LTD)
    expected = [host_checksum(p) for p in chunks.payloads[:1]]
    weights = DeviceWeights("cuda:0")
    checked = {"done": False}

    def read(idx: list[int]) -> int:
        objs = backend.batched_get_blocking([keys[i] for i in idx])
        try:
            got = [o for o in objs if o is not None]
            if len(got) != len(idx):
                raise RuntimeError(f"GdsBackend served {len(got)} of {len(idx)}")
            torch.cuda.synchronize()
            if not checked["done"] and idx[0] == 0:  # it read the right bytes
                raw = got[0].tensor.reshape(-1).view(torch.uint8)
                sums = [to_unsigned(v) for v in device_checksum(raw, nbytes, weights).tolist()]
                if tuple(sums) != expected[0]:
                    raise RuntimeError("GdsBackend returned wrong bytes")
                checked["done"] = True
            return len(got) * nbytes
        finally:
            for o in objs:
                if o is not None:
                    o.ref_count_down()

    def close() -> None:
        backend.hot_cache.clear()
        try:
            backend.close()
        finally:
            loop.call_soon_threadsafe(loop.stop)

    return Variant(f"gds-{'true' if use_gds else 'false'}", read, close,
                   f"LMCache GdsBackend use_gds={use_gds}")


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch = require_gpu(args.cpu_dry_run)
    from lmcache_nvme_backend.config import NVMeSettings
    from lmcache_nvme_backend.gpu.select import GpuProbe
    from lmcache_nvme_backend.store.chunk_store import ChunkStore
    from lmcache_nvme_backend.testing.gpu import write_chunks

    names = [v.strip() for v in args.variants.split(",") if v.strip()]
    for name in names:
        if name not in VARIANTS:
            fail(f"unknown variant {name!r}; choose from {', '.join(VARIANTS)}")
    probe = GpuProbe.detect()
    report: dict[str, Any] = {"device": torch.cuda.get_device_name(0) if not
                              args.cpu_dry_run else "cpu (dry run: nothing measured)",
                              "probe": probe.__dict__, "args": vars(args), "sizes": []}
    print(f"device: {report['device']}; probe: {probe}")
    for chunk_mb in [float(x) for x in args.chunk_mb.split(",")]:
        nbytes = int(chunk_mb * 2**20) // 2 * 2
        root = Path(args.dir) / f"chunks-{chunk_mb:g}MiB"
        settings = NVMeSettings.from_params({
            "path": str(root), "max_size_gb": max(1.0, 2 * args.chunks * nbytes / 2**30),
            "min_free_gb": 0, "manifest_interval_s": 0, "io_threads": args.threads,
            "task_size_mb": args.task_mb, "write_queue_mb": max(64.0, 4 * chunk_mb)})
        store = ChunkStore(settings)
        store.set_gpu_checksums(True)  # the files the kvikio path verifies on the GPU
        try:
            chunks = write_chunks(store, args.chunks, nbytes, prefix=f"bench-{chunk_mb:g}")
            variants, failures = build_variants(names, store, chunks, args, nbytes, torch)
            rates: dict[str, list[float]] = {v.name: [] for v in variants}
            batches = [list(range(i, min(args.chunks, i + args.batch)))
                       for i in range(0, args.chunks, args.batch)]
            dropped = False
            for rep in range(args.reps):
                order = variants[rep % max(1, len(variants)):] + \
                    variants[: rep % max(1, len(variants))]
                for v in order:
                    if v.name in failures:
                        continue
                    if args.drop_caches:
                        dropped = drop_page_cache() or dropped
                    try:
                        started = time.perf_counter()
                        moved = sum(v.read(b) for b in batches)
                        rates[v.name].append(moved / (time.perf_counter() - started) / 1e9)
                    except Exception as exc:
                        failures[v.name] = f"{type(exc).__name__}: {exc}"
            for v in variants:
                try:
                    v.close()
                except Exception as exc:
                    print(f"closing {v.name}: {exc}", file=sys.stderr)
            entry = {"chunk_mb": chunk_mb, "chunks": args.chunks, "page_cache_dropped": dropped,
                     "notes": {v.name: v.note for v in variants},
                     "gbps": {k: r for k, r in rates.items() if r},
                     "median_gbps": {k: statistics.median(r) for k, r in rates.items() if r},
                     "failures": failures}
            med = entry["median_gbps"]
            if "kvikio" in med and "host-bounce" in med:
                entry["kvikio_over_bounce"] = med["kvikio"] / med["host-bounce"]
            report["sizes"].append(entry)
            print_entry(entry)
        finally:
            store.close()
            if not args.keep:
                shutil.rmtree(root, ignore_errors=True)
    return report


def print_entry(entry: dict[str, Any]) -> None:
    print(f"\nchunk {entry['chunk_mb']:g} MiB x {entry['chunks']} "
          f"(page cache dropped: {entry['page_cache_dropped']})")
    print(f"  {'variant':<12} {'median GB/s':>12}  {'min':>7} {'max':>7}  note")
    for name, rates in entry["gbps"].items():
        print(f"  {name:<12} {statistics.median(rates):12.2f}  {min(rates):7.2f} "
              f"{max(rates):7.2f}  {entry['notes'].get(name, '')}")
    for name, why in entry["failures"].items():
        print(f"  {name:<12} {'failed':>12}  {why}")
    if "kvikio_over_bounce" in entry:
        print(f"  kvikio / host-bounce: {entry['kvikio_over_bounce']:.2f}x (target 1.3x)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", default="/tmp/lmcache-nvme-bench-gpu",
                        help="directory for the chunk files (put it on the NVMe drive)")
    parser.add_argument("--chunk-mb", default="4,16,64", help="chunk sizes in MiB, comma list")
    parser.add_argument("--chunks", type=int, default=64, help="chunk files per size")
    parser.add_argument("--batch", type=int, default=16, help="chunks per get call")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=16,
                        help="kvikio threads / I/O threads / GdsBackend disk_io_threads")
    parser.add_argument("--task-mb", type=float, default=4.0, help="kvikio and POSIX task size")
    parser.add_argument("--pool-mb", type=float, default=0,
                        help="GPU pool per reader (default: one batch of the largest chunk)")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--json", help="write the report here")
    parser.add_argument("--keep", action="store_true", help="keep the chunk files")
    parser.add_argument("--drop-caches", action="store_true",
                        help="drop the page cache before each variant (root; cold reads)")
    parser.add_argument("--verbose", action="store_true")
    parser.add_argument("--cpu-dry-run", action="store_true",
                        help="exercise the script on CPU tensors (pread stands in for kvikio; "
                             "figures mean nothing): how CI checks it")
    args = parser.parse_args(argv)
    args.device = "cpu" if args.cpu_dry_run else "cuda:0"
    if args.pool_mb <= 0:
        largest = max(float(x) for x in args.chunk_mb.split(","))
        args.pool_mb = largest * args.batch + 64
    report = run(args)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
