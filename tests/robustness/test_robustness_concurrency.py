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
import time
from pathlib import Path

import pytest
from support.shared_tree import MAX_FILE, PROCS, TOTAL_BUDGET, worker
from support.shared_tree import bytes_on_disk as _bytes_on_disk
from support.stores import StoreFactory


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_four_processes_share_one_tree(tmp_path: Path, open_store: StoreFactory,
                                      native_io: str | None) -> None:
    cache = tmp_path / "cache"
    open_store(cache, max_size_gb=0.01, manifest_interval_s=None).close()
    ctx = multiprocessing.get_context("fork")
    pipes, procs = [], []
    for n in range(PROCS):
        parent, child = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=worker, args=(str(cache), n, native_io, child))
        proc.start()
        child.close()
        pipes.append(parent)
        procs.append(proc)
    peak = 0
    while any(p.is_alive() for p in procs):
        peak = max(peak, _bytes_on_disk(cache))
        time.sleep(0.02)
    assert [proc.exitcode for proc in procs] == [0] * PROCS
    results = [pipe.recv() for pipe in pipes]
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
