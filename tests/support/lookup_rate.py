"""Shared-mode lookups per second, hits and misses.

``python -m support.lookup_rate CACHE N``: one member publishes 200 chunks, another looks
up N keys it has and N it has not, and prints one JSON line.  Runs with earlier versions
of the store too (no ``refresh_shared``: a lookup looked on disk then).  Run by hand: no
test runs it; the lookup rates in docs/benchmarks.md (shared mode) were taken with it, by
a script removed once they were recorded (docs/development-log.md says where it is).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from .chunks import NS, put
from .stores import open_store

CHUNKS = 200


def main() -> None:
    cache, n = Path(sys.argv[1]), int(sys.argv[2])
    writer = open_store(cache, shared=True)
    reader = open_store(cache, shared=True)
    for i in range(CHUNKS):
        put(writer, f"chunk-{i}", 4096)
    writer.flush(60)
    if hasattr(reader, "refresh_shared"):
        reader.refresh_shared()
    hits = [f"chunk-{i % CHUNKS}" for i in range(n)]
    misses = [f"absent-{i}" for i in range(n)]
    assert all(reader.lookup(key, NS) for key in hits[:CHUNKS])  # warm (adopted, if so)
    rates = {}
    for what, keys, expected in (("hits", hits, n), ("misses", misses, 0)):
        started = time.perf_counter()
        found = sum(reader.lookup(key, NS) for key in keys)
        rates[f"{what}_per_s"] = n / (time.perf_counter() - started)
        assert found == expected, (what, found)
    reader.close()
    writer.close()
    print(json.dumps({"lookups": n, **rates}), flush=True)


if __name__ == "__main__":
    main()
