"""Driver for tests/e2e/test_e2e_sglang_unified.py, run by the python of SGLang 0.5.23's
environment (``support.engine_env.SGLANG_UNIFIED``) as ``python -m
support.e2e_sglang_unified_driver`` (tests/ on ``PYTHONPATH``).

``run --phase store|load``: SGLang's own ``LMCacheUnifiedRadixCache`` (SGLang 0.5.21 and
later), chosen and built by SGLang's tree-cache factory (``mem_cache.registry.create_tree_cache``
with ``--enable-lmcache``) over SGLang's own pools, allocator and ``ModelConfig``, so that
its ``UnifiedLMCacheMPConnector`` (LMCache's) registers them with a running ``lmcache
server``.  The model decides the object groups: a plain Llama has one (its full-attention
KV); the same tiny model declared hybrid SWA (SGLang's ``is_hybrid_swa`` /
``hybrid_layer_pattern`` opt-in: layer 0 full attention, layers 1-2 a 64-token sliding
window) has two, SGLang's ``SWAKVPool`` with its FULL and SWA sub-pools, which LMCache stores
as two objects per chunk of different sizes (the server runs with
``--separate-object-groups``).

The scheduler's part is played here, in the order SGLang 0.5.23's scheduler calls the cache:
``Req.init_next_round_input`` and ``prefetch_from_storage`` (LOOKUP), ``check_prefetch_progress``
until it answers, ``init_next_round_input`` again (the host hit), ``init_load_back``
(RETRIEVE into fresh slots), ``check_hicache_events`` until the load completes (what the
forward waits for); then a request row and KV slots for the computed tokens (their KV written
as the forward pass would, ``support.sglang_side.prompt_kv``; the slots from SGLang's own
``alloc_token_slots`` / ``alloc_paged_token_slots_extend``), and SGLang's own
``release_kv_cache`` for the finished request (the tree takes it; the cache STOREs it),
``check_hicache_events`` until the store completes.  A probe is a request that is looked up
and then aborted (``finish(..., ABORT)``), so that it stores nothing.

* ``store``: A (700 tokens, no ``cache_salt``), B (600, salt ``alice``) and a short one
  (200) arrive cold and finish.
* ``load`` (a fresh process: empty radix tree, fresh pools): A without a salt and B with
  ``alice`` hit LMCache in full and load back byte for byte -- every full-attention layer over
  the whole hit, every sliding-window layer over the hit's last window (the part SGLang
  loads); probes of B as ``bob`` and without a salt, and of A as ``alice``, miss.  Then,
  with the server's L1 emptied, B's first 320 tokens in a fresh radix tree and B again: only
  the rest of the hit loads, byte for byte.  The report counts the adapter's chunk reads of
  each step (``--http``: the server's HTTP address).

One LMCache 0.5.6 bug is worked around, on CPU only, where LMCache's shared-memory transfer
(``lmcache_driven``, the only one that takes several object groups on CPU) is configured:
``UnifiedLMCacheMPConnector`` registers block views of SGLang's pool tensors, LMCache moves the
views' memory into POSIX shared memory and re-points only those views, so SGLang's own
tensors keep the old memory -- stores would send stale KV and loads land where SGLang never
reads.  ``share_pools`` moves SGLang's tensors first, with LMCache's own function, so the
views share them (``support.sglang_cpu``).  The pools and tree cache are otherwise SGLang's,
unpatched.

Prints its report (``support.reports``), with its pid: the test checks that the process
left no shared-memory segment behind.
"""

from __future__ import annotations

import argparse
import os
import time
from array import array
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

for _k, _v in {"LMCACHE_TRACK_USAGE": "false", "DO_NOT_TRACK": "1",
               "LMCACHE_DISABLE_BANNER": "1", "SGLANG_DISABLE_REQUEST_LOGGING": "1"}.items():
    os.environ.setdefault(_k, _v)

import torch  # noqa: E402
import yaml  # noqa: E402

