"""The worker of tests/robustness/test_robustness_concurrency.py: a ``ChunkStore`` doing
random put / get / remove on a directory tree that other processes use too.

Run as a ``multiprocessing`` (fork) child; ``DATA`` is built at import, before forking.
"""

from __future__ import annotations

import random
import time
from multiprocessing.connection import Connection
from pathlib import Path

from lmcache_nvme_backend.disk.format import file_size_for

from .chunks import NS, meta_for, payload_for, read
from .stores import open_store

PROCS = 4
DURATION_S = 4.0
KEYS = 48
TOTAL_BUDGET = 2 * 2**20
SIZES = (4096, 65_536 + 17, 150_000)
MAX_FILE = file_size_for(max(SIZES))


def size_of(i: int) -> int:
    return SIZES[i % len(SIZES)]


DATA = {i: payload_for(f"shared-{i}", size_of(i)) for i in range(KEYS)}


def worker(path: str, seed: int, native_io: str | None, conn: Connection) -> None:
    """Random operations for ``DURATION_S`` with a ``TOTAL_BUDGET / PROCS`` budget and
    ``nvme.native_io`` = ``native_io``; sends (verified reads served, wrong ones, stats
    snapshot) over ``conn``."""
    rng = random.Random(seed)
    store = open_store(path, max_size_gb=TOTAL_BUDGET / PROCS / 2**30,
                       manifest_interval_s=0.2, io_threads=2, native_io=native_io)
    served = wrong = 0
    deadline = time.monotonic() + DURATION_S
    while time.monotonic() < deadline:
        i = rng.randrange(KEYS)
        key = f"shared-{i}"
        op = rng.random()
        if op < 0.45:
            store.submit(key, NS, meta_for(size_of(i)), memoryview(DATA[i]), release=lambda: None)
        elif op < 0.9:
            if store.contains(key) and store.tensor_meta(key) is not None:
                got = read(store, key, size_of(i))
                if got is not None:
                    served += 1
                    wrong += got != DATA[i]
        elif op < 0.95:
            store.remove(key)
        else:
            store.flush(1)
    store.close()
    conn.send((served, wrong, store.stats_snapshot()))


def bytes_on_disk(root: Path) -> int:
    """Bytes of the chunk files (and temp files) under ``root/ns`` right now."""
    total = 0
    for p in (root / "ns").rglob("*"):
        try:
            if p.is_file() and p.name != "NAMESPACE":
                total += p.stat().st_size
        except OSError:
            pass  # removed or renamed while walking
    return total
