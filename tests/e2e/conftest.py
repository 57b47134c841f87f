"""What the end-to-end tests share: the engines' environments, ``lmcache server``
processes, and how a missing prerequisite ends.

A prerequisite that is missing (an engine's environment cannot be built, the engine does
not import)
skips the tests with the reason on a developer's machine, and fails them when ``CI`` is
set, so that CI never reports success for tests that did not run.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import pytest
from support.engine_env import (
    SGLANG,
    SGLANG_UNIFIED,
    VLLM,
    EngineSpec,
    EngineUnavailable,
    ensure_env,
)
from support.mp_server import MPServer, ServerFactory
from support.paths import REPO_ROOT
from support.prerequisites import missing_prerequisite
from support.vllm_runs import build_model


def _engine_python(spec: EngineSpec, label: str, config: pytest.Config) -> Path:
    """The python of an engine's environment (built on first use, then reused); what was
    built or reused, and where, is printed to the terminal."""
    def say(line: str) -> None:  # on the terminal, past pytest's output capture
        reporter = config.pluginmanager.get_plugin("terminalreporter")
        capture = config.pluginmanager.get_plugin("capturemanager")
        if reporter is None or capture is None:
            print(line)
            return
        with capture.global_and_fixture_disabled():
            reporter.write_line("")
            reporter.write_line(line)

    try:
        env = ensure_env(spec, say)
    except EngineUnavailable as exc:
        missing_prerequisite(f"{label}'s environment is not usable: {exc}")
    say(env.summary())
    ours = Path(env.imports["lmcache_nvme_backend"]).resolve()
    if REPO_ROOT not in ours.parents:
        missing_prerequisite(f"{label}'s environment imports lmcache_nvme_backend from {ours}, "
                             f"not from this checkout ({REPO_ROOT}); install this checkout "
                             "(pip install -e .) in the environment that runs the tests")
    return env.python


@pytest.fixture(scope="session")
def vllm_python(pytestconfig: pytest.Config) -> Path:
    """The python of vLLM's environment (``support.engine_env.VLLM``)."""
    return _engine_python(VLLM, "vLLM", pytestconfig)


@pytest.fixture(scope="module")
def tiny_model(vllm_python: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The vLLM driver's tiny random-weight model (``support.e2e_vllm_driver build-model``),
    a directory of its own for each test module (one may replace its weights)."""
    return build_model(vllm_python, tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def sglang_python(pytestconfig: pytest.Config) -> Path:
    """The python of SGLang 0.5.20's environment (``support.engine_env.SGLANG``:
    ``LMCRadixCache``)."""
    return _engine_python(SGLANG, "SGLang", pytestconfig)


@pytest.fixture(scope="session")
def sglang_unified_python(pytestconfig: pytest.Config) -> Path:
    """The python of SGLang 0.5.23's environment (``support.engine_env.SGLANG_UNIFIED``:
    ``LMCacheUnifiedRadixCache``)."""
    return _engine_python(SGLANG_UNIFIED, "SGLang 0.5.23", pytestconfig)


@pytest.fixture
def start_server(tmp_path: Path) -> Iterator[ServerFactory]:
    """``start_server(cache_dir, name, env=None, server_args=(), **settings)``: a running ``lmcache
    server`` with the NVMe L2 on ``cache_dir`` (examples/mp-server.sh; ``env`` and
    ``settings`` as :class:`MPServer` takes them; ``server_args=(...)``: the script's
    arguments, for ``lmcache server``), logging to ``tmp_path / f"{name}.log"``;
    every server started is stopped at teardown."""
    started: list[MPServer] = []

    def start(cache_dir: Path, name: str, env: Mapping[str, str] | None = None,
              server_args: Sequence[str] = (), **settings: str) -> MPServer:
        server = MPServer(cache_dir, tmp_path / f"{name}.log", env, server_args=server_args,
                          **settings)
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()
