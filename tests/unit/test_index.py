"""ChunkIndex: byte accounting per root, LRU order, pins, reservations and eviction plans."""

from __future__ import annotations

import dataclasses
import gc
from collections.abc import Callable

import pytest

from lmcache_nvme_backend.disk.format import TensorMeta
from lmcache_nvme_backend.io import native
from lmcache_nvme_backend.store.index import ChunkIndex, IndexEntry

BUDGET = 10_000
META = TensorMeta(shapes=((4,),), dtypes=("uint8",), fmt=1, nbytes=4)

MakeEntry = Callable[..., IndexEntry]


@pytest.fixture
def entry() -> MakeEntry:
    def make(digest: str, size: int = 1000, root: int = 0, pins: int = 0) -> IndexEntry:
        return IndexEntry(digest=digest, ns_id="ns", root=root, size=size, meta=META, pins=pins)

    return make


@pytest.fixture
def index() -> ChunkIndex:
    return ChunkIndex([BUDGET, BUDGET])


@pytest.fixture
def full(index: ChunkIndex, entry: MakeEntry) -> ChunkIndex:
    """Root 0 at 9000 of 10000 bytes: a (2000), b (3000), c (4000), oldest first."""
    for digest, size in (("a", 2000), ("b", 3000), ("c", 4000)):
        index.add(entry(digest, size))
    return index


def order(index: ChunkIndex, root: int = 0) -> list[str]:
    return [e.digest for e in index.lru_order(root)]


def digests(entries: list[IndexEntry] | None) -> list[str] | None:
    return None if entries is None else [e.digest for e in entries]


# -- basic bookkeeping ------------------------------------------------------------------------


def test_get_many_answers_each_digest_in_order(full: ChunkIndex) -> None:
    found = full.get_many(["c", "z", "a", "c"])
    assert [e.digest if e is not None else None for e in found] == ["c", None, "a", "c"]
    assert full.get_many([]) == []


def test_publish_turns_a_reservation_into_an_entry(index: ChunkIndex, entry: MakeEntry) -> None:
    index.reserve(1, 700)
    assert (index.reserved_bytes(1), index.used_bytes(1)) == (700, 0)
    first = entry("x", 700, root=1)
    assert index.publish(first, 700) is None
    assert (index.reserved_bytes(1), index.used_bytes(1)) == (0, 700)
    index.reserve(1, 600)
    again = entry("x", 600, root=1)  # the same chunk written again: replaces the first
    assert index.publish(again, 600) is first
    assert (index.reserved_bytes(1), index.used_bytes(1), index.get("x")) == (0, 600, again)


def test_add_get_remove_used_bytes(index: ChunkIndex, entry: MakeEntry) -> None:
    a, b = entry("a", 100), entry("b", 250, root=1)
    index.add(a)
    index.add(b)
    assert len(index) == 2
    assert "a" in index and "b" in index and "z" not in index
    assert index.get("a") is a and index.get("z") is None
    assert (index.used_bytes(0), index.used_bytes(1), index.used_bytes()) == (100, 250, 350)

    assert index.remove("a") is a
    assert index.remove("a") is None
    assert "a" not in index and len(index) == 1
    assert (index.used_bytes(0), index.used_bytes()) == (0, 250)
    assert order(index, 0) == []


def test_add_replaces_and_reaccounts(index: ChunkIndex, entry: MakeEntry) -> None:
    first = entry("a", 100)
    assert index.add(first) is None
    assert index.add(entry("b", 100)) is None
    assert index.add(entry("a", 700)) is first  # the entry it replaced
    assert len(index) == 2
    assert index.used_bytes(0) == 800
    assert order(index) == ["b", "a"]  # replacement is most recently used


def test_add_replacing_on_another_root_moves_bytes(index: ChunkIndex, entry: MakeEntry) -> None:
    index.add(entry("a", 100, root=0))
    index.add(entry("a", 300, root=1))
    assert (index.used_bytes(0), index.used_bytes(1)) == (0, 300)
    assert order(index, 0) == [] and order(index, 1) == ["a"]


