"""Driver for tests/e2e/test_e2e_sglang_radix.py, run by the python of SGLang's environment
(``support.sglang_env``) as ``python -m support.e2e_sglang_driver`` (tests/ on
``PYTHONPATH``).

``radix --phase store|load``: SGLang's own ``LMCRadixCache`` (MP mode), built as SGLang's
scheduler builds it (``ServerArgs`` published, ``ModelConfig`` of the tiny model,
``ReqToTokenPool``, ``MHATokenToKVPool`` on CPU, SGLang's token allocator, ``CacheInitParams``)
against a running ``lmcache server``.  Requests are SGLang ``Req`` objects; the
scheduler's part is played here: ``match_prefix`` at admission, ``init_load_back`` when it
reports a host hit, a request row and KV slots for the computed tokens (their KV written as
the forward pass would, ``support.sglang_side.prompt_kv``), ``cache_finished_req`` at the end.

* ``store``: prompts A (700 tokens), B (600) and a short one (200) arrive cold and finish;
  LMCRadixCache stores their whole chunks.
* ``load`` (a fresh process: empty radix tree, fresh pools): A and B hit LMCache in full and
  load back, byte for byte; then, with the server's L1 emptied again, B's first 320 tokens
  are in the radix tree (a finished request inserted them, and stored B's first chunk in
  L1) and a new B request loads only the rest of B's hit: its second chunk, from the file.
  The report counts the adapter's chunk reads of each step (``--http``: the server's
  HTTP address).

Prints its report (``support.reports``), with its pid: the test checks that the process
left no shared-memory segment behind (it unlinks its pools' names as a normal exit would).

One SGLang bug is worked around, on CPU only: ``LMCRadixCache`` cannot create its streams
on a CPU device (``support.sglang_cpu``).
"""

from __future__ import annotations

import argparse
import os
from array import array
from typing import Any

for _k, _v in {"LMCACHE_TRACK_USAGE": "false", "DO_NOT_TRACK": "1",
               "LMCACHE_DISABLE_BANNER": "1", "SGLANG_DISABLE_REQUEST_LOGGING": "1"}.items():
    os.environ.setdefault(_k, _v)

import torch  # noqa: E402

from support import reports, sglang_cpu  # noqa: E402
from support.mp_server import adapter_status, clear_l1, settle, shm_segments  # noqa: E402
from support.sglang_side import ModelShape, prompt_kv  # noqa: E402
from support.sglang_workload import PROMPT_A, PROMPT_B, SHORT  # noqa: E402

RADIX_PART = 320  # tokens of B a finished request put into the radix tree
POOL_TOKENS = 8192