from support import reports, sglang_cpu  # noqa: E402
from support.mp_server import adapter_status, clear_l1, settle, shm_segments  # noqa: E402
from support.sglang_side import ModelShape, prompt_kv  # noqa: E402
from support.sglang_workload import PROMPT_A, PROMPT_B, SHORT  # noqa: E402

RADIX_PART = 320  # tokens of B a finished request put into the radix tree
POOL_TOKENS = 8192
WAIT_S = 60.0
SALT, OTHER_SALT = "alice", "bob"
TRANSFER_MODE_KEY = "lmcache.mp.mp_transfer_mode"


class Scheduler:
    """The scheduler's side of one SGLang process: pools, tree cache, requests."""

    def __init__(self, model: str, config: str, page_size: int) -> None:
        from sglang.srt.configs.model_config import ModelConfig
        from sglang.srt.mem_cache.allocator import (
            PagedTokenToKVPoolAllocator,
            TokenToKVPoolAllocator,
        )
        from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator
        from sglang.srt.mem_cache.cache_init_params import CacheInitParams
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
        from sglang.srt.mem_cache.registry import TreeCacheBuildContext, create_tree_cache
        from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool
        from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler

        args = ServerArgs(model_path=model, device="cpu", enable_lmcache=True,
                          lmcache_config_file=config, page_size=page_size,
                          attention_backend="torch_native")
        args.resolve_once()
        set_global_server_args_for_scheduler(args)
        mc = ModelConfig.from_server_args(args)
        self.page_size = page_size
        self.hybrid = bool(mc.is_hybrid_swa)
        self.swa_layers = frozenset(mc.swa_attention_layer_ids or ())
        self.shape = ModelShape(layers=mc.num_hidden_layers, kv_heads=mc.get_num_kv_heads(1),
                                head_dim=mc.head_dim)
        self.req_to_token_pool = ReqToTokenPool(size=16, max_context_len=2048, device="cpu",
                                                enable_memory_saver=False)
        dtype = torch.bfloat16
        if self.hybrid:  # as KVCacheConfigurator builds a hybrid SWA model's pool
            self.kv_pool = SWAKVPool(
                size=POOL_TOKENS, size_swa=POOL_TOKENS, page_size=page_size, dtype=dtype,
                head_num=self.shape.kv_heads, head_dim=self.shape.head_dim,
                swa_attention_layer_ids=mc.swa_attention_layer_ids,
                full_attention_layer_ids=mc.full_attention_layer_ids, device="cpu",
                token_to_kv_pool_class=MHATokenToKVPool, enable_memory_saver=False)
            self.allocator = SWATokenToKVPoolAllocator(
                POOL_TOKENS, POOL_TOKENS, page_size=page_size, dtype=dtype, device="cpu",
                kvcache=self.kv_pool, need_sort=False, req_to_token_pool=self.req_to_token_pool)
            sub_pools = [self.kv_pool.full_kv_pool, self.kv_pool.swa_kv_pool]
        else:
            self.kv_pool = MHATokenToKVPool(
                POOL_TOKENS, page_size=page_size, dtype=dtype, head_num=self.shape.kv_heads,
                head_dim=self.shape.head_dim, layer_num=self.shape.layers, device="cpu",
                enable_memory_saver=False)
            self.allocator = (
                TokenToKVPoolAllocator(POOL_TOKENS, dtype, "cpu", self.kv_pool, need_sort=False)
                if page_size == 1 else
                PagedTokenToKVPoolAllocator(POOL_TOKENS, page_size, dtype, "cpu", self.kv_pool,
                                            need_sort=False))
            sub_pools = [self.kv_pool]
        with open(config) as f:
            extra = (yaml.safe_load(f) or {}).get("extra_config") or {}
        self.transfer_mode = extra.get(TRANSFER_MODE_KEY) or "auto"
        if self.transfer_mode == "lmcache_driven":
            sglang_cpu.share_pools([t for pool in sub_pools
                                    for t in (*pool.k_buffer, *pool.v_buffer)])
        params = CacheInitParams(
            disable=False, req_to_token_pool=self.req_to_token_pool,
            token_to_kv_pool_allocator=self.allocator, page_size=page_size,
            sliding_window_size=mc.sliding_window_size if self.hybrid else None)
        # SGLang's model runner: torch.get_device_module("cpu").Stream()
        tp_worker = SimpleNamespace(model_runner=SimpleNamespace(
            forward_stream=torch.cpu.Stream()))
        self.cache = create_tree_cache(TreeCacheBuildContext(
            server_args=args, params=params, is_hybrid_swa=self.hybrid, is_hybrid_ssm=False,
            enable_hierarchical_cache=False, disable_radix_cache=False, tp_worker=tp_worker,
            model_config=mc, tp_size=1, tp_rank=0, tp_group=None,
            full_tokens_per_layer=POOL_TOKENS))
        connector = self.cache.lmcache_connector
        self.window = connector.aligned_swa_window_size() if self.hybrid else None
        self.layout = {"cache": type(self.cache).__name__,
                       "components": [c.name for c in self.cache.tree_components],
                       "groups": [[g.name, len(g.kv_tensors), g.sliding_window_size]
                                  for g in connector._kv_groups],
                       "transfer_mode": self.transfer_mode, "window": self.window,
                       "shared_pools": sglang_cpu.pools_shared(
                           [t for pool in sub_pools for t in (*pool.k_buffer, *pool.v_buffer)],
                           list(connector._kv_caches.values()))}

    def request(self, rid: str, tokens: list[int], salt: str | None = None) -> Any:
        from sglang.srt.managers.schedule_batch import Req
        from sglang.srt.sampling.sampling_params import SamplingParams

        return Req(rid, "", array("q", tokens), SamplingParams(max_new_tokens=1),
                   cache_salt=salt)

    def _poll(self, done: Callable[[], bool], what: str) -> None:
        """The scheduler's loop: ``check_hicache_events`` at each pass until ``done``."""
        deadline = time.monotonic() + WAIT_S
        while not done():
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what}: not done after {WAIT_S:.0f} s")
            self.cache.check_hicache_events()
            time.sleep(0.002)

    def lookup(self, req: Any) -> int:
        """``Scheduler._prefetch_kvcache`` then ``check_prefetch_progress`` until it answers;
        the host hit ``init_next_round_input`` reports after it."""
        cache = self.cache
        req.init_next_round_input(cache, cow_mamba=False)
        fill = req.full_untruncated_fill_ids
        matched = req.prefix_len + req.host_hit_length
        end = req._compute_max_prefix_len(len(fill))
        cache.prefetch_from_storage(
            req.cache_request_handle, req.last_host_node, fill[matched:end],
            cache.get_last_hash_value(req.last_host_node), None,
            matched_prefix_tokens=fill[:matched], extra_key=req.extra_key,
            cache_salt=req.cache_salt)
        self._poll(lambda: cache.check_prefetch_progress(req.cache_request_handle), "lookup")
        cache.pop_prefetch_loaded_span(req.cache_request_handle)
        req.init_next_round_input(cache)
        return int(req.host_hit_length)

    def admit(self, req: Any) -> dict[str, Any]:
        """:meth:`lookup`, then ``init_load_back`` on a host hit and the wait for it; the
        request's prefix (slots of the radix part and of what was loaded)."""
        from sglang.srt.mem_cache.base_prefix_cache import InitLoadBackParams

        cache = self.cache
        host_hit = self.lookup(req)
        radix = int(req.prefix_len)
        if host_hit > 0:  # PrefillAdder: init_load_back, then the prefix grows by the load
            req.host_loaded_length, req.last_node = cache.init_load_back(InitLoadBackParams(
                best_match_node=req.best_match_node, host_hit_length=host_hit, req=req))
            req.prefix_len += req.host_loaded_length
            if cache.load_back_is_cache_owned():
                req.kv.cache_protected_len = req.prefix_len
        req.lock = cache.lock(req.last_node)
        flow = cache._external_flows.get(req.rid)
        if flow is not None and flow.load is not None:
            self._poll(lambda: flow.load_completed, "load")
        prefix = (cache.prefix_device_indices(req) if req.prefix_len
                  else torch.empty(0, dtype=torch.int64))
        return {"prefix": prefix.to(torch.int64), "host_hit_length": host_hit,
                "radix": radix, "loaded": int(req.prefix_len) - radix}

    def probe(self, req: Any) -> int:
        """A request looked up and then aborted before it runs (stores nothing)."""
        from sglang.srt.mem_cache.base_prefix_cache import CacheRequestOutcome

        host_hit = self.lookup(req)
        self.cache.finish(req.cache_request_handle, CacheRequestOutcome.ABORT)
        self._poll(lambda: not self.cache.has_pending_cache_operations(), "abort")
        return host_hit

    def _locs(self, layer: int, slots: torch.Tensor) -> torch.Tensor:
        if layer in self.swa_layers:
            return self.allocator.translate_loc_from_full_to_swa(slots)
        return slots

    def finish(self, req: Any, prefix: torch.Tensor) -> None:
        """Compute the rest of the prompt (KV written into fresh slots), then SGLang's
        ``release_kv_cache`` for the finished request: the radix tree takes it and LMCache
        stores its whole chunks; wait until the store completes."""
        from sglang.srt.managers.schedule_batch import FINISH_LENGTH
        from sglang.srt.mem_cache.allocation import (
            alloc_paged_token_slots_extend,
            alloc_token_slots,
        )
        from sglang.srt.mem_cache.common import release_kv_cache

        tokens = list(req.origin_input_ids)
        (row,) = self.req_to_token_pool.alloc([req])
        fresh = len(tokens) - len(prefix)
        if self.page_size == 1:  # as alloc_for_extend allocates
            slots = alloc_token_slots(self.cache, fresh)
        else:
            lens = (torch.tensor([len(prefix)]), torch.tensor([len(tokens)]))
            last_loc = prefix[-1:] if len(prefix) else torch.full((1,), -1, dtype=torch.int64)
            slots = alloc_paged_token_slots_extend(self.cache, lens[0], lens[0], lens[1],
                                                   lens[1], last_loc, fresh)
        slots = slots.to(torch.int64)
        kv = prompt_kv(tokens, self.shape)[:, :, len(prefix):]
        for layer in range(self.shape.layers):
            locs = self._locs(layer, slots)
            self.kv_pool.get_key_buffer(layer)[locs] = kv[0, layer]
            self.kv_pool.get_value_buffer(layer)[locs] = kv[1, layer]
        self.req_to_token_pool.req_to_token[row, : len(tokens)] = torch.cat(
            [prefix, slots]).to(torch.int32)
        req.kv.kv_allocated_len = req.kv.kv_committed_len = len(tokens)
        req.extend_end = len(tokens)
        req.finished_reason = FINISH_LENGTH(length=1)
        release_kv_cache(req, self.cache, checkpoint=True)
        self._poll(lambda: not self.cache.has_pending_cache_operations(), "store")

    def mismatches(self, slots: torch.Tensor, tokens: list[int], start: int
                   ) -> dict[str, int]:
        """KV values in ``slots`` that differ from the KV of ``tokens[start:]``: every
        full-attention layer over all of them, every sliding-window layer over the last
        window (what SGLang holds of a sliding-window layer); ``-1`` on a shape mismatch."""
        expected = prompt_kv(tokens, self.shape)[:, :, start:]
        if expected.shape[2] != len(slots):
            return {"full": -1, "swa": -1, "swa_tokens": 0}
        tail = min(self.window or 0, len(slots))
        counts = {"full": 0, "swa": 0, "swa_tokens": tail if self.swa_layers else 0}
        for layer in range(self.shape.layers):
            swa = layer in self.swa_layers
            span = slice(len(slots) - tail, len(slots)) if swa else slice(0, len(slots))
            locs = self._locs(layer, slots[span])
            got = torch.stack([self.kv_pool.get_key_buffer(layer)[locs],
                               self.kv_pool.get_value_buffer(layer)[locs]])
            counts["swa" if swa else "full"] += int(
                (got.view(torch.int16) != expected[:, layer, span].view(torch.int16)).sum())
        return counts

    def close(self) -> None:
        self.cache.shutdown()


