"""Shared mode under damaged coordination files (issue 47): a version of the ledger that is
truncated, not JSON, holds NaN, names another number, is a link, FIFO or directory, grants
a huge budget, a negative cap, frees chunks still on disk, or sits ahead of the chain; an
account listing thousands of dead members; a janitor whose lease moves while it does
nothing.  Each test plants the damage beside live members (stores in this process, as in
tests/store/test_store_shared.py) and checks what the issue asks: the members keep writing
within the budget plus one chunk per member, nothing is left in ``shared/evicting/``, a
warning names the file, and every byte served is the one written.
"""

from __future__ import annotations

import json
import logging
import math
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from support.ledger_files import (
    edit_field,
    ledger_damage,
    newest,
    plant,
    renewed_lease,
    successor,
)
from support.process import child_env
from support.shared_run import tree_bytes
from support.stores import StoreFactory

from lmcache_nvme_backend.cli.inspect import shared_report
from lmcache_nvme_backend.disk.coordination import EVICTING_DIR, lease_path
from lmcache_nvme_backend.disk.format import TensorMeta, file_size_for
from lmcache_nvme_backend.disk.layout import key_digest
from lmcache_nvme_backend.store.chunk_store import ChunkRead, ChunkStore
from lmcache_nvme_backend.store.shared.ledger import Account, LedgerChain, LedgerDoc

pytestmark = pytest.mark.timeout(120)

NBYTES = 64 * 1024
FILE = file_size_for(NBYTES)
META = TensorMeta(shapes=((NBYTES,),), dtypes=("uint8",), fmt=1, nbytes=NBYTES)
CHUNKS = 8
BUDGET = CHUNKS * FILE


def payload(key: str) -> bytes:
    return key.encode().ljust(NBYTES, b".")


def put(store: ChunkStore, key: str) -> None:
    store.submit(key, "model", META, memoryview(payload(key)), release=lambda: None)
    assert store.flush(30)


def served_right(store: ChunkStore, key: str) -> bool | None:
    """None: a miss; else whether every byte read is the one written."""
    buf = bytearray(NBYTES)
    (ok,) = store.read_into([ChunkRead(key, memoryview(buf))])
    return bytes(buf) == payload(key) if ok else None


def stranded(root: Path) -> list[Path]:
    return [p for p in (root / EVICTING_DIR).rglob("*") if p.is_file()]


