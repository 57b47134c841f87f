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
from lmcache_nvme_backend.disk.layout import RootLayout
from lmcache_nvme_backend.disk.safe_fs import root_descriptor
from lmcache_nvme_backend.disk.validate import Expected, judge_chunk
from lmcache_nvme_backend.io import engine as seam
from lmcache_nvme_backend.io import native
from lmcache_nvme_backend.io.buffers import AlignedBuffer
from lmcache_nvme_backend.io.native import NativeEngine

if not native.available():
    missing_prerequisite(native.unavailable_reason())

SUFFIX = ".tmp-test-retired"
MODE = 0o640
NS_ID = "0123456789abcdef"
SHARDS = ("aa", "bb")  # the first hex digits of a digest: its shard directory


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


def digest(shard: str, name: str) -> str:
    """The digest of chunk ``name`` in shard directory ``shard`` (a lowercase hex name)."""
    return shard + name.encode().hex()


class Writes:
    """Synchronous writes and removals through one engine, over a root at ``root``: each
    chunk named by its shard and a name (``digest``), its key ``k``."""

    def __init__(self, engine: NativeEngine, root: Path) -> None:
        self.engine, self.root = engine, root
        self.fd = root_descriptor(str(root))
        self.layout = RootLayout(root)
        for shard in SHARDS:
            (root / self.layout.shard_rel(NS_ID, shard)).mkdir(parents=True, exist_ok=True)

    def rel(self, shard: str, name: str) -> str:
        """The chunk's file beneath the root."""
        return self.layout.chunk_rel(NS_ID, digest(shard, name))

    def path(self, shard: str, name: str) -> Path:
        return self.root / self.rel(shard, name)

    def share(self, shard: str, name: str, payload: memoryview, *, direct: bool = True,
              mode: int = MODE, victims: tuple[str, ...] = ()) -> seam.WriteShare:
        """A share of one chunk (a batch of them has a mode and a direct flag each)."""
        return (self.fd, self.layout.write_naming(NS_ID, ".tmp-test-w"), b"ns",
                meta_for(len(payload)).to_json(), direct, mode, 0o750, 0, victims,
                [digest(shard, name)], [payload], [b"k"], None)

    def write(self, *shares: seam.WriteShare) -> seam.Batch:
        done = threading.Event()
        got: list[seam.Batch] = []
        self.engine.submit_write(list(shares), lambda batch: (got.append(batch), done.set()))
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
    assert writes.write(writes.share(SHARDS[0], "old", source_for(old, aligned),
                                     direct=direct)).statuses == bytes([seam.OK])
    inode = os.stat(writes.path(SHARDS[0], "old")).st_ino

    assert writes.remove(writes.rel(SHARDS[0], "old")) == [0]
    assert names_in(tmp_path) == [writes.rel(SHARDS[0], "old") + SUFFIX]  # not removed: kept
    assert writes.engine.retired_bytes() == file_size(n)

    before = recycled()
    assert writes.write(writes.share(SHARDS[1], "new", source_for(new, aligned),
                                     direct=direct)).statuses == bytes([seam.OK])
    assert recycled() - before == 1
    assert names_in(tmp_path) == [writes.rel(SHARDS[1], "new")]
    assert os.stat(writes.path(SHARDS[1], "new")).st_ino == inode  # the same file, reused
    assert writes.engine.retired_bytes() == 0
    assert_chunk(writes.path(SHARDS[1], "new"), new)


def test_a_write_of_another_size_or_mode_makes_a_new_file(writes_for, tmp_path: Path) -> None:
    writes = writes_for()
    n = 2 * BLOCK_SIZE
    writes.write(writes.share(SHARDS[0], "old", source_for(payload_for(n, 1))))
    writes.remove(writes.rel(SHARDS[0], "old"))
    before = recycled()
    other = payload_for(n + 4096, 2)
    assert writes.write(writes.share(SHARDS[1], "bigger", source_for(other))).statuses == \
        bytes([seam.OK])
    assert recycled() == before
    assert_chunk(writes.path(SHARDS[1], "bigger"), other)
    assert writes.engine.retired_bytes() == file_size(n)  # still kept for its size

    same = payload_for(n, 3)
    batch = writes.write(writes.share(SHARDS[1], "mode", source_for(same), mode=0o600))
    assert batch.statuses == bytes([seam.OK]) and recycled() == before
    # the kept file was taken, found with another mode, and removed: never half-used
    assert names_in(tmp_path) == sorted([writes.rel(SHARDS[1], "bigger"),
                                         writes.rel(SHARDS[1], "mode")])
    assert os.stat(writes.path(SHARDS[1], "mode")).st_mode & 0o7777 == 0o600


