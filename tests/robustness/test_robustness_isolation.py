"""Isolation: private file modes by default, and models / cache salts never see each
other's entries, through a real LMCacheEngine (CPU harness)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
import torch
from support.chunks import meta_for, payload_for
from support.paths import EXAMPLE_YAML
from support.stores import StoreFactory

from lmcache_nvme_backend.testing.engine import (
    build_engine,
    destroy_engine,
    evict_from_cpu,
    load_config,
    make_kv,
    make_prompt,
    wait_until_in_tier,
)

CHUNK = 256


@pytest.mark.timeout(30)
@pytest.mark.parametrize("umask", [0o022, 0o077])
@pytest.mark.parametrize("mode", [None, 0o640])
def test_chunk_and_manifest_files_are_private_by_default(tmp_path: Path, mode: int | None,
                                                         umask: int,
                                                         open_store: StoreFactory) -> None:
    old_umask = os.umask(umask)
    try:  # file_mode None: the default mode
        store = open_store(tmp_path / "c", max_size_gb=0.1,
                           file_mode=None if mode is None else oct(mode))
        store.submit("a", "m", meta_for(4096), memoryview(payload_for("a", 4096)), lambda: None)
        store.flush(10)
        store.close()
    finally:
        os.umask(old_umask)
    chunks = list((tmp_path / "c" / "ns").rglob("*.kv"))
    manifests = [p for p in (tmp_path / "c" / "index").rglob("*") if p.is_file()]
    assert chunks and manifests
    for p in chunks + manifests:
        assert stat.S_IMODE(p.stat().st_mode) == (0o600 if mode is None else 0o640), p


def _engine(cache: Path, instance: str, model: str):  # type: ignore[no-untyped-def]
    config = load_config(EXAMPLE_YAML, {
        "max_local_cpu_size": 0.5,
        "extra_config": {"nvme.path": str(cache), "nvme.max_size_gb": 1, "nvme.min_free_gb": 0}})
    return build_engine(config, instance_id=instance, model_name=model)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_models_and_cache_salts_never_share_entries(tmp_path: Path) -> None:
    cache = tmp_path / "nvme"
    tokens = make_prompt(3 * CHUNK, seed=5)
    salt_a = {"lmcache.tag.cache_salt": "tenant-a"}
    salt_b = {"lmcache.tag.cache_salt": "tenant-b"}
    engine, conn = _engine(cache, "iso-a", "model-a")
    try:
        kv = make_kv(conn, len(tokens), seed=6)
        engine.store(tokens, kvcaches=kv, request_configs=salt_a)
        keys = [k for _, _, k in engine.token_database.process_tokens(
            tokens=tokens, request_configs=salt_a)]
        wait_until_in_tier(engine, "nvme", keys, timeout_s=60)
        evict_from_cpu(engine, keys)

        def hits(eng, connector, configs):  # type: ignore[no-untyped-def]
            dest = torch.full(connector.get_shape(len(tokens)), float("nan"),
                              dtype=connector.dtype)
            mask = eng.retrieve(tokens, kvcaches=dest, request_configs=configs)
            return int(mask.sum()), dest

        assert hits(engine, conn, salt_b)[0] == 0  # same model, another salt
        assert hits(engine, conn, None)[0] == 0  # same model, no salt
        n, got = hits(engine, conn, salt_a)
        assert n == len(tokens) and torch.equal(got, kv)
    finally:
        destroy_engine("iso-a")
    # another model on the same directory tree sees nothing, with or without the salt
    engine, conn = _engine(cache, "iso-b", "model-b")
    try:
        for configs in (salt_a, None):
            dest = torch.full(conn.get_shape(len(tokens)), float("nan"), dtype=conn.dtype)
            assert int(engine.retrieve(tokens, kvcaches=dest, request_configs=configs).sum()) == 0
    finally:
        destroy_engine("iso-b")