class Scheduler:
    """The scheduler's side of one SGLang process: pools, tree cache, requests."""

    def __init__(self, model: str, config: str, page_size: int) -> None:
        from sglang.srt.configs.model_config import ModelConfig
        from sglang.srt.mem_cache import memory_pool
        from sglang.srt.mem_cache.allocator import (
            PagedTokenToKVPoolAllocator,
            TokenToKVPoolAllocator,
        )
        from sglang.srt.mem_cache.cache_init_params import CacheInitParams
        from sglang.srt.mem_cache.storage.lmcache import lmc_radix_cache
        from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler

        args = ServerArgs(model_path=model, device="cpu", enable_lmcache=True,
                          lmcache_config_file=config, page_size=page_size,
                          attention_backend="torch_native")
        args.resolve_once()
        set_global_server_args_for_scheduler(args)
        self.model_config = ModelConfig.from_server_args(args)
        mc = self.model_config
        self.page_size = page_size
        self.req_to_token_pool = memory_pool.ReqToTokenPool(
            size=16, max_context_len=2048, device="cpu", enable_memory_saver=False)
        self.kv_pool = memory_pool.MHATokenToKVPool(
            POOL_TOKENS, page_size=page_size, dtype=torch.bfloat16,
            head_num=mc.get_num_kv_heads(1), head_dim=mc.head_dim,
            layer_num=mc.num_hidden_layers, device="cpu", enable_memory_saver=False)
        if page_size == 1:
            self.allocator = TokenToKVPoolAllocator(POOL_TOKENS, torch.bfloat16, "cpu",
                                                    self.kv_pool, need_sort=False)
        else:
            self.allocator = PagedTokenToKVPoolAllocator(
                POOL_TOKENS, page_size, torch.bfloat16, "cpu", self.kv_pool, need_sort=False)
        sglang_cpu.install()
        self.cache = lmc_radix_cache.LMCRadixCache(
            CacheInitParams(disable=False, req_to_token_pool=self.req_to_token_pool,
                            token_to_kv_pool_allocator=self.allocator,
                            page_size=page_size),
            model_config=mc, tp_size=1, rank=0, tp_group=None)
        self.shape = ModelShape(layers=mc.num_hidden_layers,
                                kv_heads=mc.get_num_kv_heads(1), head_dim=mc.head_dim)

    def request(self, rid: str, tokens: list[int]) -> Any:
        from sglang.srt.managers.schedule_batch import Req
        from sglang.srt.sampling.sampling_params import SamplingParams

        return Req(rid, "", array("q", tokens), SamplingParams(max_new_tokens=1))

    def admit(self, req: Any) -> dict[str, Any]:
        """``match_prefix``, then ``init_load_back`` on a host hit; the request's prefix
        (slots of the radix part and of what was loaded)."""
        from sglang.srt.mem_cache.base_prefix_cache import (
            InitLoadBackParams,
            MatchPrefixParams,
        )
        from sglang.srt.mem_cache.radix_cache import RadixKey

        fill_ids = req.origin_input_ids + req.output_ids  # as Req.init_next_round_input
        result = self.cache.match_prefix(MatchPrefixParams(key=RadixKey(fill_ids), req=req))
        radix = result.device_indices
        loaded = torch.empty(0, dtype=torch.int64)
        if result.host_hit_length > 0:
            loaded, _ = self.cache.init_load_back(InitLoadBackParams(
                best_match_node=result.best_match_node,
                host_hit_length=result.host_hit_length, req=req))
        return {"radix": radix.to(torch.int64), "loaded": loaded.to(torch.int64),
                "host_hit_length": int(result.host_hit_length)}

    def finish(self, req: Any, prefix: torch.Tensor) -> None:
        """Compute the rest of the prompt (KV written into fresh slots), then
        ``cache_finished_req``: the radix tree takes it and LMCache stores it."""
        tokens = list(req.origin_input_ids)
        (row,) = self.req_to_token_pool.alloc([req])
        fresh = len(tokens) - len(prefix)
        slots = self.allocator.alloc(-(-fresh // self.page_size) * self.page_size)
        slots = slots[:fresh].to(torch.int64)
        kv = prompt_kv(tokens, self.shape)[:, :, len(prefix):]
        for layer in range(self.shape.layers):
            self.kv_pool.k_buffer[layer][slots] = kv[0, layer]
            self.kv_pool.v_buffer[layer][slots] = kv[1, layer]
        self.req_to_token_pool.req_to_token[row, : len(tokens)] = torch.cat(
            [prefix, slots]).to(torch.int32)
        req.kv.req_pool_idx = row
        req.kv.kv_allocated_len = req.kv.kv_committed_len = len(tokens)
        req.kv.cache_protected_len = len(prefix)
        self.cache.cache_finished_req(req, kv_len_to_handle=len(tokens))

    def mismatches(self, slots: torch.Tensor, tokens: list[int], start: int) -> int:
        """KV values in ``slots`` that differ from the KV of ``tokens[start:]``."""
        expected = prompt_kv(tokens, self.shape)[:, :, start:]
        got = torch.stack([torch.stack([pool[slots] for pool in pools])
                           for pools in (self.kv_pool.k_buffer, self.kv_pool.v_buffer)])
        if got.shape != expected.shape:
            return -1
        return int((got.view(torch.int16) != expected.view(torch.int16)).sum())


def store(s: Scheduler) -> dict[str, Any]:
    report: dict[str, Any] = {}
    for name, tokens in (("a", PROMPT_A), ("b", PROMPT_B), ("short", SHORT)):
        req = s.request(f"{name}-store", tokens)
        admitted = s.admit(req)
        s.finish(req, admitted["radix"])
        report[name] = {"host_hit_length": admitted["host_hit_length"]}
    return report


def load(s: Scheduler, http: str) -> dict[str, Any]:
    report: dict[str, Any] = {}
    reads = adapter_status(http)["read_chunks"]
    for name, tokens in (("a", PROMPT_A), ("b", PROMPT_B)):
        req = s.request(f"{name}-load", tokens)
        admitted = s.admit(req)
        report[name] = {"host_hit_length": admitted["host_hit_length"],
                        "radix": len(admitted["radix"]), "loaded": len(admitted["loaded"]),
                        "mismatches": s.mismatches(admitted["loaded"], tokens[:512], 0)}
        s.finish(req, torch.cat([admitted["radix"], admitted["loaded"]]))
    report["ab_reads"] = adapter_status(http)["read_chunks"] - reads
    # A fresh tree with B's first RADIX_PART tokens, then B again.  The server commits what
    # ``store_kv`` handed it after the call returns, and whether L1 took A's and B's chunks
    # again depends on how those stores met the retrieves' temporary copies: let it settle
    # and empty L1, so that what B finds where is fixed.
    settle(http)
    clear_l1(http)
    s.cache.reset()
    reads = adapter_status(http)["read_chunks"]
    part = s.request("b-part", PROMPT_B[:RADIX_PART])
    s.finish(part, torch.empty(0, dtype=torch.int64))
    settle(http)  # B's first chunk, stored by that request, is in L1
    req = s.request("b-partial", PROMPT_B)
    admitted = s.admit(req)
    radix = admitted["radix"]
    report["b_partial"] = {
        "host_hit_length": admitted["host_hit_length"], "radix": len(radix),
        "loaded": len(admitted["loaded"]),
        "mismatches": s.mismatches(admitted["loaded"], PROMPT_B[:512], len(radix)),
        "radix_mismatches": s.mismatches(radix, PROMPT_B[: len(radix)], 0)}
    report["partial_reads"] = adapter_status(http)["read_chunks"] - reads
    return report


def main() -> None:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("radix")
    r.add_argument("--model", required=True)
    r.add_argument("--config", required=True)
    r.add_argument("--page-size", type=int, default=1)
    r.add_argument("--phase", choices=["store", "load"], required=True)
    r.add_argument("--http", required=True, help="the lmcache server's HTTP address")
    args = parser.parse_args()
    scheduler = Scheduler(args.model, args.config, args.page_size)
    report = store(scheduler) if args.phase == "store" else load(scheduler, args.http)
    report["pid"] = os.getpid()
    scheduler.cache.lmcache_connector.close()
    # The pools live in POSIX shared memory (LMCache moved them there to share them with
    # the server) and LMCache unlinks their names from finalizers, which run at a normal
    # exit but not at os._exit: unlink them as that exit would.
    for segment in shm_segments(os.getpid()):
        segment.unlink()
    reports.emit(report)


if __name__ == "__main__":
    main()
