"""LMCache's L2 framework settings around ``NVMeL2Adapter``, each through a real ``lmcache
server`` (examples/mp-server.sh with ``L2_ADAPTER_EXTRA``) driven by LMCache's own ``lmcache
bench server``, which stores each request's KV, reads it back and checksums it.

What LMCache 0.5.6 lets a user add beside ``adapter_params`` either works byte-exact across a
restart (``"shared": true`` with the tier's shared mode, an ``fp8`` ``serde``) or stops the
server at start with a message that names the key and what to do (an ``"eviction"`` block,
``"shared": true`` without the tier's shared mode, ``"persist_enabled": false``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from support.mp_server import MPServer, ServerFactory

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

REQUESTS = 3  # 4 chunks of 2 MiB (float16) each: support.mp_server.BENCH_KV_SHAPE
CHUNKS = 4 * REQUESTS
BUDGET_GB = "0.1"


def extra(**spec: Any) -> dict[str, str]:
    """The example script's variable for more of the ``--l2-adapter`` JSON."""
    return {"L2_ADAPTER_EXTRA": json.dumps(spec), "MAX_SIZE_GB": BUDGET_GB}


def refusal(start_server: ServerFactory, cache: Path, **spec: Any) -> str:
    """The log of a server that would not start with ``spec`` beside adapter_params."""
    with pytest.raises(AssertionError, match="lmcache server exited") as failed:
        start_server(cache, "refused", **extra(**spec))
    return str(failed.value)


def files_bytes(cache: Path) -> int:
    return sum(path.stat().st_size for path in cache.rglob("*") if path.is_file())


def round_trip(start_server: ServerFactory, cache: Path, **spec: Any
               ) -> tuple[dict[int, str], dict[int, str], dict[str, Any]]:
    """Store ``REQUESTS`` requests, restart the server on the same directory, read them
    back (from the tier: the new server's L1 is empty): the digests of what was stored and
    of what was read, by request, and the tier's status after the store."""
    first = start_server(cache, "first", **extra(**spec))
    stored = first.bench(0, REQUESTS)
    status = first.wait_persisted(CHUNKS)
    first.stop()
    second = start_server(cache, "restarted", **extra(**spec))
    read = second.bench(0, REQUESTS)
    assert second.status()["hits"] >= CHUNKS  # every chunk came from the tier
    return ({seq: stored[seq, "cold"] for seq in range(REQUESTS)},
            {seq: read[seq, "warm"] for seq in range(REQUESTS)}, status)


@pytest.mark.parametrize("policy", ["LRU", "IsolatedLRU"])
def test_an_eviction_block_is_refused_at_start(start_server: ServerFactory, tmp_path: Path,
                                               policy: str) -> None:
    log = refusal(start_server, tmp_path / "cache", eviction={"eviction_policy": policy})
    assert '--l2-adapter "eviction": the NVMe tier evicts on its own' in log
    assert 'Remove the "eviction" block' in log


def test_shared_without_the_tiers_shared_mode_is_refused_at_start(
        start_server: ServerFactory, tmp_path: Path) -> None:
    log = refusal(start_server, tmp_path / "cache", shared=True)
    assert '--l2-adapter "shared": true' in log
    assert 'Add "shared": true to adapter_params' in log


def test_persist_disabled_is_refused_at_start(start_server: ServerFactory,
                                              tmp_path: Path) -> None:
    log = refusal(start_server, tmp_path / "cache", persist_enabled=False)
    assert '--l2-adapter "persist_enabled": false' in log
    assert 'Remove "persist_enabled"' in log


def test_shared_true_with_the_tiers_shared_mode_round_trips_across_a_restart(
        start_server: ServerFactory, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    stored, read, status = round_trip(start_server, cache, shared=True,
                                      adapter_params={"shared": True})
    assert read == stored
    assert status["shared"] is True
    assert files_bytes(cache) <= float(BUDGET_GB) * 1e9


def test_fp8_serde_reads_back_what_lmcaches_own_fs_adapter_reads_back(
        start_server: ServerFactory, tmp_path: Path) -> None:
    """fp8 is lossy: what comes back is not what was stored, but it must be exactly what
    LMCache's ``fs`` adapter with the same serde gives back (the tier stores the smaller
    serialized objects byte for byte), and the budget counts their real size."""
    serde = {"type": "fp8"}
    cache = tmp_path / "cache"
    stored, read, status = round_trip(start_server, cache, serde=serde)
    reference = MPServer(tmp_path / "unused", tmp_path / "fs.log",
                         l2_adapter={"type": "fs", "base_path": str(tmp_path / "fs"),
                                     "serde": serde})
    try:
        assert reference.bench(0, REQUESTS)  # stored through the fs adapter
        reference.clear_l1()
        expected = reference.bench(0, REQUESTS)  # read back through it
    finally:
        reference.stop()
    assert read == {seq: expected[seq, "warm"] for seq in range(REQUESTS)}
    assert read != stored  # the serde ran: fp8 changed the KV
    float16_bytes = CHUNKS * 2 * 1024**2
    assert status["used_bytes"] < 0.6 * float16_bytes  # fp8's bytes, not float16's
    assert files_bytes(cache) <= float(BUDGET_GB) * 1e9
