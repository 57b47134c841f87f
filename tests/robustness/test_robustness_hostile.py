"""Hostile input: keys / model names that try to escape the root, symlinks and foreign
files planted in the tree, headers with absurd lengths or another format version."""

from __future__ import annotations

import os
import struct
import tracemalloc
from pathlib import Path

import pytest
from support.chunks import meta_for, payload_for, read
from support.stores import StoreFactory

from lmcache_nvme_backend.disk.format import HEADER_SIZE, encode_header
from lmcache_nvme_backend.disk.layout import RootLayout, key_digest, namespace_id
from lmcache_nvme_backend.store.chunk_store import SubmitResult

pytestmark = pytest.mark.timeout(60)

HOSTILE = [
    "../../../../etc/passwd", "/etc/shadow", "a/b/../../c", "..", ".", "", "\x00",
    "key\x00../../x", "\\..\\..\\windows", "ключ-🙂-鍵", "x" * 3000, "%2e%2e%2f" * 50,
    "model\nname", "raw-bytes-\udcff-decoded",  # a lone surrogate (os.fsdecode of bad bytes)
]


CAPACITY_GB = 0.1


def test_hostile_keys_and_model_names_stay_inside_the_root(tmp_path: Path,
                                                           open_store: StoreFactory) -> None:
    root = tmp_path / "cache"
    layout = RootLayout(root)
    for name in HOSTILE:
        for ns in (name, "m"):
            p = layout.chunk_path(namespace_id(ns), key_digest(name)).resolve()
            assert root.resolve() in p.parents
            assert p.name.isascii() and "\x00" not in str(p)
    store = open_store(root, max_size_gb=CAPACITY_GB)
    try:
        stored = []
        for i, name in enumerate(HOSTILE):
            data = payload_for(ascii(name), 5000 + i)
            r = store.submit(name, name, meta_for(len(data)), memoryview(data), lambda: None)
            assert r in (SubmitResult.QUEUED, SubmitResult.OVERSIZE)  # long keys: refused
            if r is SubmitResult.QUEUED:
                stored.append((name, data))
        assert store.flush(10)
        assert len(stored) >= len(HOSTILE) - 3
        for name, data in stored:
            assert read(store, name, len(data)) == data
    finally:
        store.close()
    outside = {p for p in tmp_path.rglob("*")} - {p for p in root.rglob("*")} - {root}
    assert not outside, outside
    for p in root.rglob("*"):
        assert p.resolve().is_relative_to(root.resolve())


def test_symlinks_and_foreign_files_are_ignored_never_followed(
        tmp_path: Path, open_store: StoreFactory) -> None:
    root = tmp_path / "cache"
    store = open_store(root, max_size_gb=CAPACITY_GB)
    data = payload_for("victim", 8192)
    store.submit("victim", "m", meta_for(8192), memoryview(data), lambda: None)
    store.flush(10)
    store.close()
    layout = RootLayout(root)
    real = layout.chunk_path(namespace_id("m"), key_digest("victim"))
    # a valid chunk file outside the tree, linked in under the names of two keys
    secret = tmp_path / "secret.kv"
    secret.write_bytes(real.read_bytes())
    real.unlink()
    os.symlink(secret, real)
    other = layout.chunk_path(namespace_id("m"), key_digest("other"))
    other.parent.mkdir(parents=True, exist_ok=True)
    os.symlink(secret, other)
    # a symlinked shard directory and a symlinked namespace pointing outside
    (tmp_path / "elsewhere").mkdir()
    os.symlink(tmp_path / "elsewhere", root / "ns" / ("f" * 16))
    # foreign files with chunk-like names and junk names
    junk = layout.chunk_path(namespace_id("m"), key_digest("junk"))
    junk.parent.mkdir(parents=True, exist_ok=True)
    junk.write_bytes(os.urandom(3 * HEADER_SIZE))
    (real.parent / "README.txt").write_text("not ours")
    (root / "ns" / "stray-file").write_bytes(b"x")

    store = open_store(root, max_size_gb=CAPACITY_GB)
    try:
        assert not store.contains("victim") and not store.contains("other")
        assert read(store, "victim", 8192) is None
        if store.contains("junk"):  # listed by name, rejected on first touch
            assert store.tensor_meta("junk") is None
        assert not store.contains("junk")
        # the link target is untouched, never moved to quarantine, never deleted
        assert secret.read_bytes()[:8] == b"LMCNVME\x00"
        # the store still works
        store.submit("fresh", "m", meta_for(4096), memoryview(payload_for("fresh", 4096)),
                     lambda: None)
        store.flush(10)
        assert read(store, "fresh", 4096) == payload_for("fresh", 4096)
    finally:
        store.close()
    assert list((tmp_path / "elsewhere").iterdir()) == []


def _plant(root: Path, key: str, header: bytes) -> None:
    path = RootLayout(root).chunk_path(namespace_id("m"), key_digest(key))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(header + bytes(4096))


def _with_fixed_field(header: bytes, fmt: str, offset: int, value: int) -> bytes:
    raw = bytearray(header)
    struct.pack_into(fmt, raw, offset, value)
    return bytes(raw)


@pytest.mark.parametrize("case", ["huge_length", "unknown_version", "huge_key_len",
                                  "huge_meta_len"])
def test_absurd_headers_are_misses_without_large_allocations(tmp_path: Path, case: str,
                                                             open_store: StoreFactory) -> None:
    root = tmp_path / "cache"
    key = "k"
    good = encode_header(key, "m", meta_for(4096), 4096, 0)
    header = {
        # offsets in format._FIXED "<8sHHIQQQHHH": version @8, payload_len @16, key_len @40,
        # meta_len @44 (header checksum left stale on purpose for some, fixed for none)
        "huge_length": encode_header(key, "m", meta_for(1 << 35), 1 << 35, 0),
        "unknown_version": _with_fixed_field(good, "<H", 8, 3),
        "huge_key_len": _with_fixed_field(good, "<H", 40, 0xFFFF),
        "huge_meta_len": _with_fixed_field(good, "<H", 44, 0xFFFF),
    }[case]
    _plant(root, key, header)
    tracemalloc.start()
    try:
        store = open_store(root, max_size_gb=CAPACITY_GB)
        try:
            assert store.tensor_meta(key) is None
            assert read(store, key, 4096) is None
            assert not store.contains(key)
            assert store.counter("invalid_files") == 1
        finally:
            store.close()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 16 * 2**20, f"peak Python allocation {peak} bytes"
