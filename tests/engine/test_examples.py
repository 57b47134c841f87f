"""Every file in examples/ works as shipped.

The LMCache YAMLs run through a real engine here (and in test_engine_nvme.py /
test_connector.py); examples/mp-server.sh runs a real server in
test_e2e_mp_vllm.py and the SGLang e2e tests and has its command line checked here; the
launch recipes that need a GPU (vLLM's LMCacheConnectorV1, an SGLang server) are parsed
and their configs validated, and the SGLang recipe is checked against what its tests run;
the Prometheus snippet is checked against the ports the other examples use.
"""

from __future__ import annotations

import json
import os
import re
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from support.engine_env import SGLANG, SGLANG_UNIFIED
from support.paths import EXAMPLES_DIR, MP_SERVER_SCRIPT, REPO_ROOT

import lmcache_nvme_backend
from lmcache_nvme_backend.adapters.l2_adapter import NVMeL2AdapterConfig
from lmcache_nvme_backend.config import NVMeSettings
from lmcache_nvme_backend.disk.layout import MARKER_NAME, marker_text
from lmcache_nvme_backend.testing.engine import (
    build_engine,
    chunk_keys,
    destroy_engine,
    evict_from_cpu,
    load_config,
    lower_tier_name,
    make_kv,
    make_prompt,
    retrieve_prompt,
    store_prompt,
    wait_until_in_tier,
)

ROOT = REPO_ROOT
EXAMPLES = EXAMPLES_DIR
LMCACHE_YAMLS = sorted(p for p in EXAMPLES.glob("*.yaml")
                       if "extra_config" in yaml.safe_load(p.read_text()))
RECIPES = sorted(EXAMPLES.glob("*.md"))
PLUGIN_CLASS_KEYS = re.compile(r"^(remote_)?storage_plugin\.\w+\.class_name$")


def test_there_are_examples_to_check() -> None:
    assert {p.name for p in LMCACHE_YAMLS} >= {"lmcache-nvme.yaml", "lmcache-nvme-remote.yaml"}
    assert (EXAMPLES / "mp-server.sh").exists() and (EXAMPLES / "prometheus.yml").exists()
    assert RECIPES


@pytest.mark.parametrize("example", LMCACHE_YAMLS, ids=lambda p: p.name)
def test_lmcache_yaml_validates_as_shipped(example: Path, tmp_path: Path) -> None:
    raw = yaml.safe_load(example.read_text())
    config = load_config(example, {"extra_config": {"nvme.path": str(tmp_path)}})
    extra = config.extra_config or {}
    for key, value in extra.items():
        if PLUGIN_CLASS_KEYS.match(key):
            assert hasattr(lmcache_nvme_backend, value), f"{key}: {value} is not exported"
            assert extra[key.replace("class_name", "module_path")] == "lmcache_nvme_backend"
    settings = NVMeSettings.from_extra_config(extra)
    shipped = {k.removeprefix("nvme."): v for k, v in raw["extra_config"].items()
               if k.startswith("nvme.")}
    assert set(shipped) >= {"path", "max_size_gb"}
    assert settings.max_size_gb == float(shipped["max_size_gb"])


@pytest.fixture
def engine_ids() -> Iterator[list[str]]:
    ids: list[str] = []
    yield ids
    for instance_id in ids:
        destroy_engine(instance_id)


