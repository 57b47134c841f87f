"""What the adapters read from LMCache's memory objects: header metadata and byte views."""

from __future__ import annotations

import pytest
import torch
from lmcache.v1.memory_management import (
    MemoryFormat,
    MemoryObj,
    MemoryObjMetadata,
    TensorMemoryObj,
)

from lmcache_nvme_backend.adapters.memory_objects import payload_views, tensor_meta_of


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


def test_payload_views_are_the_objects_own_bytes() -> None:
    objs = [tensor_obj((4, 1024), torch.uint8), tensor_obj((2, 1024), torch.uint8)]
    views = payload_views(objs, [100, 7])
    assert [len(v) for v in views] == [100, 7] and not any(v.readonly for v in views)
    views[0][0:3] = b"abc"
    views[1][0:2] = b"xy"
    assert bytes(objs[0].byte_array[:4]) == b"abc\x00"
    assert bytes(objs[1].byte_array[:3]) == b"xy\x00"
