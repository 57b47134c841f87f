"""Manifest: the persisted index snapshot is a hint that round-trips and never breaks startup."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lmcache_nvme_backend.disk.format import TensorMeta
from lmcache_nvme_backend.disk.manifest import MANIFEST_NAME, load_manifest, save_manifest
from lmcache_nvme_backend.store.index import IndexEntry

META_A = TensorMeta(shapes=((2, 4, 256, 512),), dtypes=("bfloat16",), fmt=1, nbytes=2097152)
META_B = TensorMeta(shapes=((8,), (3, 3)), dtypes=("uint8", "float32"), fmt=5, nbytes=44)


def entries(n: int) -> list[IndexEntry]:
    metas = [META_A, META_B, None]
    return [IndexEntry(f"{i:032x}", f"{i % 3:016x}", 0, 4096 * (i + 2), metas[i % 3], 1000 + i)
            for i in range(n)]


@pytest.mark.parametrize("n", [0, 1, 5, 10_000], ids=["empty", "one", "few", "many-batches"])
def test_round_trip_keeps_order_sizes_and_metadata(tmp_path: Path, n: int) -> None:
    written = entries(n)
    save_manifest(tmp_path, written, 0o600, batch=3000)
    loaded = load_manifest(tmp_path)
    assert list(loaded) == [e.digest for e in written]  # LRU order preserved
    for e in written:
        rec = loaded[e.digest]
        assert (rec.ns_id, rec.size, rec.last_access_ns, rec.meta) == (
            e.ns_id, e.size, e.last_access_ns, e.meta)


def test_metadata_is_stored_once_per_distinct_value(tmp_path: Path) -> None:
    save_manifest(tmp_path, entries(300), 0o600)
    doc = json.loads((tmp_path / MANIFEST_NAME).read_text())
    assert len(doc["metas"]) == 2
    assert (tmp_path / MANIFEST_NAME).stat().st_mode & 0o777 == 0o600
    assert not [p for p in tmp_path.iterdir() if p.name != MANIFEST_NAME]  # no temp file left


UNREADABLE = {
    "empty": "",
    "garbage": "{not json",
    "other-version": '{"version": 99, "metas": [], "entries": []}',
    "bad-meta-ref": '{"version": 1, "metas": [], "entries": [["d", "n", 1, 2, 7]]}',
    "truncated": '{"version": 1}',
}


@pytest.mark.parametrize("content", UNREADABLE.values(), ids=UNREADABLE.keys())
def test_unreadable_manifest_is_ignored(tmp_path: Path, content: str) -> None:
    (tmp_path / MANIFEST_NAME).write_text(content)
    assert load_manifest(tmp_path) == {}


def test_missing_manifest_is_empty(tmp_path: Path) -> None:
    assert load_manifest(tmp_path) == {}
