"""End to end: a real ``lmcache server`` with NVMeL2Adapter as L2, and a real vLLM on CPU.

1. Cold prompt (700 tokens) -> the server stores its two full 256-token chunks
   in L1 and writes them to our files; ``POST /cache/clear`` empties L1; the
   repeat gets ``num_cached_tokens == 512`` and the same first-token logprobs.
2. The server is stopped and a new one started on the same directory (empty
   L1), with a fresh vLLM: the hit can only come from our files (the adapter's
   ``read_chunks`` counts them).

vLLM runs from its own environment (``tests/support/engine_env.py`` explains why; the
``vllm_python`` fixture is in ``conftest.py``);
the model and tokenizer are built locally.  Every process is started and
stopped here, each with a time limit.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest
from support import reports
from support.mp_server import QUIET_ENV, MPServer, ServerFactory
from support.process import child_env, module_command
from support.reports import assert_same_first_token

# The first run on a machine also builds vLLM's environment (a few minutes).
pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(1500)]

DRIVER = "support.e2e_vllm_driver"  # run by the vLLM environment's python
CHUNK = 256
FULL_CHUNK_TOKENS = 512  # 700-token prompt: two full chunks
VLLM_RUN_S = 400

ENV = {**QUIET_ENV, "VLLM_CPU_KVCACHE_SPACE": "1", "TOKENIZERS_PARALLELISM": "false",
       "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


@pytest.fixture(scope="module")
def tiny_model(vllm_python: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tiny-llama")
    subprocess.run(module_command(DRIVER, "build-model", out, python=vllm_python), check=True,
                   timeout=300, env=child_env(**ENV), capture_output=True)
    return out


def python_shm_segments() -> set[str]:
    """The ``multiprocessing.shared_memory`` segments in /dev/shm (``psm_*``, random names:
    vLLM's message queues between its engine and its workers)."""
    return {p.name for p in Path("/dev/shm").glob("psm_*")}


def unmapped(segments: set[str]) -> set[str]:
    """Of ``segments``, those no live process maps: left behind, nobody will remove them."""
    left = set(segments)
    for maps in Path("/proc").glob("[0-9]*/maps"):
        with contextlib.suppress(OSError):
            text = maps.read_text()
            left -= {name for name in left if f"/dev/shm/{name}" in text}
    return left


def run_vllm(python: Path, model: Path, server: MPServer, phase: str, log: Path
             ) -> dict[str, Any]:
    """One vLLM run of the driver; its report.  Its engine is shut down before the driver
    exits: a vLLM left to exit on its own left two message-queue segments (160 and 240
    MiB) in /dev/shm per run."""
    segments_before = python_shm_segments()
    cmd = module_command(DRIVER, "run", "--model", model, "--port", str(server.port),
                         "--http", server.http, "--phase", phase, python=python)
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                env=child_env(**ENV), start_new_session=True)
        try:
            proc.wait(timeout=VLLM_RUN_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
        finally:
            with contextlib.suppress(ProcessLookupError):  # vLLM workers that outlived it
                os.killpg(proc.pid, signal.SIGKILL)
    text = log.read_text()
    report = reports.find(text)
    if report is not None:
        left = unmapped(python_shm_segments() - segments_before)
        assert not left, f"vLLM run '{phase}' left shared memory in /dev/shm: {sorted(left)}"
        return report
    raise AssertionError(f"vLLM run '{phase}' produced no report (rc {proc.returncode}):\n"
                         f"{text[-6000:]}\n--- server log ---\n{server.log.read_text()[-3000:]}")


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