@pytest.mark.slow
@pytest.mark.parametrize("example", LMCACHE_YAMLS, ids=lambda p: p.name)
def test_lmcache_yaml_round_trips_through_a_real_engine(example: Path, tmp_path: Path,
                                                        engine_ids: list[str]) -> None:
    """Only the path and sizes change: store, push out of host memory, load back."""
    # SGLang's in-process mode moves KV layer by layer (use_layerwise); the copying CPU
    # connector moves whole chunks. The tier sees the same stores and loads either way.
    config = load_config(example, {"max_local_cpu_size": 0.5, "use_layerwise": False,
                                   "extra_config": {"nvme.path": str(tmp_path / "cache"),
                                                    "nvme.max_size_gb": 1,
                                                    "nvme.min_free_gb": 0}})
    engine_ids.append(f"example-{example.stem}")
    kv_shape = (2, 2, config.chunk_size, 4, 32)
    engine, connector = build_engine(config, instance_id=engine_ids[-1], kv_shape=kv_shape)
    tokens = make_prompt(3 * config.chunk_size, seed=3)
    kv = make_kv(connector, len(tokens), seed=4)
    keys = chunk_keys(engine, tokens)
    store_prompt(engine, tokens, kv)
    wait_until_in_tier(engine, lower_tier_name(engine), keys, timeout_s=60)
    assert evict_from_cpu(engine, keys) == 3
    got = retrieve_prompt(engine, tokens, connector)
    assert bool(got.ret_mask.all()) and torch.equal(got.kv, kv)


def run_mp_server(tmp_path: Path, *args: str, **env: str
                  ) -> tuple[subprocess.CompletedProcess[str], list[str] | None]:
    """Run examples/mp-server.sh (with ``args``) with a stand-in ``lmcache`` that records its
    arguments: the finished script, and the arguments (None: the server was never started)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    capture = tmp_path / "argv.json"
    capture.unlink(missing_ok=True)
    stand_in = bin_dir / "lmcache"
    stand_in.write_text(f"#!/usr/bin/env python3\nimport json, sys\n"
                        f"open({str(capture)!r}, 'w').write(json.dumps(sys.argv[1:]))\n")
    stand_in.chmod(stand_in.stat().st_mode | stat.S_IEXEC)
    proc = subprocess.run(["bash", str(EXAMPLES / "mp-server.sh"), *args], timeout=120,
                          capture_output=True, text=True,
                          env=dict(os.environ, PYTHON=sys.executable,
                                   PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", **env))
    argv = json.loads(capture.read_text()) if capture.exists() else None
    return proc, argv


def mp_server_command(tmp_path: Path, *args: str, **env: str) -> list[str]:
    """The arguments examples/mp-server.sh gives ``lmcache``, captured by a stand-in."""
    proc, argv = run_mp_server(tmp_path, *args, **env)
    assert proc.returncode == 0 and argv is not None, proc.stderr
    return argv


def option(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_mp_server_script_builds_a_valid_adapter_config(tmp_path: Path) -> None:
    drives = f"{tmp_path / 'nvme0'},{tmp_path / 'nvme1'}"
    argv = mp_server_command(tmp_path, CACHE_DIR=drives, MAX_SIZE_GB="7", PORT="6000")
    assert argv[0] == "server" and option(argv, "--port") == "6000"
    assert option(argv, "--chunk-size") == "256"
    adapter = json.loads(option(argv, "--l2-adapter"))
    assert (adapter["type"], adapter["module_path"], adapter["class_name"]) == (
        "plugin", "lmcache_nvme_backend", "NVMeL2Adapter")
    settings = NVMeL2AdapterConfig.from_dict(adapter["adapter_params"]).settings
    assert settings.paths == (tmp_path / "nvme0", tmp_path / "nvme1")
    assert settings.max_size_gb == 7


def test_mp_server_script_defaults_match_the_docs(tmp_path: Path) -> None:
    argv = mp_server_command(tmp_path, CACHE_DIR=str(tmp_path / "c"))
    assert option(argv, "--port") == "5555" and option(argv, "--http-port") == "8080"
    params = json.loads(option(argv, "--l2-adapter"))["adapter_params"]
    assert params["max_size_gb"] == 500 and params["min_free_gb"] == 1


def test_mp_server_script_passes_its_arguments_to_the_server(tmp_path: Path) -> None:
    """What SGLang 0.5.21+ with a sliding-window or Mamba model needs of the server
    (examples/sglang-recipe.md): extra arguments go to ``lmcache server``, after the
    script's own."""
    plain = mp_server_command(tmp_path, CACHE_DIR=str(tmp_path / "c"))
    argv = mp_server_command(tmp_path, "--separate-object-groups", CACHE_DIR=str(tmp_path / "c"))
    assert argv == [*plain, "--separate-object-groups"]


