"""How long a restart takes to rebuild the index: the store opened on a tree of ``--chunks``
chunk files, cold (page cache dropped, when run as root) and warm.

The store's constructor walks the tree (every shard directory listed, every chunk file's
``lstat`` through the open directory), reads the manifest, and indexes what it found; the
engine that opens the tier waits for it.  Each measurement opens the store afresh in this
process and reports wall and CPU seconds (``time.process_time``: this process's user and
system time), and per chunk.  Tiny chunks (4 KiB) keep the tree cheap to make; the walk
costs the same per file whatever the size::

    LMCACHE_TRACK_USAGE=false python bench/instruments/bench_recovery.py /path/on/the/drive \\
        --chunks 100000

To compare two revisions, run it from a checkout of each on the same directory.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import time
from pathlib import Path

# bench/ for common.py, the shared helpers
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))
from common import add_drop_caches_option, drop_caches  # noqa: E402

from lmcache_nvme_backend.config import NVMeSettings
from lmcache_nvme_backend.disk.format import TensorMeta
from lmcache_nvme_backend.store.chunk_store import ChunkStore
from lmcache_nvme_backend.store.writeback import ChunkWrite

CHUNK_BYTES = 4096
PER_TASK = 64


def open_store(path: Path) -> ChunkStore:
    return ChunkStore(NVMeSettings.from_params({"path": str(path), "max_size_gb": 64,
                                                "min_free_gb": 0, "manifest_interval_s": 0}))


def fill(path: Path, chunks: int) -> float:
    """Store ``chunks`` chunks (and the manifest a clean close saves); seconds taken."""
    store = open_store(path)
    meta = TensorMeta(shapes=((CHUNK_BYTES,),), dtypes=("uint8",), fmt=1, nbytes=CHUNK_BYTES)
    payload = memoryview(bytes(CHUNK_BYTES))
    started = time.perf_counter()
    for first in range(0, chunks, PER_TASK):
        store.submit_many([ChunkWrite(f"chunk-{i}", "bench-model", meta, payload)
                           for i in range(first, min(first + PER_TASK, chunks))])
        if first % (64 * PER_TASK) == 0:
            store.flush()  # keep the write queue from dropping chunks
    store.flush()
    store.close()
    return time.perf_counter() - started


def reopen(path: Path) -> tuple[float, float, int]:
    """(wall s, CPU s, entries) of opening the store."""
    wall, cpu = time.perf_counter(), time.process_time()
    store = open_store(path)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    entries = store.usage()["entries"]
    store.close()
    return wall, cpu, entries


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("path", type=Path, help="a directory on the drive (made, then removed)")
    parser.add_argument("--chunks", type=int, default=100_000)
    parser.add_argument("--repeat", type=int, default=3)
    add_drop_caches_option(parser)
    args = parser.parse_args()
    tree = args.path / "bench-recovery"
    shutil.rmtree(tree, ignore_errors=True)
    print(f"stored {args.chunks:,} chunks in {fill(tree, args.chunks):.1f} s", flush=True)
    results: dict[str, list[tuple[float, float]]] = {"cold": [], "warm": []}
    for rep in range(args.repeat):
        for kind in ("cold", "warm"):
            if kind == "cold" and not (args.drop_caches and drop_caches()):  # root
                continue
            wall, cpu, entries = reopen(tree)
            if entries != args.chunks:
                raise SystemExit(f"the reopened store indexed {entries} of {args.chunks}")
            results[kind].append((wall, cpu))
            print(f"rep {rep + 1} {kind}: {wall:.2f} s wall, {cpu:.2f} s CPU", flush=True)
    shutil.rmtree(tree, ignore_errors=True)
    print("\n| page cache | wall s | CPU s | wall µs / chunk | CPU µs / chunk |")
    print("|---|---|---|---|---|")
    for kind, runs in results.items():
        if runs:
            wall = statistics.median(w for w, _ in runs)
            cpu = statistics.median(c for _, c in runs)
            print(f"| {kind} | {wall:.2f} | {cpu:.2f} | {wall / args.chunks * 1e6:.1f} | "
                  f"{cpu / args.chunks * 1e6:.1f} |")


if __name__ == "__main__":
    main()
