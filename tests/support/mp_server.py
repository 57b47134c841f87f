"""A real ``lmcache server`` with the NVMe tier as its L2, started by examples/mp-server.sh.

The example runs as a user runs it; only the ports, paths and sizes differ.  The script
finds ``lmcache`` on PATH: this interpreter's environment first.  Every server is stopped
by its process group (SIGINT, a clean close that saves the index; then SIGKILL).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from .paths import MP_SERVER_SCRIPT
from .process import free_port

SERVER_START_S = 120
QUIET = {"LMCACHE_TRACK_USAGE": "false", "DO_NOT_TRACK": "1", "VLLM_NO_USAGE_STATS": "1",
         "LMCACHE_DISABLE_BANNER": "1"}


class MPServer:
    """One ``lmcache server`` with ``NVMeL2Adapter`` on ``cache_dir``; ``settings`` are the
    script's variables (``MAX_SIZE_GB``, ``MIN_FREE_GB``, ``L1_GB``)."""

    def __init__(self, cache_dir: Path, log: Path, env: dict[str, str] | None = None,
                 **settings: str) -> None:
        self.port, self.http_port = free_port(), free_port()
        self.http = f"http://127.0.0.1:{self.http_port}"
        self.log = log
        self._log_file = open(log, "w")  # noqa: SIM115 (closed in stop)
        variables = {"MAX_SIZE_GB": "1", "MIN_FREE_GB": "0", "L1_GB": "1", **settings}
        full_env = {**os.environ, **QUIET, **(env or {}), **variables,
                    "CACHE_DIR": str(cache_dir), "PORT": str(self.port),
                    "HTTP_PORT": str(self.http_port),
                    "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
        self.proc = subprocess.Popen(["bash", str(MP_SERVER_SCRIPT)], stdout=self._log_file,
                                     stderr=subprocess.STDOUT, env=full_env,
                                     start_new_session=True)
        deadline = time.monotonic() + SERVER_START_S
        while True:
            if self.proc.poll() is not None:
                raise AssertionError(f"lmcache server exited:\n{log.read_text()[-4000:]}")
            try:
                with urllib.request.urlopen(f"{self.http}/healthcheck", timeout=2) as resp:
                    if resp.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise AssertionError(f"lmcache server not up in {SERVER_START_S} s:\n"
                                     f"{log.read_text()[-4000:]}")
            time.sleep(0.5)

    def status(self) -> dict[str, Any]:
        """The NVMe adapter's entry of the server's ``/status``."""
        with urllib.request.urlopen(f"{self.http}/status", timeout=10) as resp:
            (adapter,) = json.loads(resp.read())["storage_manager"]["l2_adapters"]
        return adapter  # type: ignore[no-any-return]

    def metrics(self) -> dict[str, float]:
        """The ``lmcache_nvme_*`` samples of the server's Prometheus endpoint, by name."""
        with urllib.request.urlopen(f"{self.http}/metrics", timeout=10) as resp:
            text = resp.read().decode()
        return {s.name + "".join(f"{{{k}={v}}}" for k, v in sorted(s.labels.items())
                                 if k not in ("adapter", "cache_dir", "root")): s.value
                for family in text_string_to_metric_families(text)
                if family.name.startswith("lmcache_nvme_") for s in family.samples}

    def clear_l1(self) -> None:
        """Empty the server's L1 (host memory), so the next hit must come from the tier."""
        request = urllib.request.Request(
            f"{self.http}/cache/clear", data=json.dumps({"tier": "l1", "force": False}).encode(),
            headers={"Content-Type": "application/json"}, method="POST")
        with urllib.request.urlopen(request, timeout=30) as resp:
            assert resp.status == 200

    def stop(self) -> None:
        """SIGINT (a clean close saves the adapter's index), then SIGKILL if it hangs."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=30)
        self._log_file.close()
