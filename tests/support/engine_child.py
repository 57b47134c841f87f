"""LMCache engines in a child process, for the tests that need a second process.

``python -m support.engine_child shared ROLE CACHE_DIR SEED``
    one engine of the two-process shared-mode test (tests/engine/test_connector.py):
    ROLE ``writer`` stores a prompt and reports; ROLE ``reader`` reports, then waits for
    a line on stdin before each of its two retrieves.  Reports are JSON lines.
``python -m support.engine_child restart CACHE_DIR``
    a fresh engine on a cache an earlier engine filled (tests/engine/test_engine_nvme.py);
    prints one JSON report.
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
                     "vanished": conn.stats().get("shared_vanished", 0)})
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


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m support.engine_child")
    sub = parser.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("shared")
    s.add_argument("role", choices=["writer", "reader"])
    s.add_argument("cache_dir", type=Path)
    s.add_argument("seed", type=int)
    r = sub.add_parser("restart")
    r.add_argument("cache_dir", type=Path)
    args = parser.parse_args()
    if args.cmd == "shared":
        shared(args.role, args.cache_dir, args.seed)
    else:
        restart(args.cache_dir)


if __name__ == "__main__":
    main()
