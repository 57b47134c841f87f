"""``ChunkStore`` writers (and the layout's digests) in a child process.

``python -m support.store_child writer CACHE_DIR``
    puts ``shared-0`` .. ``shared-19`` and closes (two of these race on one tree).
``python -m support.store_child crash-writer CACHE_DIR``
    publishes ``crash-0``, prints ``writing``, then puts ``crash-1``, ``crash-2``, ...
    until it is killed.
``python -m support.store_child digests KEY...``
    prints ``key_digest(k) + namespace_id(k)`` of each KEY, space-separated.
"""

from __future__ import annotations

import argparse
import itertools

from lmcache_nvme_backend.disk.layout import key_digest, namespace_id

from .chunks import put
from .stores import open_store

CRASH_CHUNK = 3 * 1024 * 1024 + 7


def writer(cache_dir: str) -> None:
    store = open_store(cache_dir)
    for i in range(20):
        put(store, f"shared-{i}")
    store.close()


def crash_writer(cache_dir: str) -> None:
    store = open_store(cache_dir, manifest_interval_s=0.05, write_threads=2)
    put(store, "crash-0", CRASH_CHUNK)
    store.flush(30)  # at least one chunk is published before the kill
    print("writing", flush=True)
    for i in itertools.count(1):
        put(store, f"crash-{i}", CRASH_CHUNK)


def digests(keys: list[str]) -> None:
    print(*[key_digest(k) + namespace_id(k) for k in keys])


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m support.store_child")
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser("writer").add_argument("cache_dir")
    sub.add_parser("crash-writer").add_argument("cache_dir")
    sub.add_parser("digests").add_argument("keys", nargs="*")
    args = parser.parse_args()
    if args.cmd == "writer":
        writer(args.cache_dir)
    elif args.cmd == "crash-writer":
        crash_writer(args.cache_dir)
    else:
        digests(args.keys)


if __name__ == "__main__":
    main()
