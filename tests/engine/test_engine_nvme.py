"""NVMeBackend through a real LMCacheEngine on CPU, configured from examples/lmcache-nvme.yaml."""

from __future__ import annotations

import asyncio
import json
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from lmcache.v1.cache_engine import LMCacheEngine
from support.engines import CHUNK, EXAMPLE_YAML, NUM_CHUNKS, example_config_overrides
from support.process import child_env, module_command

from lmcache_nvme_backend.adapters.backend import NVMeBackend
from lmcache_nvme_backend.disk.layout import key_digest, namespace_id
from lmcache_nvme_backend.testing.engine import (
    CPU_TIER,
    CopyingCPUConnector,
    build_engine,
    chunk_keys,
    destroy_engine,
    evict_from_cpu,
    keys_in_tier,
    load_config,
    lower_tier_name,
    make_kv,
    make_prompt,
    retrieve_prompt,
    store_prompt,
    wait_until_in_tier,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

EngineFactory = Callable[[Path], tuple[LMCacheEngine, CopyingCPUConnector]]


@pytest.fixture
def make_engine(request: pytest.FixtureRequest) -> Iterator[EngineFactory]:
    instance_ids: list[str] = []

    def factory(cache_dir: Path) -> tuple[LMCacheEngine, CopyingCPUConnector]:
        instance_id = f"{request.node.name}-{len(instance_ids)}"
        instance_ids.append(instance_id)
        config = load_config(EXAMPLE_YAML, example_config_overrides(cache_dir))
        return build_engine(config, instance_id=instance_id)

    yield factory
    for instance_id in instance_ids:
        destroy_engine(instance_id)


def nvme_backend(engine: LMCacheEngine) -> NVMeBackend:
    assert engine.storage_manager is not None
    backend = engine.storage_manager.storage_backends[lower_tier_name(engine)]
    assert isinstance(backend, NVMeBackend)
    return backend


def test_store_evict_retrieve_and_restart(make_engine: EngineFactory, tmp_path: Path) -> None:
    cache_dir = tmp_path / "nvme"
    engine, connector = make_engine(cache_dir)
    backend = nvme_backend(engine)
    tokens = make_prompt(NUM_CHUNKS * CHUNK, seed=11)
    kv = make_kv(connector, len(tokens), seed=12)
    keys = chunk_keys(engine, tokens)
    assert len(keys) == NUM_CHUNKS

    store_prompt(engine, tokens, kv)
    wait_until_in_tier(engine, "nvme", keys, timeout_s=60)
    assert evict_from_cpu(engine, keys) == NUM_CHUNKS
    assert keys_in_tier(engine, CPU_TIER, keys) == 0

    got = retrieve_prompt(engine, tokens, connector)
    assert bool(got.ret_mask.all())
    assert torch.equal(got.kv, kv)
    stats = backend.stats()
    assert stats["read_chunks"] == NUM_CHUNKS
    assert stats["read_bytes"] == kv.numel() * kv.element_size()
    assert stats["checksum_failures"] == 0 and stats["invalid_files"] == 0
    destroy_engine(f"{test_store_evict_retrieve_and_restart.__name__}-0")

    # a new engine in a new process on the same directory (support/engine_child.py)
    proc = subprocess.run(module_command("support.engine_child", "restart", cache_dir),
                          capture_output=True, text=True, timeout=180, check=True,
                          env=child_env())
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report == {"in_cpu": 0, "in_nvme": NUM_CHUNKS, "hit_tokens": NUM_CHUNKS * CHUNK,
                      "identical": True, "read_chunks": NUM_CHUNKS}


def test_corrupted_chunk_is_never_served_through_the_engine(
        make_engine: EngineFactory, tmp_path: Path) -> None:
    """A flipped payload bit in chunk 3 truncates the hit to the 3 intact chunks before it."""
    engine, connector = make_engine(tmp_path / "nvme")
    backend = nvme_backend(engine)
    tokens = make_prompt(6 * CHUNK, seed=21)
    kv = make_kv(connector, len(tokens), seed=22)
    keys = chunk_keys(engine, tokens)
    store_prompt(engine, tokens, kv)
    wait_until_in_tier(engine, "nvme", keys, timeout_s=60)
    evict_from_cpu(engine, keys)
    store = backend.store
    victim = store.layouts[0].chunk_path(namespace_id(keys[3].model_name),
                                              key_digest(keys[3].to_string()))
    with open(victim, "r+b") as f:
        f.seek(4096 + 12345)
        byte = f.read(1)
        f.seek(4096 + 12345)
        f.write(bytes([byte[0] ^ 0x40]))

    got = retrieve_prompt(engine, tokens, connector)
    assert int(got.ret_mask.sum()) == 3 * CHUNK
    assert torch.equal(got.kv[:, :, : 3 * CHUNK], kv[:, :, : 3 * CHUNK])
    assert backend.stats()["checksum_failures"] == 1
    assert not backend.contains(keys[3])


def test_async_lookup_and_prefetch_hooks(make_engine: EngineFactory, tmp_path: Path) -> None:
    """The hooks LMCache's async loading path calls: pinning lookup, then prefetch."""
    engine, connector = make_engine(tmp_path / "nvme")
    backend = nvme_backend(engine)
    tokens = make_prompt(4 * CHUNK, seed=31)
    kv = make_kv(connector, len(tokens), seed=32)
    keys = chunk_keys(engine, tokens)
    store_prompt(engine, tokens, kv)
    wait_until_in_tier(engine, "nvme", keys, timeout_s=60)
    missing = chunk_keys(engine, make_prompt(CHUNK, seed=33))

    async def lookup_then_prefetch() -> tuple[int, list[Any]]:
        hits = await backend.batched_async_contains("req", keys + missing, pin=True)
        return hits, await backend.batched_get_non_blocking("req", keys)

    hits, objs = asyncio.run(lookup_then_prefetch())
    assert hits == 4
    assert len(objs) == 4
    for i, obj in enumerate(objs):
        assert torch.equal(obj.tensor, kv[:, :, i * CHUNK : (i + 1) * CHUNK])
        obj.ref_count_down()
    entries = [backend.store.entry(k.to_string()) for k in keys]
    assert all(e is not None and e.pins == 0 for e in entries)
