"""End to end: chunks are bound to the build of the model's weights (``nvme.model_build``,
default ``auto``), with a real vLLM on CPU and a real ``lmcache server`` with our adapter.

The model is the driver's tiny one in a local directory (vLLM is given its path, so the
adapter fingerprints its weight files); one cache directory throughout, and each step a
fresh server and a fresh vLLM on it:

1. cold: the 700-token prompt stores its two full chunks (namespace ``<model>#<build>``);
2. the weights unchanged: the prompt hits, read from our files, same first token;
3. the weights replaced in place (same path and file names, same shapes and file size, other
   values): the prompt gets no chunk from the tier, though the old build's chunks are on the
   drive and recovered, and its first token equals a cold run of the new weights (the same
   prompt under a fresh ``cache_salt`` in the same engine: keys nothing was stored under);
   the server log says that chunks of the earlier build are skipped.

Three vLLM starts (``support/vllm_runs.py``), the fewest that show both restarts.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from support.mp_server import ServerFactory
from support.reports import assert_same_first_token
from support.vllm_runs import ENV, build_model, run_vllm

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(1500)]

FULL_CHUNK_TOKENS = 512  # 700-token prompt: two full 256-token chunks
WEIGHTS = "model.safetensors"


def namespaces(cache_dir: Path) -> set[str]:
    """The names of the namespaces in the cache directory (their NAMESPACE files)."""
    return {p.read_text().rstrip("\n") for p in cache_dir.glob("ns/*/NAMESPACE")}


def build_of(namespace: str, model: Path) -> str:
    """The build of ``<model>#<build>``."""
    base, _, build = namespace.rpartition("#")
    assert base == str(model) and build, f"namespace {namespace!r} is not {model}#<build>"
    return build


def test_replaced_weights_never_get_the_old_builds_chunks(
        vllm_python: Path, tiny_model: Path, start_server: ServerFactory, tmp_path: Path
) -> None:
    model, cache_dir = tiny_model, tmp_path / "nvme"

    # 1. Cold, on the first weights.
    first = start_server(cache_dir, "server1", env=ENV)
    cold = run_vllm(vllm_python, model, first, "cold", tmp_path / "vllm1.log")
    assert cold["cold"]["num_cached_tokens"] == 0
    stored = cold["status_stored"]["entries"]
    assert stored >= 2
    first.stop()
    (stored_ns,) = namespaces(cache_dir)

    # 2. Restart, the weights unchanged: the prompt hits, from our files.
    second = start_server(cache_dir, "server2", env=ENV)
    assert second.status()["recovered_entries"] == stored
    same = run_vllm(vllm_python, model, second, "restart", tmp_path / "vllm2.log")
    assert same["hit"]["num_cached_tokens"] == FULL_CHUNK_TOKENS
    assert same["status_after"]["read_chunks"] >= 2
    assert same["status_after"]["checksum_failures"] == 0
    assert_same_first_token(cold["cold"], same["hit"])
    second.stop()
    assert namespaces(cache_dir) == {stored_ns}  # the same build
    assert "earlier builds" not in second.log.read_text()

    # 3. The weights replaced in place, the same shapes: the same path, other values.
    files_before = {p.name: p.read_bytes() for p in model.iterdir()}
    build_model(vllm_python, model, seed=1)
    files_after = {p.name: p.read_bytes() for p in model.iterdir()}
    assert files_after.keys() == files_before.keys()
    assert {n for n in files_after if files_after[n] != files_before[n]} == {WEIGHTS}
    assert len(files_after[WEIGHTS]) == len(files_before[WEIGHTS])

    third = start_server(cache_dir, "server3", env=ENV)
    assert third.status()["recovered_entries"] == stored  # the old chunks are there
    new = run_vllm(vllm_python, model, third, "restart", tmp_path / "vllm3.log",
                   "--cold-reference")
    reference, again = new["reference"], new["hit"]
    assert reference["num_cached_tokens"] == 0  # a cold run of the new weights
    with pytest.raises(AssertionError):  # ... which answer otherwise than the old ones
        assert_same_first_token(cold["cold"], reference)
    assert again["token"] == reference["token"], (
        f"greedy token {again['token']} (with {again['num_cached_tokens']} cached tokens) "
        f"is not the cold run's {reference['token']}")
    assert_same_first_token(reference, again)
    assert again["num_cached_tokens"] == 0, "the old build's chunks were served"
    after = new["status_after"]
    assert after["read_chunks"] == 0 and after["hits"] == 0, after  # nothing from the drive
    assert after["misses"] >= 1
    third.stop()

    old_build = build_of(stored_ns, model)
    (new_ns,) = {ns for ns in namespaces(cache_dir) if ns.startswith(f"{model}#")} - {stored_ns}
    new_build = build_of(new_ns, model)
    assert new_build != old_build
    log = third.log.read_text()
    assert (f"{str(model)!r} is build {new_build} of its weights now; chunks stored under "
            f"its earlier builds ({old_build}) are skipped, never served") in log, log[-4000:]
