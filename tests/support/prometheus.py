"""A real Prometheus (Debian's ``prometheus`` package) on loopback, for dashboard and alert tests.

``Prometheus(binary, workdir, targets, rule_files)`` scrapes ``targets`` every second,
evaluates ``rule_files`` every second, keeps its data under ``workdir``, and answers
PromQL through its HTTP API; ``stop()`` ends it by its PID.
"""

from __future__ import annotations

import json
import signal
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import yaml

from .process import free_port

START_S = 60


class Prometheus:
    """One Prometheus server; its log is ``workdir / "prometheus.log"``."""

    def __init__(self, binary: str, workdir: Path, targets: list[str],
                 rule_files: list[Path]) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = {"global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                  "rule_files": [str(p) for p in rule_files],
                  "scrape_configs": [{"job_name": "lmcache-nvme",
                                      "static_configs": [{"targets": targets}]}]}
        config_file = workdir / "prometheus.yml"
        config_file.write_text(yaml.safe_dump(config))
        self.log = workdir / "prometheus.log"
        self._log_file = open(self.log, "w")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(
            [binary, f"--config.file={config_file}", f"--storage.tsdb.path={workdir / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}"],
            stdout=self._log_file, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + START_S
        while not self._ready():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise AssertionError(f"prometheus did not start:\n{self.log.read_text()[-3000:]}")
            time.sleep(0.3)

    def _ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as resp:
                return resp.status == 200
        except OSError:
            return False

    def api(self, path: str, **params: str) -> Any:
        """The ``data`` of a successful API answer (an AssertionError names the error)."""
        query = urllib.parse.urlencode(params)
        try:
            with urllib.request.urlopen(f"{self.url}/api/v1/{path}?{query}", timeout=30) as resp:
                answer = json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            answer = json.loads(exc.read())
        assert answer["status"] == "success", f"{path} {params}: {answer}"
        return answer["data"]

    def query(self, promql: str) -> list[dict[str, Any]]:
        """The series of an instant query, evaluated now."""
        data = self.api("query", query=promql)
        assert data["resultType"] == "vector", data
        return data["result"]  # type: ignore[no-any-return]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)
        self._log_file.close()
