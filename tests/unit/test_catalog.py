"""store/catalog.py: the index, pending writes and removal listeners under one lock."""

from __future__ import annotations

import logging

import pytest

from lmcache_nvme_backend.disk.format import TensorMeta
from lmcache_nvme_backend.store.catalog import Catalog
from lmcache_nvme_backend.store.index import IndexEntry
from lmcache_nvme_backend.store.writeback import ChunkWrite

META = TensorMeta(shapes=((10,),), dtypes=("uint8",), fmt=1, nbytes=10)


NS_ID = "0" * 16


def entry(digest: str, size: int = 100, root: int = 0, t: int = 0, ns_id: str = NS_ID
          ) -> IndexEntry:
    return IndexEntry(digest, ns_id, root, size, META, t)


def write(key: str) -> ChunkWrite:
    return ChunkWrite(key, "ns", META, memoryview(bytes(10)), release=lambda: None)


@pytest.fixture
def catalog() -> Catalog:
    c = Catalog([1000, 1000])
    for i, digest in enumerate(("a", "b", "c")):
        c.publish_many([(entry(digest, t=i), 0)])
    return c


def always(root: int) -> bool:
    return True


def test_a_hit_is_a_use_and_may_pin(catalog: Catalog) -> None:
    assert catalog.lookup("a", always, now_ns=99, pin=True)
    found = catalog.entry("a")
    assert found is not None and found.last_access_ns == 99 and found.pins == 1
    assert [e.digest for e in catalog.lru_entries(0)] == ["b", "c", "a"]
    assert not catalog.lookup("zz", always, now_ns=100)


def test_an_entry_on_a_root_out_of_service_is_a_miss(catalog: Catalog) -> None:
    assert not catalog.lookup("a", lambda root: root != 0, now_ns=1)
    assert catalog.entry("a") is not None  # not forgotten: the root may come back


def test_register_marks_a_new_batch_pending_and_a_known_key_as_a_use(catalog: Catalog
                                                                      ) -> None:
    batch = [write("n1"), write("n2"), write("n3")]
    assert catalog.register([w.digest for w in batch], 5, NS_ID, []) == [True, True, True]
    assert all(catalog.is_pending(w.digest) for w in batch)
    stored = write("s")
    catalog.publish_many([(entry(stored.digest), 0)])
    digests = [write("n4").digest, write("n2").digest, stored.digest]
    assert catalog.register(digests, 7, NS_ID, []) == [True, False, False]
    known = catalog.entry(stored.digest)
    assert known is not None and known.last_access_ns == 7
    assert catalog.usage()["pending_writes"] == 4


def test_a_key_stored_under_another_namespace_is_replaced_not_a_duplicate(
        catalog: Catalog) -> None:
    """The same key under another build of the model's weights (another namespace) is
    registered afresh; the earlier build's entry leaves the index for its file to go."""
    earlier = entry(write("k").digest, ns_id="1" * 16)
    catalog.publish_many([(earlier, 0)])
    stale: list[IndexEntry] = []
    assert catalog.register([earlier.digest], 5, NS_ID, stale) == [True]
    assert stale == [earlier] and catalog.entry(earlier.digest) is None
    assert catalog.is_pending(earlier.digest)
    assert catalog.register([earlier.digest], 6, NS_ID, stale) == [False]  # now a duplicate


def test_register_skips_keys_stored_or_queued(catalog: Catalog) -> None:
    fresh, again = write("k1"), write("k1")
    stored = ChunkWrite("x", "ns", META, memoryview(bytes(10)), release=lambda: None)
    catalog.publish_many([(entry(stored.digest), 0)])
    digests = [fresh.digest, again.digest, stored.digest]
    assert catalog.register(digests, 5, NS_ID, []) == [True, False, False]
    assert catalog.is_pending(fresh.digest)
    catalog.end_pending([fresh.digest])
    assert not catalog.is_pending(fresh.digest)
    assert catalog.usage()["pending_writes"] == 0


