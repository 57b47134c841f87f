"""Drive a real ``LMCacheEngine`` on CPU with byte-exact KV round trips.

:class:`CopyingCPUConnector` stands in for GPU memory (LMCache's ``MockGPUConnector`` moves
nothing), so ``engine.store()`` / ``retrieve()`` run their production paths for whatever
tier the config selects.  KV tensors are ``KV_2LTD``: ``[2, num_layers, num_tokens,
num_heads * head_size]``.  Call :func:`disable_telemetry` before building an engine.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml
from lmcache.utils import CacheEngineKey
from lmcache.v1.cache_engine import LMCacheEngine, LMCacheEngineBuilder
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.gpu_connector import GPUConnectorInterface
from lmcache.v1.memory_management import MemoryFormat, MemoryObj
from lmcache.v1.metadata import LMCacheMetadata
from lmcache.v1.storage_backend.abstract_backend import StorageBackendInterface

#: Environment that turns off LMCache's and vLLM's usage telemetry and LMCache's banner.
NO_TELEMETRY_ENV: dict[str, str] = {
    "LMCACHE_TRACK_USAGE": "false",
    "DO_NOT_TRACK": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "LMCACHE_DISABLE_BANNER": "1",
}


def disable_telemetry() -> None:
    """Set :data:`NO_TELEMETRY_ENV` in this process (values already set are kept)."""
    for name, value in NO_TELEMETRY_ENV.items():
        os.environ.setdefault(name, value)


class CopyingCPUConnector(GPUConnectorInterface):
    """Copies tokens ``[start, end)`` between LMCache's memory objects and
    ``kvcaches[:, :, start:end]`` of the ``kvcaches=<tensor>`` (the whole prompt) every
    ``store`` / ``retrieve`` call passes."""

    def __init__(self, num_layers: int, hidden_dim: int, dtype: torch.dtype) -> None:
        self.num_layers = num_layers
        self.hidden_dim = hidden_dim
        self.dtype = dtype

    def get_shape(self, num_tokens: int) -> torch.Size:
        """Shape of one memory object holding ``num_tokens`` tokens (KV_2LTD)."""
        return torch.Size([2, self.num_layers, num_tokens, self.hidden_dim])

    def _chunk_views(self, memory_obj: MemoryObj, start: int, end: int,
                     kwargs: Mapping[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        """Return (memory object tensor, matching slice of ``kwargs['kvcaches']``)."""
        kvcaches = kwargs.get("kvcaches")
        if not isinstance(kvcaches, torch.Tensor):
            raise TypeError("CopyingCPUConnector needs kvcaches=<CPU tensor> in the call")
        expected = (2, self.num_layers, self.hidden_dim)
        actual = (kvcaches.shape[0], kvcaches.shape[1], kvcaches.shape[3])
        if kvcaches.dim() != 4 or actual != expected or kvcaches.dtype != self.dtype:
            raise ValueError(
                f"kvcaches must be [2, {self.num_layers}, tokens, {self.hidden_dim}] "
                f"{self.dtype}, got {tuple(kvcaches.shape)} {kvcaches.dtype}")
        if not 0 <= start < end <= kvcaches.shape[2]:
            raise ValueError(f"token range [{start}, {end}) outside kvcaches "
                             f"({kvcaches.shape[2]} tokens)")
        fmt = memory_obj.get_memory_format()
        if fmt != MemoryFormat.KV_2LTD:
            raise ValueError(f"CopyingCPUConnector handles KV_2LTD only, got {fmt}")
        chunk = memory_obj.tensor
        if chunk is None:
            raise RuntimeError("memory object has no tensor (invalidated?)")
        if chunk.shape != self.get_shape(end - start) or chunk.dtype != self.dtype:
            raise ValueError(f"memory object is {tuple(chunk.shape)} {chunk.dtype}, "
                             f"expected {tuple(self.get_shape(end - start))} {self.dtype}")
        return chunk, kvcaches[:, :, start:end]

    def from_gpu(self, memory_obj: MemoryObj, start: int, end: int, **kwargs: Any) -> None:
        """Copy tokens ``[start, end)`` of ``kvcaches`` into ``memory_obj``."""
        chunk, region = self._chunk_views(memory_obj, start, end, kwargs)
        chunk.copy_(region)

    def to_gpu(self, memory_obj: MemoryObj, start: int, end: int, **kwargs: Any) -> None:
        """Copy ``memory_obj`` into tokens ``[start, end)`` of ``kvcaches``."""
        chunk, region = self._chunk_views(memory_obj, start, end, kwargs)
        region.copy_(chunk)

    def batched_from_gpu(self, memory_objs: Sequence[MemoryObj], starts: Sequence[int],
                         ends: Sequence[int], **kwargs: Any) -> None:
        """Apply :meth:`from_gpu` to each (memory object, start, end)."""
        for memory_obj, start, end in zip(memory_objs, starts, ends, strict=True):
            self.from_gpu(memory_obj, start, end, **kwargs)

    def batched_to_gpu(self, memory_objs: Sequence[MemoryObj] | None = None,
                       starts: Sequence[int] | None = None, ends: Sequence[int] | None = None,
                       **kwargs: Any) -> None:
        """Apply :meth:`to_gpu` to each (memory object, start, end)."""
        if memory_objs is None or starts is None or ends is None:
            raise TypeError("CopyingCPUConnector does not support layerwise retrieval")
        for memory_obj, start, end in zip(memory_objs, starts, ends, strict=True):
            self.to_gpu(memory_obj, start, end, **kwargs)


CPU_TIER = "LocalCPUBackend"  # LMCache's name for its host-memory tier

#: ``LMCacheMetadata.kv_shape`` (num_layers, 2, chunk_size, num_kv_heads, head_size) of the
#: default test model: a 256-token chunk is 2 MiB in bfloat16.
DEFAULT_KV_SHAPE: tuple[int, int, int, int, int] = (4, 2, 256, 8, 64)


def load_config(yaml_path: str | os.PathLike[str] | None = None,
                overrides: Mapping[str, Any] | None = None) -> LMCacheEngineConfig:
    """An ``LMCacheEngineConfig`` from a YAML file plus overrides (no ``LMCACHE_*`` variables):
    top-level keys replace the file's, ``extra_config`` merges key by key (None deletes)."""
    settings: dict[str, Any] = {}
    if yaml_path is not None:
        settings = yaml.safe_load(Path(yaml_path).read_text()) or {}
    overrides = dict(overrides or {})
    known = LMCacheEngineConfig._config_definitions
    unknown = sorted(set(overrides) - set(known))
    if unknown:
        raise KeyError(f"unknown LMCache config key(s): {', '.join(unknown)}")
    extra_overrides = overrides.pop("extra_config", None)
    settings.update(overrides)
    if extra_overrides is not None:
        extra = dict(settings.get("extra_config") or {})
        for key, value in extra_overrides.items():
            if value is None:
                extra.pop(key, None)
            else:
                extra[key] = value
        settings["extra_config"] = extra
    config = LMCacheEngineConfig.from_dict(settings)
    config.validate()
    return config


