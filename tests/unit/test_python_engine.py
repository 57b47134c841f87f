"""The Python engine's own parts (io/python_engine.py and what it is built from:
disk/resolve.py beneath a root's descriptor, format.encode_raw_header and quick_verdict, the
read-priority gate, python_chunks.py, files.read_failure); the behaviour it shares with the
compiled engine is tests/unit/test_engine_contract.py."""

from __future__ import annotations

import errno
import os
import random
import stat
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import xxhash
from support.engine_contract import (
    NS_ID,
    Done,
    buffer_for,
    flip,
    meta_for,
    payload_for,
    read_share,
    rel_of,
    write_now,
    write_share,
)

from lmcache_nvme_backend.disk import format as fmt
from lmcache_nvme_backend.disk import resolve
from lmcache_nvme_backend.disk.format import (
    BLOCK_SIZE,
    HEADER_SIZE,
    FormatError,
    TensorMeta,
    block_digests,
    encode_header,
    encode_raw_header,
    padded_length,
    payload_checksum,
    quick_verdict,
)
from lmcache_nvme_backend.disk.safe_fs import NotAChunkFile, root_descriptor
from lmcache_nvme_backend.disk.validate import Expected, judge_chunk
from lmcache_nvme_backend.io import engine as seam
from lmcache_nvme_backend.io import native
from lmcache_nvme_backend.io.files import ShortFileError, read_failure
from lmcache_nvme_backend.io.python_chunks import unlink_at
from lmcache_nvme_backend.io.python_engine import PythonEngine, ReadPriorityGate


@pytest.fixture
def engine() -> Iterator[PythonEngine]:
    made = PythonEngine(2, 2, 1 << 20)
    yield made
    made.close()


@pytest.fixture(params=["openat2", "walk"])
def resolver(request: pytest.FixtureRequest) -> Iterator[str]:
    old = resolve.use_openat2(request.param == "openat2")
    try:
        yield request.param
    finally:
        resolve.use_openat2(old)


# -- beneath a root's descriptor --------------------------------------------------------------


def test_opens_beneath_the_root_and_never_through_a_link(tmp_path: Path, resolver: str) -> None:
    (tmp_path / "a" / "b").mkdir(parents=True)
    (tmp_path / "a" / "b" / "f").write_bytes(b"data")
    (tmp_path / "outside").mkdir()
    os.symlink(tmp_path / "outside", tmp_path / "a" / "link")
    os.symlink(tmp_path / "a" / "b" / "f", tmp_path / "a" / "b" / "flink")
    (tmp_path / "a" / "file").write_bytes(b"")
    root = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fd = resolve.open_at(root, "a/b/f", os.O_RDONLY)
        assert os.read(fd, 10) == b"data"
        os.close(fd)
        for rel, errnos in (("a/link/f", (errno.ELOOP, errno.ENOTDIR)),
                            ("a/b/flink", (errno.ELOOP,)), ("a/file/x", (errno.ENOTDIR,)),
                            ("a/../../etc", (errno.EXDEV,)), ("a/missing", (errno.ENOENT,))):
            with pytest.raises(OSError) as raised:
                resolve.open_at(root, rel, os.O_RDONLY)
            assert raised.value.errno in errnos, rel
    finally:
        os.close(root)


@pytest.mark.parametrize("existing,created_at", [
    ("", 0), ("ns", 1), ("ns/n", 2), ("ns/n/ab", -1)])
def test_makes_missing_directories_with_exactly_their_mode(tmp_path: Path, resolver: str,
                                                           existing: str, created_at: int) -> None:
    if existing:
        (tmp_path / existing).mkdir(parents=True)
    root = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    old = os.umask(0o077)
    try:
        fd, made_at = resolve.make_dirs_at(root, "ns/n/ab", 0o751)
        os.close(fd)
    finally:
        os.umask(old)
        os.close(root)
    assert made_at == created_at
    parts = Path("ns/n/ab").parts
    for depth in range(len(Path(existing).parts) if existing else 0, 3):
        assert stat.S_IMODE(tmp_path.joinpath(*parts[: depth + 1]).stat().st_mode) == 0o751


@pytest.mark.parametrize("rel", ["x/../..", "..", "x/./y", "/abs"])
def test_make_dirs_at_never_walks_out_of_the_root(tmp_path: Path, resolver: str,
                                                  rel: str) -> None:
    (tmp_path / "root").mkdir()
    root = os.open(tmp_path / "root", os.O_RDONLY | os.O_DIRECTORY)
    try:
        with pytest.raises(OSError) as raised:
            resolve.make_dirs_at(root, rel, 0o700)
    finally:
        os.close(root)
    assert raised.value.errno == errno.EXDEV
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["root"]


