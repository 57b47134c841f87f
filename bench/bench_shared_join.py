"""What it costs a member to join a shared directory: time until it serves, memory per chunk.

Fills DIRECTORY through the public ``ChunkStore`` API with ``nvme.shared`` (a writer stores
``--history`` times CHUNKS small chunks under a budget of CHUNKS, so CHUNKS stay live and
the rest were evicted: the journals hold the whole history), then, while the writer is
still open, starts a second process that opens a member on the directory and reports how
long until a lookup of a live chunk hits and its bytes read back, and the growth of its
resident memory per live chunk::

    python bench/bench_shared_join.py /tmp/join 100000

DIRECTORY must be empty or absent (it is filled, and left for inspection).  One run, one
figure each: on a busy machine expect tens of percent of noise.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

from lmcache_nvme_backend.config import NVMeSettings
from lmcache_nvme_backend.disk.format import TensorMeta, file_size_for
from lmcache_nvme_backend.store.chunk_store import ChunkRead, ChunkStore

NAMESPACE = "bench-model"
SAMPLE = 1000  # live keys looked up (95 % must hit) and 20 of them read back
SETTLE_S = 5.0  # memory is measured again this long after the member serves


def settings(directory: Path, chunks: int, payload: int) -> NVMeSettings:
    return NVMeSettings.from_params({
        "path": [str(directory)], "shared": True, "min_free_gb": 0,
        "max_size_gb": chunks * file_size_for(payload) / 2**30, "manifest_interval_s": 0})


def payload_of(i: int, payload: int) -> bytes:
    return i.to_bytes(8, "little") * (payload // 8)


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def fill(directory: Path, chunks: int, history: int, payload: int) -> ChunkStore:
    meta = TensorMeta(shapes=((payload,),), dtypes=("uint8",), fmt=1, nbytes=payload)
    store = ChunkStore(settings(directory, chunks, payload))
    started = time.perf_counter()
    for i in range(chunks * history):
        store.submit(f"k{i}", NAMESPACE, meta, memoryview(payload_of(i, payload)),
                     release=lambda: None)
        if i % 4096 == 4095:
            store.flush(600)
    store.flush(600)
    print(f"filled: {chunks * history} chunks stored in {time.perf_counter() - started:.1f} s, "
          f"{store.usage()}", flush=True)
    return store


def live_sample(writer: ChunkStore, chunks: int, history: int) -> list[int]:
    """Keys the writer still holds (of the last CHUNKS stored, those not yet evicted)."""
    newest = range(chunks * (history - 1), chunks * history)
    live = [i for i in newest if writer.contains(f"k{i}")]
    return random.Random(1).sample(live, min(SAMPLE, len(live)))


def join(directory: Path, chunks: int, payload: int, keys: list[int]) -> dict[str, float]:
    """Open a member and wait until it serves (runs in its own process)."""
    before = rss_bytes()
    started = time.perf_counter()
    store = ChunkStore(settings(directory, chunks, payload))
    opened = time.perf_counter() - started
    # the writer keeps some headroom free, evicting a few of the sampled keys meanwhile
    while sum(store.contains(f"k{i}") for i in keys) < 0.95 * len(keys):
        time.sleep(0.01)
    hits = [i for i in keys if store.contains(f"k{i}")]
    for i in hits[:20]:
        buf = bytearray(payload)
        if store.read_into([ChunkRead(f"k{i}", memoryview(buf))]) == [True]:
            assert bytes(buf) == payload_of(i, payload), f"wrong bytes for k{i}"
    serves = time.perf_counter() - started
    grown = rss_bytes() - before
    time.sleep(SETTLE_S)  # the rest of the journals, read in the background
    settled = rss_bytes() - before
    entries = store.usage()
    store.close()
    return {"open_s": opened, "serves_s": serves, "rss_delta_bytes": grown,
            "bytes_per_live_chunk": grown / chunks, "sample_hits": len(hits) / len(keys),
            "settled_bytes_per_live_chunk": settled / chunks,
            "us_per_live_chunk": serves / chunks * 1e6,
            **{f"index_{k}": v for k, v in entries.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("directory", type=Path)
    parser.add_argument("chunks", type=int, help="live chunks")
    parser.add_argument("--history", type=int, default=3,
                        help="chunks stored over the run, in multiples of CHUNKS")
    parser.add_argument("--payload", type=int, default=4096, help="bytes per chunk")
    parser.add_argument("--join-keys", help=argparse.SUPPRESS)  # the joining process
    args = parser.parse_args()
    if args.join_keys:
        keys = [int(k) for k in args.join_keys.split(",")]
        print(json.dumps(join(args.directory, args.chunks, args.payload, keys)))
        return
    if args.directory.exists() and any(args.directory.iterdir()):
        sys.exit(f"{args.directory} is not empty")
    writer = fill(args.directory, args.chunks, args.history, args.payload)
    try:
        journals = sum(p.stat().st_size for p in (args.directory / "shared" / "members")
                       .glob("*.journal"))
        out = subprocess.run(
            [sys.executable, __file__, str(args.directory), str(args.chunks), "--history",
             str(args.history), "--payload", str(args.payload), "--join-keys",
             ",".join(map(str, live_sample(writer, args.chunks, args.history)))],
            check=True, capture_output=True, text=True).stdout
    finally:
        writer.close()
    result = json.loads(out.strip().splitlines()[-1])
    print(f"join: opened in {result['open_s']:.2f} s, serves after {result['serves_s']:.2f} s "
          f"({result['us_per_live_chunk']:.1f} us per live chunk); RSS +"
          f"{result['rss_delta_bytes'] / 2**20:.0f} MiB "
          f"({result['bytes_per_live_chunk']:.0f} bytes per live chunk, "
          f"{result['settled_bytes_per_live_chunk']:.0f} {SETTLE_S:.0f} s later); "
          f"journals {journals / 2**20:.1f} MiB")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
