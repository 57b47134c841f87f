"""tests/gpu: the kvikio/GDS read path on a real CUDA GPU.

Every test here needs CUDA and skips cleanly without it, so the default
``python -m pytest`` collects this folder everywhere.  On a GPU machine:
``bash tests/gpu/run_on_device.sh`` (docs/gpu.md).  Chunk files go under
``$NVME_GPU_TEST_DIR`` when set (put it on the NVMe filesystem: GDS needs a
real local filesystem, not tmpfs or overlayfs), else under pytest's tmp_path.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture
def cache_dir(tmp_path: Path) -> Iterator[Path]:
    base = os.environ.get("NVME_GPU_TEST_DIR")
    if not base:
        yield tmp_path / "cache"
        return
    path = Path(base) / f"t-{uuid.uuid4().hex[:8]}"
    yield path
    import shutil

    shutil.rmtree(path, ignore_errors=True)
