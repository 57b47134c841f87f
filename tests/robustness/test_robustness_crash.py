"""Crash safety: a writer process killed with SIGKILL at random points, 60 times.

Each trial forks a writer (forking the already-imported test process keeps a trial
to a few tens of milliseconds).  The writer reports every key whose publish completed
(``on_persisted``: after the rename, and the directory fsync under ``fsync: full``)
over a pipe, and is killed at a random moment.  A process crash (not a power loss)
keeps the page cache, so under every fsync policy each reported key must be found
after reopening, and nothing corrupt or partial may ever be served.
"""

from __future__ import annotations

import multiprocessing
import os
import random
import signal
import time
from pathlib import Path

import pytest
from support.chunks import meta_for, read
from support.crash_trials import KEYS, data_of, size_of
from support.crash_trials import writer as _writer
from support.stores import StoreFactory

from lmcache_nvme_backend.disk.layout import RootLayout

TRIALS = 60


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_sigkill_at_random_points_never_serves_a_bad_chunk(tmp_path: Path,
                                                           open_store: StoreFactory) -> None:
    rng = random.Random(1234)
    ctx = multiprocessing.get_context("fork")
    total_published = total_found = 0
    for i in range(KEYS):
        data_of(f"t-{i}")
    for trial in range(TRIALS):
        cache = tmp_path / f"c{trial % 4}"  # reuse trees: recovery of an already-crashed tree
        fsync = ("none", "data", "full")[trial % 3]
        parent, child = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_writer, args=(str(cache), fsync, 1 + trial % 2, child))
        proc.start()
        child.close()
        assert parent.poll(20) and parent.recv() == "ready"
        deadline = time.monotonic() + rng.uniform(0.01, 0.3)
        published: set[str] = set()
        while time.monotonic() < deadline:
            if parent.poll(0.002):
                published.add(parent.recv())
        published.discard("done")
        os.kill(proc.pid or 0, signal.SIGKILL)
        proc.join(10)
        while parent.poll():  # everything sent before the kill
            try:
                published.add(parent.recv())
            except (EOFError, OSError):
                break
        published.discard("done")
        parent.close()
        assert proc.exitcode == -signal.SIGKILL

        store = open_store(cache)
        try:
            assert not list(RootLayout(cache).iter_temp_files())
            for loc in RootLayout(cache).iter_chunks():
                assert loc.path.stat().st_size % 4096 == 0
            # every key written so far in this tree: served only with its exact bytes
            for i in range(KEYS):
                key = f"t-{i}"
                if not store.contains(key):
                    continue
                total_found += 1
                assert store.tensor_meta(key) == meta_for(size_of(key))
                assert read(store, key, size_of(key)) == data_of(key)
            assert store.counter("invalid_files") == 0
            assert store.counter("checksum_failures") == 0
            # every published key is found (the budget is never reached, so nothing is
            # evicted), except ones the writer itself removed afterwards
            lost = [k for k in published if not store.contains(k)
                    and int(k.rsplit("-", 1)[1]) % 13 != 7]
            assert not lost, (trial, fsync, sorted(lost)[:5])
            assert store.counter("evictions") == 0
            total_published += len(published)
        finally:
            store.close()
    assert total_published > TRIALS  # the kills did land after real publishes
    print(f"{TRIALS} trials, {total_published} publishes reported, {total_found} found")