def test_touch_moves_to_most_recent(full: ChunkIndex) -> None:
    full.touch("a", now_ns=123)
    assert order(full) == ["b", "c", "a"]
    assert full.get("a").last_access_ns == 123  # type: ignore[union-attr]
    full.touch("missing", now_ns=5)  # no effect, no error
    assert order(full) == ["b", "c", "a"]


def test_pin_unpin_counts(full: ChunkIndex) -> None:
    assert full.pin("a") and full.pin("a")
    assert full.get("a").pins == 2  # type: ignore[union-attr]
    assert full.unpin("a") and full.unpin("a")
    assert not full.unpin("a")  # never below zero
    assert full.get("a").pins == 0  # type: ignore[union-attr]
    assert not full.pin("missing") and not full.unpin("missing")


# -- eviction planning ------------------------------------------------------------------------


@pytest.mark.parametrize(("size", "victims"), [
    (0, []), (1000, []),            # fits exactly in the free 1000 bytes
    (1001, ["a"]), (3000, ["a"]),   # evicting a frees 2000 -> 3000 free
    (3001, ["a", "b"]), (6000, ["a", "b"]),
    (6001, ["a", "b", "c"]), (BUDGET, ["a", "b", "c"]),
    (BUDGET + 1, None),             # bigger than the whole root
])
def test_plan_reservation_lru_victims(full: ChunkIndex, size: int,
                                      victims: list[str] | None) -> None:
    assert digests(full.plan_reservation(0, size)) == victims


def test_plan_does_not_change_the_index(full: ChunkIndex) -> None:
    full.plan_reservation(0, 5000)
    assert order(full) == ["a", "b", "c"] and full.used_bytes(0) == 9000


def test_plan_follows_touch_order(full: ChunkIndex) -> None:
    full.touch("a", now_ns=1)
    assert digests(full.plan_reservation(0, 3000)) == ["b"]
    assert digests(full.plan_reservation(0, 5001)) == ["b", "c"]


def test_plan_skips_pinned(full: ChunkIndex) -> None:
    full.pin("a")
    assert digests(full.plan_reservation(0, 1001)) == ["b"]
    assert digests(full.plan_reservation(0, 8000)) == ["b", "c"]


def test_plan_returns_none_when_pins_make_it_impossible(full: ChunkIndex) -> None:
    full.pin("c")
    assert full.plan_reservation(0, 8001) is None  # only a and b (5000) can go: 6000 free
    assert digests(full.plan_reservation(0, 6000)) == ["a", "b"]
    full.unpin("c")
    assert digests(full.plan_reservation(0, 8001)) == ["a", "b", "c"]


def test_reserve_and_release_affect_planning(full: ChunkIndex) -> None:
    full.reserve(0, 1000)
    assert full.reserved_bytes(0) == 1000 and full.reserved_bytes() == 1000
    assert digests(full.plan_reservation(0, 1)) == ["a"]
    full.reserve(0, 500)
    assert digests(full.plan_reservation(0, 1501)) == ["a", "b"]
    full.release(0, 1500)
    assert full.reserved_bytes(0) == 0
    assert full.plan_reservation(0, 1000) == []


def test_reservation_larger_than_evictable_is_none(full: ChunkIndex) -> None:
    full.reserve(0, 1000)  # an in-flight write that cannot be evicted
    assert full.plan_reservation(0, BUDGET) is None
    assert digests(full.plan_reservation(0, BUDGET - 1000)) == ["a", "b", "c"]


def test_budgets_are_per_root(full: ChunkIndex, entry: MakeEntry) -> None:
    assert full.plan_reservation(1, BUDGET) == []
    full.reserve(1, 4000)
    full.add(entry("x", 5000, root=1))
    assert digests(full.plan_reservation(1, 1001)) == ["x"]
    assert digests(full.plan_reservation(0, 1001)) == ["a"]  # root 1 does not spill into 0
    full.pin("x")
    assert full.plan_reservation(1, 1001) is None
    assert full.plan_reservation(0, 1000) == []


