"""Every integrity guarantee through the store after the per-chunk read pipeline and format 2:
a damaged block anywhere, truncation, foreign and wrong-key files are misses (quarantined);
version 1 and version 2 files in one directory both serve."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from support.chunks import NS, meta_for, put, read
from support.stores import StoreFactory

from lmcache_nvme_backend.disk.format import (
    BLOCK_SIZE,
    HEADER_SIZE,
    encode_header,
    padded_length,
    payload_checksum,
)
from lmcache_nvme_backend.disk.layout import RootLayout, key_digest, namespace_id

SIZE = 3 * BLOCK_SIZE + 1000  # four checksum blocks, the last one short


def payload(key: str, size: int = SIZE) -> bytes:
    return random.Random(key).randbytes(size)


def chunk_file(root: Path, key: str) -> Path:
    return RootLayout(root).chunk_path(namespace_id(NS), key_digest(key))


def write_v1_file(root: Path, key: str, data: bytes) -> None:
    """A chunk file as a version 1 writer left it (one xxh3 over the whole payload)."""
    path = chunk_file(root, key)
    path.parent.mkdir(parents=True, exist_ok=True)
    header = encode_header(key, NS, meta_for(len(data)), len(data),
                           payload_checksum(data, version=1), version=1)
    path.write_bytes(header + data + bytes(padded_length(len(data)) - len(data)))


def store_with(open_store: StoreFactory, root: Path, keys: list[str]) -> None:
    store = open_store(root)
    for key in keys:
        store.submit(key, NS, meta_for(SIZE), memoryview(payload(key)), release=lambda: None)
    assert store.flush(30)
    store.close()


@pytest.mark.parametrize("offset", [0, BLOCK_SIZE - 1, BLOCK_SIZE, 2 * BLOCK_SIZE + 77,
                                    SIZE - 1])
def test_a_flipped_bit_in_any_block_is_a_quarantined_miss(open_store: StoreFactory,
                                                          tmp_path: Path, offset: int) -> None:
    root = tmp_path / "cache"
    store_with(open_store, root, ["a", "b"])
    path = chunk_file(root, "a")
    raw = bytearray(path.read_bytes())
    raw[HEADER_SIZE + offset] ^= 0x10
    path.write_bytes(raw)
    store = open_store(root)
    assert read(store, "a", SIZE) is None
    assert read(store, "b", SIZE) == payload("b")
    assert store.counter("checksum_failures") == 1
    assert store.counter("quarantined_files") == 1 and not path.exists()
    assert not store.contains("a")


@pytest.mark.parametrize("keep", [HEADER_SIZE - 1, HEADER_SIZE + BLOCK_SIZE,
                                  HEADER_SIZE + SIZE - 1])
def test_a_truncated_file_is_a_quarantined_miss(open_store: StoreFactory, tmp_path: Path,
                                                keep: int) -> None:
    root = tmp_path / "cache"
    store_with(open_store, root, ["a"])
    path = chunk_file(root, "a")
    path.write_bytes(path.read_bytes()[:keep])
    store = open_store(root)
    assert read(store, "a", SIZE) is None
    assert store.counter("invalid_files") == 1 and not path.exists()


def test_foreign_and_wrong_key_files_are_misses(open_store: StoreFactory,
                                                tmp_path: Path) -> None:
    root = tmp_path / "cache"
    store_with(open_store, root, ["a", "b"])
    a, b = chunk_file(root, "a"), chunk_file(root, "b")
    a.write_bytes(b.read_bytes())  # b's file under a's name: valid, but another key
    store = open_store(root)
    assert read(store, "a", SIZE) is None
    assert read(store, "b", SIZE) == payload("b")
    foreign = chunk_file(root, "c")
    foreign.parent.mkdir(parents=True, exist_ok=True)
    foreign.write_bytes(b"\x7fELF not a chunk" * 4096)
    store.close()
    store = open_store(root)
    assert read(store, "c", SIZE) is None
    assert store.counter("invalid_files") == 1


def test_version_1_and_version_2_files_in_one_directory_both_serve(open_store: StoreFactory,
                                                                   tmp_path: Path) -> None:
    root = tmp_path / "cache"
    store_with(open_store, root, ["new"])
    write_v1_file(root, "old", payload("old"))
    write_v1_file(root, "old-small", payload("old-small", 5000))
    store = open_store(root)
    assert read(store, "new", SIZE) == payload("new")
    assert read(store, "old", SIZE) == payload("old")
    assert read(store, "old-small", 5000) == payload("old-small", 5000)
    assert store.counter("invalid_files") == 0
    raw = bytearray(chunk_file(root, "old").read_bytes())
    raw[HEADER_SIZE + 2 * BLOCK_SIZE] ^= 0x01
    chunk_file(root, "old").write_bytes(raw)
    assert read(store, "old", SIZE) is None  # the version 1 check still catches it
    assert store.counter("checksum_failures") == 1


def test_the_store_writes_version_2(open_store: StoreFactory, tmp_path: Path) -> None:
    store = open_store(tmp_path / "cache")
    assert put(store, "k", 5000).value == "queued"
    assert store.flush(10)
    raw = chunk_file(tmp_path / "cache", "k").read_bytes()
    assert int.from_bytes(raw[8:10], "little") == 2
    assert read(store, "k", 5000) is not None