def _loaded(s: Scheduler, req: Any, tokens: list[int]) -> tuple[dict[str, Any], torch.Tensor]:
    admitted = s.admit(req)
    prefix = admitted.pop("prefix")
    hit = admitted["radix"] + admitted["loaded"]
    admitted["mismatches"] = s.mismatches(prefix[admitted["radix"]:], tokens[:hit],
                                          admitted["radix"])
    return admitted, prefix


def store(s: Scheduler, http: str) -> dict[str, Any]:
    report: dict[str, Any] = {}
    for name, tokens, salt in (("a", PROMPT_A, None), ("b_alice", PROMPT_B, SALT),
                               ("short", SHORT, None)):
        req = s.request(f"{name}-store", tokens, salt)
        admitted = s.admit(req)
        s.finish(req, admitted["prefix"])
        report[name] = {"host_hit_length": admitted["host_hit_length"]}
    return report


def load(s: Scheduler, http: str) -> dict[str, Any]:
    report: dict[str, Any] = {}
    reads = adapter_status(http)["read_chunks"]
    for name, tokens, salt in (("a", PROMPT_A, None), ("b_alice", PROMPT_B, SALT)):
        req = s.request(f"{name}-load", tokens, salt)
        report[name], prefix = _loaded(s, req, tokens)
        s.finish(req, prefix)
    report["reads"] = adapter_status(http)["read_chunks"] - reads
    # Another user's salt, no salt, and the salted user asking for what was stored unsalted.
    report["probes"] = {
        name: s.probe(s.request(f"{name}-probe", tokens, salt))
        for name, tokens, salt in (("b_bob", PROMPT_B, OTHER_SALT), ("b_none", PROMPT_B, None),
                                   ("a_alice", PROMPT_A, SALT))}
    # A fresh tree holding B's first RADIX_PART tokens (a finished request put them there),
    # L1 emptied, then B again: only the rest of the hit loads.
    settle(http)
    clear_l1(http)
    s.cache.reset()
    reads = adapter_status(http)["read_chunks"]
    part = s.request("b-part", PROMPT_B[:RADIX_PART], SALT)
    s.finish(part, s.admit(part)["prefix"])
    settle(http)
    req = s.request("b-partial", PROMPT_B, SALT)
    report["b_partial"], prefix = _loaded(s, req, PROMPT_B)
    report["b_partial"]["radix_mismatches"] = s.mismatches(
        prefix[: report["b_partial"]["radix"]], PROMPT_B[:RADIX_PART], 0)
    report["partial_reads"] = adapter_status(http)["read_chunks"] - reads
    s.finish(req, prefix)
    return report


def main() -> None:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--model", required=True)
    r.add_argument("--config", required=True)
    r.add_argument("--page-size", type=int, default=1)
    r.add_argument("--phase", choices=["store", "load"], required=True)
    r.add_argument("--http", required=True, help="the lmcache server's HTTP address")
    args = parser.parse_args()
    scheduler = Scheduler(args.model, args.config, args.page_size)
    report = (store if args.phase == "store" else load)(scheduler, args.http)
    report["layout"] = scheduler.layout
    report["pid"] = os.getpid()
    scheduler.close()
    # The pools live in POSIX shared memory (LMCache moved them there to share them with
    # the server) and LMCache unlinks their names from finalizers, which run at a normal
    # exit but not at os._exit: unlink them as that exit would.
    for segment in shm_segments(os.getpid()):
        segment.unlink()
    reports.emit(report)


if __name__ == "__main__":
    main()
