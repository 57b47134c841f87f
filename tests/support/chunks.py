"""Chunk payloads, metadata, and writes / reads through a ``ChunkStore`` (no LMCache)."""

from __future__ import annotations

from pathlib import Path

from lmcache_nvme_backend.disk.format import TensorMeta
from lmcache_nvme_backend.store.chunk_store import ChunkRead, ChunkStore, SubmitResult

NS = "test-model"
CHUNK = 256 * 1024 + 123  # deliberately not a multiple of 4 KiB


def payload_for(key: str, size: int = CHUNK) -> bytes:
    """Deterministic, key-specific bytes, so a wrong chunk can never look right."""
    seed = key.encode() * (size // max(1, len(key)) + 1)
    return bytes(b ^ (i * 31 & 0xFF) for i, b in enumerate(seed[:size]))


def meta_for(size: int) -> TensorMeta:
    return TensorMeta(shapes=((size,),), dtypes=("uint8",), fmt=1, nbytes=size)


def put(store: ChunkStore, key: str, size: int = CHUNK) -> SubmitResult:
    """Submit ``payload_for(key, size)`` under ``key`` in namespace ``NS``."""
    data = payload_for(key, size)
    return store.submit(key, NS, meta_for(size), memoryview(data), release=lambda: None)


def read(store: ChunkStore, key: str, size: int = CHUNK) -> bytes | None:
    """The ``size`` payload bytes of ``key``, or None on a miss."""
    dest = bytearray(size + 8192)
    ok = store.read_into([ChunkRead(key, memoryview(dest))])[0]
    return bytes(dest[:size]) if ok else None


def files_on_disk(root: Path) -> list[Path]:
    """Every file under ``root/ns`` except the NAMESPACE name files."""
    return [p for p in (root / "ns").rglob("*") if p.is_file() and p.name != "NAMESPACE"]