def test_it_keeps_at_most_its_bytes_and_removes_the_rest(writes_for, tmp_path: Path) -> None:
    n = BLOCK_SIZE
    writes = writes_for(recycle_bytes=2 * file_size(n) + file_size(n) // 2)
    names = [f"c{i}" for i in range(4)]
    writes.write(*(writes.share(SHARDS[0], name, source_for(payload_for(n, i)))
                   for i, name in enumerate(names)))
    gone = writes.rel(SHARDS[0], "gone")
    assert writes.remove(*(writes.rel(SHARDS[0], name) for name in names), gone) == \
        [0, 0, 0, 0, errno.ENOENT]
    assert writes.engine.retired_bytes() == 2 * file_size(n)
    assert len(names_in(tmp_path)) == 2
    assert all(name.endswith(SUFFIX) for name in names_in(tmp_path))


def test_a_write_takes_its_own_victim(writes_for, tmp_path: Path) -> None:
    """Eviction: the victims go first, into the pool, and the write of the same size that
    made room for itself overwrites one of them."""
    writes = writes_for()
    n = 2 * BLOCK_SIZE
    writes.write(writes.share(SHARDS[0], "victim", source_for(payload_for(n, 1))))
    inode = os.stat(writes.path(SHARDS[0], "victim")).st_ino
    before = recycled()
    new = payload_for(n, 2)
    batch = writes.write(writes.share(SHARDS[1], "new", source_for(new),
                                      victims=(writes.rel(SHARDS[0], "victim"),)))
    assert batch.statuses == bytes([seam.OK]) and recycled() - before == 1
    assert names_in(tmp_path) == [writes.rel(SHARDS[1], "new")]
    assert os.stat(writes.path(SHARDS[1], "new")).st_ino == inode
    assert_chunk(writes.path(SHARDS[1], "new"), new)


@pytest.mark.parametrize("tamper", ["link", "grown", "hard-linked", "vanished"])
def test_a_kept_file_changed_meanwhile_is_never_written_into(
        writes_for, tmp_path: Path, tamper: str) -> None:
    """What the pool holds is checked when taken (O_NOFOLLOW, a lone regular file of the
    size and mode it was put with): anything else is removed and a new file is made."""
    writes = writes_for()
    n = BLOCK_SIZE
    writes.write(writes.share(SHARDS[0], "old", source_for(payload_for(n, 1))))
    writes.remove(writes.rel(SHARDS[0], "old"))
    kept = tmp_path / (writes.rel(SHARDS[0], "old") + SUFFIX)
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
    assert writes.write(writes.share(SHARDS[1], "new", source_for(new))).statuses == \
        bytes([seam.OK])
    assert recycled() == before
    assert not kept.exists() and not kept.is_symlink()
    assert outside.read_bytes() == b"x" * file_size(n)
    assert_chunk(writes.path(SHARDS[1], "new"), new)


def test_close_removes_what_is_kept(writes_for, tmp_path: Path) -> None:
    writes = writes_for()
    n = BLOCK_SIZE
    writes.write(*(writes.share(SHARDS[i % 2], f"c{i}", source_for(payload_for(n, i)))
                   for i in range(3)))
    writes.remove(*(writes.rel(SHARDS[i % 2], f"c{i}") for i in range(3)))
    assert len(names_in(tmp_path)) == 3
    writes.engine.close()
    assert names_in(tmp_path) == []
    assert writes.engine.retired_bytes() == 0
    assert writes.remove(writes.rel(SHARDS[0], "c0")) == [errno.ENOENT]  # gone, none kept


def test_without_recycle_bytes_a_removal_removes(tmp_path: Path) -> None:
    engine = NativeEngine(2, 2, 64 << 20)
    try:
        writes = Writes(engine, tmp_path)
        writes.write(writes.share(SHARDS[0], "c", source_for(payload_for(BLOCK_SIZE, 1))))
        assert writes.remove(writes.rel(SHARDS[0], "c")) == [0]
        assert names_in(tmp_path) == [] and engine.retired_bytes() == 0
    finally:
        engine.close()


@pytest.mark.parametrize("suffix", [None, "", "/escape"])
def test_recycle_bytes_needs_a_plain_suffix(suffix: str | None) -> None:
    with pytest.raises(ValueError, match="recycle_suffix"):
        NativeEngine(1, 1, 64 << 20, 1 << 20, suffix)
