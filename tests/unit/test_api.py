"""The public Python API (``lmcache_nvme_backend.__all__``, docs/api.md)."""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from support.paths import DOCS_DIR

import lmcache_nvme_backend

PUBLIC = {"ChunkRead", "ChunkStore", "ChunkWrite", "NVMeBackend", "NVMeConfigError",
          "NVMeConnector", "NVMeL2Adapter", "NVMeL2AdapterConfig", "NVMeSettings",
          "SubmitResult", "TensorMeta", "__version__", "check_paths"}


def test_all_lists_the_documented_names_and_each_resolves() -> None:
    assert set(lmcache_nvme_backend.__all__) == PUBLIC
    for name in PUBLIC:
        assert getattr(lmcache_nvme_backend, name) is not None
    text = (DOCS_DIR / "api.md").read_text()
    assert all(f"`{name}" in text for name in PUBLIC - {"__version__"})


def test_the_adapters_are_the_classes_lmcache_loads() -> None:
    from lmcache_nvme_backend.adapters.backend import NVMeBackend
    from lmcache_nvme_backend.adapters.connector import NVMeConnector
    from lmcache_nvme_backend.adapters.l2_adapter import NVMeL2Adapter, NVMeL2AdapterConfig

    assert lmcache_nvme_backend.NVMeBackend is NVMeBackend
    assert lmcache_nvme_backend.NVMeConnector is NVMeConnector
    assert lmcache_nvme_backend.NVMeL2Adapter is NVMeL2Adapter
    assert lmcache_nvme_backend.NVMeL2AdapterConfig is NVMeL2AdapterConfig
    with pytest.raises(AttributeError, match="no attribute 'NVMeNothing'"):
        _ = lmcache_nvme_backend.NVMeNothing  # type: ignore[attr-defined]


def test_importing_the_package_imports_neither_lmcache_nor_torch() -> None:
    code = ("import sys, lmcache_nvme_backend; "
            "print(sorted(m for m in ('torch', 'lmcache', 'kvikio') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True)
    assert out.stdout.strip() == "[]"


def test_the_example_in_docs_api_md_runs(monkeypatch: pytest.MonkeyPatch,
                                         tmp_path: Path) -> None:
    blocks = re.findall(r"```python\n(.*?)```", (DOCS_DIR / "api.md").read_text(), re.S)
    example = next(b for b in blocks if "ChunkStore(settings)" in b)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    exec(compile(example, "docs/api.md", "exec"), {})
    (cache,) = tmp_path.glob("nvme-api-*")
    assert any(cache.rglob("*.kv"))
