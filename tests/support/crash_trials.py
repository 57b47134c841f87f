"""The writer of tests/robustness/test_robustness_crash.py, killed at random points.

Run as a ``multiprocessing`` (fork) child.  Call ``data_of`` for every key before
forking, so that the children inherit the payloads instead of building them.
"""

from __future__ import annotations

import functools
import time
from multiprocessing.connection import Connection

from .chunks import NS, meta_for, payload_for
from .stores import open_store

KEYS = 200
SIZES = (4096, 70_000, 300_001, 1_048_576 + 5)


def size_of(key: str) -> int:
    return SIZES[int(key.rsplit("-", 1)[1]) % len(SIZES)]


@functools.cache
def data_of(key: str) -> bytes:
    return payload_for(key, size_of(key))  # built once, before forking


def writer(path: str, fsync: str, threads: int, conn: Connection) -> None:
    """Put ``t-0`` .. ``t-{KEYS-1}`` (removing some), sending each key whose publish
    completed over ``conn``; then ``done``, and wait to be killed."""
    store = open_store(path, manifest_interval_s=0.01, write_threads=threads, fsync=fsync,
                       io_threads=2)
    conn.send("ready")
    i = 0
    while i < KEYS:
        key = f"t-{i}"
        data = data_of(key)
        store.submit(key, NS, meta_for(len(data)), memoryview(data), release=lambda: None,
                     on_persisted=lambda k=key: conn.send(k))  # type: ignore[misc]
        if i % 8 == 7:
            store.flush(5)
        if i % 13 == 12:  # evictions and removals race with the kill too
            store.remove(f"t-{i - 5}")
        i += 1
    store.flush(30)
    conn.send("done")
    time.sleep(60)
