"""Shared mode in one process: several stores (members) on one directory, one budget.

The multi-process versions (SIGKILL, a real distributed filesystem, 4 writers) are in
tests/robustness/test_robustness_shared_budget.py.  Here the members' background threads
run too, but each test calls ``refresh_shared`` (what they do every 0.1 s) or a janitor
round where it needs a result at once.
"""

from __future__ import annotations

import logging
import os
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from support.ledger_files import plant, successor
from support.mounts import tmpfs
from support.stores import StoreFactory

from lmcache_nvme_backend.disk.coordination import (
    evicting_dir,
    evicting_name,
    journal_path,
    lease_path,
)
from lmcache_nvme_backend.disk.format import TensorMeta, file_size_for
from lmcache_nvme_backend.disk.layout import key_digest, namespace_id
from lmcache_nvme_backend.store.chunk_store import ChunkRead, ChunkStore, ChunkWrite
from lmcache_nvme_backend.store.index import IndexEntry
from lmcache_nvme_backend.store.shared import share
from lmcache_nvme_backend.store.shared.account import ACCESS_RESOLUTION_S
from lmcache_nvme_backend.store.shared.ledger import DEAD, Account, LedgerChain, LedgerDoc

pytestmark = pytest.mark.timeout(120)

NBYTES = 64 * 1024
FILE = file_size_for(NBYTES)
META = TensorMeta(shapes=((NBYTES,),), dtypes=("uint8",), fmt=1, nbytes=NBYTES)


def put(store: ChunkStore, key: str, ns: str = "model", fill: int = 1) -> bytes:
    payload = bytes([fill]) * NBYTES
    store.submit(key, ns, META, memoryview(payload), release=lambda: None)
    assert store.flush(30)
    return payload


def read(store: ChunkStore, key: str) -> bytes | None:
    buf = bytearray(NBYTES)
    (ok,) = store.read_into([ChunkRead(key, memoryview(buf))])
    return bytes(buf) if ok else None


def budget_gb(chunks: int) -> float:
    return chunks * FILE / 2**30


def ledger_of(root: Path) -> LedgerDoc:
    doc = LedgerChain(root, "reader-1-00000000", 0o600, 0o700).latest()
    assert doc is not None
    return doc


def ledger(store: ChunkStore) -> LedgerDoc:
    return ledger_of(store.layouts[0].root)


def janitor_round(*stores: ChunkStore) -> None:
    """One round of the janitor's duties by whichever store is the janitor."""
    for store in stores:
        for member in store._shared.members:  # type: ignore[union-attr]
            if member.is_janitor():
                member.janitor_round()


def chunk_files(root: Path) -> list[Path]:
    return [p for p in (root / "ns").rglob("*.kv")]


def test_lookup_equals_contains_without_shared_mode(tmp_path: Path,
                                                    open_store: StoreFactory) -> None:
    a = open_store(tmp_path)
    b = open_store(tmp_path)
    put(a, "k1")
    assert a.lookup("k1", "model")
    assert not b.lookup("k1", "model")  # b's index was built before a wrote
    assert not (tmp_path / "shared").exists()


def test_members_see_what_the_others_published(tmp_path: Path,
                                               open_store: StoreFactory) -> None:
    a = open_store(tmp_path, shared=True)
    b = open_store(tmp_path, shared=True)
    payload = put(a, "k1", fill=7)
    b.refresh_shared()  # a's journal: what b's background thread reads every 0.1 s
    assert not b.lookup("k1", "other-model")  # the key's namespace is part of the match
    assert b.lookup("k1", "model", pin=True)
    assert b.counter("shared_adopted") == 1
    assert b.tensor_meta("k1") == META  # from the journal: no header read needed
    assert read(b, "k1") == payload
    assert b.unpin("k1")
    assert not b.lookup("absent", "model")
    # a member that starts later finds it from the listing and a's journal
    c = open_store(tmp_path, shared=True)
    assert c.lookup("k1", "model") and read(c, "k1") == payload
    # a deletes it: the others forget it when they read a's journal
    assert a.remove("k1")
    b.refresh_shared()
    assert not b.lookup("k1", "model") and b.counter("shared_vanished") == 1
    # a file deleted behind every member's back is a miss on read, never an error
    put(a, "k2")
    c.refresh_shared()
    for path in chunk_files(tmp_path):
        path.unlink()
    assert c.lookup("k2", "model") and read(c, "k2") is None
    assert not c.lookup("k2", "model")


