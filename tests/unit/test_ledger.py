"""The ledger of a shared root: accounts, transfers, and versions published by ``link``."""

from __future__ import annotations

import multiprocessing
from pathlib import Path

import pytest

from lmcache_nvme_backend.disk import coordination
from lmcache_nvme_backend.disk.coordination import LEDGER_DIR, version_path
from lmcache_nvme_backend.store.shared.ledger import (
    DEAD,
    LIVE,
    Account,
    LedgerChain,
    LedgerDoc,
    LedgerError,
)

A, B, C = "hostA-1-0000000a", "hostB-2-0000000b", "hostC-3-0000000c"
D1, D2 = "1" * 32, "2" * 32


def doc_with(budget: int = 1000, **caps: int) -> LedgerDoc:
    names = {"a": A, "b": B, "c": C}
    return LedgerDoc(1, budget, A, {names[k]: Account(v) for k, v in caps.items()})


def chain(root: Path, member: str = A) -> LedgerChain:
    return LedgerChain(root, member, 0o600, 0o700)


def test_pool_is_what_no_account_holds() -> None:
    doc = doc_with(a=300, b=200)
    doc.orphans_cap = 100
    assert doc.pool() == 400
    doc.merge_into_orphans(B)
    assert doc.orphans_cap == 300 and doc.pool() == 400 and B not in doc.accounts


def test_take_from_a_live_owner_leaves_a_freed_entry() -> None:
    doc = doc_with(a=300, b=200)
    assert doc.take(B, D1, 50, claim_gen=0) == 50
    assert doc.accounts[B].cap == 150
    assert doc.accounts[B].freed == [(1, D1, 50)] and doc.accounts[B].next_seq == 2


def test_take_from_the_orphans_only_in_the_generation_the_victim_was_claimed() -> None:
    doc = doc_with(a=300)
    doc.orphans_cap, doc.orphans_gen = 100, 4
    assert doc.take("", D1, 60, claim_gen=4) == 60 and doc.orphans_cap == 40
    # recounted since the claim: the walk decided whether it counted; nothing is taken
    assert doc.take("", D2, 30, claim_gen=3) == 0 and doc.orphans_cap == 40
    # never more than the orphans hold, and a dead account's cap never goes below zero
    assert doc.take("", D2, 100, claim_gen=4) == 40 and doc.orphans_cap == 0
    doc.accounts[A].state = DEAD
    assert doc.take(A, D1, 500, claim_gen=4) == 300 and doc.accounts[A].cap == 0


def test_json_round_trip_and_garbage(tmp_path: Path) -> None:
    doc = doc_with(a=3, b=4)
    doc.take(B, D1, 1, 0)
    doc.accounts[A].evicting.append(f"{D2}.4096.~")
    assert LedgerDoc.from_json(doc.to_json()) == doc
    for raw in (b"", b"[]", b'{"format":1}', doc.to_json().replace(b'"cap":3', b'"cap":"3"'),
                doc.to_json().replace(A.encode(), b"../etc")):
        with pytest.raises(LedgerError):
            LedgerDoc.from_json(raw)


def test_versions_are_published_once(tmp_path: Path) -> None:
    first, second = chain(tmp_path, A), chain(tmp_path, B)
    assert second.latest() is None
    assert first.create(doc_with(a=10))
    assert not second.create(doc_with(b=10))  # the ledger exists: the loser joins it
    assert second.latest().accounts.keys() == {A}  # type: ignore[union-attr]

    def add_b(doc: LedgerDoc) -> bool:
        doc.accounts[B] = Account(0)
        return True

    assert second.update(add_b).n == 2
    # the first chain's cached version 1 is stale: its update lands on version 3
    new = first.update(lambda doc: doc.accounts[A].__setattr__("cap", 20) or True)
    assert new.n == 3 and new.accounts.keys() == {A, B} and new.accounts[A].cap == 20
    assert first.conflicts == 0  # it read the newest version before writing
    assert not any(p.name.startswith(".tmp-") for p in (tmp_path / LEDGER_DIR).iterdir())
    assert first.update(lambda doc: False).n == 3  # "nothing to change" writes nothing


def test_a_conflict_recomputes_on_the_newer_version(tmp_path: Path) -> None:
    one, two = chain(tmp_path, A), chain(tmp_path, B)
    assert one.create(doc_with(a=0))
    two.latest()
    calls = []

    def bump(doc: LedgerDoc) -> bool:
        calls.append(doc.n)
        if len(calls) == 1:  # another member publishes meanwhile
            one.update(lambda d: d.accounts[A].__setattr__("cap", d.accounts[A].cap + 1)
                       or True)
        doc.accounts[A].cap += 10
        return True

    assert two.update(bump).accounts[A].cap == 11
    assert calls == [1, 2] and two.conflicts == 1


def _bump_many(root: str, member: str, times: int) -> None:
    c = LedgerChain(Path(root), member, 0o600, 0o700)
    for _ in range(times):
        c.update(lambda doc: doc.accounts[A].__setattr__("cap", doc.accounts[A].cap + 1)
                 or True)


@pytest.mark.slow
def test_concurrent_processes_lose_no_update(tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(coordination, "EPOCH_VERSIONS", 16)  # epochs retire meanwhile
    assert chain(tmp_path).create(doc_with(a=0))
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_bump_many, args=(str(tmp_path), m, 40))
             for m in ("h-10-0000000a", "h-11-0000000b", "h-12-0000000c")]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    final = chain(tmp_path, B).latest()
    assert final is not None and final.n == 121 and final.accounts[A].cap == 120
    epochs = sorted(p.name for p in (tmp_path / LEDGER_DIR).iterdir() if p.name.isdigit())
    assert epochs == ["00000006", "00000007"]  # older epochs were removed whole


def test_a_reader_whose_version_was_retired_lists_the_directory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(coordination, "EPOCH_VERSIONS", 4)
    stale, busy = chain(tmp_path, B), chain(tmp_path, A)
    assert busy.create(doc_with(a=0))
    assert stale.latest().n == 1  # type: ignore[union-attr]
    for _ in range(20):
        busy.update(lambda doc: doc.accounts[A].__setattr__("cap", doc.accounts[A].cap + 1)
                    or True)
    assert not (tmp_path / version_path(1)).exists()
    # its version 1 is gone (and so is 2): it must not write a second version 2
    assert stale.latest().n == 21  # type: ignore[union-attr]
    assert stale.update(lambda doc: doc.accounts[A].__setattr__("cap", 0) or True).n == 22


def test_a_damaged_version_is_set_aside_not_a_fork(tmp_path: Path) -> None:
    """Damage is skipped by every member alike (the robustness suite covers each kind): the
    chain goes on from the last valid version, past the damaged number."""
    c = chain(tmp_path)
    assert c.create(doc_with(a=0))
    bad = tmp_path / version_path(2)
    bad.write_bytes(b"{not json")
    assert chain(tmp_path, B).latest().n == 1  # type: ignore[union-attr]
    assert chain(tmp_path, B).update(lambda doc: True).n == 3
    assert c.latest().n == 3  # type: ignore[union-attr]


def test_states_survive_a_round_trip() -> None:
    doc = doc_with(a=1, b=2)
    doc.accounts[B].state = DEAD
    assert LedgerDoc.from_json(doc.to_json()).accounts[B].state == DEAD
    assert doc.live() == [A] and doc.accounts[A].state == LIVE
