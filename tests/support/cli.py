"""Helpers of the command-line tests: the cache the ``cache_dir`` fixture of tests/cli
writes with a real ChunkStore, its keys, and the type of the ``run_cli`` fixture."""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path

from lmcache_nvme_backend.disk.format import TensorMeta
from lmcache_nvme_backend.disk.layout import RootLayout, key_digest, namespace_id
from lmcache_nvme_backend.store.chunk_store import ChunkRead, ChunkStore

CHUNK = 64 * 1024
NAMESPACES = ("model-a", "model-b")
KEYS_PER_NAMESPACE = 5

RunCLI = Callable[..., subprocess.CompletedProcess[str]]


def payload_for(key: str) -> bytes:
    """Key-specific bytes: a chunk served under the wrong key can never look right."""
    seed = key.encode() * (CHUNK // len(key) + 1)
    return bytes(b ^ (i * 7 & 0xFF) for i, b in enumerate(seed[:CHUNK]))


def cache_keys() -> list[tuple[str, str]]:
    """(namespace, key) of every chunk the ``cache_dir`` fixture writes."""
    return [(ns, f"{ns}@256@0@{i:04x}@bfloat16") for ns in NAMESPACES
            for i in range(KEYS_PER_NAMESPACE)]


def write_chunks(store: ChunkStore, items: list[tuple[str, str]]) -> None:
    meta = TensorMeta(shapes=((CHUNK,),), dtypes=("uint8",), fmt=1, nbytes=CHUNK)
    for ns, key in items:
        store.submit(key, ns, meta, memoryview(payload_for(key)), release=lambda: None)
    assert store.flush(30)


def read_chunk(store: ChunkStore, key: str) -> bytes | None:
    dest = bytearray(CHUNK + 8192)
    ok = store.read_into([ChunkRead(key, memoryview(dest))])[0]
    return bytes(dest[:CHUNK]) if ok else None


def chunk_path(root: Path, ns: str, key: str) -> Path:
    return RootLayout.of(root).chunk_path(namespace_id(ns), key_digest(key))
