"""Seeded fuzzing of a real cache tree (docs/robustness.md, "Hostile trees").

Each case copies a tree written by a real store, applies one to three random mutations
(``support.fuzz_tree``: payload, header, metadata JSON, manifest, file types, links, modes,
swaps, temp files), then starts a store on it (plain or shared mode), looks up, reads and
writes every key, and runs ``verify``, ``inspect`` and ``gc``.  Asserted for every case:
no exception escapes, nothing blocks (FIFOs are planted), no wrong byte is served, nothing
outside the cache root is created, changed or chmodded, and every chunk no mutation
touched keeps serving.  Rerun one case with ``FUZZ_SEED=<seed> FUZZ_CASES=1``.
"""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path

import pytest
from support.chunks import NS, meta_for, payload_for, put, read
from support.fuzz_tree import ALL, MUTATIONS, Tree, make_outside
from support.hostile import chunk_path, fifo_guard, finishes, run_cli, snapshot
from support.stores import StoreFactory
from support.stores import open_store as open_plain_store

from lmcache_nvme_backend.store.chunk_store import ChunkStore

pytestmark = pytest.mark.timeout(300)

SEED = int(os.environ.get("FUZZ_SEED", "20261123"))
CASES = int(os.environ.get("FUZZ_CASES", "520"))
KEYS = [f"fuzz-{i}" for i in range(6)]
SIZES = {key: 4096 * (i % 3) + 100 * i + 1 for i, key in enumerate(KEYS)}


def _exercise(store: ChunkStore, tree: Tree, rng: random.Random) -> list[str]:
    """Lookups, metadata, reads and writes of every key; returns the problems found."""
    problems = []
    order = list(KEYS)
    rng.shuffle(order)
    for key in order:
        intact = key not in tree.touched and ALL not in tree.touched
        # a manifest's metadata that its header denies costs one miss, then serves
        for _attempt in range(2 if intact else 1):
            store.lookup(key, NS, pin=rng.random() < 0.3)
            store.tensor_meta(key)
            got = read(store, key, SIZES[key])
            if got is not None:
                break
        if got is not None and got != payload_for(key, SIZES[key]):
            problems.append(f"{key}: wrong bytes served")
        if got is not None and store.tensor_meta(key) != meta_for(SIZES[key]):
            problems.append(f"{key}: served with metadata {store.tensor_meta(key)}")
        if intact and got is None:
            problems.append(f"{key}: intact chunk not served")
    put(store, "fresh", 5000)
    store.flush(10)
    got = read(store, "fresh", 5000)
    if got is not None and got != payload_for("fresh", 5000):
        problems.append("fresh: wrong bytes served")
    return problems


def _outside(base: Path, outside: Path) -> None:
    make_outside(outside, chunk_path(base, KEYS[0]).read_bytes())
    for key in KEYS:  # what a shard linked out of the tree would find
        shutil.copy(chunk_path(base, key), outside / "shard" / chunk_path(base, key).name)


def _case(base: Path, work: Path, seed: int, applied: dict[str, int]) -> str:
    """One fuzz case; returns "" or what went wrong (``applied`` counts the mutations)."""
    rng = random.Random(seed)
    root, outside = work / "cache", work / "outside"
    shutil.copytree(base, root, symlinks=True)
    _outside(base, outside)
    tree = Tree(root, KEYS, outside, rng)
    for mutate in rng.sample(MUTATIONS, rng.randint(1, 3)):
        try:
            mutate(tree)
            tree.applied.append(mutate.__name__)
        except OSError:  # an earlier mutation removed what this one works on
            tree.applied.append(f"{mutate.__name__} (could not)")
    for name in tree.applied:
        applied[name] = applied.get(name, 0) + 1
    shared = rng.random() < 0.4
    before = snapshot(outside)  # after the mutations (which may write through their links)

    def run() -> list[str]:
        store = open_plain_store(root, shared=shared, io_threads=2)
        try:
            problems = _exercise(store, tree, rng)
        finally:
            store.close()
        for args in (["verify", root], ["inspect", root],
                     ["gc", root, "--temp", "--purge-quarantine", "--max-size-gb", "1"]):
            status, _out, err = run_cli(*args)
            if status not in (0, 1) or "Traceback" in err:
                problems.append(f"{args[0]} exited {status}: {err[-300:]}")
        return problems

    with fifo_guard(tree.fifos):
        done, result = finishes(run, timeout_s=30)
    if not done:
        return f"seed {seed} {tree.applied}: blocked"
    if isinstance(result, BaseException):
        return f"seed {seed} {tree.applied}: raised {type(result).__name__}: {result}"
    after = snapshot(outside)
    if after != before:
        changed = sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))
        result.append(f"outside the cache root changed: {changed}")
    if result:
        return f"seed {seed} {tree.applied} shared={shared}: {'; '.join(result)}"
    return ""


def test_fuzzed_cache_trees_never_raise_block_leak_or_serve_a_wrong_byte(
        tmp_path: Path, open_store: StoreFactory) -> None:
    base = tmp_path / "base"
    store = open_store(base)
    for key in KEYS:
        put(store, key, SIZES[key])
    assert store.flush(10)
    store.close()
    failures = []
    applied: dict[str, int] = {}
    for case in range(CASES):
        work = tmp_path / f"case-{case}"
        failure = _case(base, work, SEED + case, applied)
        if failure:
            failures.append(failure)
        shutil.rmtree(work, ignore_errors=True)
        if len(failures) >= 10:
            break
    assert not failures, f"{len(failures)} failing cases:\n" + "\n".join(failures)
    print(f"\n{CASES} fuzz cases from seed {SEED}; mutations applied: "
          + ", ".join(f"{name} {n}" for name, n in sorted(applied.items())))
    if CASES >= 500:  # every kind of mutation was tried many times
        assert all(applied.get(m.__name__, 0) >= 20 for m in MUTATIONS), applied