def test_publish_layout_indexes_each_chunk_in_place_of_its_reservation(
        index: ChunkIndex, entry: MakeEntry) -> None:
    index.add(entry("old", size=10))
    index.reserve(0, 30)
    index.publish_layout(["a", "old", "b"], [0, 0, 0], "ns2", 10, META, 42)
    assert order(index, 0) == ["a", "old", "b"]  # "old" written again: replaced, most recent
    assert index.used_bytes(0) == 30 and index.reserved_bytes(0) == 0 and len(index) == 3
    again = index.get("old")
    assert again is not None and (again.ns_id, again.size, again.meta, again.last_access_ns,
                                  again.pins) == ("ns2", 10, META, 42, 0)


def test_remove_many_takes_out_entries_of_any_root(full: ChunkIndex, entry: MakeEntry) -> None:
    full.add(entry("d", size=500, root=1))
    assert digests(full.remove_many(["b", "zz", "d", "b"])) == ["b", "d"]
    assert order(full, 0) == ["a", "c"] and order(full, 1) == []
    assert (full.used_bytes(0), full.used_bytes(1), len(full)) == (6000, 0, 2)
    assert full.remove_many([]) == []


def test_unequal_budgets() -> None:
    idx = ChunkIndex([100, 5000])
    idx.add(IndexEntry("a", "ns", 0, 80, None))
    idx.add(IndexEntry("b", "ns", 1, 80, None))
    assert digests(idx.plan_reservation(0, 21)) == ["a"]
    assert idx.plan_reservation(1, 4920) == []
    assert idx.plan_reservation(0, 101) is None


@pytest.mark.skipif(not native.available(), reason=native.unavailable_reason())
def test_the_cycle_collector_tracks_neither_the_entries_nor_the_tables(
        index: ChunkIndex, entry: MakeEntry) -> None:
    """A million tracked entries held the GIL 0.19 s in every full collection: with the
    native extension neither an entry nor a table that holds one is tracked, whatever the
    index did to it, and the collector leaves the index intact."""
    for i in range(300):
        index.add(entry(f"{i:04x}", size=10, root=i % 2))
    index.touch("0000", 5)
    index.pin("0001")
    index.remove("0002")
    index.add(entry("0003", size=20, root=1))  # replaces: out of one root, into the other
    index.publish(entry("new", size=10), reserved=0)
    index.reserve(1, 20)
    index.publish_layout(["laid0", "laid1"], [1, 1], "ns", 10, META, 7)
    gc.collect()
    assert not [o for o in gc.get_objects() if type(o) is IndexEntry]
    probe = index.get("0004")
    assert probe is not None
    assert not [r for r in gc.get_referrers(probe) if isinstance(r, dict)]
    assert not [r for r in gc.get_referrers(probe.digest) if isinstance(r, dict)]
    assert len(index) == 302
    assert order(index, 0)[-2:] == ["0000", "new"]
    assert index.get("0001").pins == 1  # type: ignore[union-attr]
    assert index.get("0003").root == 1 and index.used_bytes(1) == 151 * 10 + 20  # type: ignore[union-attr]


def test_an_entry_refers_to_nothing_that_could_lead_back_to_it(entry: MakeEntry) -> None:
    """What makes untracking the entries safe: every field is a string, an integer, None or
    a TensorMeta of tuples of those (a new field must keep it so)."""
    atomic = (str, int, type(None))
    e = entry("a")
    assert all(isinstance(getattr(e, f.name), atomic) for f in dataclasses.fields(e)
               if f.name != "meta")
    assert all(isinstance(value, atomic) or
               all(isinstance(x, atomic) or all(isinstance(y, atomic) for y in x)
                   for x in value)
               for value in dataclasses.astuple(META))
