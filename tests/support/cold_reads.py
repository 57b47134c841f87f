"""Cold reads of a shared directory.

``python -m support.cold_reads write CACHE N`` stores N chunks of 1 MiB in shared mode;
``python -m support.cold_reads read CACHE N`` (a new process, after the page cache was
dropped) looks each up and reads it in batches of 16, compares every byte outside the
timed reads, and prints one JSON line with the GB/s of the reads.  Run by hand: no test
runs it; the cold reads in docs/development-log.md (shared mode, local against GlusterFS)
were taken with it, by a script removed once they were recorded (that page says where it
is).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from lmcache_nvme_backend.store.chunk_store import ChunkRead

from .chunks import NS, meta_for
from .shared_member import payload
from .stores import open_store

SIZE = 1 << 20
BATCH = 16


def main() -> None:
    role, cache, n = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
    store = open_store(cache, shared=True, max_size_gb=4 * n * SIZE / 2**30,
                       write_queue_mb=256, queue_full_policy="wait")
    keys = [f"cold-{i}" for i in range(n)]
    if role == "write":
        for key in keys:
            store.submit(key, NS, meta_for(SIZE), memoryview(payload(key, SIZE)),
                         release=lambda: None)
        store.flush(600)
        written = store.counter("writes_completed")
        store.close()
        print(json.dumps({"written": written}), flush=True)
        return
    bufs = [bytearray(SIZE + 8192) for _ in range(BATCH)]
    seconds = 0.0
    served = wrong = 0
    for start in range(0, n, BATCH):
        batch = [k for k in keys[start:start + BATCH] if store.lookup(k, NS)]
        reads = [ChunkRead(k, memoryview(b)) for k, b in zip(batch, bufs, strict=False)]
        began = time.perf_counter()
        ok = store.read_into(reads)
        seconds += time.perf_counter() - began
        for key, buf, good in zip(batch, bufs, ok, strict=False):
            served += good
            wrong += good and bytes(buf[:SIZE]) != payload(key, SIZE)
    store.close()
    print(json.dumps({"chunks": served, "size": SIZE, "wrong": wrong, "seconds": seconds,
                      "gb_s": served * SIZE / seconds / 1e9 if seconds else 0.0}), flush=True)


if __name__ == "__main__":
    main()
