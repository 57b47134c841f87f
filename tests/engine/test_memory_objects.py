"""What the adapters read from LMCache's memory objects: header metadata and byte views."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
import torch
from lmcache.utils import CacheEngineKey
from lmcache.v1.memory_management import (
    MemoryFormat,
    MemoryObj,
    MemoryObjMetadata,
    TensorMemoryObj,
)
from support.stores import StoreFactory

from lmcache_nvme_backend.adapters._common import EngineKeyNames
from lmcache_nvme_backend.adapters.memory_objects import (
    payload_views,
    submit_objects,
    tensor_meta_of,
    tensor_metas,
)
from lmcache_nvme_backend.store import ChunkRead


def tensor_obj(shape: tuple[int, ...], dtype: torch.dtype,
               fmt: MemoryFormat = MemoryFormat.KV_2LTD) -> MemoryObj:
    raw = torch.zeros(shape, dtype=dtype).view(torch.uint8).flatten()
    meta = MemoryObjMetadata(shape=torch.Size(shape), dtype=dtype, address=0,
                             phy_size=raw.numel(), fmt=fmt, ref_count=1)
    return TensorMemoryObj(raw_data=raw, metadata=meta, parent_allocator=None)


@pytest.mark.parametrize("order", ["grouped", "alternating"])
def test_tensor_meta_follows_every_field_of_the_layout(order: str) -> None:
    """Objects that differ in one field only (shape, dtype, format, size) never share a
    header's metadata, whatever the order they come in; equal layouts share one instance.
    Each layout differs from the one before it in one field."""
    layouts = [((2, 4, 8), torch.bfloat16, MemoryFormat.KV_2LTD),
               ((2, 8, 4), torch.bfloat16, MemoryFormat.KV_2LTD),  # shape, same size
               ((2, 8, 4), torch.float16, MemoryFormat.KV_2LTD),  # dtype, same size
               ((2, 8, 4), torch.float16, MemoryFormat.KV_T2D),  # format
               ((2, 8, 8), torch.float16, MemoryFormat.KV_T2D)]  # size
    sequence = [i for i in range(len(layouts)) for _ in range(3)] if order == "grouped" \
        else [i for _ in range(3) for i in range(len(layouts))]
    seen: dict[int, object] = {}
    for i in sequence:
        shape, dtype, fmt = layouts[i]
        meta = tensor_meta_of(tensor_obj(shape, dtype, fmt))
        assert meta.shapes == (shape,)
        assert meta.dtypes == (str(dtype).removeprefix("torch."),)
        assert meta.fmt == fmt.value
        assert meta.nbytes == torch.zeros(shape, dtype=dtype).nbytes
        assert seen.setdefault(i, meta) is meta
    assert len({id(m) for m in seen.values()}) == len(layouts)


@pytest.mark.parametrize("odd_one", [None, 0, 3, 5])
def test_tensor_metas_of_a_task_are_each_objects_own(odd_one: int | None) -> None:
    """A task of one layout gets one shared metadata; an object that differs anywhere in the
    task (first, middle, last) gets its own, and so does every other object still."""
    layouts = [((2, 8, 4), torch.float16, MemoryFormat.KV_2LTD)] * 6
    if odd_one is not None:
        layouts = list(layouts)
        layouts[odd_one] = ((2, 8, 4), torch.bfloat16, MemoryFormat.KV_2LTD)
    objs = [tensor_obj(*layout) for layout in layouts]
    metas = tensor_metas(objs)
    assert metas == [tensor_meta_of(obj) for obj in objs]
    if odd_one is None:
        assert len({id(m) for m in metas}) == 1
    else:
        assert metas[odd_one].dtypes == ("bfloat16",)
        assert all(m.dtypes == ("float16",) for i, m in enumerate(metas) if i != odd_one)
    assert tensor_metas([]) == []


def test_tensor_metas_follow_each_objects_size() -> None:
    """Same shape, dtype and format, but one object's used size narrowed: its own size."""
    objs = [tensor_obj((4, 1024), torch.uint8) for _ in range(3)]
    objs[1].set_used_size(2048)
    assert [m.nbytes for m in tensor_metas(objs)] == [4096, 2048, 4096]


def test_payload_views_are_the_objects_own_bytes() -> None:
    objs = [tensor_obj((4, 1024), torch.uint8), tensor_obj((2, 1024), torch.uint8)]
    views = payload_views(objs, [100, 7])
    assert [len(v) for v in views] == [100, 7] and not any(v.readonly for v in views)
    views[0][0:3] = b"abc"
    views[1][0:2] = b"xy"
    assert bytes(objs[0].byte_array[:4]) == b"abc\x00"
    assert bytes(objs[1].byte_array[:3]) == b"xy\x00"


def engine_keys(n: int) -> list[CacheEngineKey]:
    return [CacheEngineKey("objects-model", 1, 0, 700 + i, torch.bfloat16) for i in range(n)]


def filled_objs(n: int) -> list[MemoryObj]:
    objs = [tensor_obj((4, 1024), torch.uint8) for _ in range(n)]
    for i, obj in enumerate(objs):
        obj.byte_array.cast("B")[:] = bytes([i + 1]) * obj.get_size()
    return objs


def wait_for(condition: Callable[[], bool], timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_submit_objects_holds_each_object_until_its_task_ended(
        open_store: StoreFactory) -> None:
    store = open_store()
    keys, objs = engine_keys(3), filled_objs(3)
    persisted: list[CacheEngineKey] = []
    submit_objects(store, EngineKeyNames(store), keys, objs, persisted.append)
    assert store.flush()
    assert wait_for(lambda: len(persisted) == 3)
    assert sorted(persisted, key=str) == sorted(keys, key=str)
    assert [obj.get_ref_count() for obj in objs] == [1, 1, 1]  # the task's references gone
    dests = [bytearray(obj.get_size()) for obj in objs]
    reads = [ChunkRead(k.to_string(), memoryview(d)) for k, d in zip(keys, dests, strict=True)]
    assert store.read_into(reads) == [True, True, True]
    assert [bytes(d) for d in dests] == [bytes(o.byte_array) for o in objs]
    again: list[CacheEngineKey] = []  # stored already: nothing persisted, nothing held
    submit_objects(store, EngineKeyNames(store), keys[:1], objs[:1], again.append)
    assert store.flush() and not again and objs[0].get_ref_count() == 1


def test_submit_objects_lets_the_objects_go_when_the_store_refuses_the_task(
        open_store: StoreFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    store = open_store()
    keys, objs = engine_keys(2), filled_objs(2)

    def refuse(*args: object) -> None:
        raise RuntimeError("refused")

    monkeypatch.setattr(store, "submit_task", refuse)
    persisted: list[CacheEngineKey] = []
    with pytest.raises(RuntimeError, match="refused"):
        submit_objects(store, EngineKeyNames(store), keys, objs, persisted.append)
    assert [obj.get_ref_count() for obj in objs] == [1, 1] and not persisted
    with pytest.raises(ValueError, match="2 keys but 1 objects"):
        submit_objects(store, EngineKeyNames(store), keys, objs[:1])
