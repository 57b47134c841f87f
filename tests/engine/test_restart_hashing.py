"""Chunk keys that survive a restart: the configuration users copy, and the two warnings.

LMCache's in-process engine names chunks by a hash chain over their tokens; with vLLM
installed, its default ``pre_caching_hash_algorithm: builtin`` is seeded per process unless
``PYTHONHASHSEED`` is set, so a restart misses every chunk on the drive
(``lmcache_nvme_backend/adapters/hashing.py``).  Here:

* the rule itself (which settings are stable, with and without vLLM);
* the load-time warning, in the user's log, from a real engine whose settings are unstable
  (vLLM's presence is simulated: it is not installed in this environment; the real thing
  runs in tests/e2e/test_e2e_restart_hashing.py);
* the run-time warning, from a real engine restarted on a cache whose chunks it misses;
* the README's YAML (and the example it points to) keeps its hits across two fresh
  processes started without ``PYTHONHASHSEED``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from support.engines import CHUNK, EXAMPLE_YAML, REMOTE_EXAMPLE_YAML, example_config_overrides
from support.paths import EXAMPLES_DIR
from support.restart_keys import LOAD_WARNING, RUN_WARNING, readme_yaml, run_keys_child

from lmcache_nvme_backend.adapters import _common, hashing
from lmcache_nvme_backend.adapters.hashing import TokenHashing, token_hashing
from lmcache_nvme_backend.testing.engine import (
    build_engine,
    chunk_keys,
    destroy_engine,
    load_config,
    make_kv,
    make_prompt,
    retrieve_prompt,
    store_prompt,
    wait_until_in_tier,
)

SHIPPED_YAMLS = [EXAMPLE_YAML, REMOTE_EXAMPLE_YAML, EXAMPLES_DIR / "sglang-lmcache.yaml"]


# -- the rule ------------------------------------------------------------------------------


@pytest.mark.parametrize(("algorithm", "seed", "vllm", "stable"), [
    ("builtin", None, True, False),     # the trap: LMCache's default with vLLM installed
    (None, None, True, False),          # unset = builtin
    ("xxhash", None, True, False),      # vLLM seeds non-cryptographic hashes randomly
    ("sha256_cbor", None, True, True),  # the fix in the examples
    ("sha256", None, True, True),
    ("builtin", "0", True, True),       # the other fix
    ("builtin", None, False, True),     # no vLLM: hash() of int tuples, fixed first link
])
def test_which_settings_give_stable_keys(algorithm: str | None, seed: str | None, vllm: bool,
                                         stable: bool) -> None:
    env = {} if seed is None else {"PYTHONHASHSEED": seed}
    facts = token_hashing(algorithm, env, vllm=vllm)
    assert facts.stable is stable
    assert facts.algorithm == (algorithm or "builtin")
    assert ("change at every restart" in facts.describe()) is not stable


def test_the_warning_names_the_setting_and_both_fixes() -> None:
    text = TokenHashing("builtin", None, True).warning("NVMe tier")
    assert text.startswith("NVMe tier: chunk keys will change at every restart")
    assert "pre_caching_hash_algorithm: sha256_cbor" in text
    assert "PYTHONHASHSEED=0" in text
    assert "docs/troubleshooting.md#no-hits-after-a-restart-or-from-another-process" in text


@pytest.mark.parametrize("example", SHIPPED_YAMLS, ids=lambda p: p.name)
def test_the_shipped_yamls_hash_stably_without_pythonhashseed(example: Path) -> None:
    algorithm = yaml.safe_load(example.read_text())["pre_caching_hash_algorithm"]
    assert token_hashing(algorithm, {}, vllm=True).stable


def test_the_readme_yaml_is_the_example_yaml_abridged() -> None:
    """What the README shows has the example's values, so the tests of the example (here
    and in tests/e2e) cover what users copy from the README."""
    readme, example = readme_yaml(), yaml.safe_load(EXAMPLE_YAML.read_text())
    assert readme["pre_caching_hash_algorithm"] == "sha256_cbor"
    site_specific = {"max_local_cpu_size", "nvme.path", "nvme.max_size_gb"}
    for key, value in readme.items():
        if key == "extra_config":
            for name, setting in value.items():
                if name not in site_specific:
                    assert example["extra_config"][name] == setting, name
        elif key not in site_specific:
            assert example[key] == value, key


# -- the load-time warning -------------------------------------------------------------------


@pytest.fixture
def fresh_warnings(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The hashing warning is logged once per tier and process: start from none, and from a
    process without PYTHONHASHSEED (the test process may have one)."""
    monkeypatch.setattr(_common, "_warned", set())
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    yield


@pytest.fixture
def engines() -> Iterator[list[str]]:
    ids: list[str] = []
    yield ids
    for instance_id in ids:
        destroy_engine(instance_id)


def build(engines: list[str], instance_id: str, example: Path, cache_dir: Path,
          **overrides: Any) -> Any:
    config = load_config(example, {**example_config_overrides(cache_dir), **overrides})
    engines.append(instance_id)
    return build_engine(config, instance_id=instance_id)


def warnings_in(log: pytest.LogCaptureFixture, text: str) -> list[str]:
    return [r.getMessage() for r in log.records
            if r.levelname == "WARNING" and text in r.getMessage()]


