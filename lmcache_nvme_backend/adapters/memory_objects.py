"""Translations between LMCache memory objects and the chunk store's buffers, for the three
adapters and the GPU reader: objects as a store task, host objects to read chunks into, a
batch of results as the prefix LMCache expects.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import operator
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, cast

import torch

from ..disk.format import TensorMeta
from ..gpu.reader import HostMemory
from ..io import native
from ..store import ChunkRead, ChunkStore, TaskOutcome
from ._common import EngineKeyNames
from .lmcache_range import lmcache_imports

with lmcache_imports():
    from lmcache.utils import CacheEngineKey
    from lmcache.v1.memory_management import MemoryFormat, MemoryObj

if TYPE_CHECKING:
    from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend

logger = logging.getLogger("lmcache_nvme_backend")


def allocate_for(local_cpu_backend: LocalCPUBackend, meta: TensorMeta) -> MemoryObj | None:
    """A host memory object for a stored chunk (None: host memory exhausted or too small)."""
    shapes = [torch.Size(s) for s in meta.shapes]
    dtypes = [getattr(torch, d, None) for d in meta.dtypes]
    try:
        fmt = MemoryFormat(meta.fmt)
    except ValueError:
        fmt = None
    if fmt is None or not all(isinstance(d, torch.dtype) for d in dtypes):
        logger.warning("NVMe tier: a chunk's metadata names dtypes %s / format %d that this "
                       "LMCache does not know; serving a miss.", meta.dtypes, meta.fmt)
        return None
    if len(shapes) == 1:
        obj = local_cpu_backend.allocate(shapes[0], dtypes[0], fmt)
    else:
        obj = local_cpu_backend.allocate(shapes, dtypes, fmt)
    if obj is None:
        logger.warning("NVMe tier: host memory for a %d-byte chunk is exhausted; serving a "
                       "miss.", meta.nbytes)
        return None
    return fit_to_payload(obj, meta.nbytes)


def host_memory(local_cpu_backend: LocalCPUBackend) -> HostMemory:
    """What the GPU read path needs of LMCache's host memory tier."""
    return HostMemory(allocate=functools.partial(allocate_for, local_cpu_backend),
                      view=host_view, fit=fit_to_payload,
                      reclaim=functools.partial(release_from_host_tier, local_cpu_backend))


def read_into_host_objects(store: ChunkStore, local_cpu_backend: LocalCPUBackend,
                           keys: Sequence[str], metas: Sequence[TensorMeta | None]
                           ) -> list[MemoryObj | None]:
    """Read chunks into new host memory objects; None (nothing held) for each one not served
    or whose ``metas[i]`` is None (not to read)."""
    objs = [None if meta is None else allocate_for(local_cpu_backend, meta) for meta in metas]
    reads = [ChunkRead(k, host_view(o)) for k, o in zip(keys, objs, strict=True) if o]
    served = iter(store.read_into(reads) if reads else [])
    results: list[MemoryObj | None] = []
    for obj in objs:
        if obj is not None and not next(served):
            obj.ref_count_down()
            obj = None
        results.append(obj)
    return results


def fit_to_payload(obj: MemoryObj, nbytes: int) -> MemoryObj | None:
    """The object sized to a chunk's payload (None, released, if it is smaller)."""
    if obj.get_size() != nbytes:
        if obj.get_size() < nbytes:
            obj.ref_count_down()
            return None
        obj.set_used_size(nbytes)
    return obj


def served_prefix(objs: list[MemoryObj | None]) -> list[MemoryObj]:
    """The objects up to the first miss; the ones after it are released."""
    prefix: list[MemoryObj] = []
    for obj in objs:
        if obj is None:
            break
        prefix.append(obj)
    for obj in objs[len(prefix) :]:
        if obj is not None:
            obj.ref_count_down()
    return prefix


def release_from_host_tier(local_cpu_backend: LocalCPUBackend, key: CacheEngineKey,
                           obj: MemoryObj) -> bool:
    """Make LMCache's host tier (where its storage manager puts what a lower tier returns)
    let go of a GPU pool object only it still holds; the chunk stays on NVMe."""
    hot_cache = getattr(local_cpu_backend, "hot_cache", None)
    if hot_cache is None or hot_cache.get(key) is not obj:
        return False
    if obj.get_ref_count() != 1 or obj.is_pinned:
        return False  # in use by a retrieve, or pinned by a lookup
    return bool(local_cpu_backend.remove(key, force=True))


