"""One "node" of the shared-mode test on a network filesystem (tests/robustness/
test_robustness_nfs.py), run as ``python -m support.shared_node ROLE DIR``.

``writer``  stores ``node-0`` .. ``node-<N-1>`` in shared mode, flushing every batch, and
            touches ``DIR/writer.done`` when it has published them all.
``reader``  until the writer is done (and one pass more): looks every key up in shared
            mode (adopting what the writer published), reads and compares the bytes,
            removes (evicts) every fifth chunk it served, and restarts its store (close,
            open) every ``RESTART_EVERY`` passes.

Each prints one JSON line of counts and timings when it ends.
"""

from __future__ import annotations

import argparse
import functools
import json
import random
import time
from pathlib import Path

from .chunks import NS, meta_for, read
from .stores import open_store

CHUNKS = 48
SIZE = 1024 * 1024 + 123
BATCH = 8
RESTART_EVERY = 3


@functools.lru_cache(maxsize=CHUNKS)
def node_payload(key: str) -> bytes:
    """Key-specific bytes (fast to make: the timings measure the store, not this)."""
    return random.Random(key).randbytes(SIZE)


def writer(cache: Path, marker: Path) -> dict[str, float]:
    store = open_store(cache, shared=True, write_queue_mb=64)
    payloads = [node_payload(f"node-{i}") for i in range(CHUNKS)]
    started = time.perf_counter()
    for start in range(0, CHUNKS, BATCH):
        for i in range(start, min(CHUNKS, start + BATCH)):
            store.submit(f"node-{i}", NS, meta_for(SIZE), memoryview(payloads[i]),
                         release=lambda: None)
        store.flush(60)
    seconds = time.perf_counter() - started
    written = store.counter("writes_completed")
    store.close()
    marker.touch()
    return {"written": written, "write_seconds": seconds,
            "write_mb_s": written * SIZE / seconds / 1e6 if seconds else 0.0}


def reader(cache: Path, marker: Path, deadline_s: float) -> dict[str, float]:
    store = open_store(cache, shared=True)
    served = wrong = misses = removed = restarts = passes = 0
    read_bytes = 0
    read_seconds = 0.0
    last_pass = False
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        last_pass = marker.exists()
        for i in range(CHUNKS):
            key = f"node-{i}"
            if not store.lookup(key, NS):
                misses += 1
                continue
            started = time.perf_counter()
            got = read(store, key, SIZE)
            read_seconds += time.perf_counter() - started
            if got is None:
                misses += 1
                continue
            served += 1
            read_bytes += len(got)
            wrong += got != node_payload(key)
            if served % 5 == 0 and store.remove(key):
                removed += 1
        passes += 1
        time.sleep(0.01)
        if passes % RESTART_EVERY == 0:
            store.close()
            store = open_store(cache, shared=True)
            restarts += 1
        if last_pass:
            break
    store.close()
    return {"served": served, "wrong": wrong, "misses": misses, "removed": removed,
            "restarts": restarts, "passes": passes, "finished": float(last_pass),
            "read_mb_s": read_bytes / read_seconds / 1e6 if read_seconds else 0.0}


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m support.shared_node")
    parser.add_argument("role", choices=["writer", "reader"])
    parser.add_argument("cache", type=Path)
    parser.add_argument("--marker", type=Path, required=True)
    parser.add_argument("--deadline-s", type=float, default=120.0)
    args = parser.parse_args()
    if args.role == "writer":
        result = writer(args.cache, args.marker)
    else:
        result = reader(args.cache, args.marker, args.deadline_s)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