@pytest.fixture
def members(tmp_path: Path, open_store: StoreFactory) -> tuple[ChunkStore, ChunkStore]:
    """Two members on a full directory (each wrote half the budget)."""
    a = open_store(tmp_path, shared=True, max_size_gb=BUDGET / 2**30)
    b = open_store(tmp_path, shared=True, max_size_gb=BUDGET / 2**30)
    for i in range(CHUNKS // 2):
        put(a, f"a-old-{i}")
        put(b, f"b-old-{i}")
    for store in (a, b):
        store.refresh_shared()
    return a, b


def keep_writing(root: Path, stores: list[ChunkStore], rounds: int = 3 * CHUNKS) -> None:
    """Every member writes ``rounds`` chunks (each evicting: the directory is full), the
    bytes on disk checked after each, and every chunk found read back."""
    drops = [store.counter("capacity_drops") for store in stores]
    for i in range(rounds):
        for n, store in enumerate(stores):
            put(store, f"{n}-new-{i}")
            store.refresh_shared()
            assert tree_bytes(root) <= BUDGET + len(stores) * FILE
    for n, store in enumerate(stores):
        assert store.counter("capacity_drops") == drops[n]
        assert store.lookup(f"{n}-new-{rounds - 1}", "model")
        for m in range(len(stores)):
            for i in range(rounds):
                assert served_right(store, f"{m}-new-{i}") is not False
    assert stranded(root) == []


DAMAGE = ledger_damage(BUDGET)


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_next_version_is_set_aside_and_the_members_write_on(
        damage: str, tmp_path: Path, members: tuple[ChunkStore, ChunkStore],
        open_store: StoreFactory, package_log: pytest.LogCaptureFixture) -> None:
    a, b = members
    _, n = newest(tmp_path)
    path = DAMAGE[damage](tmp_path, n)
    keep_writing(tmp_path, [a, b])
    assert f"ledger version {path} is damaged" in package_log.text
    assert a.stats_snapshot()["ledger_damaged"] == 1
    # a member that starts afterwards joins the same chain (past the damaged number)
    c = open_store(tmp_path, shared=True, max_size_gb=BUDGET / 2**30)
    assert "cannot take part" not in package_log.text
    assert newest(tmp_path)[0].n > n
    keep_writing(tmp_path, [a, b, c], rounds=CHUNKS)


def test_a_huge_budget_in_a_version_grants_nothing(
        tmp_path: Path, members: tuple[ChunkStore, ChunkStore]) -> None:
    a, b = members
    plant(tmp_path, *successor(tmp_path, edit_field("budget", 1 << 50)))
    keep_writing(tmp_path, [a, b])
    assert newest(tmp_path)[0].effective_budget() == BUDGET
    assert a.stats_snapshot()["directory_budget_bytes"] == BUDGET


def test_a_members_chunks_listed_as_freed_stay_counted(
        tmp_path: Path, members: tuple[ChunkStore, ChunkStore],
        package_log: pytest.LogCaptureFixture) -> None:
    a, b = members
    (b_id,) = b.shared_members()

    def free_bs_chunks(fields: dict[str, Any]) -> None:
        mine = fields["accounts"][b_id]
        seq = mine["next"]
        mine["freed"] += [[seq + i, key_digest(f"b-old-{i}"), FILE] for i in range(4)]
        mine["next"] = seq + 4

    owned = b.stats_snapshot()["member_bytes"]
    plant(tmp_path, *successor(tmp_path, free_bs_chunks))
    b.refresh_shared()
    assert b.stats_snapshot()["member_bytes"] == owned
    assert f"chunk(s) of this member as evicted (accounts.{b_id}.freed) whose files are " \
        "still in place" in package_log.text
    keep_writing(tmp_path, [a, b])


def test_a_valid_copy_five_ahead_is_not_a_second_chain(
        tmp_path: Path, members: tuple[ChunkStore, ChunkStore], open_store: StoreFactory,
        package_log: pytest.LogCaptureFixture) -> None:
    a, b = members
    n, raw = successor(tmp_path, ahead=5)
    far = plant(tmp_path, n, raw)
    # a member that starts now follows the members' chain, not the copy ahead of it
    c = open_store(tmp_path, shared=True, max_size_gb=BUDGET / 2**30)
    assert f"ledger version {far} is damaged" in package_log.text
    assert c.shared_members()[0] in newest(tmp_path)[0].accounts
    # the chain runs into the copy's number: it is set aside there too
    keep_writing(tmp_path, [a, b, c])
    doc = newest(tmp_path)[0]
    assert doc.n > n and set(doc.live()) >= {*a.shared_members(), *c.shared_members()}


def test_a_member_never_publishes_a_version_its_parser_refuses_and_victims_go_back(
        tmp_path: Path, members: tuple[ChunkStore, ChunkStore],
        package_log: pytest.LogCaptureFixture) -> None:
    """An account whose list of claims is full: the eviction's transfer would be a version
    the parser refuses, so it is not written and the victims go back in place."""
    a, b = members
    for store in (a, b):
        quiet(store)
    (a_id,) = a.shared_members()
    junk = [f"{key_digest(str(i))}.{FILE}.~" for i in range(65536)]
    plant(tmp_path, *successor(tmp_path, lambda f: f["accounts"][a_id].update(evicting=junk)))
    versions = newest(tmp_path)[0].n
    theirs = [f"b-old-{i}" for i in range(CHUNKS // 2) if b.entry(f"b-old-{i}") is not None]
    for i in range(CHUNKS // 2):  # b's chunks are the coldest
        a.lookup(f"a-old-{i}", "model")
    put(a, "a-needs-room")
    assert "would be refused (accounts." in package_log.text
    assert "victim(s) are back in place" in package_log.text
    assert newest(tmp_path)[0].n == versions and stranded(tmp_path) == []
    b.refresh_shared()
    assert theirs and all(served_right(b, key) for key in theirs)
    assert tree_bytes(tmp_path) <= BUDGET + 2 * FILE
    # the next round of a's books drops the claims it does not hold: it evicts again
    a.refresh_shared()
    assert len(newest(tmp_path)[0].accounts[a_id].evicting) == 0
    renew_leases(a, b)
    keep_writing(tmp_path, [a, b], rounds=CHUNKS)


def quiet(store: ChunkStore) -> None:
    """Stop a store's shared-mode threads (the test runs their steps itself)."""
    tree = store._shared
    assert tree is not None
    tree._stop.set()
    tree._room_wanted.set()
    for thread in tree._threads:
        thread.join()


def renew_leases(*stores: ChunkStore) -> None:
    """What a quiet store's thread does every second: renew its lease."""
    for store in stores:
        for member in store._shared.members:  # type: ignore[union-attr]
            member.heartbeat()


def test_three_thousand_dead_accounts_cost_a_few_versions(
        tmp_path: Path, members: tuple[ChunkStore, ChunkStore]) -> None:
    a, b = members
    for store in (a, b):
        quiet(store)
    host = a.shared_members()[0].rsplit("-", 2)[0]
    dead = [f"{host}-{4_300_000 + i}-{i:08x}" for i in range(3000)]  # no such processes

    def add_dead(fields: dict[str, Any]) -> None:
        for member in dead:
            fields["accounts"][member] = {"cap": 0, "state": "live", "budget": BUDGET,
                                          "chunk_format": 1, "freed": [], "next": 1,
                                          "evicting": []}

    plant(tmp_path, *successor(tmp_path, add_dead))
    before = newest(tmp_path)[0].n
    for store in (a, b):
        store.refresh_shared()
        for member in store._shared.members:  # type: ignore[union-attr]
            if member.is_janitor():
                member.janitor_round()
    doc = newest(tmp_path)[0]
    assert not set(dead) & set(doc.accounts)
    assert doc.n - before <= 6  # dead, merged, the walk: not one version per account
    renew_leases(a, b)
    keep_writing(tmp_path, [a, b], rounds=CHUNKS)


def test_close_returns_while_the_janitor_has_thousands_of_members_to_clear(
        tmp_path: Path, open_store: StoreFactory) -> None:
    a = open_store(tmp_path, shared=True, max_size_gb=BUDGET / 2**30)
    host = a.shared_members()[0].rsplit("-", 2)[0]
    gone = [f"{host}-{4_300_000 + i}-{i:08x}" for i in range(3000)]
    members_dir = tmp_path / "shared" / "members"
    for member in gone:  # departed members whose files are left to remove
        (members_dir / f"{member}.lease").write_bytes(b"{}")

    def add_departed(fields: dict[str, Any]) -> None:
        for member in gone:
            fields["accounts"][member] = {"cap": 0, "state": "departed", "budget": BUDGET,
                                          "chunk_format": 1, "freed": [], "next": 1,
                                          "evicting": []}

    plant(tmp_path, *successor(tmp_path, add_departed))
    time.sleep(1.5)  # the janitor thread's round is under way
    started = time.monotonic()
    a.close()
    assert time.monotonic() - started < 10


@pytest.fixture
def moving_lease(tmp_path: Path) -> Iterator[str]:
    """A live account's moving lease; its id is the smallest, so it would be the janitor."""
    stuck = "000stuck-1-0000abcd"
    with renewed_lease(tmp_path, stuck, 2, BUDGET):
        yield stuck


def test_a_janitor_whose_lease_moves_without_progress_is_passed_over(
        tmp_path: Path, open_store: StoreFactory, moving_lease: str,
        package_log: pytest.LogCaptureFixture) -> None:
    a = open_store(tmp_path, shared=True, max_size_gb=BUDGET / 2**30)
    host = a.shared_members()[0].rsplit("-", 2)[0]
    killed = f"{host}-4300001-deadbee1"  # this host, no such process: dead at once

    def add(fields: dict[str, Any]) -> None:
        for member, cap in ((moving_lease, 0), (killed, 4 * FILE)):
            fields["accounts"][member] = {"cap": cap, "state": "live", "budget": BUDGET,
                                          "chunk_format": 1, "freed": [], "next": 1,
                                          "evicting": []}

    plant(tmp_path, *successor(tmp_path, add))
    assert (tmp_path / lease_path(moving_lease)).exists() or time.sleep(0.5) is None
    deadline = time.monotonic() + 20
    while killed in newest(tmp_path)[0].accounts and time.monotonic() < deadline:
        time.sleep(0.2)
    doc = newest(tmp_path)[0]
    assert killed not in doc.accounts, "the killed member's share never came back"
    assert doc.accounts[moving_lease].state == "live"  # its lease moves: not dead
    assert a.stats_snapshot()["janitor_stalled"] == 1
    assert f"member {killed} is dead" in package_log.text
    assert shared_report(tmp_path)["janitor_stalled"] == [moving_lease]  # type: ignore[index]


def test_damage_is_said_once_and_not_again_by_a_reader_that_starts_past_it(
        tmp_path: Path, members: tuple[ChunkStore, ChunkStore], open_store: StoreFactory,
        package_log: pytest.LogCaptureFixture) -> None:
    """Both members meet a damaged version: one warning in this process, counted once; a
    member that joins later, here or in another process (or ``inspect``), starts past it
    (the members set it aside already) and does not warn about it again."""
    a, b = members
    _, n = newest(tmp_path)
    path = plant(tmp_path, n, b"not a ledger")
    keep_writing(tmp_path, [a, b], rounds=2)
    said = f"ledger version {path} is damaged"

    def warnings() -> int:
        return len({id(r) for r in package_log.records
                    if r.levelno >= logging.WARNING and said in r.getMessage()})

    assert warnings() == 1
    assert a.stats_snapshot()["ledger_damaged"] == b.stats_snapshot()["ledger_damaged"] == 1
    open_store(tmp_path, shared=True, max_size_gb=BUDGET / 2**30)
    assert warnings() == 1
    reader = ("import logging, sys; from lmcache_nvme_backend.store.shared.ledger import "
              "LedgerChain; logging.basicConfig(level=logging.WARNING); chain = LedgerChain("
              "__import__('pathlib').Path(sys.argv[1]), 'reader-1-00000000', 0o600, 0o700); "
              "print(chain.latest().n, chain.damaged_total)")
    done = subprocess.run([sys.executable, "-c", reader, str(tmp_path)], env=child_env(),
                          capture_output=True, text=True, timeout=60, check=True)
    assert int(done.stdout.split()[0]) > n and done.stdout.split()[1] == "0"
    assert "is damaged" not in done.stderr, done.stderr


def test_inspect_names_a_damaged_version(tmp_path: Path,
                                         members: tuple[ChunkStore, ChunkStore]) -> None:
    _, n = newest(tmp_path)
    path = plant(tmp_path, n, b"not a ledger")
    report = shared_report(tmp_path)
    assert report is not None and report["damaged_versions"] == [
        {"version": n, "path": str(path), "why": report["damaged_versions"][0]["why"]}]
    assert report["damaged_versions"][0]["why"].startswith("json: not JSON")


def test_every_planted_value_is_named_with_itsedit_field(tmp_path: Path,
                                                     members: tuple[ChunkStore, ChunkStore],
                                                     package_log: pytest.LogCaptureFixture
                                                     ) -> None:
    a, _ = members
    n, raw = successor(tmp_path, edit_field("budget", math.nan))
    path = plant(tmp_path, n, raw)
    LedgerChain(tmp_path, "reader-1-00000000", 0o600, 0o700).latest()
    assert f"{path} is damaged (budget: not an integer: nan)" in package_log.text
    assert json.loads(raw.replace(b"NaN", b"0"))["n"] == n


def test_a_member_of_an_older_format_running_keeps_a_newer_one_reading_until_it_left(
        tmp_path: Path, open_store: StoreFactory,
        package_log: pytest.LogCaptureFixture) -> None:
    """Version skew: a directory whose ledger an older package (format 1) keeps, with one
    of its members running; a member of this version serves reads only, says why, and
    joins (moving the ledger to its format) once that member left."""
    older = "oldnode-1-0000abcd"
    doc = LedgerDoc(1, BUDGET, older, {older: Account(0, budget=BUDGET)}, format=1)
    plant(tmp_path, 1, doc.to_json())
    with renewed_lease(tmp_path, older, 1, BUDGET):
        b = open_store(tmp_path, shared=True, max_size_gb=BUDGET / 2**30)
        assert f"member(s) {older} of an older version of the package (ledger format 1, " \
            "this version writes format 2) are running" in package_log.text
        put(b, "k-while-older-runs")
        assert b.counter("capacity_drops") == 1 and newest(tmp_path)[0].format == 1
        # the older member leaves (its account departs, its lease goes)
        plant(tmp_path, 2, LedgerDoc(2, BUDGET, older, {older: Account(0, "departed")},
                                     format=1).to_json())
    (tmp_path / lease_path(older)).unlink()
    deadline = time.monotonic() + 30
    while b.stats_snapshot()["member_cap_bytes"] == 0 and time.monotonic() < deadline:
        put(b, "k-after")
        time.sleep(0.5)
    assert "joins the directory's shared budget now" in package_log.text
    assert newest(tmp_path)[0].format == 2
    assert b.lookup("k-after", "model") and served_right(b, "k-after")
