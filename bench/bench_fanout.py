"""Directory fan-out at millions of files: what a cold open and a new chunk cost per layout.

For each layout, ``--files`` empty chunk files are created (names are xxh3-128 digests,
like the store's), the page cache is dropped, and then, interleaved by layout and
repeated, the benchmark times

* a cold open: ``open`` + ``fstat`` + ``close`` of a random existing file (the path walk
  reads the directory blocks it has not cached: the cost a cold read pays before any
  data moves), and
* a new chunk: ``mkdir -p`` of its shard directory (when missing), create the temp file,
  ``rename`` into place (the metadata part of a store).

Layouts (under one namespace directory, as the store writes them):

* ``2x256``  ``<aa>/<bb>/<d32>.kv``: 65 536 leaf directories (the format's layout);
* ``1x4096`` ``<abc>/<d32>.kv``: 4 096 directories;
* ``1x256``  ``<aa>/<d32>.kv``: 256 directories;
* ``flat``   ``<d32>.kv``: one directory (LMCache's ``fs_native``; for reference).

    sudo python bench/bench_fanout.py /path/on/the/drive --files 2000000

Needs root to drop the page cache.  Uses about ``files x layouts`` inodes; the tree is
removed at the end (that takes a while too).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import sys
import time
from pathlib import Path

import xxhash
from bench_l2 import drop_caches as drop_page_cache  # this directory: run as a script

LAYOUTS = {
    "2x256": lambda d: (d[0:2], d[2:4]),
    "1x4096": lambda d: (d[0:3],),
    "1x256": lambda d: (d[0:2],),
    "flat": lambda d: (),
}


def digest(i: int, salt: str) -> str:
    return xxhash.xxh3_128_hexdigest(f"{salt}-{i}".encode())


def path_of(root: Path, layout: str, d: str) -> Path:
    return root.joinpath(*LAYOUTS[layout](d), d + ".kv")


def populate(root: Path, layout: str, files: int) -> None:
    made: set[Path] = set()
    started = time.perf_counter()
    for i in range(files):
        path = path_of(root, layout, digest(i, "existing"))
        if path.parent not in made:
            path.parent.mkdir(parents=True, exist_ok=True)
            made.add(path.parent)
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
        if i and i % 500_000 == 0:
            print(f"  {layout}: {i} files, {time.perf_counter() - started:.0f} s",
                  file=sys.stderr, flush=True)


def drop_caches() -> None:
    if not drop_page_cache():
        sys.exit("bench_fanout.py: cannot drop the page cache (run it as root)")


def cold_opens(root: Path, layout: str, files: int, samples: int, seed: int) -> list[float]:
    rng = random.Random(seed)
    out = []
    for _ in range(samples):
        path = path_of(root, layout, digest(rng.randrange(files), "existing"))
        started = time.perf_counter()
        fd = os.open(path, os.O_RDONLY)
        os.fstat(fd)
        os.close(fd)
        out.append(time.perf_counter() - started)
    return out


def new_chunks(root: Path, layout: str, samples: int, rep: int) -> list[float]:
    out = []
    for i in range(samples):
        final = path_of(root, layout, digest(i, f"new-{rep}"))
        tmp = final.with_name(final.name + ".tmp")
        started = time.perf_counter()
        final.parent.mkdir(parents=True, exist_ok=True)
        os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
        os.rename(tmp, final)
        out.append(time.perf_counter() - started)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("path", type=Path)
    parser.add_argument("--files", type=int, default=2_000_000)
    parser.add_argument("--layouts", default="2x256,1x4096,1x256")
    parser.add_argument("--samples", type=int, default=2000)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    layouts = args.layouts.split(",")
    roots = {layout: args.path / f"fanout-{layout}" for layout in layouts}
    results: dict[str, dict[str, list[float]]] = {k: {"open": [], "new": []} for k in layouts}
    try:
        for layout in layouts:
            shutil.rmtree(roots[layout], ignore_errors=True)
            started = time.perf_counter()
            populate(roots[layout], layout, args.files)
            print(f"{layout}: {args.files} files in {time.perf_counter() - started:.0f} s",
                  file=sys.stderr, flush=True)
        for rep in range(args.reps):
            order = layouts[rep % len(layouts):] + layouts[: rep % len(layouts)]
            for layout in order:
                drop_caches()
                results[layout]["open"] += cold_opens(roots[layout], layout, args.files,
                                                      args.samples, seed=rep)
                drop_caches()
                results[layout]["new"] += new_chunks(roots[layout], layout, args.samples, rep)
    finally:
        for root in roots.values():
            shutil.rmtree(root, ignore_errors=True)
    print(f"{args.files} files per layout, {args.reps} x {args.samples} samples, page cache "
          "dropped before each batch; milliseconds")
    print("| layout | cold open p50 | p90 | p99 | new chunk (mkdir + create + rename) p50 "
          "| p90 | p99 |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for layout in layouts:
        row = [layout]
        for op in ("open", "new"):
            values = sorted(results[layout][op])
            row += [f"{statistics.median(values) * 1e3:.3f}",
                    f"{values[int(0.9 * len(values))] * 1e3:.3f}",
                    f"{values[int(0.99 * len(values))] * 1e3:.3f}"]
        print("| " + " | ".join(row) + " |")
    if args.json:
        args.json.write_text(json.dumps({"files": args.files, "results": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