def test_mp_server_script_passes_min_free_auto(tmp_path: Path) -> None:
    argv = mp_server_command(tmp_path, CACHE_DIR=str(tmp_path / "c"), MIN_FREE_GB="auto")
    params = json.loads(option(argv, "--l2-adapter"))["adapter_params"]
    assert params["min_free_gb"] == "auto"
    assert NVMeL2AdapterConfig.from_dict(params).settings.min_free_gb is None


@pytest.mark.parametrize(("env", "message"), [
    ({"MAX_SIZE_GB": "100GB"}, "MAX_SIZE_GB='100GB' is not a number (GB, no unit); "
                               "e.g. MAX_SIZE_GB=500"),
    ({"MAX_SIZE_GB": "0"}, "MAX_SIZE_GB='0' must be more than 0"),
    ({"MIN_FREE_GB": "-1"}, "MIN_FREE_GB='-1' must be at least 0"),
    ({"L1_GB": "lots"}, "L1_GB='lots' is not a number"),
    ({"PORT": "99999"}, "PORT='99999' must be at least 1 and at most 65535"),
    ({"HTTP_PORT": "80a"}, "HTTP_PORT='80a' is not a whole number"),
], ids=["unit-in-size", "zero-size", "negative-free", "l1-word", "port-range", "port-word"])
def test_mp_server_script_names_a_bad_variable_before_starting(tmp_path: Path,
                                                               env: dict[str, str],
                                                               message: str) -> None:
    proc, argv = run_mp_server(tmp_path, CACHE_DIR=str(tmp_path / "c"), **env)
    assert proc.returncode == 2 and argv is None  # the server never started
    assert proc.stderr.startswith(f"mp-server.sh: {message}"), proc.stderr


def test_mp_server_script_shows_the_adapters_own_error_first(tmp_path: Path) -> None:
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    proc, argv = run_mp_server(tmp_path, CACHE_DIR=str(not_a_dir), MAX_SIZE_GB="7")
    assert proc.returncode == 2 and argv is None
    first = proc.stderr.splitlines()[0]
    assert first.startswith("mp-server.sh: the NVMe tier would not start (CACHE_DIR=")
    assert f"adapter_params.path: '{not_a_dir}' exists and is not a directory" in first


def test_mp_server_script_checks_the_cache_directory_before_starting(tmp_path: Path) -> None:
    """What only the directory tells (here a cache tree from a newer layout) stops the
    script too, not only the server's log: the adapter's config class parses it fine."""
    newer = tmp_path / "cache"
    newer.mkdir()
    (newer / MARKER_NAME).write_bytes(marker_text(3))
    proc, argv = run_mp_server(tmp_path, CACHE_DIR=str(newer), MAX_SIZE_GB="7")
    assert proc.returncode == 2 and argv is None, proc.stderr
    first = proc.stderr.splitlines()[0]
    assert first.startswith("mp-server.sh: the NVMe tier would not start (CACHE_DIR=")
    assert f"adapter_params.path: {newer / MARKER_NAME} says shard_levels 3" in first
    assert sorted(p.name for p in newer.iterdir()) == [MARKER_NAME]  # nothing created


def bash_blocks(markdown: str) -> list[str]:
    return re.findall(r"```bash\n(.*?)```", markdown, flags=re.S)


