"""``lmcache-nvme forget`` against a running ``lmcache server`` (examples/mp-server.sh) that
LMCache's ``lmcache bench server`` fills: the server stops serving the dropped build within
seconds, without a restart, and stores its chunks afresh when they are asked for again."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support.mp_server import QUIET_ENV, ServerFactory
from support.process import child_env

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

REQUESTS = 2  # 4 chunks each (support.mp_server.BENCH_KV_SHAPE)
MODEL = "test-model"  # the model name lmcache bench server gives its keys


def test_forget_drops_a_build_that_a_running_server_serves(start_server: ServerFactory,
                                                          tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    server = start_server(cache, "server", MAX_SIZE_GB="0.1", L2_ADAPTER_EXTRA=json.dumps(
        {"adapter_params": {"model_build": "rev1"}}))
    server.bench(0, REQUESTS)
    assert server.wait_persisted(4 * REQUESTS)["entries"] == 4 * REQUESTS
    server.clear_l1()
    forget = subprocess.run(
        [sys.executable, "-m", "lmcache_nvme_backend", "forget", str(cache), "--model", MODEL,
         "--build", "rev1", "--json"],
        env=child_env(**QUIET_ENV), capture_output=True, text=True, timeout=60)
    assert forget.returncode == 0, forget.stdout + forget.stderr
    deadline = time.monotonic() + 30
    while server.status()["entries"] and time.monotonic() < deadline:
        time.sleep(0.1)
    status = server.status()
    assert status["entries"] == 0 and status["used_bytes"] == 0
    read_before = status["read_chunks"]
    again = server.bench(0, REQUESTS)  # nothing to hit: every request is stored afresh
    assert all((seq, "cold") in again for seq in range(REQUESTS))
    assert server.status()["read_chunks"] == read_before
    assert server.wait_persisted(4 * REQUESTS)["entries"] == 4 * REQUESTS
