"""Shared mode with damaged journals: every line and file a peer wrote is untrusted input.

A journal planted or damaged in ``shared/members/`` (junk, an overlong line, a 200 MB or a
sparse 16 TiB file, a FIFO, a link, a directory), or a checksummed line claiming a size no
chunk file has: a member still starts within seconds, ``submit``, ``flush`` and ``close()``
return, the bytes on disk stay within the budget plus one chunk per member, a warning names
the journal, and every chunk read is the one written (or a miss).
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from support.stores import StoreFactory

from lmcache_nvme_backend.disk.coordination import journal_path
from lmcache_nvme_backend.disk.format import TensorMeta, file_size_for
from lmcache_nvme_backend.disk.layout import key_digest, namespace_id
from lmcache_nvme_backend.store.chunk_store import ChunkRead, ChunkStore
from lmcache_nvme_backend.store.shared.journal import MAX_CHUNK_FILE, _line
from lmcache_nvme_backend.store.shared.ledger import LedgerChain

pytestmark = pytest.mark.timeout(120)

NBYTES = 64 * 1024
FILE = file_size_for(NBYTES)
META = TensorMeta(shapes=((NBYTES,),), dtypes=("uint8",), fmt=1, nbytes=NBYTES)
BUDGET = 8  # chunks
STRANGER = "planted-99-deadbeef"  # a member id no process has
BOUND_S = 10.0  # generous: these calls hung or took 30 s and more before


def payload(key: str) -> bytes:
    return key.encode().ljust(64, b".") * (NBYTES // 64)


def put(store: ChunkStore, key: str) -> None:
    store.submit(key, "model", META, memoryview(payload(key)), release=lambda: None)


def read(store: ChunkStore, key: str) -> bytes | None:
    buf = bytearray(NBYTES)
    (ok,) = store.read_into([ChunkRead(key, memoryview(buf))])
    return bytes(buf) if ok else None


def disk_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in (root / "ns").rglob("*.kv"))


def timed(call: Callable[[], object]) -> float:
    started = time.monotonic()
    call()
    return time.monotonic() - started


def open_member(root: Path, open_store: StoreFactory) -> ChunkStore:
    return open_store(root, shared=True, max_size_gb=BUDGET * FILE / 2**30)


def check_members_work(root: Path, stores: list[ChunkStore], rounds: int = 3) -> None:
    """Every member writes past the budget (evicting), reads back what it finds, and the
    directory stays within its budget plus one chunk per member."""
    for i in range(rounds * BUDGET):
        for n, store in enumerate(stores):
            put(store, f"w{n}-{i}")
        for store in stores:
            assert store.flush(BOUND_S)
            store.refresh_shared()
        assert disk_bytes(root) <= (BUDGET + len(stores)) * FILE
    for store in stores:
        found = [k for n in range(len(stores)) for i in range(rounds * BUDGET)
                 if store.lookup(k := f"w{n}-{i}", "model")]
        assert found  # the newest writes are there
        for key in found:
            assert read(store, key) in (payload(key), None)  # a miss at worst, never wrong
    assert all(store.counter("evictions") > 0 for store in stores)


def plant(root: Path, kind: str) -> Path:
    """A journal of a member no process has, damaged as ``kind`` says."""
    path = root / journal_path(STRANGER, 1)
    path.parent.mkdir(parents=True, exist_ok=True)
    junk = random.Random(47).randbytes(1 << 20)
    if kind == "overlong line":  # a checksummed record of 1.3 MB
        path.write_bytes(_line("A " + " ".join(["ab" * 16] * 40_000)))
    elif kind == "junk":
        path.write_bytes(junk)
    elif kind == "200 MB of junk":
        with path.open("wb") as f:
            for _ in range(200):
                f.write(junk)
    elif kind == "sparse 16 TiB":  # less one block: the largest file ext4 holds
        path.touch()
        os.truncate(path, (16 << 40) - 4096)
    elif kind == "FIFO":
        os.mkfifo(path)
    elif kind == "symlink":
        (root / "elsewhere").write_bytes(_line("S"))
        path.symlink_to(root / "elsewhere")
    elif kind == "directory":
        path.mkdir()
    return path


@pytest.mark.parametrize("kind", ["overlong line", "junk", "200 MB of junk", "sparse 16 TiB",
                                  "FIFO", "symlink", "directory"])
def test_a_damaged_journal_costs_a_bounded_amount(
        tmp_path: Path, open_store: StoreFactory, package_log: pytest.LogCaptureFixture,
        kind: str) -> None:
    a = open_member(tmp_path, open_store)
    for i in range(4):
        put(a, f"a{i}")
    assert a.flush(BOUND_S)
    path = plant(tmp_path, kind)
    assert timed(a.refresh_shared) < BOUND_S  # a running member's read is bounded
    holder: list[ChunkStore] = []
    assert timed(lambda: holder.append(open_member(tmp_path, open_store))) < BOUND_S
    b = holder[0]
    assert b.lookup("a3", "model") and read(b, "a3") == payload("a3")
    check_members_work(tmp_path, [a, b])
    assert str(path) in package_log.text  # the warning names the journal
    damage = a.counter("shared_journal_refused") + a.counter("shared_journals_set_aside")
    assert damage >= 1 and b.counter("shared_journal_refused") + \
        b.counter("shared_journals_set_aside") >= 1
    assert timed(b.close) < BOUND_S and timed(a.close) < BOUND_S


def test_a_journal_beyond_its_bound_is_set_aside_for_the_members_next_generation(
        tmp_path: Path, open_store: StoreFactory, package_log: pytest.LogCaptureFixture
        ) -> None:
    """A planted newer generation (sparse, far beyond any journal's size) does not hide the
    member's real journal: readers set it aside and follow the generation before it."""
    a = open_member(tmp_path, open_store)
    b = open_member(tmp_path, open_store)
    a_id = a.shared_members()[0]
    planted = tmp_path / journal_path(a_id, 7)
    planted.touch()
    os.truncate(planted, 1 << 40)
    put(a, "after")
    assert a.flush(BOUND_S)
    b.refresh_shared()
    assert b.lookup("after", "model") and read(b, "after") == payload("after")
    assert f"journal {planted}: set aside" in package_log.text
    assert b.counter("shared_journals_set_aside") == 1


@pytest.mark.parametrize(("size", "refused"), [
    (1 << 40, True),  # 1 TiB: no chunk file is that large
    (-FILE, True),
    (MAX_CHUNK_FILE, False),  # a size a chunk file may have, but not this file's
])
def test_a_chunk_size_claimed_by_a_journal_never_decides_the_budget(
        tmp_path: Path, open_store: StoreFactory, package_log: pytest.LogCaptureFixture,
        size: int, refused: bool) -> None:
    """A checksummed line in a live member's journal claims a chunk of ``size``: refused
    when no chunk file has that size; otherwise the eviction that takes the chunk credits
    the file's real size (its ``lstat``), so the directory stays within its budget and no
    member evicts everything."""
    a = open_member(tmp_path, open_store)
    b = open_member(tmp_path, open_store)
    put(a, "real")
    assert a.flush(BOUND_S)
    digest = key_digest("claimed")
    claimed = a.chunk_path("claimed", "model")
    claimed.parent.mkdir(parents=True, exist_ok=True)
    # a file of a chunk's size, written for another key: reading it is a miss
    claimed.write_bytes(a.chunk_path("real", "model").read_bytes())
    journal = tmp_path / journal_path(a.shared_members()[0], 1)
    with journal.open("ab") as f:
        f.write(_line(f"P {digest} {namespace_id('model')} {size} -"))
    b.refresh_shared()
    assert b.lookup("claimed", "model") is not refused
    if refused:
        assert f"journal {journal}: 1 line(s) refused, field size" in package_log.text
        assert b.counter("shared_journal_refused") == 1
        claimed.unlink()  # in no index: no member would ever count or evict it
    for i in range(3 * BUDGET):  # b alone: it evicts the claimed chunk, then its own
        put(b, f"b{i}")
        assert b.flush(BOUND_S)
        assert disk_bytes(tmp_path) <= (BUDGET + 2) * FILE
    # not every chunk evicted for one claimed chunk
    assert sum(b.lookup(f"b{i}", "model") for i in range(3 * BUDGET)) >= BUDGET - 2
    check_members_work(tmp_path, [a, b])
    assert read(b, "claimed") is None
    # every version published since parses (a freed entry of a negative size would not)
    assert LedgerChain(tmp_path, STRANGER, 0o600, 0o700).latest() is not None