def test_readme_commands_write_no_file_into_the_checkout() -> None:
    """Files the README's commands create land outside the tree or where .gitignore
    covers them, so trying them leaves ``git status`` clean."""
    ignored = [line.strip().rstrip("/") for line in (ROOT / ".gitignore").read_text()
               .splitlines() if line.strip() and not line.startswith("#")]
    outputs = [out for block in bash_blocks((ROOT / "README.md").read_text())
               for out in re.findall(r"--plot (\S+)", block)]
    assert outputs, "the README no longer shows --plot; update this test"
    for out in outputs:
        path = Path(out)
        inside = not path.is_absolute() or ROOT in path.resolve().parents
        assert not inside or Path(out).parts[0].lstrip("./") in ignored, (
            f"README: --plot {out} would leave an untracked file in the checkout")


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.name)
def test_launch_recipe_commands_parse(recipe: Path) -> None:
    text = recipe.read_text()
    assert "LMCACHE_TRACK_USAGE=false" in text, "recipes keep telemetry off"
    blocks = bash_blocks(text)
    assert blocks, f"{recipe.name} has no bash block"
    for block in blocks:
        subprocess.run(["bash", "-n"], input=block, text=True, check=True, timeout=10)
        for raw in re.findall(r"--kv-transfer-config '(.*?)'", block, flags=re.S):
            transfer: dict[str, Any] = json.loads(raw)
            assert transfer["kv_connector"] in ("LMCacheConnectorV1", "LMCacheMPConnector")
            assert transfer["kv_role"] == "kv_both"
        for config_file in re.findall(r"(?:LMCACHE_CONFIG_FILE=|--lmcache-config-file )(\S+)",
                                      block):
            assert (ROOT / config_file).is_file(), f"{recipe.name}: {config_file} is missing"
        for script in re.findall(r"(examples/\S+\.sh)", block):
            assert (ROOT / script).is_file(), f"{recipe.name}: {script} is missing"


def test_sglang_recipe_matches_what_the_tests_run() -> None:
    """The versions, tests, config file and server address the recipe names are the ones
    the SGLang e2e tests use."""
    from importlib.metadata import version

    recipe = (EXAMPLES / "sglang-recipe.md").read_text()
    for spec in (SGLANG, SGLANG_UNIFIED):
        assert f"SGLang {spec.pinned().split('==')[1]}" in recipe
        assert spec.requirements.relative_to(ROOT).as_posix() in recipe
    assert f"LMCache {version('lmcache')}" in recipe
    for test in ("tests/e2e/test_e2e_mp_sglang.py", "tests/e2e/test_e2e_sglang_radix.py",
                 "tests/e2e/test_e2e_sglang_unified.py"):
        assert test in recipe and (ROOT / test).is_file(), test
        assert "sglang-lmcache.yaml" in (ROOT / test).read_text(), f"{test} uses the recipe's file"
    launch = re.findall(r"--lmcache-config-file (\S+)", "\n".join(bash_blocks(recipe)))
    assert launch and set(launch) == {"examples/sglang-lmcache.yaml"}
    config = yaml.safe_load((EXAMPLES / "sglang-lmcache.yaml").read_text())
    script = MP_SERVER_SCRIPT.read_text()
    assert "--host 127.0.0.1" in script and config["mp_host"] == "127.0.0.1"
    (default_port,) = re.findall(r"^PORT=\$\{PORT:-(\d+)\}", script, flags=re.M)
    assert config["mp_port"] == int(default_port)
    assert f"PORT={default_port} " in recipe


def test_prometheus_snippet_scrapes_the_ports_the_examples_use() -> None:
    scrape = yaml.safe_load((EXAMPLES / "prometheus.yml").read_text())["scrape_configs"]
    targets = {job["job_name"]: [t for group in job["static_configs"] for t in group["targets"]]
               for job in scrape}
    worker_port = yaml.safe_load((EXAMPLES / "lmcache-nvme.yaml").read_text())[
        "extra_config"]["nvme.metrics_port"]
    worker_ports = [int(t.rsplit(":", 1)[1]) for t in targets["lmcache-nvme-vllm-workers"]]
    assert worker_ports[0] == worker_port
    assert worker_ports == list(range(worker_port, worker_port + len(worker_ports)))
    assert targets["lmcache-mp-server"] == ["127.0.0.1:8080"]  # mp-server.sh's HTTP_PORT
