"""The host side of the vLLM end-to-end tests (tests/e2e/test_e2e_mp_vllm.py,
test_e2e_model_build.py): building the tiny model and running ``support.e2e_vllm_driver``
with the vLLM environment's python against a running ``lmcache server``.

Every vLLM run is a child process with a time limit, killed by its process group; its
engine is shut down before it exits, and a run that left ``multiprocessing`` shared memory
behind in /dev/shm fails.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from pathlib import Path
from typing import Any

from . import reports
from .mp_server import QUIET_ENV, MPServer
from .process import child_env, module_command

DRIVER = "support.e2e_vllm_driver"  # run by the vLLM environment's python
VLLM_RUN_S = 400
BUILD_MODEL_S = 300

#: The environment of the servers and vLLM runs: 1 GiB of CPU KV cache, offline.
ENV = {**QUIET_ENV, "VLLM_CPU_KVCACHE_SPACE": "1", "TOKENIZERS_PARALLELISM": "false",
       "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def build_model(python: Path, out: Path, seed: int = 0) -> Path:
    """The driver's tiny model in ``out`` (weights drawn with ``seed``); ``out``."""
    subprocess.run(module_command(DRIVER, "build-model", out, "--seed", str(seed),
                                  python=python),
                   check=True, timeout=BUILD_MODEL_S, env=child_env(**ENV), capture_output=True)
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


def run_vllm(python: Path, model: Path, server: MPServer, phase: str, log: Path,
             *options: str) -> dict[str, Any]:
    """One vLLM run of the driver (``options``: more of its ``run`` arguments, e.g.
    ``--cold-reference``); its report.  Its engine is shut down before the driver
    exits: a vLLM left to exit on its own left two message-queue segments (160 and 240
    MiB) in /dev/shm per run."""
    segments_before = python_shm_segments()
    cmd = module_command(DRIVER, "run", "--model", model, "--port", str(server.port),
                         "--http", server.http, "--phase", phase, *options, python=python)
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
