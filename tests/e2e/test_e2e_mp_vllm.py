"""End to end: a real ``lmcache server`` with NVMeL2Adapter as L2, and a real vLLM on CPU.

1. Cold prompt (700 tokens) -> the server stores its two full 256-token chunks
   in L1 and writes them to our files; ``POST /cache/clear`` empties L1; the
   repeat gets ``num_cached_tokens == 512`` and the same first-token logprobs.
2. The server is stopped and a new one started on the same directory (empty
   L1), with a fresh vLLM: the hit can only come from our files (the adapter's
   ``read_chunks`` counts them).

vLLM runs from its own environment (``tests/support/engine_env.py`` explains why; the
``vllm_python`` fixture is in ``conftest.py``);
the model and tokenizer are built locally (the ``tiny_model`` fixture, ``conftest.py``).
Every process is started and stopped here, each with a time limit
(``support/vllm_runs.py``).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from support.mp_server import ServerFactory
from support.reports import assert_same_first_token
from support.vllm_runs import ENV, run_vllm

# The first run on a machine also builds vLLM's environment (a few minutes).
pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(1500)]

CHUNK = 256
FULL_CHUNK_TOKENS = 512  # 700-token prompt: two full chunks


def test_mp_server_with_nvme_l2_and_real_vllm(vllm_python: Path, tiny_model: Path,
                                             start_server: ServerFactory, tmp_path: Path
                                             ) -> None:
    cache_dir = tmp_path / "nvme"
    first = start_server(cache_dir, "server1", env=ENV)
    report = run_vllm(vllm_python, tiny_model, first, "cold", tmp_path / "vllm1.log")

    assert report["cold"]["num_cached_tokens"] == 0
    stored = report["status_stored"]
    assert stored["entries"] >= 2 and stored["writes_completed"] >= 2
    assert report["clear"] is not None
    hit = report["hit"]
    assert hit["num_cached_tokens"] == FULL_CHUNK_TOKENS
    assert_same_first_token(report["cold"], hit)
    after = report["status_after"]
    assert after["read_chunks"] - report["status_stored"]["read_chunks"] >= 2  # from L2
    assert after["checksum_failures"] == 0
    chunk_files = sorted(cache_dir.glob("ns/**/*.kv"))
    assert len(chunk_files) == stored["entries"]
    first.stop()

    second = start_server(cache_dir, "server2", env=ENV)
    before = second.status()
    assert before["recovered_entries"] == len(chunk_files) and before["read_chunks"] == 0
    restart = run_vllm(vllm_python, tiny_model, second, "restart", tmp_path / "vllm2.log")
    hit2 = restart["hit"]
    assert hit2["num_cached_tokens"] == FULL_CHUNK_TOKENS
    assert_same_first_token(report["cold"], hit2)
    after2 = restart["status_after"]
    assert after2["read_chunks"] >= 2  # the restarted server's L1 was empty: our files
    assert after2["checksum_failures"] == 0
    scraped = second.metrics()  # the same counts on the server's Prometheus endpoint
    assert scraped["lmcache_nvme_served_chunks_total"] == after2["read_chunks"]
    assert scraped["lmcache_nvme_read_chunks_total{path=posix}"] == after2["read_chunks"]
    assert scraped["lmcache_nvme_recovered_entries_total"] == len(chunk_files)
    assert scraped["lmcache_nvme_read_latency_seconds_count{path=posix}"] >= 1
    assert sorted(cache_dir.glob("ns/**/*.kv"))[: len(chunk_files)] == chunk_files
