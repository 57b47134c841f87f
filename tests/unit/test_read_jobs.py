"""io/read_jobs.py and the engine's job pipeline: block digests as pieces land, completion
callbacks, hashed writes with the header last."""

from __future__ import annotations

import os
import random
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from lmcache_nvme_backend.disk.format import (
    BLOCK_SIZE,
    HEADER_SIZE,
    TensorMeta,
    block_digests,
    combine_block_digests,
    decode_header,
    encode_header,
    padded_length,
    payload_checksum,
)
from lmcache_nvme_backend.io import read_jobs
from lmcache_nvme_backend.io.buffers import AlignedBuffer
from lmcache_nvme_backend.io.posix import PosixIOEngine, create_for_write
from lmcache_nvme_backend.io.read_jobs import ReadRequest

MIB = 1 << 20
# Sizes around block boundaries, and task sizes that split blocks or hold several.
SIZES = [0, 1, 4096, BLOCK_SIZE - 1, BLOCK_SIZE, 3 * BLOCK_SIZE + 4097]
TASK_SIZES = [8192, BLOCK_SIZE + 4096, 4 * MIB]


def payload_for(n: int) -> bytes:
    return random.Random(n).randbytes(n)


def header_for(payload: bytes, version: int = 2) -> bytes:
    n = len(payload)
    meta = TensorMeta(shapes=((n,),), dtypes=("uint8",), fmt=1, nbytes=n)
    return encode_header("k", "ns", meta, n, payload_checksum(payload, version), version=version)


@pytest.fixture
def pool() -> Iterator[ThreadPoolExecutor]:
    p = ThreadPoolExecutor(4)
    yield p
    p.shutdown(wait=True)


@pytest.fixture
def engines(pool: ThreadPoolExecutor) -> Callable[[int], PosixIOEngine]:
    return lambda task_size: PosixIOEngine(task_size, pool)


def dest_for(n: int, kind: str) -> memoryview:
    if kind == "aligned":
        return AlignedBuffer(n + 4096).view[: padded_length(n)] if n else memoryview(b"")
    return memoryview(bytearray(n + 1))[1:]  # not 4 KiB aligned: staged through a buffer


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "buffered"])
@pytest.mark.parametrize("kind", ["aligned", "unaligned"])
@pytest.mark.parametrize("task_size", TASK_SIZES)
@pytest.mark.parametrize("n", SIZES)
def test_digests_of_every_block_are_ready_when_the_read_completes(
        engines: Callable[[int], PosixIOEngine], tmp_path: Path, n: int, task_size: int,
        kind: str, direct: bool) -> None:
    engine = engines(task_size)
    payload = payload_for(n)
    path = tmp_path / "c.kv"
    engine.write_chunk(path, header_for(payload), memoryview(payload), direct=direct,
                       mode=0o600, sync_data=False)
    req = ReadRequest(path, n, dest_for(n, kind), direct)
    engine.read_chunks([req])
    assert req.error is None
    assert bytes(req.dest[:n]) == payload
    assert req.digests == block_digests(payload)
    assert req.payload_matches(decode_header(req.header))


def test_a_version_1_file_is_checked_over_the_whole_payload(
        engines: Callable[[int], PosixIOEngine], tmp_path: Path) -> None:
    engine = engines(8192)
    payload = payload_for(2 * BLOCK_SIZE + 5)
    path = tmp_path / "v1.kv"
    engine.write_chunk(path, header_for(payload, version=1), memoryview(payload), direct=True,
                       mode=0o600, sync_data=False)
    req = ReadRequest(path, len(payload), dest_for(len(payload), "aligned"), True)
    engine.read_chunks([req])
    header = decode_header(req.header)
    assert header.version == 1 and req.payload_matches(header)
    req.dest[BLOCK_SIZE + 3] ^= 0xFF
    assert not req.payload_matches(header)


@pytest.mark.parametrize("version", [1, 2])
def test_block_digests_are_hashed_only_for_version_2(
        engines: Callable[[int], PosixIOEngine], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch, version: int) -> None:
    hashed: list[int] = []

    def counting(view: memoryview) -> list[int]:
        hashed.append(len(view))
        return block_digests(view)

    monkeypatch.setattr(read_jobs, "hash_blocks", counting)
    engine = engines(4 * MIB)  # one piece: the header lands with the payload
    payload = payload_for(3 * BLOCK_SIZE + 5)
    path = tmp_path / "c.kv"
    engine.write_chunk(path, header_for(payload, version=version), memoryview(payload),
                       direct=True, mode=0o600, sync_data=False)
    req = ReadRequest(path, len(payload), dest_for(len(payload), "aligned"), True)
    engine.read_chunks([req])
    assert req.error is None and req.payload_matches(decode_header(req.header))
    assert sum(hashed) == (len(payload) if version == 2 else 0)


