"""Quick start: a real LMCache engine with the NVMe tier, on any machine (CPU only is fine).

It loads ``examples/lmcache-nvme.yaml`` with the cache directory set to
``./lmcache-nvme-demo`` (or ``--cache-dir``), stores a long prompt's KV cache,
waits until every chunk is persisted, pushes the chunks out of host memory, drops
the page cache when allowed (root), and loads the prompt back from the NVMe tier.
The loaded KV is compared byte for byte with what was stored, and timings are
printed.  Run it twice: the second run starts a fresh engine on the same
directory and hits the chunks the first run wrote: the YAML's
``pre_caching_hash_algorithm: sha256_cbor`` keeps chunk keys the same across processes
with no environment variable (the script prints how its keys are hashed).

LMCache's own log is kept to errors (``LMCACHE_LOG_LEVEL=WARNING`` shows its warnings);
the hashing warnings it prints on a machine without vLLM are explained before the
engine starts.

A small CPU connector stands in for GPU memory; the storage path through LMCache
is the production one.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")
os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("LMCACHE_DISABLE_BANNER", "1")
os.environ.setdefault("LMCACHE_LOG_LEVEL", "ERROR")  # its warnings: explained in main()

import torch  # noqa: E402

from lmcache_nvme_backend import NVMeConfigError, NVMeSettings, check_paths  # noqa: E402
from lmcache_nvme_backend.adapters.hashing import token_hashing  # noqa: E402
from lmcache_nvme_backend.testing.engine import (  # noqa: E402
    CPU_TIER,
    build_engine,
    chunk_keys,
    destroy_engine,
    drop_page_cache,
    evict_from_cpu,
    keys_in_tier,
    kv_nbytes,
    load_config,
    make_kv,
    make_prompt,
    retrieve_prompt,
    store_prompt,
    wait_until_in_tier,
)

EXAMPLE_YAML = Path(__file__).resolve().parent / "lmcache-nvme.yaml"
# (num_layers, 2, chunk_size, num_kv_heads, head_size): 8 MiB of bf16 KV per 256-token chunk.
KV_SHAPE = (16, 2, 256, 8, 64)
LMCACHE_HASH_WARNINGS = (
    "without vLLM, LMCache logs \"Could not load 'sha256_cbor' from vLLM. Using builtin "
    "hash\" and \"you MUST set PYTHONHASHSEED\" at start (LMCACHE_LOG_LEVEL=WARNING shows "
    "them). Harmless here: without vLLM LMCache hashes token ids with Python's hash() of "
    "integers, the same in every process, so the second run still hits. They matter on a "
    "vLLM server whose config keeps LMCache's default hashing (builtin): keys then change at "
    "every restart; keep pre_caching_hash_algorithm: sha256_cbor, as this YAML does "
    "(docs/troubleshooting.md, no hits after a restart).")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cache-dir", type=Path, default=Path("lmcache-nvme-demo"),
                        help="NVMe tier directory (default: ./lmcache-nvme-demo)")
    parser.add_argument("--tokens", type=int, default=16 * 256,
                        help="prompt length in tokens (default: 4096, 16 chunks)")
    args = parser.parse_args()

    config = load_config(EXAMPLE_YAML, {
        "max_local_cpu_size": 1,
        "extra_config": {"nvme.path": str(args.cache_dir.resolve()), "nvme.max_size_gb": 2,
                         "nvme.min_free_gb": 0.5},
    })
    try:  # the checks the tier runs at start, before LMCache swallows them into a log line
        check_paths(NVMeSettings.from_extra_config(config.extra_config))
    except NVMeConfigError as exc:
        raise SystemExit(f"quickstart: {exc}") from None
    hashing = token_hashing(config.pre_caching_hash_algorithm)
    print(f"token hashing: {hashing.describe()}")
    if not hashing.vllm:
        print(f"note: {LMCACHE_HASH_WARNINGS}")
    engine, connector = build_engine(config, instance_id="quickstart", kv_shape=KV_SHAPE)
    try:
        nvme = engine.storage_manager.storage_backends.get("nvme")  # type: ignore[union-attr]
        if nvme is None:
            raise SystemExit("quickstart: the NVMe tier did not load; the log above says why "
                             "('NVMe tier NOT loaded: ...').")
        tokens = make_prompt(args.tokens, seed=2026)
        kv = make_kv(connector, args.tokens, seed=7)
        keys = chunk_keys(engine, tokens)
        size_mib = kv_nbytes(kv) / 2**20
        print(f"prompt: {args.tokens} tokens, {len(keys)} chunks, {size_mib:.0f} MiB of KV; "
              f"NVMe tier at {args.cache_dir.resolve()}")

        already = keys_in_tier(engine, "nvme", keys)
        if already == len(keys):
            print(f"restart: all {len(keys)} chunks found on the NVMe tier from an earlier run")
        else:
            started = time.perf_counter()
            store_prompt(engine, tokens, kv)
            stored = time.perf_counter() - started
            waited = wait_until_in_tier(engine, "nvme", keys, timeout_s=120)
            print(f"store():  {stored * 1e3:8.1f} ms (returns before the drive is touched)")
            print(f"persist:  {waited * 1e3:8.1f} ms later every chunk is on the NVMe tier")
            evict_from_cpu(engine, keys)
        print(f"host memory tier holds {keys_in_tier(engine, CPU_TIER, keys)} of the chunks")
        why_not = drop_page_cache()
        print("page cache dropped" if why_not is None else f"page cache kept ({why_not})")

        got = retrieve_prompt(engine, tokens, connector)
        hit = int(got.ret_mask.sum())
        identical = torch.equal(got.kv, kv)
        gbps = kv_nbytes(kv) / got.seconds / 1e9
        print(f"retrieve: {got.seconds * 1e3:8.1f} ms for {hit} of {args.tokens} tokens "
              f"({gbps:.2f} GB/s) from the NVMe tier")
        print(f"bytes identical to what was stored: {identical}")
        stats = nvme.stats()
        print(f"tier stats: {int(stats['entries'])} chunks, "
              f"{stats['used_bytes'] / 2**20:.0f} MiB on disk, "
              f"{int(stats['read_chunks'])} chunks read, "
              f"{int(stats['checksum_failures'])} checksum failures, "
              f"direct I/O on {int(stats['direct_io_roots'])} path(s)")
        if not identical or hit != args.tokens:
            raise SystemExit("FAILED: the prompt did not come back intact")
    finally:
        destroy_engine("quickstart")


if __name__ == "__main__":
    main()
