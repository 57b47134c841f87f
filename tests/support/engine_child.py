"""LMCache engines in a child process, for the tests that need a second process.

``python -m support.engine_child shared ROLE CACHE_DIR SEED``
    one engine of the two-process shared-mode test (tests/engine/test_connector.py):
    ROLE ``writer`` stores a prompt and reports; ROLE ``reader`` reports, then waits for
    a line on stdin before each of its two retrieves.  Reports are JSON lines.
``python -m support.engine_child restart CACHE_DIR``
    a fresh engine on a cache an earlier engine filled (tests/engine/test_engine_nvme.py);
    prints one JSON report.
``python -m support.engine_child keys PHASE YAML CACHE_DIR [--algorithm A] [--miss-window N]``
    an engine built from an LMCache YAML as a user copies it (only the cache path and sizes
    changed), for the restart-hits tests (tests/engine/test_restart_hashing.py,
    tests/e2e/test_e2e_restart_hashing.py).  PHASE ``store`` stores a prompt and waits until
    the NVMe tier holds it; PHASE ``load`` looks the prompt up and retrieves it, after
    ``--miss-window`` lookups of prompts never stored.  Prints one JSON report; the
    engine's log goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

from lmcache_nvme_backend.testing.engine import (
    CPU_TIER,
    build_engine,
    chunk_keys,
    destroy_engine,
    evict_from_cpu,
    keys_in_tier,
    load_config,
    make_kv,
    make_prompt,
    retrieve_prompt,
    store_prompt,
    wait_until_in_tier,
)

from . import memory_cap
from .engines import (
    CHUNK,
    EXAMPLE_YAML,
    NUM_CHUNKS,
    REMOTE_EXAMPLE_YAML,
    REMOTE_TIER,
    connector_of,
    example_config_overrides,
    remote_overrides,
)


def _report(report: dict[str, Any]) -> None:
    print(json.dumps(report), flush=True)


def shared(role: str, cache_dir: Path, seed: int) -> None:
    engine, connector = build_engine(load_config(REMOTE_EXAMPLE_YAML,
                                                 remote_overrides(cache_dir)),
                                     instance_id=role)
    try:
        tokens = make_prompt(6 * CHUNK, seed=seed)
        keys = chunk_keys(engine, tokens)
        conn = connector_of(engine)
        if role == "writer":
            store_prompt(engine, tokens, make_kv(connector, len(tokens), seed=seed + 1))
            wait_until_in_tier(engine, REMOTE_TIER, keys, timeout_s=60)
            _report({"stored": len(keys)})
        else:
            _report({"ready": conn.stats()["entries"]})
            sys.stdin.readline()  # the writer has stored
            got = retrieve_prompt(engine, tokens, connector)
            expected = make_kv(connector, len(tokens), seed=seed + 1)
            _report({"hit_tokens": int(got.ret_mask.sum()),
                     "identical": bool(torch.equal(got.kv, expected)),
                     "adopted": conn.stats()["shared_adopted"],
                     "read_chunks": conn.stats()["read_chunks"]})
            # another process evicts the files: this engine sees misses, never errors
            sys.stdin.readline()
            evict_from_cpu(engine, keys)
            got = retrieve_prompt(engine, tokens, connector)
            _report({"hit_tokens_after_evict": int(got.ret_mask.sum()),
                     "read_failures": conn.stats()["read_failures"]})
    finally:
        destroy_engine(role)


def restart(cache_dir: Path) -> None:
    config = load_config(EXAMPLE_YAML, example_config_overrides(cache_dir))
    engine, connector = build_engine(config, instance_id="restarted")
    try:
        tokens = make_prompt(NUM_CHUNKS * CHUNK, seed=11)
        keys = chunk_keys(engine, tokens)
        backend: Any = engine.storage_manager.storage_backends["nvme"]
        report: dict[str, Any] = {"in_cpu": keys_in_tier(engine, CPU_TIER, keys),
                                  "in_nvme": keys_in_tier(engine, "nvme", keys)}
        got = retrieve_prompt(engine, tokens, connector)
        report["hit_tokens"] = int(got.ret_mask.sum())
        report["identical"] = bool(torch.equal(got.kv, make_kv(connector, len(tokens),
                                                               seed=12)))
        report["read_chunks"] = backend.stats()["read_chunks"]
        _report(report)
    finally:
        destroy_engine("restarted")


def keys(phase: str, yaml_path: Path, cache_dir: Path, algorithm: str | None,
         miss_window: int) -> None:
    overrides = example_config_overrides(cache_dir)
    if algorithm is not None:
        overrides["pre_caching_hash_algorithm"] = algorithm
    if miss_window:
        from lmcache_nvme_backend.adapters import _common

        _common.RESTART_MISS_LOOKUPS = miss_window
    config = load_config(yaml_path, overrides)
    engine, connector = build_engine(config, instance_id=f"keys-{phase}")
    try:
        tokens = make_prompt(4 * CHUNK, seed=21)
        keys = chunk_keys(engine, tokens)
        backend: Any = engine.storage_manager.storage_backends["nvme"]
        report: dict[str, Any] = {"algorithm": config.pre_caching_hash_algorithm,
                                  "first_key": keys[0].to_string()}
        if phase == "store":
            store_prompt(engine, tokens, make_kv(connector, len(tokens), seed=22))
            wait_until_in_tier(engine, "nvme", keys, timeout_s=60)
            report["stored"] = len(keys)
        else:
            for seed in range(miss_window):  # new prompts: the misses a server sees first
                retrieve_prompt(engine, make_prompt(CHUNK, seed=1000 + seed), connector)
            report["recovered"] = backend.stats()["recovered_entries"]
            report["in_nvme"] = keys_in_tier(engine, "nvme", keys)
            got = retrieve_prompt(engine, tokens, connector)
            report["hit_tokens"] = int(got.ret_mask.sum())
            report["identical"] = bool(torch.equal(got.kv, make_kv(connector, len(tokens),
                                                                   seed=22)))
        _report(report)
    finally:
        destroy_engine(f"keys-{phase}")


def main() -> None:
    memory_cap.install()
    parser = argparse.ArgumentParser(prog="python -m support.engine_child")
    sub = parser.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("shared")
    s.add_argument("role", choices=["writer", "reader"])
    s.add_argument("cache_dir", type=Path)
    s.add_argument("seed", type=int)
    r = sub.add_parser("restart")
    r.add_argument("cache_dir", type=Path)
    k = sub.add_parser("keys")
    k.add_argument("phase", choices=["store", "load"])
    k.add_argument("yaml", type=Path)
    k.add_argument("cache_dir", type=Path)
    k.add_argument("--algorithm")
    k.add_argument("--miss-window", type=int, default=0)
    args = parser.parse_args()
    if args.cmd == "shared":
        shared(args.role, args.cache_dir, args.seed)
    elif args.cmd == "keys":
        keys(args.phase, args.yaml, args.cache_dir, args.algorithm, args.miss_window)
    else:
        restart(args.cache_dir)


if __name__ == "__main__":
    main()