def test_reserve_evicts_lru_unpinned_and_publish_takes_the_reservation(catalog: Catalog
                                                                       ) -> None:
    catalog.pin("a")
    victims = catalog.reserve(0, 800)  # 300 used + 800 > 1000: one victim, not pinned "a"
    assert victims is not None and [v.digest for v in victims] == ["b"]
    assert catalog.usage()["reserved_bytes"] == 800
    catalog.publish_many([(entry("new", size=800), 800)])
    usage = catalog.usage()
    assert usage["reserved_bytes"] == 0 and usage["used_bytes"] == 1000


def test_reserve_refuses_what_pinned_chunks_block(catalog: Catalog) -> None:
    for digest in ("a", "b", "c"):
        catalog.pin(digest)
    assert catalog.reserve(0, 800) is None
    assert catalog.usage()["reserved_bytes"] == 0
    assert catalog.pop_oldest_unpinned(0) is None


def test_release_returns_a_reservation(catalog: Catalog) -> None:
    assert catalog.reserve(1, 500) == []
    catalog.release(1, 500)
    assert catalog.usage()["reserved_bytes"] == 0


def test_recovered_entries_over_the_budget_come_back_oldest_first() -> None:
    c = Catalog([250])
    over = c.add_recovered(0, [entry("old", t=1), entry("mid", t=2), entry("new", t=3)])
    assert [e.digest for e in over] == ["old"]
    assert c.used_bytes(0) == 200 and c.entry("old") is None


def test_learn_meta_fills_in_a_recovered_entry() -> None:
    c = Catalog([1000])
    c.add_recovered(0, [IndexEntry("r", "0" * 16, 0, 100, None, 1)])
    c.learn_meta("r", META)
    found = c.entry("r")
    assert found is not None and found.meta == META
    c.learn_meta("gone", META)  # an entry removed meanwhile: nothing to do


def test_a_failing_listener_never_breaks_the_others(catalog: Catalog,
                                                    package_log: pytest.LogCaptureFixture) -> None:
    heard: list[list[str]] = []

    def broken(entries: list[IndexEntry]) -> None:
        raise RuntimeError("listener bug")

    catalog.add_removal_listener(broken)
    catalog.add_removal_listener(lambda entries: heard.append([e.digest for e in entries]))
    removed = catalog.remove_many(["a"])
    assert len(removed) == 1
    with package_log.at_level(logging.ERROR):
        catalog.notify_removed(removed)
    assert heard == [["a"]]
    assert "removal listener failed" in package_log.text
    catalog.notify_removed([])  # nothing removed: nobody is called
    assert heard == [["a"]]


def test_lookup_many_answers_as_lookup_does_under_one_hold(catalog: Catalog) -> None:
    assert catalog.lookup_many(["c", "zz", "a"], lambda root: True, now_ns=50, pin=True) == \
        [True, False, True]
    assert [(e.digest, e.last_access_ns) for e in catalog.lru_entries(0)][0] == ("b", 1)
    assert [catalog.entry(d).last_access_ns for d in "ac"] == [50, 50]  # type: ignore[union-attr]
    assert [catalog.entry(d).pins for d in "abc"] == [1, 0, 1]  # type: ignore[union-attr]
    assert catalog.lookup_many(["b"], lambda root: False, now_ns=60) == [False]


def test_publish_many_replaces_each_reservation(catalog: Catalog) -> None:
    assert catalog.reserve(1, 300) == []
    catalog.publish_many([(entry("d", 100, root=1), 100), (entry("e", 200, root=1), 200)])
    assert catalog.usage()["reserved_bytes"] == 0
    assert catalog.used_bytes(1) == 300


def test_remove_many_returns_what_was_there(catalog: Catalog) -> None:
    removed = catalog.remove_many(["a", "zz", "c"])
    assert [e.digest for e in removed] == ["a", "c"]
    assert catalog.entry("a") is None and catalog.entry("b") is not None