@pytest.mark.slow
@pytest.mark.parametrize("example", [EXAMPLE_YAML, REMOTE_EXAMPLE_YAML], ids=lambda p: p.name)
def test_unstable_hashing_is_a_warning_at_start(example: Path, tmp_path: Path,
                                                engines: list[str], fresh_warnings: None,
                                                package_log: pytest.LogCaptureFixture,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hashing, "vllm_installed", lambda: True)  # as in a vLLM worker
    build(engines, "unstable", example, tmp_path / "a", pre_caching_hash_algorithm="builtin")
    build(engines, "unstable-2", example, tmp_path / "b", pre_caching_hash_algorithm="builtin")
    (message,) = warnings_in(package_log, LOAD_WARNING)  # once per process, not per engine
    assert "pre_caching_hash_algorithm 'builtin'" in message
    assert "pre_caching_hash_algorithm: sha256_cbor" in message and "PYTHONHASHSEED" in message


@pytest.mark.slow
def test_the_shipped_yaml_starts_without_the_warning(tmp_path: Path, engines: list[str],
                                                     fresh_warnings: None,
                                                     package_log: pytest.LogCaptureFixture,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hashing, "vllm_installed", lambda: True)
    build(engines, "stable", EXAMPLE_YAML, tmp_path / "c")
    assert not warnings_in(package_log, LOAD_WARNING)
    assert any("ready" in r.getMessage() for r in package_log.records)  # the log was seen


# -- the run-time warning ----------------------------------------------------------------------


def fill_cache(engines: list[str], cache_dir: Path) -> Any:
    """A first engine stores a 3-chunk prompt on ``cache_dir`` and is closed."""
    engine, connector = build(engines, "first", EXAMPLE_YAML, cache_dir)
    tokens = make_prompt(3 * CHUNK, seed=5)
    store_prompt(engine, tokens, make_kv(connector, len(tokens), seed=6))
    wait_until_in_tier(engine, "nvme", chunk_keys(engine, tokens), timeout_s=60)
    destroy_engine(engines.pop())
    return tokens


@pytest.mark.slow
def test_a_restart_that_misses_everything_is_a_warning(tmp_path: Path, engines: list[str],
                                                       fresh_warnings: None,
                                                       package_log: pytest.LogCaptureFixture,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    fill_cache(engines, tmp_path / "cache")
    monkeypatch.setattr(_common, "RESTART_MISS_LOOKUPS", 4)
    engine, connector = build(engines, "restarted", EXAMPLE_YAML, tmp_path / "cache")
    for seed in range(6):  # prompts that were never stored: every lookup misses
        got = retrieve_prompt(engine, make_prompt(2 * CHUNK, seed=100 + seed), connector)
        assert not bool(got.ret_mask.any())
    (message,) = warnings_in(package_log, RUN_WARNING)  # once, not per lookup
    assert message.startswith("NVMe tier: 3 chunks were on disk at start, but none of the "
                              "first 4 lookups")
    assert "model name, tensor-parallel size, KV dtype or chunk_size" in message
    assert "docs/troubleshooting.md#no-hits-after-a-restart" in message


@pytest.mark.slow
def test_a_restart_whose_first_lookups_hit_is_not_a_warning(
        tmp_path: Path, engines: list[str], fresh_warnings: None,
        package_log: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    tokens = fill_cache(engines, tmp_path / "cache")
    monkeypatch.setattr(_common, "RESTART_MISS_LOOKUPS", 4)
    engine, connector = build(engines, "restarted", EXAMPLE_YAML, tmp_path / "cache")
    got = retrieve_prompt(engine, tokens, connector)
    assert bool(got.ret_mask.all())
    for seed in range(6):
        retrieve_prompt(engine, make_prompt(2 * CHUNK, seed=100 + seed), connector)
    assert not warnings_in(package_log, RUN_WARNING)


@pytest.mark.slow
def test_the_run_time_warning_names_unstable_hashing_when_it_is_the_cause(
        tmp_path: Path, engines: list[str], fresh_warnings: None,
        package_log: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    fill_cache(engines, tmp_path / "cache")
    monkeypatch.setattr(_common, "RESTART_MISS_LOOKUPS", 2)
    monkeypatch.setattr(hashing, "vllm_installed", lambda: True)
    engine, connector = build(engines, "restarted", EXAMPLE_YAML, tmp_path / "cache",
                              pre_caching_hash_algorithm="builtin")
    for seed in range(3):
        retrieve_prompt(engine, make_prompt(CHUNK, seed=200 + seed), connector)
    assert warnings_in(package_log, LOAD_WARNING)
    (message,) = warnings_in(package_log, RUN_WARNING)
    assert "hashes tokens with pre_caching_hash_algorithm 'builtin' and no PYTHONHASHSEED" \
        in message


# -- the README path across two processes ---------------------------------------------------------


@pytest.mark.slow
def test_the_readme_yaml_keeps_its_hits_across_two_processes(tmp_path: Path) -> None:
    readme = tmp_path / "lmcache-nvme.yaml"  # what the user saves from the README
    readme.write_text(yaml.safe_dump(readme_yaml()))
    cache = tmp_path / "cache"
    stored, _ = run_keys_child("store", readme, cache)
    loaded, log = run_keys_child("load", readme, cache)
    assert stored["algorithm"] == "sha256_cbor" and stored["stored"] == 4
    assert loaded["first_key"] == stored["first_key"]
    assert loaded["recovered"] == 4 and loaded["in_nvme"] == 4
    assert loaded["hit_tokens"] == 4 * CHUNK and loaded["identical"]
    assert LOAD_WARNING not in log and RUN_WARNING not in log
