"""Prove the engine harness against LMCache's built-in ``LocalDiskBackend``.

These tests pin down what the NVMe tier's engine tests rely on: a chunk
evicted from host memory is really gone from it, ``retrieve`` then reads it
from the lower tier byte for byte, and LMCache writes it back into host memory.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from lmcache.v1.cache_engine import LMCacheEngine
from support.paths import EXAMPLE_YAML

from lmcache_nvme_backend.testing.engine import (
    CPU_TIER,
    CopyingCPUConnector,
    build_engine,
    chunk_keys,
    destroy_engine,
    evict_from_cpu,
    keys_in_tier,
    load_config,
    local_disk_settings,
    lower_tier_name,
    make_kv,
    make_prompt,
    retrieve_prompt,
    store_prompt,
    wait_until_in_tier,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

CHUNK = 256

EngineFactory = Callable[..., tuple[LMCacheEngine, CopyingCPUConnector]]


@pytest.fixture
def make_engine(request: pytest.FixtureRequest) -> Iterator[EngineFactory]:
    """Build engines from config overrides; destroy them all at teardown."""
    instance_ids: list[str] = []

    def factory(**overrides: Any) -> tuple[LMCacheEngine, CopyingCPUConnector]:
        settings: dict[str, Any] = {"chunk_size": CHUNK, "max_local_cpu_size": 0.5}
        settings.update(overrides)
        instance_id = f"{request.node.name}-{len(instance_ids)}"
        instance_ids.append(instance_id)
        return build_engine(load_config(None, settings), instance_id=instance_id)

    yield factory
    for instance_id in instance_ids:
        destroy_engine(instance_id)


# LMCache drops a trailing partial chunk unless save_unfull_chunk is set.
@pytest.mark.parametrize(("num_tokens", "save_unfull_chunk"),
                         [(8 * CHUNK, False), (9 * CHUNK + 100, True)],
                         ids=["8-full-chunks", "9-chunks-and-a-partial"])
def test_cold_round_trip_through_local_disk(
    make_engine: EngineFactory, tmp_path: Path, num_tokens: int, save_unfull_chunk: bool
) -> None:
    engine, connector = make_engine(save_unfull_chunk=save_unfull_chunk,
                                    **local_disk_settings(tmp_path / "disk", 1.0))
    tier = lower_tier_name(engine)
    assert tier == "LocalDiskBackend"
    tokens = make_prompt(num_tokens, seed=1)
    kv = make_kv(connector, num_tokens, seed=2)
    keys = chunk_keys(engine, tokens)
    assert len(keys) == -(-num_tokens // CHUNK)

    store_prompt(engine, tokens, kv)
    assert keys_in_tier(engine, CPU_TIER, keys) == len(keys)
    wait_until_in_tier(engine, tier, keys, timeout_s=60)
    assert evict_from_cpu(engine, keys) == len(keys)
    assert keys_in_tier(engine, CPU_TIER, keys) == 0
    assert keys_in_tier(engine, tier, keys) == len(keys)
    assert engine.lookup(tokens) == num_tokens

    cold = retrieve_prompt(engine, tokens, connector)
    assert bool(cold.ret_mask.all())
    assert torch.equal(cold.kv, kv)

    # LMCache writes chunks read from a lower tier back into host memory, so the
    # next retrieve is served from there.
    assert keys_in_tier(engine, CPU_TIER, keys) == len(keys)
    hot = retrieve_prompt(engine, tokens, connector)
    assert bool(hot.ret_mask.all())
    assert torch.equal(hot.kv, kv)


def test_eviction_leaves_host_only_engine_without_the_prompt(make_engine: EngineFactory) -> None:
    """Eviction is real: with no lower tier, an evicted prompt is a full miss."""
    engine, connector = make_engine()
    assert list(engine.storage_manager.storage_backends) == [CPU_TIER]
    tokens = make_prompt(4 * CHUNK, seed=3)
    kv = make_kv(connector, len(tokens), seed=4)
    keys = chunk_keys(engine, tokens)
    store_prompt(engine, tokens, kv)
    assert retrieve_prompt(engine, tokens, connector).ret_mask.all()

    evict_from_cpu(engine, keys)
    assert engine.lookup(tokens) == 0
    missed = retrieve_prompt(engine, tokens, connector)
    assert not bool(missed.ret_mask.any())
    assert bool(missed.kv.isnan().all())


def test_memory_pressure_evicts_to_local_disk(make_engine: EngineFactory, tmp_path: Path) -> None:
    """LRU eviction under host-memory pressure, no explicit remove, still round-trips."""
    # 2 MiB chunks; 40 MiB of host memory holds 20 of them.
    engine, connector = make_engine(max_local_cpu_size=40 / 1024,
                                    **local_disk_settings(tmp_path / "disk", 1.0))
    tier = lower_tier_name(engine)
    first_tokens = make_prompt(8 * CHUNK, seed=5)
    first_kv = make_kv(connector, len(first_tokens), seed=6)
    first_keys = chunk_keys(engine, first_tokens)
    store_prompt(engine, first_tokens, first_kv)
    wait_until_in_tier(engine, tier, first_keys, timeout_s=60)

    # Chunks still queued for the disk cannot be evicted, so wait for each prompt.
    for seed in range(100, 104):
        tokens = make_prompt(8 * CHUNK, seed=seed)
        store_prompt(engine, tokens, make_kv(connector, len(tokens), seed=seed))
        wait_until_in_tier(engine, tier, chunk_keys(engine, tokens), timeout_s=60)
    assert keys_in_tier(engine, CPU_TIER, first_keys) == 0

    cold = retrieve_prompt(engine, first_tokens, connector)
    assert bool(cold.ret_mask.all())
    assert torch.equal(cold.kv, first_kv)


def test_load_config_merges_extra_config_overrides(tmp_path: Path) -> None:
    config = load_config(EXAMPLE_YAML, {
        "max_local_cpu_size": 1,
        "extra_config": {"nvme.path": str(tmp_path), "nvme.fsync": None},
    })
    assert config.max_local_cpu_size == 1.0
    assert config.storage_plugins == ["nvme"]
    assert config.extra_config["nvme.path"] == str(tmp_path)
    assert "nvme.fsync" not in config.extra_config
    assert config.extra_config["storage_plugin.nvme.class_name"] == "NVMeBackend"
    assert config.extra_config["nvme.max_size_gb"] == 100
    with pytest.raises(KeyError, match="max_local_cpu_sise"):
        load_config(EXAMPLE_YAML, {"max_local_cpu_sise": 1})


def test_connector_rejects_mismatched_kv(make_engine: EngineFactory) -> None:
    engine, connector = make_engine()
    tokens = make_prompt(CHUNK, seed=7)
    wrong_layers = torch.zeros(2, connector.num_layers + 1, CHUNK, connector.hidden_dim,
                               dtype=connector.dtype)
    with pytest.raises(ValueError, match="kvcaches must be"):
        store_prompt(engine, tokens, wrong_layers)