def test_a_changed_block_fails_the_version_2_check(engines: Callable[[int], PosixIOEngine],
                                                   tmp_path: Path) -> None:
    engine = engines(4 * MIB)
    payload = bytearray(payload_for(3 * BLOCK_SIZE))
    path = tmp_path / "c.kv"
    header = header_for(bytes(payload))
    payload[2 * BLOCK_SIZE + 100] ^= 0x01  # on disk, under a header for the original bytes
    engine.write_chunk(path, header, memoryview(payload), direct=True, mode=0o600,
                       sync_data=False)
    req = ReadRequest(path, len(payload), dest_for(len(payload), "aligned"), True)
    engine.read_chunks([req])
    assert req.error is None and not req.payload_matches(decode_header(req.header))


def test_submitted_reads_complete_once_each_on_pool_threads(
        engines: Callable[[int], PosixIOEngine], tmp_path: Path) -> None:
    engine = engines(BLOCK_SIZE)
    payloads = [payload_for(n) for n in (5000, 2 * BLOCK_SIZE, 3 * BLOCK_SIZE + 1)]
    done: list[tuple[int, str]] = []
    finished = threading.Semaphore(0)
    requests = []
    for i, payload in enumerate(payloads):
        path = tmp_path / f"{i}.kv"
        engine.write_chunk(path, header_for(payload), memoryview(payload), direct=True,
                           mode=0o600, sync_data=False)

        def on_done(req: ReadRequest, i: int = i) -> None:
            done.append((i, threading.current_thread().name))
            finished.release()

        requests.append(ReadRequest(path, len(payload), dest_for(len(payload), "aligned"),
                                    True, on_done=on_done))
    engine.submit_reads(requests)
    for _ in requests:
        assert finished.acquire(timeout=30)
    assert sorted(i for i, _ in done) == [0, 1, 2]
    assert all(name != threading.current_thread().name for _, name in done)
    for req, payload in zip(requests, payloads, strict=True):
        assert bytes(req.dest[: len(payload)]) == payload
        assert req.digests == block_digests(payload)


def test_a_failing_completion_never_stops_the_others(engines: Callable[[int], PosixIOEngine],
                                                     tmp_path: Path) -> None:
    engine = engines(8192)
    payload = payload_for(30000)
    paths = [tmp_path / f"{i}.kv" for i in range(3)]
    for path in paths:
        engine.write_chunk(path, header_for(payload), memoryview(payload), direct=True,
                           mode=0o600, sync_data=False)
    seen: list[Path] = []

    def on_done(req: ReadRequest) -> None:
        seen.append(req.path)
        if req.path == paths[0]:
            raise RuntimeError("a broken callback")

    engine.read_chunks([ReadRequest(p, len(payload), dest_for(len(payload), "aligned"), True,
                                    on_done=on_done) for p in paths])
    assert sorted(seen) == sorted(paths)


def test_missing_files_and_small_buffers_complete_with_an_error(
        engines: Callable[[int], PosixIOEngine], tmp_path: Path) -> None:
    engine = engines(8192)
    calls: list[BaseException | None] = []
    missing = ReadRequest(tmp_path / "nope.kv", 9000, dest_for(9000, "aligned"), True,
                          on_done=lambda r: calls.append(r.error))
    small = ReadRequest(tmp_path / "nope.kv", 9000, memoryview(bytearray(10)), True,
                        on_done=lambda r: calls.append(r.error))
    engine.read_chunks([missing, small])
    assert isinstance(missing.error, FileNotFoundError)
    assert isinstance(small.error, ValueError)
    assert len(calls) == 2


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "buffered"])
@pytest.mark.parametrize("n", [0, 4097, 3 * BLOCK_SIZE + 17])
def test_hashed_write_puts_the_header_from_the_digests_last(
        engines: Callable[[int], PosixIOEngine], tmp_path: Path, n: int, direct: bool) -> None:
    engine = engines(BLOCK_SIZE)
    payload = payload_for(n)
    given: list[list[int]] = []

    def header_from(digests: list[int]) -> bytes:
        given.append(digests)
        meta = TensorMeta(shapes=((n,),), dtypes=("uint8",), fmt=1, nbytes=n)
        return encode_header("k", "ns", meta, n, combine_block_digests(digests))

    path = tmp_path / "h.kv"
    fd = create_for_write(path, direct, 0o640)
    try:
        engine.write_hashed_to(fd, memoryview(payload), header_from, direct=direct,
                               sync_data=True)
    finally:
        os.close(fd)
    assert given == [block_digests(payload)]
    raw = path.read_bytes()
    assert len(raw) == HEADER_SIZE + padded_length(n)
    assert raw[HEADER_SIZE : HEADER_SIZE + n] == payload
    assert decode_header(raw[:HEADER_SIZE]).payload_checksum == payload_checksum(payload)
    assert os.stat(path).st_mode & 0o777 == 0o640


def test_a_chunk_file_is_never_created_over_an_existing_one(tmp_path: Path) -> None:
    path = tmp_path / "x.kv"
    path.write_bytes(b"someone else's")
    with pytest.raises(FileExistsError):
        create_for_write(path, direct=False, mode=0o600)
    assert path.read_bytes() == b"someone else's"


def test_warm_up_starts_the_threads(pool: ThreadPoolExecutor,
                                    engines: Callable[[int], PosixIOEngine]) -> None:
    engines(8192).warm_up(4)
    assert len(pool._threads) == 4
