"""A real ``lmcache server`` with NVMeL2Adapter as its L2, started by examples/mp-server.sh.

The end-to-end tests (vLLM's and SGLang's) and the monitoring tests start the example as a
user runs it; only ports, paths and sizes differ.  ``MPServer`` waits for
``/healthcheck``, reads the adapter's ``/status`` and the ``lmcache_nvme_*`` samples of
``/metrics``, empties L1 (``POST /cache/clear``), and stops the server by its process group
(SIGINT, so that the adapter saves its index, then SIGKILL if it hangs).  The HTTP
functions use only the standard library: the vLLM driver imports them from vLLM's
environment.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, Protocol

from .paths import MP_SERVER_SCRIPT
from .process import child_env, free_port, wait_until_answers

START_S = 120
#: No telemetry, no banner; what every process of the end-to-end tests runs with.
QUIET_ENV = {"LMCACHE_TRACK_USAGE": "false", "DO_NOT_TRACK": "1", "VLLM_NO_USAGE_STATS": "1",
             "LMCACHE_DISABLE_BANNER": "1"}


def shm_segments(pid: int) -> list[Path]:
    """The POSIX shared-memory segments LMCache made for KV pools of process ``pid`` (a
    CPU engine's pools move there when they register with the server)."""
    return sorted(Path("/dev/shm").glob(f"lmcache_kv_{pid}_*"))


def http_json(url: str, body: dict[str, Any] | None = None) -> Any:
    """GET ``url`` (or POST ``body`` as JSON) and decode the JSON answer."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method="GET" if body is None else "POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        return json.loads(resp.read() or b"null")


def adapter_status(http: str) -> dict[str, Any]:
    """The NVMe adapter's entry of the server's ``/status``."""
    (adapter,) = http_json(f"{http}/status")["storage_manager"]["l2_adapters"]
    return adapter  # type: ignore[no-any-return]


def clear_l1(http: str, timeout_s: float = 60.0) -> dict[str, Any]:
    """Empty the server's L1, so that the next hit must come from the NVMe L2.

    LMCache keeps an L1 object read-locked until its L2 store task completes and it
    has processed the completion, which trails the adapter's own status a little: a
    clear can find objects still locked.  Clear until L1 holds no object.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        cleared = http_json(f"{http}/cache/clear", {"tier": "l1", "force": False})
        left = http_json(f"{http}/status")["storage_manager"]["l1_manager"][
            "total_object_count"]
        if left == 0:
            return cleared  # type: ignore[no-any-return]
        if time.monotonic() > deadline:
            raise TimeoutError(f"L1 still holds {left} objects after {timeout_s:.0f} s")
        time.sleep(0.1)


def settle(http: str, timeout_s: float = 60.0) -> dict[str, Any]:
    """Wait until the server has nothing in flight: no L1 object staged or locked (a store
    that ``store_kv`` has returned from may still be staged; a retrieve's temporary copies
    stay until it is done) and no L2 write pending (of this tier: LMCache's own adapters do
    not report theirs).  Its L1 status then."""
    deadline = time.monotonic() + timeout_s
    while True:
        status = http_json(f"{http}/status")["storage_manager"]
        l1 = status["l1_manager"]
        busy = {name: l1[name] for name in ("staging_object_count", "write_locked_count",
                                            "read_locked_count", "temporary_count")
                if l1[name]}
        pending = sum(a.get("pending_writes", 0) for a in status["l2_adapters"])  # ours only
        if pending:
            busy["pending_writes"] = pending
        if not busy:
            return l1  # type: ignore[no-any-return]
        if time.monotonic() > deadline:
            raise TimeoutError(f"the server is still busy after {timeout_s:.0f} s: {busy}")
        time.sleep(0.05)


def wait_persisted(http: str, entries: int, timeout_s: float = 60.0) -> dict[str, Any]:
    """Wait until the adapter holds ``entries`` chunks and has no write pending (the
    server writes L1 to L2 in the background); its status then."""
    deadline = time.monotonic() + timeout_s
    while True:
        status = adapter_status(http)
        if status["entries"] >= entries and status["pending_writes"] == 0:
            return status
        if time.monotonic() > deadline:
            raise TimeoutError(f"the server did not persist {entries} chunks: {status}")
        time.sleep(0.2)


#: ``lmcache bench server``'s KV cache and request length in these tests: 4 chunks of
#: 256 tokens a request, 2 MiB of float16 KV a chunk.
BENCH_KV_SHAPE = "(2,256,16,8,64):float16:4"
BENCH_TOKENS = 1024
_DIGEST = re.compile(r"\[seq (\d+)/(cold|warm)\] CHECKSUM: ([0-9a-f]+)")


class MPServer:
    """One ``lmcache server`` with our adapter on ``cache_dir``, run by examples/mp-server.sh.

    ``env`` is added to this process's environment (after :data:`QUIET_ENV`);
    ``settings`` are the script's variables (``MAX_SIZE_GB``, ``MIN_FREE_GB``, ``L1_GB``,
    ``L2_ADAPTER_EXTRA``); ``server_args`` are the script's arguments, which it passes on to
    ``lmcache server`` (e.g. ``--separate-object-groups``).  With ``l2_adapter`` (an
    ``--l2-adapter`` spec, e.g. one of LMCache's own adapters) the server is started as the
    script starts it, with that L2 instead (``cache_dir`` unused); ``l2_adapter="none"``:
    with no L2 (LMCache's host memory only).
    """

    def __init__(self, cache_dir: Path, log: Path, env: Mapping[str, str] | None = None,
                 l2_adapter: dict[str, Any] | Literal["none"] | None = None,
                 server_args: Sequence[str] = (),
                 **settings: str) -> None:
        self.port, self.http_port = free_port(), free_port()
        self.http = f"http://127.0.0.1:{self.http_port}"
        self.log = log
        self._log_file = open(log, "w")  # noqa: SIM115 (closed in stop)
        variables = {"MAX_SIZE_GB": "1", "MIN_FREE_GB": "0", "L1_GB": "1", **settings}
        # The script finds ``lmcache`` on PATH: this interpreter's environment first.
        full_env = {**os.environ, **QUIET_ENV, **(env or {}), **variables,
                    "CACHE_DIR": str(cache_dir), "PORT": str(self.port),
                    "HTTP_PORT": str(self.http_port),
                    "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
        command = ["bash", str(MP_SERVER_SCRIPT), *server_args]
        if l2_adapter is not None:  # the script's own command line, with this L2
            command = ["lmcache", "server", "--host", "127.0.0.1", "--port", str(self.port),
                       "--http-host", "127.0.0.1", "--http-port", str(self.http_port),
                       "--chunk-size", "256", "--l1-size-gb", variables["L1_GB"],
                       "--no-l1-use-lazy", "--eviction-policy", "LRU",
                       "--supported-transfer-mode", "auto",
                       *([] if l2_adapter == "none" else
                         ["--l2-adapter", json.dumps(l2_adapter)]), *server_args]
        self.proc = subprocess.Popen(command, stdout=self._log_file,
                                     stderr=subprocess.STDOUT, env=full_env,
                                     start_new_session=True)
        try:
            wait_until_answers(f"{self.http}/healthcheck", self.proc, log, "lmcache server",
                               START_S)
        except AssertionError:
            self.stop()
            raise

    def log_tail(self, chars: int = 4000) -> str:
        return self.log.read_text()[-chars:]

    def status(self) -> dict[str, Any]:
        return adapter_status(self.http)

    def clear_l1(self) -> dict[str, Any]:
        return clear_l1(self.http)

    def wait_persisted(self, entries: int) -> dict[str, Any]:
        return wait_persisted(self.http, entries)

    def metrics(self) -> dict[str, float]:
        """The ``lmcache_nvme_*`` samples of the server's Prometheus endpoint, by name
        and the labels other than which adapter, cache directory and root."""
        from prometheus_client.parser import text_string_to_metric_families

        with urllib.request.urlopen(f"{self.http}/metrics", timeout=10) as resp:
            text = resp.read().decode()
        return {s.name + "".join(f"{{{k}={v}}}" for k, v in sorted(s.labels.items())
                                 if k not in ("adapter", "cache_dir", "root")): s.value
                for family in text_string_to_metric_families(text)
                if family.name.startswith("lmcache_nvme_") for s in family.samples}

    def bench(self, start: int, end: int) -> dict[tuple[int, str], str]:
        """LMCache's server benchmark (``lmcache bench server --mode cpu``) for requests
        ``start`` .. ``end`` - 1: each stored if missed, then read back; the digest of the
        KV each request stored (``cold``) or read back (``warm``), by request and kind.
        Fails if the benchmark does, e.g. on a checksum mismatch within the run."""
        cmd = [sys.executable, "-c", "import sys; from lmcache.cli.main import main; "
               "sys.exit(main())", "bench", "server", "--mode", "cpu",
               "--rpc-url", f"tcp://127.0.0.1:{self.port}", "--url", self.http,
               "--start", str(start), "--end", str(end), "--interval", "0",
               "--num-tokens", str(BENCH_TOKENS), "--kvcache-shape-spec", BENCH_KV_SHAPE]
        proc = subprocess.run(cmd, env=child_env(**QUIET_ENV), capture_output=True,
                              text=True, timeout=300)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
        failed = re.search(r"Checksum FAIL:\s+(\d+)", proc.stdout)
        assert failed is None or failed.group(1) == "0", proc.stdout[-3000:]
        return {(int(seq), kind): digest
                for seq, kind, digest in _DIGEST.findall(proc.stdout + proc.stderr)}

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


class ServerFactory(Protocol):
    """``start_server(cache_dir, name, env=None, server_args=(), **settings)`` (the fixture
    of tests/e2e/conftest.py): an :class:`MPServer` logging to ``<tmp_path>/<name>.log``."""

    def __call__(self, cache_dir: Path, name: str, env: Mapping[str, str] | None = None,
                 server_args: Sequence[str] = (), **settings: str) -> MPServer: ...