def test_unlink_at_removes_a_link_never_its_target(tmp_path: Path, resolver: str) -> None:
    (tmp_path / "d").mkdir()
    (tmp_path / "target").write_bytes(b"kept")
    os.symlink(tmp_path / "target", tmp_path / "d" / "l")
    root = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        assert [unlink_at(root, rel) for rel in ("d/l", "d/l", "target")] == \
            [0, errno.ENOENT, 0]
    finally:
        os.close(root)


# -- headers from raw bytes -------------------------------------------------------------------


@pytest.mark.parametrize("gpu", [None, (7, 2**64 - 1)])
@pytest.mark.parametrize("key,namespace", [("k", "ns"), ("é" * 500, "model@salt"), ("x", ""),
                                           ("\udcff-surrogate", "ns")])
def test_raw_headers_are_byte_identical_to_the_reference_encoder(
        key: str, namespace: str, gpu: tuple[int, int] | None) -> None:
    meta = TensorMeta(shapes=((123,),), dtypes=("uint8",), fmt=1, nbytes=123)
    ref = encode_header(key, namespace, meta, 123, 99, created_unix_ns=5, gpu_checksum=gpu)
    raw = encode_raw_header(key.encode("utf-8", "surrogatepass"), namespace.encode(),
                            meta.to_json(), 123, 99, 5, gpu)
    assert raw == ref
    if native.available():
        from lmcache_nvme_backend.io import _native  # type: ignore[attr-defined]

        assert _native.encode_header(key.encode("utf-8", "surrogatepass"), namespace.encode(),
                                     meta.to_json(), 123, 99, 5, gpu) == raw


def test_a_key_too_long_is_refused_like_the_reference_encoder() -> None:
    meta = TensorMeta(shapes=((1,),), dtypes=("uint8",), fmt=1, nbytes=1)
    with pytest.raises(FormatError):
        encode_header("k" * 5000, "ns", meta, 1, 0)
    with pytest.raises(ValueError, match="a header holds"):
        encode_raw_header(b"k" * 5000, b"ns", meta.to_json(), 1, 0, 0)


def test_the_quick_verdict_never_serves_what_the_validator_would_not() -> None:
    """Random damage to a header: whenever the quick check passes, ``judge_chunk`` serves
    it too (the quick check may refuse more: the validator then names the defect)."""
    meta = TensorMeta(shapes=((100,),), dtypes=("uint8",), fmt=1, nbytes=100)
    good = encode_raw_header(b"key", b"ns", meta.to_json(), 100, 42, 1, (1, 2))
    assert quick_verdict(good, b"key", meta.to_json(), 100, 42)
    assert not quick_verdict(good, b"kez", meta.to_json(), 100, 42)
    assert not quick_verdict(good, b"key", meta.to_json(), 100, 43)
    assert not quick_verdict(good, b"key", meta.to_json(), 99, 42)
    rng = random.Random(3)
    for _ in range(2000):
        raw = bytearray(good)
        for _ in range(rng.randint(1, 3)):
            raw[rng.choice([*range(0, 120), *range(4070, 4096)])] = rng.randrange(256)
        if rng.random() < 0.5:  # a header checksum that matches the damage
            raw[4088:] = xxhash.xxh3_64_intdigest(bytes(raw[:4088])).to_bytes(8, "little")
        if quick_verdict(bytes(raw), b"key", meta.to_json(), 100, 42):
            assert judge_chunk(bytes(raw), Expected(key="key", payload_len=100, meta=meta),
                               lambda h: h.payload_checksum == 42).ok


# -- the read-priority gate -------------------------------------------------------------------


def test_writers_wait_for_reads_at_most_a_while_and_never_once_released() -> None:
    gate = ReadPriorityGate(max_wait_s=0.2)
    assert gate.wait_for_readers() is False
    gate.begin_read()
    started = time.monotonic()
    assert gate.wait_for_readers() is True and time.monotonic() - started >= 0.19
    threading.Timer(0.05, gate.end_read).start()
    started = time.monotonic()
    assert gate.wait_for_readers() is True and time.monotonic() - started < 0.19
    with gate.reading():
        assert gate._readers == 1
        gate.release_writers()
        assert gate.wait_for_readers() is False


# -- read failures as the exceptions of the Python reads -----------------------------------------


