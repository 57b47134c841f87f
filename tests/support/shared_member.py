"""One member of a shared cache directory, for the shared-budget tests
(tests/robustness/test_robustness_shared_budget.py).

Run as ``python -m support.shared_member ROLE CACHE --budget-bytes N ...``:

``writer``  stores ``<prefix>-0``, ``<prefix>-1``, ... as fast as the store takes them for
            ``--seconds`` (with ``--chunks N``: until N are written, ``--seconds`` the
            limit; with ``--cycle N``: keys ``<prefix>-0`` to ``<prefix>-<N-1>`` over and
            over, each stored again once it was evicted); between batches it looks up
            and reads recent chunks of the members named in ``--peers`` (how far each
            got: ``--progress``) and compares every byte (with ``--until FILE``: it
            also stops once that file exists).
``hot``     stores ``--hot`` chunks, prints ``HOT``, then reads them again and again
            (lookup, read, compare) for ``--seconds`` (with ``--until FILE``: until that
            file exists, ``--seconds`` the limit).

It prints ``READY <member ids>`` once its store is open (and, with ``--go FILE``, starts
when that file exists, so that all members start together), and one JSON line at the end.
Payloads are a function of the key, so any member can check any chunk.  With ``--stats
FILE`` (the fault harness, ``support.fault_harness``) it rewrites FILE every 0.25 s with
its counts, the worst time of each public call (a call still running counted with its age:
``support.call_clock``), when it last stored a new chunk and read it back right, and when
it last saw an eviction; a writer then reads back its own newest chunk after every batch.
``--param NAME=VALUE`` adds a store setting (a number or a word).  With the store
of an older checkout on ``PYTHONPATH`` (no ``refresh_shared``) it runs just the same:
the benchmark's "before" column.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import random
import sys
import threading
import time
from pathlib import Path
from typing import Any

import lmcache_nvme_backend

from .call_clock import CallClock
from .chunks import NS, meta_for, read
from .stores import open_store

BATCH = 4
STATS_EVERY_S = 0.25
CLOCK = CallClock()
MARKS: dict[str, float] = {}  # time.monotonic() of the last roundtrip and eviction seen


@functools.lru_cache(maxsize=256)
def payload(key: str, size: int) -> bytes:
    return random.Random(key).randbytes(size)


def _store(args: argparse.Namespace) -> Any:
    return open_store(args.cache, shared=True, max_size_gb=args.budget_bytes / 2**30,
                      write_queue_mb=max(8, 4 * args.size // 2**20 + 1),
                      queue_full_policy="wait", io_threads=2, write_threads=1,
                      **dict(_setting(p) for p in args.param))


def _setting(text: str) -> tuple[str, Any]:
    name, _, value = text.partition("=")
    try:
        return name, float(value)
    except ValueError:
        return name, value


def _put(store: Any, key: str, size: int) -> None:
    data = memoryview(payload(key, size))
    with CLOCK.call("submit"):
        store.submit(key, NS, meta_for(size), data, release=lambda: None)


def _flush(store: Any) -> None:
    with CLOCK.call("flush"):
        store.flush(60)


def _check(store: Any, key: str, size: int, counts: dict[str, int], what: str) -> bool:
    """Look ``key`` up and, on a hit, read it and compare every byte; whether it was
    served right."""
    counts["lookups"] += 1
    with CLOCK.call("lookup"):
        found = store.lookup(key, NS)
    if not found:
        counts[f"{what}_misses"] += 1
        return False
    with CLOCK.call("load"):
        got = read(store, key, size)
    if got is None:
        counts[f"{what}_read_misses"] += 1  # deleted between lookup and read: a miss
        return False
    counts[f"{what}_served"] += 1
    wrong = got != payload(key, size)
    counts["wrong"] += wrong
    return not wrong


def writer(args: argparse.Namespace, store: Any, counts: dict[str, int]) -> None:
    peers = [p for p in args.peers.split(",") if p and p != args.prefix]
    rng = random.Random(args.prefix)
    deadline = time.monotonic() + args.seconds
    written = 0
    while time.monotonic() < deadline and (args.chunks is None or written < args.chunks) \
            and not (args.until is not None and args.until.exists()):
        for _ in range(BATCH):
            _put(store, f"{args.prefix}-{_key(written, args.cycle)}", args.size)
            written += 1
        _flush(store)
        counts["written"] = written
        if args.stats is not None and _check(
                store, f"{args.prefix}-{_key(written - 1, args.cycle)}", args.size, counts,
                "own"):
            MARKS["roundtrip_at"] = time.monotonic()
        if args.progress is not None:
            (args.progress / args.prefix).write_text(str(written))
        for _ in range(len(peers)):
            peer = rng.choice(peers)
            theirs = _progress(args.progress, peer, written)
            recent = rng.randrange(max(0, theirs - 24), max(1, theirs - 2))  # likely there
            _check(store, f"{peer}-{_key(recent, args.cycle)}", args.size, counts, "peer")
    counts["written"] = written


def _key(n: int, cycle: int | None) -> int:
    return n % cycle if cycle else n


def _progress(directory: Path | None, peer: str, default: int) -> int:
    """How many chunks ``peer`` has written (it says so in ``directory``)."""
    try:
        return int((directory / peer).read_text()) if directory is not None else default
    except (OSError, ValueError):
        return default


def hot(args: argparse.Namespace, store: Any, counts: dict[str, int]) -> None:
    keys = [f"{args.prefix}-hot-{i}" for i in range(args.hot)]
    for key in keys:
        _put(store, key, args.size)
    _flush(store)
    print("HOT", flush=True)
    deadline = time.monotonic() + args.seconds
    while time.monotonic() < deadline and not (args.until is not None and args.until.exists()):
        for key in keys:
            _check(store, key, args.size, counts, "hot")
        time.sleep(args.pause)
    counts["written"] = len(keys)


def _report(path: Path, store: Any, counts: dict[str, int], stop: threading.Event) -> None:
    """Rewrite ``path`` (by rename) with the figures every ``STATS_EVERY_S`` until the end
    (the clock's part, which shows a hung ``close()``, after ``stop`` too)."""
    evictions = 0.0
    while True:
        if not stop.is_set():
            seen = store.counter("evictions")
            if seen > evictions:
                evictions, MARKS["evicted_at"] = seen, time.monotonic()
        figures = {**counts, **CLOCK.snapshot(), **MARKS, "evictions": evictions,
                   "at": time.monotonic()}
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(figures))
        os.replace(tmp, path)
        time.sleep(STATS_EVERY_S)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m support.shared_member")
    parser.add_argument("role", choices=["writer", "hot"])
    parser.add_argument("cache", type=Path)
    parser.add_argument("--budget-bytes", type=int, required=True)
    parser.add_argument("--size", type=int, default=1 << 20)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--prefix", required=True)
    parser.add_argument("--peers", default="")
    parser.add_argument("--hot", type=int, default=8)
    parser.add_argument("--pause", type=float, default=0.05)
    parser.add_argument("--chunks", type=int, help="writer: stop once this many are written")
    parser.add_argument("--cycle", type=int, help="writer: store keys 0 to N-1 over and over")
    parser.add_argument("--until", type=Path, help="stop once this file exists")
    parser.add_argument("--go", type=Path, help="start once this file exists")
    parser.add_argument("--progress", type=Path,
                        help="directory where writers say how far they got")
    parser.add_argument("--stats", type=Path, help="rewrite this file with the figures "
                        f"every {STATS_EVERY_S} s")
    parser.add_argument("--param", action="append", default=[], metavar="NAME=VALUE",
                        help="a store setting (repeatable)")
    args = parser.parse_args()
    counts = dict.fromkeys(["lookups", "wrong", "written", "peer_served", "peer_misses",
                            "peer_read_misses", "hot_served", "hot_misses",
                            "hot_read_misses", "own_served", "own_misses",
                            "own_read_misses"], 0)
    with CLOCK.call("open"):
        store = _store(args)
    stop = threading.Event()
    if args.stats is not None:
        threading.Thread(target=_report, args=(args.stats, store, counts, stop),
                         daemon=True).start()
    ids = store.shared_members() if hasattr(store, "shared_members") else []
    print("READY", " ".join(ids), flush=True)
    deadline = time.monotonic() + 300
    while args.go is not None and not args.go.exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    started = time.monotonic()
    (writer if args.role == "writer" else hot)(args, store, counts)
    seconds = time.monotonic() - started
    snap = store.stats_snapshot()
    stop.set()  # the store's counters are not read once it closes
    with CLOCK.call("close"):
        store.close()
    result: dict[str, Any] = {"prefix": args.prefix, "role": args.role, "seconds": seconds,
                              "package": str(Path(lmcache_nvme_backend.__file__).parent),
                              "write_mb_s": counts["written"] * args.size / seconds / 1e6,
                              **counts, **CLOCK.snapshot()}
    for key in ("capacity_drops", "evictions", "shared_transfers", "shared_adopted",
                "write_failures", "queue_full_drops", "ledger_conflicts", "ledger_updates"):
        result[key] = snap.get(key, 0)
    print(json.dumps(result), flush=True)
    sys.exit(0)


if __name__ == "__main__":
    main()
