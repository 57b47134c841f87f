"""Four processes doing put / get / remove / LRU eviction on one directory tree.

What holds when several processes share a tree without the shared mode (each has its
own in-memory index and its own byte budget):

* a reader only serves a file after its header names the key and the payload checksum
  matches, and files are published by rename, so a reader never sees another process's
  partial file and never serves another key's bytes; a file removed or replaced by
  another process is a miss (and is forgotten);
* every chunk file in the tree is counted in the index of at least one process (the one
  whose rename put it there), so the bytes on disk never exceed the sum of the
  per-process budgets: give each process ``total / N`` (e.g. one per TP rank) and the
  tree stays within the total.  A process may over-count (a file it indexed was replaced
  or removed by another), never under-count;
* temp names carry host, pid and thread, so writers never share a temp file, and each
  process removes its own temp files on failure; ``close`` finishes or drops the queue.
"""

from __future__ import annotations

import multiprocessing
import random
import time
from multiprocessing.connection import Connection
from pathlib import Path

import pytest
from test_store import NS, meta_for, payload_for, read

from lmcache_nvme_backend.config import NVMeSettings
from lmcache_nvme_backend.disk.format import file_size_for
from lmcache_nvme_backend.store.chunk_store import ChunkStore

PROCS = 4
DURATION_S = 4.0
KEYS = 48
TOTAL_BUDGET = 2 * 2**20
SIZES = (4096, 65_536 + 17, 150_000)
MAX_FILE = file_size_for(max(SIZES))


def size_of(i: int) -> int:
    return SIZES[i % len(SIZES)]


DATA = {i: payload_for(f"shared-{i}", size_of(i)) for i in range(KEYS)}


def _worker(path: str, seed: int, conn: Connection) -> None:
    rng = random.Random(seed)
    store = ChunkStore(NVMeSettings.from_params({
        "path": path, "max_size_gb": TOTAL_BUDGET / PROCS / 2**30, "min_free_gb": 0,
        "manifest_interval_s": 0.2, "io_threads": 2}))
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


def _bytes_on_disk(root: Path) -> int:
    total = 0
    for p in (root / "ns").rglob("*"):
        try:
            if p.is_file() and p.name != "NAMESPACE":
                total += p.stat().st_size
        except OSError:
            pass  # removed or renamed while walking
    return total


@pytest.mark.timeout(60)
def test_four_processes_share_one_tree(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    ChunkStore(NVMeSettings.from_params({"path": str(cache), "max_size_gb": 0.01,
                                        "min_free_gb": 0})).close()
    ctx = multiprocessing.get_context("fork")
    pipes, procs = [], []
    for n in range(PROCS):
        parent, child = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_worker, args=(str(cache), n, child))
        proc.start()
        child.close()
        pipes.append(parent)
        procs.append(proc)
    peak = 0
    while any(p.is_alive() for p in procs):
        peak = max(peak, _bytes_on_disk(cache))
        time.sleep(0.02)
    results = [pipe.recv() for pipe in pipes]
    for proc in procs:
        proc.join(10)
        assert proc.exitcode == 0
    served = sum(r[0] for r in results)
    wrong = sum(r[1] for r in results)
    print(f"served {served} verified reads, {wrong} wrong; peak {peak} bytes on disk; "
          f"invalid files {sum(r[2]['invalid_files'] for r in results)}")
    assert wrong == 0
    assert served > 50  # the processes really read each other's and their own chunks
    # a sample can count a temp file and its renamed final once each: one chunk of slack
    assert peak <= TOTAL_BUDGET + MAX_FILE
    assert _bytes_on_disk(cache) <= TOTAL_BUDGET
    assert not [p for p in cache.rglob("*") if ".tmp-" in p.name]
    for r in results:
        assert r[2]["checksum_failures"] == 0
