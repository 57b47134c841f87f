"""The native engine's retired files (``recycle_bytes``): a removed chunk file is kept under a
temp name of this process and overwritten whole by the next write of its size; nothing
else changes about what is on disk or what a read sees.  Skipped (or failed under CI)
where the extension was not built."""

from __future__ import annotations

import errno
import os
import random
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from support.prerequisites import missing_prerequisite

from lmcache_nvme_backend.disk.format import (
    BLOCK_SIZE,
    HEADER_SIZE,
    TensorMeta,
    decode_header,
    padded_length,
    payload_checksum,
)
from lmcache_nvme_backend.disk.safe_fs import root_descriptor
from lmcache_nvme_backend.disk.validate import Expected, judge_chunk
from lmcache_nvme_backend.io import engine as seam
from lmcache_nvme_backend.io import native
from lmcache_nvme_backend.io.buffers import AlignedBuffer
from lmcache_nvme_backend.io.native import NativeEngine, WriteItem

if not native.available():
    missing_prerequisite(native.unavailable_reason())

SUFFIX = ".tmp-test-retired"
MODE = 0o640
SHARDS = ("ns/0123456789abcdef/aa", "ns/0123456789abcdef/bb")


def payload_for(n: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(n)


def meta_for(n: int) -> TensorMeta:
    return TensorMeta(shapes=((n,),), dtypes=("uint8",), fmt=1, nbytes=n)


def source_for(payload: bytes, aligned: bool = True) -> memoryview:
    n = len(payload)
    view = AlignedBuffer(n + 4096).view[:n] if aligned else memoryview(bytearray(n + 1))[1:]
    view[:] = payload
    return view


def file_size(n: int) -> int:
    return HEADER_SIZE + padded_length(n)


class Writes:
    """Synchronous writes and removals through one engine, over a root at ``root``."""

    def __init__(self, engine: NativeEngine, root: Path) -> None:
        self.engine, self.root = engine, root
        self.fd = root_descriptor(str(root))
        for shard in SHARDS:
            (root / shard).mkdir(parents=True, exist_ok=True)

    def item(self, shard: str, name: str, payload: memoryview, *, direct: bool = True,
             mode: int = MODE, victims: tuple[str, ...] = ()) -> WriteItem:
        return (self.fd, shard, f"{name}.tmp-test-w", name, payload, b"k", b"ns",
                meta_for(len(payload)).to_json(), None, direct, mode, 0o750, 0, victims)

    def write(self, *items: WriteItem) -> seam.Batch:
        done = threading.Event()
        got: list[seam.Batch] = []
        self.engine.submit_write(list(items), lambda batch: (got.append(batch), done.set()))
        assert done.wait(30)
        return got[0]

    def remove(self, *rels: str) -> list[int]:
        return self.engine.unlink([(self.fd, rel) for rel in rels])


@pytest.fixture
def writes_for(tmp_path: Path) -> Iterator[Callable[..., Writes]]:
    made: list[NativeEngine] = []

    def make(recycle_bytes: int = 64 << 20) -> Writes:
        made.append(NativeEngine(2, 2, 64 << 20, recycle_bytes, SUFFIX))
        return Writes(made[-1], tmp_path)

    yield make
    for engine in made:
        engine.close()


def recycled() -> int:
    return native.counters()["recycled_writes"]


def assert_chunk(path: Path, payload: bytes) -> None:
    """``path`` is exactly the chunk of ``payload``: whole, zero padded, and it validates."""
    n = len(payload)
    data = path.read_bytes()
    assert len(data) == file_size(n)
    assert data[HEADER_SIZE:HEADER_SIZE + n] == payload
    assert set(data[HEADER_SIZE + n:]) <= {0}
    assert decode_header(data[:HEADER_SIZE]).payload_checksum == payload_checksum(payload)
    assert judge_chunk(data[:HEADER_SIZE], Expected(key="k", payload_len=n, meta=meta_for(n),
                                                    file_size=len(data))).ok
    assert os.stat(path).st_mode & 0o7777 == MODE


def names_in(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


@pytest.mark.parametrize("n,direct,aligned", [
    (2 * BLOCK_SIZE, True, True),  # overlapped: written in groups while hashed
    (3 * BLOCK_SIZE + 4096, True, True),
    (BLOCK_SIZE + 100, True, True),  # one call, the tail staged and padded
    (2 * BLOCK_SIZE, True, False),  # a source that is not page aligned
    (BLOCK_SIZE + 100, False, True),  # buffered
], ids=["overlapped", "overlapped-short-group", "staged-tail", "unaligned", "buffered"])
def test_a_removed_file_is_overwritten_whole_by_the_next_write_of_its_size(
        writes_for, tmp_path: Path, n: int, direct: bool, aligned: bool) -> None:
    writes = writes_for()
    old, new = payload_for(n, 1), payload_for(n, 2)
    assert writes.write(writes.item(SHARDS[0], "old.kv", source_for(old, aligned),
                                    direct=direct)).statuses == bytes([seam.OK])
    inode = os.stat(tmp_path / SHARDS[0] / "old.kv").st_ino

    assert writes.remove(f"{SHARDS[0]}/old.kv") == [0]
    assert names_in(tmp_path) == [f"{SHARDS[0]}/old.kv{SUFFIX}"]  # gone from its name, kept
    assert writes.engine.retired_bytes() == file_size(n)

    before = recycled()
    assert writes.write(writes.item(SHARDS[1], "new.kv", source_for(new, aligned),
                                    direct=direct)).statuses == bytes([seam.OK])
    assert recycled() - before == 1
    assert names_in(tmp_path) == [f"{SHARDS[1]}/new.kv"]
    assert os.stat(tmp_path / SHARDS[1] / "new.kv").st_ino == inode  # the same file, reused
    assert writes.engine.retired_bytes() == 0
    assert_chunk(tmp_path / SHARDS[1] / "new.kv", new)


def test_a_write_of_another_size_or_mode_makes_a_new_file(writes_for, tmp_path: Path) -> None:
    writes = writes_for()
    n = 2 * BLOCK_SIZE
    writes.write(writes.item(SHARDS[0], "old.kv", source_for(payload_for(n, 1))))
    writes.remove(f"{SHARDS[0]}/old.kv")
    before = recycled()
    other = payload_for(n + 4096, 2)
    assert writes.write(writes.item(SHARDS[1], "bigger.kv", source_for(other))).statuses == \
        bytes([seam.OK])
    assert recycled() == before
    assert_chunk(tmp_path / SHARDS[1] / "bigger.kv", other)
    assert writes.engine.retired_bytes() == file_size(n)  # still kept for its size

    same = payload_for(n, 3)
    batch = writes.write(writes.item(SHARDS[1], "mode.kv", source_for(same), mode=0o600))
    assert batch.statuses == bytes([seam.OK]) and recycled() == before
    # the kept file was taken, found with another mode, and removed: never half-used
    assert names_in(tmp_path) == [f"{SHARDS[1]}/bigger.kv", f"{SHARDS[1]}/mode.kv"]
    assert os.stat(tmp_path / SHARDS[1] / "mode.kv").st_mode & 0o7777 == 0o600


def test_it_keeps_at_most_its_bytes_and_removes_the_rest(writes_for, tmp_path: Path) -> None:
    n = BLOCK_SIZE
    writes = writes_for(recycle_bytes=2 * file_size(n) + file_size(n) // 2)
    names = [f"c{i}.kv" for i in range(4)]
    writes.write(*(writes.item(SHARDS[0], name, source_for(payload_for(n, i)))
                   for i, name in enumerate(names)))
    assert writes.remove(*(f"{SHARDS[0]}/{name}" for name in names), f"{SHARDS[0]}/gone.kv") \
        == [0, 0, 0, 0, errno.ENOENT]
    assert writes.engine.retired_bytes() == 2 * file_size(n)
    assert len(names_in(tmp_path)) == 2
    assert all(name.endswith(SUFFIX) for name in names_in(tmp_path))


def test_a_write_takes_its_own_victim(writes_for, tmp_path: Path) -> None:
    """Eviction: the victims go first, into the pool, and the write of the same size that
    made room for itself overwrites one of them."""
    writes = writes_for()
    n = 2 * BLOCK_SIZE
    writes.write(writes.item(SHARDS[0], "victim.kv", source_for(payload_for(n, 1))))
    inode = os.stat(tmp_path / SHARDS[0] / "victim.kv").st_ino
    before = recycled()
    new = payload_for(n, 2)
    batch = writes.write(writes.item(SHARDS[1], "new.kv", source_for(new),
                                     victims=(f"{SHARDS[0]}/victim.kv",)))
    assert batch.statuses == bytes([seam.OK]) and recycled() - before == 1
    assert names_in(tmp_path) == [f"{SHARDS[1]}/new.kv"]
    assert os.stat(tmp_path / SHARDS[1] / "new.kv").st_ino == inode
    assert_chunk(tmp_path / SHARDS[1] / "new.kv", new)


@pytest.mark.parametrize("tamper", ["link", "grown", "hard-linked", "vanished"])
def test_a_kept_file_changed_meanwhile_is_never_written_into(
        writes_for, tmp_path: Path, tamper: str) -> None:
    """What the pool holds is checked when taken (O_NOFOLLOW, a lone regular file of the
    size and mode it was put with): anything else is removed and a new file is made."""
    writes = writes_for()
    n = BLOCK_SIZE
    writes.write(writes.item(SHARDS[0], "old.kv", source_for(payload_for(n, 1))))
    writes.remove(f"{SHARDS[0]}/old.kv")
    kept = tmp_path / SHARDS[0] / f"old.kv{SUFFIX}"
    outside = tmp_path.parent / f"{tmp_path.name}-outside"
    outside.write_bytes(b"x" * file_size(n))
    if tamper == "link":
        kept.unlink()
        kept.symlink_to(outside)
    elif tamper == "grown":
        with open(kept, "ab") as f:
            f.write(b"more")
    elif tamper == "hard-linked":
        os.link(kept, tmp_path / "second-name")
    else:
        kept.unlink()
    before = recycled()
    new = payload_for(n, 2)
    assert writes.write(writes.item(SHARDS[1], "new.kv", source_for(new))).statuses == \
        bytes([seam.OK])
    assert recycled() == before
    assert not kept.exists() and not kept.is_symlink()
    assert outside.read_bytes() == b"x" * file_size(n)
    assert_chunk(tmp_path / SHARDS[1] / "new.kv", new)


def test_close_removes_what_is_kept(writes_for, tmp_path: Path) -> None:
    writes = writes_for()
    n = BLOCK_SIZE
    writes.write(*(writes.item(SHARDS[i % 2], f"c{i}.kv", source_for(payload_for(n, i)))
                   for i in range(3)))
    writes.remove(*(f"{SHARDS[i % 2]}/c{i}.kv" for i in range(3)))
    assert len(names_in(tmp_path)) == 3
    writes.engine.close()
    assert names_in(tmp_path) == []
    assert writes.engine.retired_bytes() == 0
    assert writes.remove(f"{SHARDS[0]}/c0.kv") == [errno.ENOENT]  # gone, none kept


def test_without_recycle_bytes_a_removal_removes(tmp_path: Path) -> None:
    engine = NativeEngine(2, 2, 64 << 20)
    try:
        writes = Writes(engine, tmp_path)
        writes.write(writes.item(SHARDS[0], "c.kv", source_for(payload_for(BLOCK_SIZE, 1))))
        assert writes.remove(f"{SHARDS[0]}/c.kv") == [0]
        assert names_in(tmp_path) == [] and engine.retired_bytes() == 0
    finally:
        engine.close()


@pytest.mark.parametrize("suffix", [None, "", "/escape"])
def test_recycle_bytes_needs_a_plain_suffix(suffix: str | None) -> None:
    with pytest.raises(ValueError, match="recycle_suffix"):
        NativeEngine(1, 1, 64 << 20, 1 << 20, suffix)
