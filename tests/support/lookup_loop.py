"""A shared-mode lookup loop between two marker system calls, for ``strace``
(tests/robustness/test_robustness_shared_budget.py).

``python -m support.lookup_loop CACHE N``: two members on CACHE, one publishes 200
chunks, the other looks up N keys (hits and misses alternating) between opening the
names ``/lookup-loop-begin`` and ``/lookup-loop-end`` (which do not exist), then prints
its thread id and the number of lookups.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from pathlib import Path

from .chunks import NS, put
from .stores import open_store

CHUNKS = 200
SIZE = 4096


def mark(name: str) -> None:
    with contextlib.suppress(OSError):
        open(f"/{name}")  # noqa: SIM115 - a visible marker in the trace, never opened


def main() -> None:
    cache, n = Path(sys.argv[1]), int(sys.argv[2])
    writer = open_store(cache, shared=True)
    reader = open_store(cache, shared=True)
    for i in range(CHUNKS):
        put(writer, f"chunk-{i}", SIZE)
    writer.flush(60)
    reader.refresh_shared()
    keys = [f"chunk-{i % CHUNKS}" if i % 2 == 0 else f"absent-{i}" for i in range(n)]
    mark("lookup-loop-begin")
    hits = sum(reader.lookup(key, NS) for key in keys)
    mark("lookup-loop-end")
    assert hits == (n + 1) // 2, (hits, n)
    print(threading.get_native_id(), n, flush=True)
    reader.close()
    writer.close()


if __name__ == "__main__":
    main()