def is_device_object(obj: MemoryObj) -> bool:
    """Whether a memory object lives in GPU memory."""
    tensor = obj.tensor
    return tensor is not None and tensor.device.type != "cpu"


def device_payload(obj: MemoryObj) -> memoryview:
    """A host copy of a GPU memory object's payload bytes."""
    size = obj.get_size()
    raw = getattr(obj, "raw_data", None)
    if isinstance(raw, torch.Tensor) and raw.dtype == torch.uint8 and raw.numel() >= size:
        data = raw.reshape(-1)[:size]
    else:
        assert obj.tensor is not None
        data = obj.tensor.contiguous().reshape(-1).view(torch.uint8)[:size]
    return memoryview(data.cpu().numpy()).cast("B")  # type: ignore[arg-type]


def check_pairs(keys: Sequence[object], objs: Sequence[MemoryObj]) -> None:
    """ValueError unless there is one memory object per key."""
    if len(keys) != len(objs):
        raise ValueError(f"{len(keys)} keys but {len(objs)} objects")


def submit_objects(store: ChunkStore, naming: EngineKeyNames, keys: Sequence[CacheEngineKey],
                   objs: Sequence[MemoryObj],
                   on_complete: Callable[[CacheEngineKey], None] | None = None) -> int:
    """Queue the objects as one store task; host objects are referenced until it ends (read
    in place), GPU ones copied to host memory here.  ``on_complete(key)`` runs for each
    chunk persisted once the task ended.  Returns how many objects were copied from GPU."""
    check_pairs(keys, objs)
    if not keys:
        return 0
    names, namespaces = zip(*naming.many(keys), strict=True)
    metas = tensor_metas(objs)
    payloads: list[memoryview] = []
    held: list[MemoryObj] = []
    for obj in objs:
        if is_device_object(obj):
            payloads.append(device_payload(obj))
        else:
            # byte_array's format is ctypes' '<B': as 'B' it mixes with the engine's buffers
            # (a payload that is not a 4 KiB multiple goes through an aligned tail buffer)
            payloads.append(obj.byte_array.cast("B"))
            held.append(obj)
    for obj in held:
        obj.ref_count_up()
    task = _PutTask(keys, held, on_complete)
    try:
        store.submit_task(names, namespaces, metas, payloads, task.ended)
    except Exception:
        task.ended(None)  # nothing persisted: the objects are let go (if not already)
        raise
    return len(objs) - len(held)


class _PutTask:
    """An in-process store task's end: the objects released and ``on_complete`` called for
    each chunk persisted, exactly once (from the store's completion, or from a submission
    that raised)."""

    def __init__(self, keys: Sequence[CacheEngineKey], held: list[MemoryObj],
                 on_complete: Callable[[CacheEngineKey], None] | None) -> None:
        self._keys = keys
        self._held: list[MemoryObj] | None = held
        self._on_complete = on_complete
        self._lock = threading.Lock()

    def ended(self, outcome: TaskOutcome | None) -> None:
        with self._lock:
            held, self._held = self._held, None
        if held is None:
            return
        for obj in held:
            obj.ref_count_down()
        if self._on_complete is not None and outcome is not None:
            stored = range(len(self._keys)) if outcome.stored is None else outcome.stored
            for i in stored:
                _call_safely(self._on_complete, self._keys[i])


def tensor_meta_of(obj: MemoryObj) -> TensorMeta:
    """The allocation metadata recorded in a chunk header (runs for every chunk stored): the
    last single-tensor layout is compared field by field before the cache is asked
    (building and hashing its key cost more than the comparison)."""
    meta = obj.metadata
    if meta.shapes:
        return _tensor_meta(tuple(map(tuple, meta.shapes)), tuple(meta.dtypes), meta.fmt,
                            obj.get_size())
    global _last_layout
    shape, dtype, fmt, size = meta.shape, meta.dtype, meta.fmt, obj.get_size()
    last = _last_layout
    if last is not None and last[0] is fmt and last[1] is dtype and last[2] == size \
            and last[3] == shape:
        return last[4]
    found = _tensor_meta((tuple(shape),), (dtype,), fmt, size)
    _last_layout = (fmt, dtype, size, shape, found)  # one atomic replacement
    return found


