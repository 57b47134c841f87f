"""The fix NVMeL2Adapter installs in ``lmcache server``: LMCache's CPU cache context can
register SGLang's split K / V pools, and nothing else changes.

The contexts are built as the server builds them when a client registers: from the
shared-memory wrappers the client sends (``wrap_one_kv_cache``), with the engine type and
layout hints SGLang's connector sends.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from lmcache.utils import EngineType
from lmcache.v1.platform.kv_wrap import wrap_one_kv_cache

from lmcache_nvme_backend.adapters import lmcache_fixes
from lmcache_nvme_backend.adapters.l2_adapter import NVMeL2Adapter

PAGE = 16
BLOCKS = 9
SGLANG_HINTS = {"tokens_per_block": PAGE, "kv_list_layout": "k_v"}


def cpu_context_module() -> Any:
    return importlib.import_module(lmcache_fixes.CPU_CONTEXT_MODULE)


def layout_function() -> Callable[..., Any]:
    return getattr(cpu_context_module(), lmcache_fixes.LAYOUT_FUNCTION)  # type: ignore[no-any-return]


def sglang_pools(layers: int = 2) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """SGLang's MHA pools: per layer, K and V of ``(slots, kv_heads, head_dim)``."""
    def pool() -> list[torch.Tensor]:
        return [torch.zeros(BLOCKS * PAGE, 2, 32, dtype=torch.bfloat16) for _ in range(layers)]
    return pool(), pool()


def register(tensors: list[torch.Tensor], engine: EngineType, hints: dict[str, Any]) -> Any:
    """The server side of REGISTER_KV_CACHE on CPU."""
    context_class = cpu_context_module().CPUCacheContext
    return context_class([wrap_one_kv_cache(t) for t in tensors], 256, layout_hints=hints,
                         engine_type=engine)


@pytest.fixture
def unfixed(monkeypatch: pytest.MonkeyPatch) -> None:
    """LMCache's own layout function, whether or not this process installed the fix."""
    original = getattr(layout_function(), "__wrapped__", layout_function())
    monkeypatch.setattr(cpu_context_module(), lmcache_fixes.LAYOUT_FUNCTION, original)


@pytest.fixture
def fixed(unfixed: None) -> None:
    assert lmcache_fixes.fix_cpu_split_kv_registration()


def test_lmcache_cannot_register_sglang_pools_on_cpu_without_the_fix(unfixed: None) -> None:
    k, v = sglang_pools()
    try:
        register([*k, *v], EngineType.SGLANG, SGLANG_HINTS)
    except AttributeError as exc:
        assert "data_ptr" in str(exc)
    else:
        pytest.fail("This LMCache registers SGLang's KV pools on CPU by itself: "
                    "lmcache_nvme_backend/adapters/lmcache_fixes.py is no longer needed.")


def test_the_fix_registers_sglang_pools_with_their_real_pointers(fixed: None) -> None:
    k, v = sglang_pools()
    context = register([*k, *v], EngineType.SGLANG, SGLANG_HINTS)
    assert context.block_size == PAGE and context.num_layers == 2
    keys, values = context.kv_caches_  # [K layers, V layers], mapped from shared memory
    assert isinstance(keys, lmcache_fixes.KVPlanes) and isinstance(values, lmcache_fixes.KVPlanes)
    assert keys.numel() == sum(t.numel() for t in k) and keys.dtype == torch.bfloat16
    assert context.get_group_kv_pointers(0).tolist() == [t.data_ptr() for t in (*keys, *values)]
    # The pools were moved into shared memory when wrapped: the context sees their writes.
    k[1][5 * PAGE + 3] = 3.0
    v[0][2 * PAGE] = -2.0
    assert bool((keys[1][5, 3] == 3.0).all()) and bool((values[0][2, 0] == -2.0).all())
    assert int(torch.count_nonzero(keys[0])) == 0 and int(torch.count_nonzero(values[1])) == 0


def test_the_fix_leaves_vllm_layers_alone(fixed: None) -> None:
    """vLLM registers one tensor per layer: the layout's tensors come out as they were."""
    layers = [torch.zeros(2, BLOCKS, PAGE, 2, 32, dtype=torch.bfloat16) for _ in range(2)]
    fixed_out, fixed_formats = layout_function()(layers, [], EngineType.VLLM, None)
    plain_out, plain_formats = layout_function().__wrapped__(layers, [], EngineType.VLLM, None)
    assert fixed_formats == plain_formats
    for a, b in zip(fixed_out, plain_out, strict=True):
        assert type(a) is torch.Tensor and type(b) is torch.Tensor
        assert (a.data_ptr(), a.shape, a.stride()) == (b.data_ptr(), b.shape, b.stride())


def test_the_fix_is_installed_once(fixed: None) -> None:
    installed = layout_function()
    assert lmcache_fixes.fix_cpu_split_kv_registration()
    assert layout_function() is installed


def test_the_l2_adapter_installs_it(unfixed: None, tmp_path: Path) -> None:
    adapter = NVMeL2Adapter({"path": str(tmp_path / "cache"), "max_size_gb": 1,
                             "min_free_gb": 0})
    try:
        assert getattr(layout_function(), "__wrapped__", None) is not None
    finally:
        adapter.close()