def nvme_plugin_settings(path: str | os.PathLike[str], max_size_gb: float,
                         **nvme_settings: Any) -> dict[str, Any]:
    """Config overrides that load the NVMe tier as storage plugin ``nvme``; each of
    ``nvme_settings`` becomes ``nvme.<name>`` in ``extra_config``."""
    extra: dict[str, Any] = {
        "storage_plugin.nvme.module_path": "lmcache_nvme_backend",
        "storage_plugin.nvme.class_name": "NVMeBackend",
        "nvme.path": str(path),
        "nvme.max_size_gb": max_size_gb,
    }
    extra.update({f"nvme.{name}": value for name, value in nvme_settings.items()})
    return {"storage_plugins": ["nvme"], "local_disk": None, "extra_config": extra}


def local_disk_settings(path: str | os.PathLike[str], max_size_gb: float) -> dict[str, Any]:
    """Config overrides that enable LMCache's built-in ``LocalDiskBackend``."""
    return {"local_disk": f"file://{Path(path).resolve()}", "max_local_disk_size": max_size_gb}


def build_engine(config: LMCacheEngineConfig | str | os.PathLike[str], *, instance_id: str,
                 kv_shape: tuple[int, int, int, int, int] = DEFAULT_KV_SHAPE,
                 dtype: torch.dtype = torch.bfloat16,
                 model_name: str = "test-model") -> tuple[LMCacheEngine, CopyingCPUConnector]:
    """A post-initialised single-worker engine and its copying connector.  Release it with
    :func:`destroy_engine`, or the process hangs at exit on LMCache's event-loop thread."""
    if not isinstance(config, LMCacheEngineConfig):
        config = load_config(config)
    num_layers, kv_dim, chunk_size, num_heads, head_size = kv_shape
    if kv_dim != 2:
        raise ValueError("kv_shape[1] must be 2 (K and V); MLA is not modelled here")
    if chunk_size != config.chunk_size:
        raise ValueError(f"kv_shape chunk size {chunk_size} != config chunk_size "
                         f"{config.chunk_size}")
    metadata = LMCacheMetadata(model_name=model_name, world_size=1, local_world_size=1,
                               worker_id=0, local_worker_id=0, kv_dtype=dtype,
                               kv_shape=kv_shape, chunk_size=chunk_size)
    connector = CopyingCPUConnector(num_layers, num_heads * head_size, dtype)
    engine = LMCacheEngineBuilder.get_or_create(
        instance_id, config, metadata, connector, broadcast_fn=lambda tensor, src: None,
        broadcast_object_fn=lambda obj, src: obj)
    try:
        engine.post_init()
    except BaseException:
        LMCacheEngineBuilder.destroy(instance_id)
        raise
    return engine, connector