def test_read_failure_names_what_is_there(tmp_path: Path) -> None:
    shard = tmp_path / "ns" / NS_ID / "ab"
    shard.mkdir(parents=True)
    os.symlink(tmp_path, shard / "link.kv")
    os.mkfifo(shard / "fifo.kv")
    (shard / "dir.kv").mkdir()
    (shard / "file.kv").write_bytes(b"")
    cases = {
        ("link.kv", errno.ELOOP): (NotAChunkFile, "symbolic link"),
        ("fifo.kv", errno.EINVAL): (NotAChunkFile, "a FIFO, not a chunk file"),
        ("dir.kv", errno.EINVAL): (NotAChunkFile, "a directory, not a chunk file"),
        ("file.kv", errno.EINVAL): (OSError, "Invalid argument"),  # O_DIRECT refused
        ("gone.kv", errno.ENOENT): (FileNotFoundError, ""),
        ("gone.kv", errno.EACCES): (PermissionError, ""),
        ("gone.kv", errno.ENODATA): (ShortFileError, "shorter"),
        ("gone.kv", errno.ESTALE): (OSError, ""),
        ("gone.kv", errno.EIO): (OSError, ""),
    }
    for (name, err), (kind, words) in cases.items():
        failure = read_failure(shard / name, err)
        assert type(failure) is kind and failure.errno == err, name
        assert words in str(failure) and failure.filename == str(shard / name)
    os.symlink(tmp_path, shard.parent / "cd")
    (shard.parent / "ef").write_bytes(b"")
    for where, err, words in (("cd", errno.ELOOP, "a symbolic link in the cache tree"),
                              ("ef", errno.ENOTDIR, "a regular file, not a directory")):
        failure = read_failure(shard.parent / where / "x.kv", err)
        assert isinstance(failure, NotAChunkFile) and words in str(failure)
        assert str(shard.parent / where) in str(failure)


# -- the engine's threads ------------------------------------------------------------------


def test_a_small_blocking_read_runs_on_the_calling_thread(engine: PythonEngine,
                                                          tmp_path: Path) -> None:
    write_now(engine, [write_share(tmp_path, ["a", "b"], [b"x" * 5000] * 2)])
    seen: set[str] = set()
    real = engine._read_next

    def spy(batch: object) -> bool:
        seen.add(threading.current_thread().name)
        return real(batch)  # type: ignore[arg-type]

    engine._read_next = spy  # type: ignore[method-assign]
    dests = [buffer_for(5000, "aligned") for _ in range(2)]
    assert engine.read([read_share(tmp_path, ["a", "b"], dests, 5000)]).statuses == bytes(2)
    assert seen == {threading.current_thread().name}


def test_many_chunks_are_read_by_the_readers_and_the_caller(engine: PythonEngine,
                                                            tmp_path: Path) -> None:
    n = 5 * (1 << 20) + 3
    keys = [f"k{i}" for i in range(6)]
    write_now(engine, [write_share(tmp_path, keys, [payload_for(n)] * 6)])
    dests = [buffer_for(n, "aligned" if i % 2 else "unaligned") for i in range(6)]
    share = read_share(tmp_path, keys, dests, n)
    for _ in range(3):
        assert engine.read([share]).statuses == bytes(6)
        assert all(bytes(d[:n]) == payload_for(n) for d in dests)
    flip(tmp_path / rel_of(tmp_path, "k3"), HEADER_SIZE + 4 * (1 << 20))
    batch = engine.read([read_share(tmp_path, keys, dests, n)])
    assert batch.statuses == bytes([0, 0, 0, seam.JUDGE, 0, 0])


@pytest.mark.parametrize("kind", ["aligned", "unaligned"])
@pytest.mark.parametrize("task_size", [8192, BLOCK_SIZE + 4096])
@pytest.mark.parametrize("n", [BLOCK_SIZE - 1, BLOCK_SIZE, 3 * BLOCK_SIZE + 4097])
def test_pieces_that_split_checksum_blocks_still_verify(tmp_path: Path, n: int,
                                                        task_size: int, kind: str) -> None:
    """I/Os of ``task_size`` that end inside checksum blocks: the payload is still hashed whole
    once it landed."""
    engine = PythonEngine(3, 1, task_size)
    try:
        write_now(engine, [write_share(tmp_path, ["k"], [payload_for(n)])])
        dest = buffer_for(n, kind)
        assert engine.read([read_share(tmp_path, ["k"], [dest], n)]).statuses == bytes(1)
        assert bytes(dest[:n]) == payload_for(n)
        flip(tmp_path / rel_of(tmp_path, "k"), HEADER_SIZE + n - 1)
        assert engine.read([read_share(tmp_path, ["k"], [dest], n)]).statuses == \
            bytes([seam.JUDGE])
    finally:
        engine.close()


