"""SGLang's side of LMCache's multiprocess mode, on CPU: KV pools in SGLang's layout, and
the calls SGLang's ``LMCRadixCache`` makes on LMCache's own connector.

``KVPools`` is SGLang's ``MHATokenToKVPool`` (one K and one V tensor per layer, shaped
``(size + page_size, kv_heads, head_dim)``, row = token slot) with its paged allocator
(page 0 is padding; pages are handed out in shuffled order, as after some traffic, so
that a request's pages are not contiguous).

``RadixSide`` makes the connector calls of ``LMCRadixCache`` in MP mode (SGLang 0.5.13 to
0.5.20, ``python/sglang/srt/mem_cache/storage/lmcache/lmc_radix_cache.py``):

* ``match_prefix``: the key cut to whole pages, ``lookup_kv``; no more than the radix
  tree already holds → ``release_pending``;
* ``init_load_back``: slots for the hit beyond the radix tree, a slot mapping with ``-1``
  for the tokens the tree holds, ``retrieve_kv`` with ``offset`` and ``prefix_pad`` (the
  radix part of the first chunk to load), unused slots freed;
* ``cache_finished_req``: ``store_kv`` (0.5.20 waits for it), or ``store_kv_async`` with
  the request's pages kept until the future resolves (SGLang's main branch since), then
  ``end_session``.

The connector is ``lmcache.integration.sglang.multi_process_adapter.LMCacheMPConnector``
built with the arguments ``LMCRadixCache.__init__`` passes (server address from the
``--lmcache-config-file`` YAML through LMCache's ``lmcache_get_config``).
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from lmcache.integration.sglang.multi_process_adapter import LMCacheMPConnector
from lmcache.integration.sglang.sglang_adapter import LoadMetadata, StoreMetadata
from lmcache.integration.sglang.utils import lmcache_get_config

DTYPE = torch.bfloat16


@dataclass
class ModelShape:
    """The tiny Llama of the end-to-end tests: 2 layers, 2 KV heads of 32."""

    layers: int = 2
    kv_heads: int = 2
    head_dim: int = 32


class KVPools:
    """SGLang's per-layer K and V pools and its paged token-slot allocator, on CPU."""

    def __init__(self, shape: ModelShape, page_size: int, size_tokens: int, seed: int = 0
                 ) -> None:
        if size_tokens % page_size:
            raise ValueError("size_tokens must be whole pages")
        self.shape, self.page_size = shape, page_size
        rows = size_tokens + page_size
        self.k = [torch.zeros(rows, shape.kv_heads, shape.head_dim, dtype=DTYPE)
                  for _ in range(shape.layers)]
        self.v = [torch.zeros(rows, shape.kv_heads, shape.head_dim, dtype=DTYPE)
                  for _ in range(shape.layers)]
        self._free_pages = list(range(1, size_tokens // page_size + 1))  # page 0: padding
        random.Random(seed).shuffle(self._free_pages)

    def alloc(self, tokens: int) -> torch.Tensor:
        """Slots for ``tokens`` (whole pages), as SGLang's paged allocator hands them out."""
        if tokens % self.page_size:
            raise ValueError(f"{tokens} tokens is not whole pages of {self.page_size}")
        pages = [self._free_pages.pop() for _ in range(tokens // self.page_size)]
        offsets = torch.arange(self.page_size, dtype=torch.int64)
        return torch.cat([page * self.page_size + offsets for page in pages]) if pages \
            else torch.empty(0, dtype=torch.int64)

    def free(self, slots: torch.Tensor) -> None:
        self._free_pages.extend(sorted({int(s) // self.page_size for s in slots.tolist()}))

    def write(self, slots: torch.Tensor, kv: torch.Tensor) -> None:
        """Put ``kv`` (``[2, layers, tokens, heads, dim]``) into ``slots``."""
        for layer in range(self.shape.layers):
            self.k[layer][slots] = kv[0, layer]
            self.v[layer][slots] = kv[1, layer]

    def read(self, slots: torch.Tensor) -> torch.Tensor:
        """The KV in ``slots``, as ``[2, layers, tokens, heads, dim]``."""
        return torch.stack([torch.stack([pool[slots] for pool in pools])
                            for pools in (self.k, self.v)])


def prompt_kv(tokens: list[int], shape: ModelShape) -> torch.Tensor:
    """KV for ``tokens`` (``[2, layers, tokens, heads, dim]``) where each position's values
    depend on the prefix up to it, as a model's do: prompts with a common prefix have the
    same KV over it."""
    per_token = []
    prefix = hashlib.blake2b(digest_size=8)
    for token in tokens:
        prefix.update(token.to_bytes(4, "little"))
        gen = torch.Generator().manual_seed(int.from_bytes(prefix.copy().digest(), "little")
                                            >> 1)
        per_token.append(torch.randn(2, shape.layers, shape.kv_heads, shape.head_dim,
                                     generator=gen))
    return torch.stack(per_token, dim=2).to(DTYPE)


@dataclass
class Request:
    """What ``LMCRadixCache`` keeps of a request between its calls."""

    rid: str
    tokens: list[int]
    radix_len: int = 0  # tokens the radix tree already holds (whole pages)
    host_hit: int = 0  # tokens LMCache holds beyond them
    key: list[int] = field(default_factory=list)


class RadixSide:
    """LMCRadixCache's calls on ``LMCacheMPConnector``, in SGLang's order."""

    def __init__(self, config_file: Path, pools: KVPools, model_path: str,
                 mq_timeout: float = 60.0) -> None:
        cfg = lmcache_get_config(str(config_file))
        self.pools = pools
        # LMCRadixCache.__init__: model config, TP 1 / rank 0, the KV cache's K and V
        # buffers, no TP group; the address from the config file.
        self.connector = LMCacheMPConnector(
            sgl_config=SimpleNamespace(model_path=model_path), tp_size=1, rank=0,
            page_size=pools.page_size, host=cfg.mp_host, port=cfg.mp_port,
            k_pool=pools.k, v_pool=pools.v, tp_group=None, mq_timeout=mq_timeout)

    def match_prefix(self, req: Request) -> int:
        """``_mp_match_prefix``: LOOKUP; the tokens LMCache holds beyond the radix tree."""
        page = self.pools.page_size
        req.key = req.tokens[: len(req.tokens) // page * page]
        matched = self.connector.lookup_kv(req.key, req.rid)
        if matched <= req.radix_len:
            self.connector.release_pending(req.rid)
            req.host_hit = 0
        else:
            req.host_hit = matched - req.radix_len
        return req.host_hit

    def init_load_back(self, req: Request) -> torch.Tensor:
        """``init_load_back`` / ``_load_back``: RETRIEVE into fresh slots; the slots that hold
        the loaded tokens (those after the radix part), in token order."""
        prefix_pad = req.radix_len % self.connector.chunk_size()
        slots = self.pools.alloc(req.host_hit)
        slot_mapping = torch.cat([torch.full((req.radix_len,), -1, dtype=torch.int64), slots])
        retrieved = self.connector.retrieve_kv(LoadMetadata(
            token_ids=req.key, slot_mapping=slot_mapping, offset=req.radix_len - prefix_pad,
            prefix_pad=prefix_pad, request_id=req.rid))
        if retrieved <= 0:
            self.pools.free(slots)
            self.connector.release_pending(req.rid)
            return torch.empty(0, dtype=torch.int64)
        fetched = retrieved - prefix_pad
        self.pools.free(slots[fetched:])
        return slots[:fetched]

    def cache_finished_req(self, req: Request, kv_indices: torch.Tensor,
                           wait: bool = True) -> Any:
        """``cache_finished_req``: STORE the request's KV, then END_SESSION.  ``wait``:
        ``store_kv`` (0.5.20); otherwise ``store_kv_async``, whose future is returned and
        must resolve before ``kv_indices`` are reused (``finish_store`` ends the session)."""
        metadata = StoreMetadata(last_node=None, token_ids=req.tokens, kv_indices=kv_indices,
                                 offset=0, request_id=req.rid)
        if wait:
            self.connector.store_kv(metadata)
            self.connector.end_session(req.rid)
            return None
        return self.connector.store_kv_async(metadata)

    def finish_store(self, req: Request, future: Any) -> bool:
        """``_settle_mp_store``: wait for an asynchronous store, then END_SESSION."""
        try:
            return bool(future.result())
        finally:
            self.connector.end_session(req.rid)

    def close(self) -> None:
        self.connector.close()