def test_a_lookup_makes_no_filesystem_call(tmp_path: Path, open_store: StoreFactory,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    a = open_store(tmp_path, shared=True)
    b = open_store(tmp_path, shared=True)
    for i in range(20):
        put(a, f"k{i}")
    b.refresh_shared()
    calls: list[str] = []
    me = threading.get_ident()

    def forbidden(name: str) -> Callable[..., Any]:
        real = getattr(os, name)

        def call(*args: Any, **kwargs: Any) -> Any:
            if threading.get_ident() == me:  # the background threads read journals
                calls.append(name)
            return real(*args, **kwargs)
        return call

    for name in ("stat", "lstat", "open", "scandir", "listdir", "access", "readlink"):
        monkeypatch.setattr(os, name, forbidden(name))
    hits = sum(b.lookup(f"k{i}", "model") for i in range(40) for _ in range(50))
    assert hits == 20 * 50
    assert b.lookup_prefix([(f"k{i}", "model") for i in range(30)]) == 20
    monkeypatch.undo()
    assert calls == []


def test_one_budget_for_every_member(tmp_path: Path, open_store: StoreFactory) -> None:
    a = open_store(tmp_path, shared=True, max_size_gb=budget_gb(8))
    b = open_store(tmp_path, shared=True, max_size_gb=budget_gb(8))
    for i in range(6):
        put(a, f"a{i}")
    b.refresh_shared()
    for i in range(10):
        put(b, f"b{i}")
        assert len(chunk_files(tmp_path)) * FILE <= 8 * FILE
    # b took the room of a's least recently used chunks: a's account shrank with them
    a.refresh_shared()
    assert b.counter("shared_transfers") >= 4
    assert a.stats_snapshot()["member_bytes"] == FILE * sum(
        a.lookup(f"a{i}", "model") for i in range(6))
    doc = ledger(b)
    assert doc.budget == 8 * FILE
    assert doc.pool() >= 0 and sum(x.cap for x in doc.accounts.values()) + \
        doc.orphans_cap <= doc.budget
    for i in range(10):
        if b.lookup(f"b{i}", "model"):
            assert read(b, f"b{i}") == bytes([1]) * NBYTES


def test_eviction_is_least_recently_used_across_members(tmp_path: Path,
                                                        open_store: StoreFactory) -> None:
    a = open_store(tmp_path, shared=True, max_size_gb=budget_gb(10))
    b = open_store(tmp_path, shared=True, max_size_gb=budget_gb(10))
    hot = [f"hot{i}" for i in range(3)]
    for key in hot:
        put(a, key)
    b.refresh_shared()
    for i in range(30):
        put(b, f"flood{i}")
        for key in hot:  # a keeps reading its hot set; the others hear of it
            assert a.lookup(key, "model")
        a.refresh_shared()
        time.sleep(ACCESS_RESOLUTION_S)  # reads are shared at most this often
    b.refresh_shared()
    assert all(b.lookup(key, "model") for key in hot)  # colder chunks went first
    assert all(read(b, key) is not None for key in hot)
    # the flood's newest fill the rest (a member may hold a chunk's worth of headroom)
    assert sum(b.lookup(f"flood{i}", "model") for i in range(30)) >= 10 - 3 - 2


def test_a_departed_members_chunks_become_orphans(tmp_path: Path,
                                                  open_store: StoreFactory) -> None:
    a = open_store(tmp_path, shared=True, max_size_gb=budget_gb(4))
    b = open_store(tmp_path, shared=True, max_size_gb=budget_gb(4))
    (a_id,) = a.shared_members()
    for i in range(3):
        put(a, f"a{i}")
    a.close()
    b.refresh_shared()
    assert ledger(b).accounts[a_id].state == "departed"
    janitor_round(b)
    doc = ledger(b)
    assert a_id not in doc.accounts and doc.orphans_cap == 3 * FILE
    assert not (tmp_path / lease_path(a_id)).exists()
    assert not (tmp_path / journal_path(a_id, 1)).exists()
    for i in range(4):  # b evicts the orphans like any chunk
        put(b, f"b{i}")
    assert ledger(b).orphans_cap == 0 and len(chunk_files(tmp_path)) == 4


def test_budgets_that_differ_are_named_in_a_warning(tmp_path: Path, open_store: StoreFactory,
                                                    package_log: pytest.LogCaptureFixture
                                                    ) -> None:
    a = open_store(tmp_path, shared=True, max_size_gb=1)
    package_log.set_level(logging.WARNING)
    b = open_store(tmp_path, shared=True, max_size_gb=2)
    text = package_log.text
    assert "gives this member 2 GiB" in text and "budget is 1 GiB" in text
    assert "1 GiB applies to every member" in text
    b.refresh_shared()
    a._shared.members[0].heartbeat()  # type: ignore[union-attr]
    assert "is configured with 2 GiB for this path, the directory's budget is 1 GiB" in \
        package_log.text
    a.close()
    b.close()
    open_store(tmp_path, shared=True, max_size_gb=3)  # no member running: it may change
    assert "the directory's budget was 1 GiB" in package_log.text
    assert "3 GiB for this path) applies from now on" in package_log.text


def test_a_newer_ledger_format_leaves_a_member_reading_only(
        tmp_path: Path, open_store: StoreFactory,
        package_log: pytest.LogCaptureFixture) -> None:
    a = open_store(tmp_path, shared=True)
    put(a, "k1")
    plant(tmp_path, *successor(tmp_path, lambda fields: fields.update(format=99)))
    b = open_store(tmp_path, shared=True)
    assert "has format 99, this version of the package writes format 2: upgrade this " \
        "member" in package_log.text
    assert b.lookup("k1", "model") and read(b, "k1") is not None
    put(b, "k2")
    assert b.counter("capacity_drops") == 1 and not b.lookup("k2", "model")


@pytest.fixture
def readonly_tree(tmp_path: Path) -> Iterator[Path]:
    if os.geteuid() != 0:
        pytest.skip("remounting a test filesystem read-only needs root")
    with tmpfs(tmp_path / "ro", "32m") as mnt:
        yield mnt


def test_a_member_on_a_read_only_directory_serves_reads_and_says_so(
        readonly_tree: Path, open_store: StoreFactory,
        package_log: pytest.LogCaptureFixture) -> None:
    a = open_store(readonly_tree, shared=True)
    payload = put(a, "k1", fill=3)
    a.close()
    subprocess.run(["mount", "-o", "remount,ro", str(readonly_tree)], check=True)
    try:
        b = open_store(readonly_tree, shared=True)
        assert "cannot take part in the directory's shared budget" in package_log.text
        assert "writes nothing there" in package_log.text
        assert b.lookup("k1", "model") and read(b, "k1") == payload
        put(b, "k2")
        assert b.counter("capacity_drops") == 1
        b.close()
    finally:
        subprocess.run(["mount", "-o", "remount,rw", str(readonly_tree)], check=True)


def _dead_member_with_claims(tmp_path: Path, b: ChunkStore) -> tuple[str, list[str]]:
    """A member that died half-way through two evictions of b's chunks: one whose
    transfer it recorded (not yet deleted), one it had only claimed (renamed)."""
    dead = "vm-999999-deadbeef"  # this host, a process id that does not exist
    b.refresh_shared()
    names = []
    for key in ("b0", "b1"):
        entry = b.entry(key)
        assert entry is not None
        name = evicting_name(entry.digest, entry.size, entry.owner)
        (tmp_path / evicting_dir(dead)).mkdir(parents=True, exist_ok=True)
        os.rename(b.chunk_path(key, "model"), tmp_path / evicting_dir(dead) / name)
        names.append(name)

    def add_dead(doc: LedgerDoc) -> bool:
        doc.accounts[dead] = Account(FILE, budget=doc.budget)  # its cap: the recorded one
        doc.accounts[dead].evicting.append(names[0])
        doc.take(b.shared_members()[0], key_digest("b0"), FILE, doc.orphans_gen)
        return True

    LedgerChain(tmp_path, dead, 0o600, 0o700).update(add_dead)
    return dead, names


def test_the_janitor_finishes_a_dead_members_evictions(tmp_path: Path,
                                                       open_store: StoreFactory) -> None:
    b = open_store(tmp_path, shared=True, max_size_gb=budget_gb(8))
    for i in range(3):
        put(b, f"b{i}")
    dead, names = _dead_member_with_claims(tmp_path, b)
    janitor_round(b)
    doc = ledger(b)
    assert dead not in doc.accounts  # merged into the orphans
    assert not (tmp_path / evicting_dir(dead)).exists()
    b.refresh_shared()
    # both claimed chunks left b's account, each exactly once
    assert b.stats_snapshot()["member_bytes"] == FILE
    mine = doc.accounts[b.shared_members()[0]]
    assert sum(x.cap for x in doc.accounts.values()) + doc.orphans_cap + doc.pool() == \
        doc.budget and mine.cap >= 0
    # the next walk recounts the orphans from the tree: the dead member held no file
    b._shared.members[0].janitor.reconcile({})  # type: ignore[union-attr]
    assert ledger(b).orphans_cap == 0


def test_a_dead_members_account_is_taken_over(tmp_path: Path, open_store: StoreFactory,
                                              package_log: pytest.LogCaptureFixture) -> None:
    b = open_store(tmp_path, shared=True, max_size_gb=budget_gb(8))
    dead = "vm-999998-deadbee0"
    LedgerChain(tmp_path, dead, 0o600, 0o700).update(
        lambda doc: doc.accounts.__setitem__(dead, Account(3 * FILE)) or True)
    janitor_round(b)
    assert f"member {dead} is dead (its process is gone)" in package_log.text
    doc = ledger(b)
    assert dead not in doc.accounts and b.counter("shared_takeovers") == 1
    assert doc.orphans_cap == 0  # the walk found none of its files: its share is back
    assert doc.pool() == doc.budget - sum(x.cap for x in doc.accounts.values())


def test_two_members_publishing_one_chunk_count_it_once(tmp_path: Path,
                                                        open_store: StoreFactory) -> None:
    a = open_store(tmp_path, shared=True, max_size_gb=budget_gb(8))
    b = open_store(tmp_path, shared=True, max_size_gb=budget_gb(8))
    put(a, "same")
    put(b, "same")  # b had not read a's journal yet: both wrote it
    for _ in range(2):
        a.refresh_shared()
        b.refresh_shared()
        janitor_round(a, b)
    owned = a.stats_snapshot()["member_bytes"] + b.stats_snapshot()["member_bytes"]
    assert owned == FILE and len(chunk_files(tmp_path)) == 1


def test_a_chunk_deleted_behind_the_members_back_leaves_their_accounts(
        tmp_path: Path, open_store: StoreFactory) -> None:
    a = open_store(tmp_path, shared=True, max_size_gb=budget_gb(8))
    put(a, "k1")
    put(a, "k2")
    os.unlink(a.chunk_path("k1", "model"))  # e.g. lmcache-nvme gc, an operator's rm
    janitor = a._shared.members[0].janitor  # type: ignore[union-attr]
    janitor.reconcile({})
    a.refresh_shared()
    assert a.stats_snapshot()["member_bytes"] == FILE and not a.lookup("k1", "model")


def test_removal_listener_sees_evictions_and_removals(tmp_path: Path,
                                                      open_store: StoreFactory) -> None:
    store = open_store(tmp_path, max_size_gb=budget_gb(2))
    removed: list[list[IndexEntry]] = []
    store.add_removal_listener(removed.append)
    store.add_removal_listener(lambda entries: 1 / 0)  # a failing listener is contained
    put(store, "a")
    put(store, "b")
    put(store, "c")  # evicts a
    assert [[e.digest for e in batch] for batch in removed] == [[key_digest("a")]]
    assert store.remove("b")
    assert [e.digest for e in removed[-1]] == [key_digest("b")]
    assert removed[-1][0].size == FILE
    os.unlink(store.layouts[0].chunk_path(namespace_id("model"), key_digest("c")))
    assert read(store, "c") is None  # the vanished file leaves the index, listeners hear it
    assert [e.digest for e in removed[-1]] == [key_digest("c")]


def test_submit_release_and_persisted_callbacks(tmp_path: Path,
                                                open_store: StoreFactory) -> None:
    store = open_store(tmp_path)
    events: list[str] = []
    payload = memoryview(b"x" * NBYTES)
    store.submit_many([ChunkWrite("k", "model", META, payload,
                                  release=lambda: events.append("released"),
                                  on_persisted=lambda: events.append("persisted"))])
    assert store.flush(30)
    assert events == ["persisted", "released"]




def test_every_path_keeps_its_share_of_the_budget(tmp_path: Path,
                                                  open_store: StoreFactory) -> None:
    paths = (tmp_path / "d0", tmp_path / "d1")
    a = open_store(*paths, shared=True, max_size_gb=budget_gb(8))
    b = open_store(*paths, shared=True, max_size_gb=budget_gb(8))
    for i in range(12):
        put(a, f"a{i}")
        put(b, f"b{i}")
    for path in paths:  # 8 chunks over two paths: 4 each, one ledger and budget per path
        assert len(chunk_files(path)) <= 4
        assert ledger_of(path).budget == 4 * FILE
    b.refresh_shared()
    on_disk = sum(len(chunk_files(p)) for p in paths)
    assert sum(b.lookup(f"{w}{i}", "model") for w in "ab" for i in range(12)) == on_disk


@pytest.mark.parametrize("learns_by", ["journal", "read"])
def test_a_chunk_stored_again_before_its_eviction_reached_the_ledger_counts_once(
        tmp_path: Path, open_store: StoreFactory, monkeypatch: pytest.MonkeyPatch,
        learns_by: str) -> None:
    """b evicts a's chunk; a learns the file is gone (b's journal, or a read that misses)
    and stores the chunk again before it reads the ledger version that takes the old
    file out of its account: that entry is the old file's, and the new one stays counted."""
    a = open_store(tmp_path, shared=True, max_size_gb=budget_gb(8))
    b = open_store(tmp_path, shared=True, max_size_gb=budget_gb(8))
    put(a, "k", fill=1)
    put(a, "spare")
    assert a.remove("spare")  # room a holds without asking the ledger
    b.refresh_shared()
    a_member = a._shared.members[0]  # type: ignore[union-attr]
    sync = a_member.sync
    monkeypatch.setattr(a_member, "sync", lambda: None)  # a reads no ledger meanwhile
    victim = b.entry("k")
    assert victim is not None and victim.owner == a.shared_members()[0]
    assert b._shared.members[0].account.delete([victim]) == FILE  # type: ignore[union-attr]
    if learns_by == "journal":
        a_member.ingest()
    else:
        assert read(a, "k") is None
    assert not a.lookup("k", "model")
    payload = put(a, "k", fill=2)
    assert a_member.account.stats()["owned_chunks"] == 2  # the earlier file is not freed yet
    sync()
    assert a.stats_snapshot()["member_bytes"] == FILE  # the new file, counted once
    assert a_member.account.stats()["owned_chunks"] == 1
    assert read(a, "k") == payload and len(chunk_files(tmp_path)) == 1
    doc = ledger(a)
    assert doc.accounts[a.shared_members()[0]].cap >= FILE


def test_a_chunk_removed_behind_its_owners_back_and_stored_again_counts_once(
        tmp_path: Path, open_store: StoreFactory) -> None:
    """No eviction is pending for the earlier file (an operator removed it): the new one
    is all the account counts once the member has read the ledger."""
    a = open_store(tmp_path, shared=True, max_size_gb=budget_gb(8))
    put(a, "k", fill=1)
    os.unlink(a.chunk_path("k", "model"))
    assert read(a, "k") is None
    payload = put(a, "k", fill=2)
    a.refresh_shared()
    assert a.stats_snapshot()["member_bytes"] == FILE
    janitor_round(a)
    a._shared.members[0].janitor.reconcile({})  # type: ignore[union-attr]
    a.refresh_shared()
    assert a.stats_snapshot()["member_bytes"] == FILE and read(a, "k") == payload


def test_a_walk_does_not_release_a_chunk_stored_again_while_it_ran(
        tmp_path: Path, open_store: StoreFactory) -> None:
    """The walk lists the tree while the file is missing; the owner stores the chunk again
    (and has settled its account) before the walk decides: that file is not gone."""
    a = open_store(tmp_path, shared=True, max_size_gb=budget_gb(8))
    put(a, "k", fill=1)
    os.unlink(a.chunk_path("k", "model"))
    janitor = a._shared.members[0].janitor  # type: ignore[union-attr]
    ingest = janitor._ingest
    stored: list[bytes] = []

    def store_again_then_ingest() -> None:
        if not stored:
            assert read(a, "k") is None
            stored.append(put(a, "k", fill=2))
            a.refresh_shared()
        ingest()

    janitor._ingest = store_again_then_ingest
    janitor.reconcile({})
    a.refresh_shared()
    assert stored and read(a, "k") == stored[0]
    assert a.stats_snapshot()["member_bytes"] == FILE


def test_an_own_chunk_whose_unlink_failed_leaves_the_account_once_deleted(
        tmp_path: Path, open_store: StoreFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    a = open_store(tmp_path, shared=True, max_size_gb=budget_gb(8))
    put(a, "k")
    unlink = share.unlink_beneath
    failed: list[str] = []

    def fail_once(root: Any, rel: str, *args: Any) -> None:
        if not failed:
            failed.append(rel)
            raise PermissionError(13, "Permission denied")
        unlink(root, rel, *args)

    monkeypatch.setattr(share, "unlink_beneath", fail_once)
    a.remove("k")
    assert failed and (tmp_path / failed[0]).exists()  # claimed, not yet deleted
    a.refresh_shared()  # the retry deletes it
    assert not (tmp_path / failed[0]).exists() and not chunk_files(tmp_path)
    assert a.stats_snapshot()["member_bytes"] == 0


def test_writes_in_flight_when_a_member_is_taken_over_settle_in_its_new_account(
        tmp_path: Path, open_store: StoreFactory,
        package_log: pytest.LogCaptureFixture) -> None:
    """A member taken over as dead (its lease stood still: a stopped process, a stalled
    disk) while writes it reserved room for are still in flight rejoins under a new id;
    those writes settle without leaving its books off: flush returns, stores go on, and
    the directory stays within its budget plus one chunk per member."""
    a = open_store(tmp_path, shared=True, max_size_gb=budget_gb(8), write_threads=1)
    b = open_store(tmp_path, shared=True, max_size_gb=budget_gb(8))
    for i in range(4):
        put(b, f"b{i}")
    a.refresh_shared()
    settle = threading.Event()  # the first write's callback holds a's write completions
    a.submit("held", "model", META, memoryview(bytes(NBYTES)), release=lambda: None,
             on_persisted=lambda: settle.wait(30))
    for i in range(4):  # room reserved under a's first id, settled after it rejoined
        a.submit(f"a{i}", "model", META, memoryview(bytes([2]) * NBYTES),
                 release=lambda: None)
    first = a.shared_members()[0]

    def take_over(doc: LedgerDoc) -> bool:  # what the janitor does to a silent member
        doc.accounts[first].state = DEAD
        return True

    LedgerChain(tmp_path, "vm-999997-deadbee1", 0o600, 0o700).update(take_over)
    janitor_round(b)
    a.refresh_shared()
    assert a.shared_members()[0] != first
    assert "rejoins the directory as" in package_log.text
    settle.set()
    assert a.flush(10)
    for round_ in range(3):  # both members write on: the budget holds
        for i in range(12):
            put(a, f"a{round_}-{i}")
            put(b, f"b{round_}-{i}")
            assert len(chunk_files(tmp_path)) <= 8 + 2
        a.refresh_shared()
        b.refresh_shared()
        janitor_round(a, b)
    assert a.counter("capacity_drops") + a.counter("queue_full_drops") == 0
    assert read(a, "a2-11") == bytes([1]) * NBYTES
    books = a.stats_snapshot()
    assert books["member_bytes"] <= books["member_cap_bytes"]
