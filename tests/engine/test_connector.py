"""NVMeConnector through LMCache's remote_storage_plugins hook, and shared mode across processes."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from lmcache.v1.cache_engine import LMCacheEngine
from support.engines import (
    CHUNK,
    REMOTE_EXAMPLE_YAML,
    REMOTE_TIER,
    connector_of,
    remote_overrides,
)
from support.process import child_env, module_command

from lmcache_nvme_backend.disk.layout import key_digest, namespace_id
from lmcache_nvme_backend.testing.engine import (
    CPU_TIER,
    CopyingCPUConnector,
    build_engine,
    chunk_keys,
    destroy_engine,
    evict_from_cpu,
    load_config,
    make_kv,
    make_prompt,
    retrieve_prompt,
    storage_tiers,
    store_prompt,
    wait_until_in_tier,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


@pytest.fixture
def engine_factory(request: pytest.FixtureRequest) -> Iterator[Any]:
    ids: list[str] = []

    def make(cache_dir: Path, shared: bool = True) -> tuple[LMCacheEngine, CopyingCPUConnector]:
        instance_id = f"{request.node.name}-{len(ids)}"
        ids.append(instance_id)
        config = load_config(REMOTE_EXAMPLE_YAML, remote_overrides(cache_dir, shared))
        return build_engine(config, instance_id=instance_id)

    yield make
    for instance_id in ids:
        destroy_engine(instance_id)


def test_remote_tier_round_trip_through_the_engine(engine_factory: Any, tmp_path: Path) -> None:
    engine, connector = engine_factory(tmp_path / "nvme", shared=False)
    assert REMOTE_TIER in storage_tiers(engine)
    conn = connector_of(engine)
    assert conn.support_batched_put() and conn.support_batched_get()
    assert conn.support_batched_contains()
    tokens = make_prompt(4 * CHUNK, seed=1)
    kv = make_kv(connector, len(tokens), seed=2)
    keys = chunk_keys(engine, tokens)
    store_prompt(engine, tokens, kv)
    wait_until_in_tier(engine, REMOTE_TIER, keys, timeout_s=60)
    evict_from_cpu(engine, keys)
    got = retrieve_prompt(engine, tokens, connector)
    assert bool(got.ret_mask.all())
    assert torch.equal(got.kv, kv)
    stats = conn.stats()
    assert stats["read_chunks"] == 4 and stats["checksum_failures"] == 0
    assert conn.batched_contains(keys) == 4
    assert conn.batched_contains(chunk_keys(engine, make_prompt(CHUNK, seed=3)) + keys) == 0
    assert conn.remove_sync(keys[3]) and conn.batched_contains(keys) == 3


def test_bad_settings_leave_the_engine_without_the_tier(engine_factory: Any,
                                                       tmp_path: Path) -> None:
    """LMCache only logs connector errors; the engine still runs (our log line names the key)."""
    config = load_config(REMOTE_EXAMPLE_YAML, {"max_local_cpu_size": 0.5,
                                               "extra_config": {"nvme.path": str(tmp_path),
                                                                "nvme.max_size_gb": -3}})
    engine, _ = build_engine(config, instance_id="bad-settings")
    try:
        backend: Any = storage_tiers(engine).get(REMOTE_TIER)
        assert backend is None or backend.connection is None
    finally:
        destroy_engine("bad-settings")


# -- shared mode: two engines in two processes ---------------------------------------


def _engine_process(role: str, cache_dir: Path, seed: int) -> subprocess.Popen[str]:
    """One engine of ``support/engine_child.py shared``: the writer stores a prompt; the
    reader reports, and retrieves after each line it reads on stdin."""
    env = child_env(PYTHONHASHSEED="0", LMCACHE_TRACK_USAGE="false",
                    LMCACHE_LOG_LEVEL="WARNING")
    return subprocess.Popen(
        module_command("support.engine_child", "shared", role, cache_dir, str(seed)),
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=env)


def _read_json(proc: subprocess.Popen[str]) -> dict[str, Any]:
    assert proc.stdout is not None
    while line := proc.stdout.readline():
        if line.startswith("{"):
            return json.loads(line)  # type: ignore[no-any-return]
    _, err = proc.communicate(timeout=30)
    raise AssertionError(f"engine process ended early (rc {proc.returncode}):\n{err[-3000:]}")


def test_two_processes_share_one_directory(tmp_path: Path) -> None:
    """The reader's engine starts on an empty directory; it must still hit the writer's chunks."""
    cache_dir = tmp_path / "shared"
    reader = _engine_process("reader", cache_dir, seed=41)
    try:
        assert _read_json(reader) == {"ready": 0}
        writer = _engine_process("writer", cache_dir, seed=41)
        try:
            assert _read_json(writer) == {"stored": 6}
            assert writer.wait(timeout=120) == 0
        finally:
            writer.kill()
        assert reader.stdin is not None
        reader.stdin.write("go\n")
        reader.stdin.flush()
        report = _read_json(reader)
        assert report == {"hit_tokens": 6 * CHUNK, "identical": True, "adopted": 6,
                          "read_chunks": 6}
        # someone deletes the files behind the tier's back: the reader's index still has
        # them (lookups never touch the disk), its reads are misses, never errors
        for chunk in cache_dir.glob("ns/**/*.kv"):
            chunk.unlink()
        reader.stdin.write("go\n")
        reader.stdin.flush()
        after = _read_json(reader)
        assert after["hit_tokens_after_evict"] == 0 and after["read_failures"] >= 1
        assert reader.wait(timeout=120) == 0
    finally:
        reader.kill()


def test_shared_lookup_never_serves_a_foreign_file(engine_factory: Any, tmp_path: Path) -> None:
    """A file planted at a chunk's name is in no member's journal: a lookup (memory only)
    misses, and nothing reads it (a restarted member would index it from the listing and
    quarantine it on its first read, tests/robustness/test_robustness_tree.py)."""
    engine, _ = engine_factory(tmp_path / "nvme")
    conn = connector_of(engine)
    keys = chunk_keys(engine, make_prompt(CHUNK, seed=5))
    path = conn.store.layouts[0].chunk_path(namespace_id(keys[0].model_name),
                                  key_digest(keys[0].to_string()))
    path.parent.mkdir(parents=True)
    path.write_bytes(b"not a chunk file" * 512)
    conn.store.refresh_shared()
    assert not conn.exists_sync(keys[0])
    assert conn.stats()["read_chunks"] == 0 and conn.stats()["invalid_files"] == 0
    assert CPU_TIER in storage_tiers(engine)
