"""A real SGLang server on CPU (SGLang's CPU engine) with LMCache's multiprocess server and
the NVMe tier, on the tiny random-weight model: cached tokens and first-token logprobs
after ``POST /cache/clear`` and after a restart of both servers.

SGLang's CPU engine (``SGLANG_USE_CPU_ENGINE=1``) needs ``sgl_kernel`` from
``sglang-kernel-cpu``, built from SGLang's source (``python/sglang/kernels/aot``,
``pyproject_cpu.toml``) and compiled for ``-march=x86-64-v4`` with AVX512-BF16/VNNI and AMX
(its CMakeLists, whatever the build machine; AMX is used only where the CPU has it);
``tests/e2e/build_sglang_cpu_kernel.sh`` builds it into SGLang's test environment.  The
test runs where that kernel is installed in SGLang's environment
(``support.engine_env.SGLANG``) and the CPU has AVX-512; otherwise it skips and says which
is missing (also under ``CI``: nothing installs the kernel there, and the README promises
this test nowhere).  Select it alone with ``-m sglang_server``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from support.mp_server import QUIET_ENV, MPServer, ServerFactory, http_json, shm_segments
from support.paths import EXAMPLES_DIR
from support.process import child_env, free_port, module_command, wait_until_answers
from support.reports import assert_same_first_token
from support.sglang_workload import CHUNK, PROMPT_A, SHORT

pytestmark = [pytest.mark.sglang_server, pytest.mark.slow, pytest.mark.timeout(1800)]

#: What the kernels' compiler flags (-march=x86-64-v4 -mavx512bf16 -mavx512vnni) assume; AMX
#: is used only where the CPU has it (``torch.cpu._is_amx_tile_supported()``).
CPU_FLAGS = ("avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl", "avx512_bf16",
             "avx512_vnni")
START_S = 600
LOGPROBS = 20


def missing_cpu_flags() -> list[str]:
    flags = set()
    with open("/proc/cpuinfo") as cpuinfo:
        for line in cpuinfo:
            if line.startswith("flags"):
                flags.update(line.split(":", 1)[1].split())
    return [flag for flag in CPU_FLAGS if flag not in flags]


@pytest.fixture(scope="module")
def sglang_cpu_python(request: pytest.FixtureRequest) -> Path:
    missing = missing_cpu_flags()
    if missing:
        pytest.skip(f"this CPU lacks {', '.join(missing)}: SGLang's CPU kernels "
                    "(sglang-kernel-cpu) are compiled for x86-64-v4 with AVX512-BF16/VNNI")
    python: Path = request.getfixturevalue("sglang_python")
    probe = subprocess.run([str(python), "-c", "import sgl_kernel"], capture_output=True,
                           text=True, timeout=120, env=child_env(SGLANG_USE_CPU_ENGINE="1"))
    if probe.returncode != 0:
        pytest.skip(f"sgl_kernel (sglang-kernel-cpu) is not installed in {python.parent.parent}"
                    " (no SGLang wheel carries it): bash tests/e2e/build_sglang_cpu_kernel.sh "
                    f"SGLANG_CHECKOUT ({probe.stderr.strip().splitlines()[-1:]})")
    return python


class SGLangServer:
    """``sglang.launch_server`` on CPU with ``--enable-lmcache``, through
    ``support.sglang_server_launch`` (SGLang's CPU stream fix in every process)."""

    def __init__(self, python: Path, model: Path, config: Path, log: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._log = open(log, "w")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(
            module_command("support.sglang_server_launch", "--model-path", model,
                           "--device", "cpu", "--port", str(self.port), "--enable-lmcache",
                           "--lmcache-config-file", config, "--max-total-tokens", "16384",
                           python=python),
            stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True,
            env=child_env(**QUIET_ENV, SGLANG_USE_CPU_ENGINE="1", HF_HUB_OFFLINE="1"))
        try:
            wait_until_answers(f"{self.url}/health", self.proc, log, "SGLang", START_S,
                               poll_s=1)
        except AssertionError:
            self.stop()
            raise

    def first_token(self, tokens: list[int]) -> dict[str, Any]:
        out = http_json(f"{self.url}/generate", {
            "input_ids": tokens, "return_logprob": True, "top_logprobs_num": LOGPROBS,
            "sampling_params": {"max_new_tokens": 1, "temperature": 0.0}})
        meta = out["meta_info"]
        return {"cached_tokens": int(meta["cached_tokens"]),
                "logprobs": {str(tok): lp for lp, tok, *_ in meta["output_top_logprobs"][0]}}

    def flush_cache(self) -> None:
        """Empty SGLang's radix tree (``POST /flush_cache`` answers in plain text)."""
        req = urllib.request.Request(f"{self.url}/flush_cache", data=b"", method="POST")
        with urllib.request.urlopen(req, timeout=60) as resp:
            assert resp.status == 200, resp.read()

    def stop(self) -> None:
        """SIGTERM to SGLang's processes, SIGKILL if they linger; then the names of the
        scheduler's KV pools in /dev/shm, which a killed process leaves behind."""
        group = subprocess.run(["pgrep", "-g", str(self.proc.pid)], capture_output=True,
                               text=True).stdout.split()
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=30)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)
        for pid in group:
            for segment in shm_segments(int(pid)):
                segment.unlink(missing_ok=True)
        self._log.close()


@pytest.fixture
def sglang_servers() -> Iterator[list[SGLangServer]]:
    started: list[SGLangServer] = []
    yield started
    for server in started:
        server.stop()


def test_sglang_cpu_server_hits_the_nvme_tier(sglang_cpu_python: Path, tmp_path: Path,
                                              start_server: ServerFactory,
                                              sglang_servers: list[SGLangServer]) -> None:
    model = tmp_path / "tiny-llama"
    subprocess.run(module_command("support.e2e_vllm_driver", "build-model", model,
                                  python=sglang_cpu_python),
                   check=True, timeout=300, env=child_env(**QUIET_ENV), capture_output=True)
    cache_dir = tmp_path / "nvme"

    def start(name: str) -> tuple[MPServer, SGLangServer]:
        server = start_server(cache_dir, f"lmcache-{name}")
        config = yaml.safe_load((EXAMPLES_DIR / "sglang-lmcache.yaml").read_text())
        config["mp_port"] = server.port
        config_file = tmp_path / f"sglang-lmcache-{name}.yaml"
        config_file.write_text(yaml.safe_dump(config))
        sglang = SGLangServer(sglang_cpu_python, model, config_file,
                              tmp_path / f"sglang-{name}.log")
        sglang_servers.append(sglang)
        return server, sglang

    server, sglang = start("first")
    sglang.first_token(SHORT)  # warm-up: under one chunk, stores nothing
    cold = sglang.first_token(PROMPT_A)
    assert cold["cached_tokens"] == 0
    server.wait_persisted(2)
    sglang.flush_cache()
    server.clear_l1()
    hit = sglang.first_token(PROMPT_A)
    assert hit["cached_tokens"] == 2 * CHUNK
    assert_same_first_token(cold, hit)
    sglang.stop()
    server.stop()

    server, sglang = start("restart")
    assert server.status()["recovered_entries"] == 2
    restart = sglang.first_token(PROMPT_A)
    assert restart["cached_tokens"] == 2 * CHUNK
    assert_same_first_token(cold, restart)
    after = server.status()
    assert after["read_chunks"] == 2 and after["checksum_failures"] == 0
