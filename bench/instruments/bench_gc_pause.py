"""How long a full collection of Python's cycle collector holds the GIL once the tier knows
many chunks: with the index's entries (and the L2 adapter's stored keys) tracked, as
before, and untracked (``native.gc_untrack``), as now.

A full collection visits every object the collector tracks, with the GIL held: the whole
engine (vLLM's scheduler, an ``lmcache server``'s controllers) stops for that long.  It
runs whenever the objects that survived since the last one reach a quarter of those that
survived it, so in a process that stores chunks for hours it comes back, each time as long
as the process has tracked objects.  A tier of 8 drives of 4 TB holds 16 million 2 MiB
chunks: one entry each in the index, and one stored key each in the L2 adapter.

Each measurement is a fresh child process (order rotated each repetition):

* ``index``: a :class:`Catalog` given ``--entries`` chunks through ``publish_many``, the
  write path's own call, in tasks of 8 (no files: the index alone);
* ``l2``: a real ``NVMeL2Adapter`` storing ``--chunks`` chunks of 4 KiB through LMCache's
  L2 interface (``submit_store_task``, event fd, ``pop_completed_store_tasks``), files on
  the drive under ``path``.

The child times ``gc.collect()`` five times before filling (the process's own floor) and
five times after; the figure is the median after, less the median before::

    LMCACHE_TRACK_USAGE=false python bench/instruments/bench_gc_pause.py /path/on/the/drive
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import select
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

VARIANTS = ("tracked", "untracked")
COLLECTIONS = 5


def collection_ms() -> float:
    """Median milliseconds of a full collection, over ``COLLECTIONS`` of them."""
    times = []
    for _ in range(COLLECTIONS):
        started = time.perf_counter()
        gc.collect()
        times.append((time.perf_counter() - started) * 1e3)
    return statistics.median(times)


def keep_tracking(part: str) -> None:
    """The code as it was: nothing is untracked."""
    from lmcache_nvme_backend.store import index

    def tracked(*objs: object) -> None:
        return None

    index.gc_untrack = tracked
    if part == "l2":
        from lmcache_nvme_backend.adapters import l2_adapter

        l2_adapter.gc_untrack = tracked  # type: ignore[attr-defined]


def prepare_index(entries: int) -> Callable[[], object]:
    """A catalog; the call that publishes ``entries`` chunks into it."""
    from lmcache_nvme_backend.disk.format import TensorMeta
    from lmcache_nvme_backend.store.catalog import Catalog
    from lmcache_nvme_backend.store.index import IndexEntry

    meta = TensorMeta(shapes=((1 << 21,),), dtypes=("uint8",), fmt=1, nbytes=1 << 21)
    catalog = Catalog([1 << 62])
    size = (1 << 21) + 4096

    def fill() -> object:
        for start in range(0, entries, 8):
            catalog.publish_many([(IndexEntry(f"{i:032x}", "0" * 16, 0, size, meta, i), 0)
                                  for i in range(start, min(start + 8, entries))])
        return catalog

    return fill


def prepare_l2(chunks: int, directory: Path) -> Callable[[], object]:
    """An adapter that has stored one task (what starting it makes is in the floor); the
    call that stores ``chunks`` more through it."""
    from lmcache.cli.commands.bench.l2_adapter_bench.data import (
        make_aligned_tensor,
        make_memory_objects,
        make_object_keys,
    )
    from lmcache.v1.platform import consume_fd

    from lmcache_nvme_backend.adapters.l2_adapter import NVMeL2Adapter

    nbytes, per_task = 4096, 64
    adapter = NVMeL2Adapter({"path": str(directory), "max_size_gb": 64, "min_free_gb": 0})
    objs = make_memory_objects(make_aligned_tensor(per_task * nbytes, nbytes), per_task,
                               nbytes, 0)
    poller = select.poll()
    poller.register(adapter.get_store_event_fd(), select.POLLIN)

    def store(first: int, count: int) -> None:
        keys = make_object_keys(count, key_offset=first)
        task = adapter.submit_store_task(keys, objs[:count])
        done: dict[int, Any] = {}
        while task not in done:
            poller.poll(60_000)
            consume_fd(adapter.get_store_event_fd())
            done.update(adapter.pop_completed_store_tasks())
        if not done[task].is_successful():
            raise SystemExit(f"the store task at chunk {first} failed")

    store(chunks, per_task)  # keys past the measured ones

    def fill() -> object:
        for start in range(0, chunks, per_task):
            store(start, min(per_task, chunks - start))
        adapter.store.flush()
        return adapter

    return fill


def child(args: argparse.Namespace) -> None:
    fill = prepare_l2(args.chunks, args.dir) if args.part == "l2" else \
        prepare_index(args.entries)
    if args.variant == "tracked":
        keep_tracking(args.part)
    gc.collect()
    before = collection_ms()
    started = time.perf_counter()
    kept = fill()
    filled_s = time.perf_counter() - started
    after = collection_ms()
    print("RESULT " + json.dumps({"before_ms": before, "after_ms": after,
                                  "pause_ms": after - before, "fill_s": filled_s,
                                  "kept": type(kept).__name__}))
    os._exit(0)  # a clean close of millions of objects is not what is measured


def run_child(args: argparse.Namespace, part: str, variant: str) -> dict[str, float]:
    directory = args.path / f"gc-{part}-{variant}"
    shutil.rmtree(directory, ignore_errors=True)
    env = dict(os.environ, LMCACHE_TRACK_USAGE="false")
    command = [sys.executable, str(Path(__file__).resolve()), "--child", "--part", part,
               "--variant", variant, "--entries", str(args.entries), "--chunks",
               str(args.chunks), "--dir", str(directory)]
    r = subprocess.run(command, env=env, capture_output=True, text=True)
    shutil.rmtree(directory, ignore_errors=True)
    found = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
    if r.returncode != 0 or not found:
        raise SystemExit(f"{part} {variant}: the child failed (rc {r.returncode}):\n"
                         f"{r.stderr[-3000:]}")
    return dict(json.loads(found[0][len("RESULT "):]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("path", type=Path, nargs="?", default=Path("."),
                        help="where the l2 part writes its chunk files")
    parser.add_argument("--parts", default="index,l2")
    parser.add_argument("--entries", type=int, default=1_000_000,
                        help="chunks in the index (index part)")
    parser.add_argument("--chunks", type=int, default=100_000,
                        help="chunks stored through the L2 adapter (l2 part)")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--part", help=argparse.SUPPRESS)
    parser.add_argument("--variant", help=argparse.SUPPRESS)
    parser.add_argument("--dir", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    args.path.mkdir(parents=True, exist_ok=True)
    results: dict[tuple[str, str], list[dict[str, float]]] = {}
    for rep in range(args.repeat):
        for part in args.parts.split(","):
            order = VARIANTS if rep % 2 == 0 else VARIANTS[::-1]
            for variant in order:
                r = run_child(args, part, variant)
                results.setdefault((part, variant), []).append(r)
                print(f"rep {rep + 1} {part} {variant}: full collection {r['after_ms']:.1f} ms "
                      f"({r['before_ms']:.1f} before filling), filled in {r['fill_s']:.1f} s",
                      flush=True)
    print("\n| part | chunks | variant | full collection, ms (more than before filling) "
          "| per million chunks, ms | fill s |")
    print("|---|---|---|---|---|---|")
    for (part, variant), rs in results.items():
        n = args.entries if part == "index" else args.chunks
        pause = statistics.median(r["pause_ms"] for r in rs)
        spread = f"{min(r['pause_ms'] for r in rs):.1f}-{max(r['pause_ms'] for r in rs):.1f}"
        print(f"| {part} | {n:,} | {variant} | {pause:.1f} ({spread}) | "
              f"{pause * 1e6 / n:.0f} | {statistics.median(r['fill_s'] for r in rs):.1f} |")


if __name__ == "__main__":
    main()