@pytest.mark.parametrize("version", [1, 2])
def test_block_digests_are_hashed_only_for_version_2(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch,
                                                     version: int) -> None:
    """A version 1 file is checked over its whole payload: no block digest is hashed for it."""
    hashed: list[int] = []

    def counting(view: memoryview) -> list[int]:
        hashed.append(len(view))
        return block_digests(view)

    n = 3 * BLOCK_SIZE + 5
    payload = payload_for(n)
    path = tmp_path / rel_of(tmp_path, "k")
    path.parent.mkdir(parents=True)
    path.write_bytes(encode_header("k", "ns", TensorMeta.from_json(meta_for(n)), n,
                                   payload_checksum(payload, version), version=version)
                     + payload + bytes(padded_length(n) - n))
    dest = buffer_for(n, "aligned")
    monkeypatch.setattr(fmt, "block_digests", counting)
    engine = PythonEngine(1, 1, 4 << 20)
    try:
        assert engine.read([read_share(tmp_path, ["k"], [dest], n)]).statuses == bytes(1)
    finally:
        engine.close()
    assert sum(hashed) == (n if version == 2 else 0)


def test_close_from_a_callback_and_twice(tmp_path: Path) -> None:
    engine = PythonEngine(1, 1, 1 << 20)
    done = Done()

    def closes(batch: seam.Batch) -> None:
        engine.close()  # on an engine thread: it is not joined
        done("closed")(batch)

    engine.submit_write([write_share(tmp_path, ["k"], [b"abc"])], closes)
    assert done.wait_for(1)["closed"].statuses == bytes([seam.NEW_NAMESPACE])
    engine.close()
    engine.close()


def test_refuses_a_task_size_the_compiled_engine_refuses() -> None:
    for threads, writers, task_size in ((0, 1, 4096), (1, 0, 4096), (1, 1, 1000), (1, 1, 0)):
        with pytest.raises(ValueError, match="multiple of 4096"):
            PythonEngine(threads, writers, task_size)


def test_round_trip_through_the_portable_walk(engine: PythonEngine, tmp_path: Path,
                                              resolver: str) -> None:
    n = 3 * (1 << 20) + 1
    assert write_now(engine, [write_share(tmp_path, ["k"], [payload_for(n)], fsync=2)]
                     ).statuses == bytes([seam.NEW_NAMESPACE])
    dest = buffer_for(n, "unaligned")
    assert engine.read([read_share(tmp_path, ["k"], [dest], n)]).statuses == bytes(1)
    assert bytes(dest[:n]) == payload_for(n)
    meta = meta_for(n)
    assert engine.read([read_share(tmp_path, ["k"], [dest], n, meta=meta[:-1] + b" ")]
                       ).statuses == bytes([seam.JUDGE])
    fd = root_descriptor(str(tmp_path))
    assert engine.unlink([(fd, rel_of(tmp_path, "k"))]) == [0]


def test_writers_racing_to_make_one_new_shard_all_publish(engine: PythonEngine,
                                                          tmp_path: Path) -> None:
    """Both writers make the same missing leaf at once: one ``mkdir`` wins, the other opens
    what it made; every chunk is published and the leaf has exactly its mode."""
    for round_ in range(10):
        root = tmp_path / f"root{round_}"
        (root / "ns" / NS_ID).mkdir(parents=True)
        share = write_share(root, ["k"], [b"abc"])
        digests = [f"ab{i:030x}" for i in range(8)]
        share = share[:9] + (digests, share[10] * 8, [b"k"] * 8, None)
        old = os.umask(0o077)
        try:
            batch = write_now(engine, [share])
        finally:
            os.umask(old)
        assert batch.statuses == bytes(8), batch.details
        leaf = root / "ns" / NS_ID / "ab"
        assert stat.S_IMODE(leaf.stat().st_mode) == 0o750
        assert sorted(p.name for p in leaf.iterdir()) == sorted(d + ".kv" for d in digests)


def test_a_write_lets_reads_in_flight_go_first_for_a_while(engine: PythonEngine,
                                                           tmp_path: Path) -> None:
    done = Done()
    engine._gate.begin_read()  # a read in flight
    try:
        engine.submit_write([write_share(tmp_path, ["k"], [b"abc"])], done("w"))
        time.sleep(0.02)
        assert done.batches == {}  # waits up to 50 ms for the read
    finally:
        engine._gate.end_read()
    assert done.wait_for(1)["w"].statuses == bytes([seam.NEW_NAMESPACE])
    started = time.monotonic()
    engine._gate.begin_read()  # a read that does not end: the write goes after 50 ms
    try:
        assert write_now(engine, [write_share(tmp_path, ["j"], [b"abc"])]).statuses == bytes(1)
    finally:
        engine._gate.end_read()
    assert time.monotonic() - started >= 0.045
