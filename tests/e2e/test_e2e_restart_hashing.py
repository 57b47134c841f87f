"""Restart hits where the trap is real: LMCache's in-process engine with vLLM installed.

Each phase is a fresh process of the vLLM environment's python (``support.engine_child
keys``) with no ``PYTHONHASHSEED``, building an engine from an LMCache YAML with only the
cache path and sizes changed:

* the README's YAML (``pre_caching_hash_algorithm: sha256_cbor``): the second process
  finds and loads every chunk the first one stored, byte for byte;
* LMCache's default (``builtin``): the second process makes other keys and misses, and the
  user's log (the process's stderr) has both warnings: at start, and after the misses.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from support.engines import CHUNK
from support.restart_keys import LOAD_WARNING, RUN_WARNING, readme_yaml, run_keys_child

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(1500)]


@pytest.fixture
def readme(tmp_path: Path) -> Path:
    path = tmp_path / "lmcache-nvme.yaml"  # what the user saves from the README
    path.write_text(yaml.safe_dump(readme_yaml()))
    return path


def test_the_readme_yaml_keeps_its_hits_with_vllm_installed(vllm_python: Path, readme: Path,
                                                            tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    stored, log1 = run_keys_child("store", readme, cache, python=vllm_python)
    loaded, log2 = run_keys_child("load", readme, cache, python=vllm_python)
    assert "Loaded 'sha256_cbor' from vllm" in log1  # vLLM's hash, not the fallback
    assert stored["stored"] == 4
    assert loaded["first_key"] == stored["first_key"]
    assert loaded["recovered"] == 4 and loaded["in_nvme"] == 4
    assert loaded["hit_tokens"] == 4 * CHUNK and loaded["identical"]
    for log in (log1, log2):
        assert LOAD_WARNING not in log and RUN_WARNING not in log


def test_lmcache_default_hashing_misses_after_a_restart_and_says_so(
        vllm_python: Path, readme: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    stored, log1 = run_keys_child("store", readme, cache, "--algorithm", "builtin",
                                  python=vllm_python)
    loaded, log2 = run_keys_child("load", readme, cache, "--algorithm", "builtin",
                                  "--miss-window", "3", python=vllm_python)
    assert stored["stored"] == 4 and loaded["recovered"] == 4
    assert loaded["first_key"] != stored["first_key"]  # the trap: new keys every process
    assert loaded["in_nvme"] == 0 and loaded["hit_tokens"] == 0
    for log in (log1, log2):
        assert LOAD_WARNING in log and "pre_caching_hash_algorithm: sha256_cbor" in log
    (line,) = [ln for ln in log2.splitlines() if RUN_WARNING in ln]
    assert "4 chunks were on disk at start" in line
    assert "pre_caching_hash_algorithm 'builtin' and no PYTHONHASHSEED" in line