def destroy_engine(instance_id: str) -> None:
    """Close the engine, its storage tiers and background threads (idempotent)."""
    if LMCacheEngineBuilder.get(instance_id) is not None:
        LMCacheEngineBuilder.destroy(instance_id)


def storage_tiers(engine: LMCacheEngine) -> dict[str, StorageBackendInterface]:
    """The engine's storage tiers in lookup order: built-in ones by class name, plugins as
    named in ``storage_plugins``."""
    if engine.storage_manager is None:
        raise RuntimeError("engine has no storage manager; was post_init() called?")
    return dict(engine.storage_manager.storage_backends)


def lower_tier_name(engine: LMCacheEngine) -> str:
    """Name of the single tier below host memory (raises unless exactly one)."""
    names = [name for name in storage_tiers(engine) if name != CPU_TIER]
    if len(names) != 1:
        raise RuntimeError(f"expected exactly one tier below {CPU_TIER}, found {names} "
                           "(did a storage plugin fail to load? LMCache only logs that)")
    return names[0]


def _generator(seed: int) -> torch.Generator:
    """A CPU generator; rejects seeds torch would silently fold to 32 bits."""
    if not 0 <= seed < 2**32:
        raise ValueError(f"seed {seed} outside [0, 2**32): torch's CPU generator keeps "
                         "only the low 32 bits, so distinct seeds would collide")
    return torch.Generator().manual_seed(seed)


def make_prompt(num_tokens: int, seed: int, vocab_size: int = 32000) -> torch.Tensor:
    """Random token ids; distinct seeds give distinct chunk keys."""
    return torch.randint(0, vocab_size, (num_tokens,), generator=_generator(seed),
                         dtype=torch.long)