def tensor_metas(objs: Sequence[MemoryObj]) -> list[TensorMeta]:
    """:func:`tensor_meta_of` of each object.  A task's objects nearly always share a layout,
    checked with C-level getters on LMCache's ``meta`` (the ``metadata`` property without
    its lock; layout fields never change): the only Python call per object is ``get_size``."""
    if len(objs) > 1:  # one object: nothing to share
        try:
            layouts = list(map(_LAYOUT_FIELDS, map(_META, objs)))
            sizes = list(map(_GET_SIZE, objs))
        except AttributeError:  # not one of LMCache's memory objects: ask each the long way
            layouts = sizes = []
        if layouts and layouts.count(layouts[0]) == len(objs) == sizes.count(sizes[0]):
            return [tensor_meta_of(objs[0])] * len(objs)
    return list(map(tensor_meta_of, objs))


_META = operator.attrgetter("meta")
_LAYOUT_FIELDS = operator.attrgetter("shapes", "dtypes", "shape", "dtype", "fmt")
_GET_SIZE = operator.methodcaller("get_size")

#: ``(fmt, dtype, size, shape, TensorMeta)`` of the last single-tensor layout seen.
_last_layout: tuple[MemoryFormat, torch.dtype, int, torch.Size, TensorMeta] | None = None


@functools.lru_cache(maxsize=1024)
def _tensor_meta(shapes: tuple[tuple[int, ...], ...], dtypes: tuple[torch.dtype, ...],
                 fmt: MemoryFormat, nbytes: int) -> TensorMeta:
    return TensorMeta(
        shapes=tuple(tuple(int(d) for d in s) for s in shapes),
        dtypes=tuple(str(d).removeprefix("torch.") for d in dtypes),
        fmt=int(fmt.value),
        nbytes=nbytes,
    )


def host_view(obj: MemoryObj, size: int | None = None) -> memoryview:
    """Writable view of the object's whole physical allocation (padding included, so an
    O_DIRECT read of the padded payload lands in place); ``size``: its ``get_size()``."""
    return host_views([obj], [obj.get_size() if size is None else size])[0]


def host_views(objs: Sequence[MemoryObj], sizes: Sequence[int]) -> list[memoryview]:
    """``host_view(objs[i], sizes[i])`` of each (a load task's buffers, in one comprehension)."""
    return [_memory_view(obj.data_ptr, max(obj.get_physical_size(), size))
            for obj, size in zip(objs, sizes, strict=True)]


def payload_views(objs: Sequence[MemoryObj], nbytes: Sequence[int]) -> list[memoryview]:
    """Read-write views of each object's first ``nbytes[i]`` (what a chunk file stores): a
    store task's, in one comprehension."""
    return [_memory_view(obj.data_ptr, n) for obj, n in zip(objs, nbytes, strict=True)]


def memory_at(address: int, nbytes: int) -> memoryview:
    """A byte view of host memory an object owns (kept alive by the caller)."""
    return _memory_view(address, nbytes)


def _ctypes_view(address: int, nbytes: int) -> memoryview:
    return memoryview(_ubyte_array_type(nbytes).from_address(address)).cast("B")


# The extension's view is about 10x faster than one through ctypes (every chunk moved).
_memory_view = cast(Callable[[int, int], memoryview],
                    native.memory_view if native.available() else _ctypes_view)


@functools.lru_cache(maxsize=256)
def _ubyte_array_type(size: int) -> type[ctypes.Array[ctypes.c_ubyte]]:
    # ctypes builds a new heap type for every ``c_ubyte * n``; reuse them.
    return ctypes.c_ubyte * size


def _call_safely(callback: Callable[[CacheEngineKey], None], key: CacheEngineKey) -> None:
    try:
        callback(key)
    except Exception as exc:  # LMCache's contract: callback errors are logged, not raised
        logger.warning("NVMe tier: on_complete_callback failed for %s: %s", key, exc)