def make_kv(connector: CopyingCPUConnector, num_tokens: int, seed: int) -> torch.Tensor:
    """Random KV for ``num_tokens`` tokens, shaped for ``connector`` (KV_2LTD)."""
    return torch.randn(connector.get_shape(num_tokens), generator=_generator(seed),
                       dtype=torch.float32).to(connector.dtype)


def chunk_keys(engine: LMCacheEngine, tokens: torch.Tensor) -> list[CacheEngineKey]:
    """The cache keys of the prompt's chunks, in token order."""
    return [key for _, _, key in engine.token_database.process_tokens(tokens=tokens)]


def kv_nbytes(kv: torch.Tensor) -> int:
    """Payload bytes of a KV tensor."""
    return kv.numel() * kv.element_size()


def store_prompt(engine: LMCacheEngine, tokens: torch.Tensor, kv: torch.Tensor) -> None:
    """``engine.store()`` the prompt's KV (returns before lower tiers persist it)."""
    engine.store(tokens, kvcaches=kv)


@dataclass(frozen=True)
class Retrieved:
    """What one ``engine.retrieve()`` produced: the destination KV (filled where
    ``ret_mask``, LMCache's per-token hit mask, is True) and the call's wall time."""

    kv: torch.Tensor
    ret_mask: torch.Tensor
    seconds: float


def retrieve_prompt(engine: LMCacheEngine, tokens: torch.Tensor,
                    connector: CopyingCPUConnector) -> Retrieved:
    """``engine.retrieve()`` the prompt into a NaN-filled destination (a chunk claimed but not
    written never equals the stored KV)."""
    destination = torch.full(connector.get_shape(len(tokens)), float("nan"),
                              dtype=connector.dtype)
    started = time.perf_counter()
    ret_mask = engine.retrieve(tokens, kvcaches=destination)
    return Retrieved(kv=destination, ret_mask=ret_mask, seconds=time.perf_counter() - started)


def keys_in_tier(engine: LMCacheEngine, tier: str, keys: Sequence[CacheEngineKey]) -> int:
    """How many of ``keys`` the tier reports as present (no pinning)."""
    backend = storage_tiers(engine)[tier]
    return sum(1 for key in keys if backend.contains(key, pin=False))


def wait_until_in_tier(engine: LMCacheEngine, tier: str, keys: Sequence[CacheEngineKey],
                       timeout_s: float = 60.0, poll_s: float = 0.01) -> float:
    """Seconds until the tier holds every key (writes to lower tiers are asynchronous);
    ``TimeoutError`` after ``timeout_s``."""
    started = time.perf_counter()
    while True:
        present = keys_in_tier(engine, tier, keys)
        if present == len(keys):
            return time.perf_counter() - started
        if time.perf_counter() - started >= timeout_s:
            raise TimeoutError(f"{tier} holds {present} of {len(keys)} chunks "
                               f"after {timeout_s:.1f} s")
        time.sleep(poll_s)


def evict_from_cpu(engine: LMCacheEngine, keys: Sequence[CacheEngineKey]) -> int:
    """Remove the keys from the host-memory tier only, as an LRU eviction would (lower tiers
    keep theirs); the number removed."""
    assert engine.storage_manager is not None
    removed = engine.storage_manager.batched_remove(list(keys), locations=[CPU_TIER])
    left = keys_in_tier(engine, CPU_TIER, keys)
    if left:
        raise RuntimeError(f"{left} of {len(keys)} chunks still in {CPU_TIER} after eviction")
    return removed


def clear_cpu_tier(engine: LMCacheEngine) -> None:
    """Empty the host-memory tier (every evictable chunk); lower tiers keep theirs."""
    engine.clear(locations=[CPU_TIER])


def drop_page_cache() -> str | None:
    """``sync`` and drop the kernel page cache (needs root); None, or why it could not."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as handle:
            handle.write("3\n")
    except OSError as exc:
        return f"{type(exc).__name__}: {exc}"
    return None
