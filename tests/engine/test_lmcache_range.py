"""The supported LMCache range and forward compatibility (adapters/lmcache_range.py).

With the real LMCache: the L2 adapter built as LMCache's plugin loader builds it, plus an
argument no LMCache passes yet; the start-up range check against a faked installed
version (our lookup function is replaced, not LMCache); the guarded imports with a module
and a name that do not exist.
"""

from __future__ import annotations

import importlib.metadata
import logging
import re
from pathlib import Path
from typing import Any

import pytest

from lmcache_nvme_backend import __version__
from lmcache_nvme_backend.adapters import _common, lmcache_range
from lmcache_nvme_backend.adapters.l2_adapter import NVMeL2Adapter, NVMeL2AdapterConfig
from lmcache_nvme_backend.adapters.lmcache_range import (
    FALLBACK_RANGE,
    in_range,
    lmcache_imports,
    supported_range,
)

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[2]


def params(path: Path) -> dict[str, Any]:
    return {"path": str(path), "max_size_gb": 1, "min_free_gb": 0}


def warnings_of(log: pytest.LogCaptureFixture, text: str) -> list[str]:
    return [r.getMessage() for r in log.records
            if r.levelno == logging.WARNING and text in r.getMessage()]


@pytest.fixture
def fresh_process_state(monkeypatch: pytest.MonkeyPatch) -> None:
    """As in a new process: nothing logged yet about arguments or the LMCache version."""
    monkeypatch.setattr(_common, "_ignored", set())
    monkeypatch.setattr(_common, "_range_checked", False)


def pyproject_range() -> str:
    text = (ROOT / "pyproject.toml").read_text()
    (spec,) = re.findall(r'^\s*"lmcache\s*([^"]*)",', text, re.MULTILINE)
    return spec


# -- the range -------------------------------------------------------------------


def test_the_range_is_pyprojects_and_contains_the_installed_lmcache() -> None:
    spec = supported_range()
    assert spec == pyproject_range() == FALLBACK_RANGE
    assert in_range(importlib.metadata.version("lmcache"), spec) is True


def test_the_fallback_range_without_package_metadata(monkeypatch: pytest.MonkeyPatch) -> None:
    def missing(name: str) -> None:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "requires", missing)
    assert supported_range.__wrapped__() == FALLBACK_RANGE


@pytest.mark.parametrize(("version", "inside"), [
    ("0.5.6", True), ("0.5.10", True), ("0.5.6.post1", True), ("0.5.5", False),
    ("0.6.0", False), ("0.6.0rc1", False), ("1.0", False),
])
def test_in_range(version: str, inside: bool) -> None:
    assert in_range(version, ">=0.5.6,<0.6") is inside
    assert in_range("not a version", ">=0.5.6,<0.6") is None


# -- unknown arguments -----------------------------------------------------------


def test_unknown_keyword_arguments_are_ignored_and_logged_once(
        tmp_path: Path, package_log: pytest.LogCaptureFixture,
        fresh_process_state: None) -> None:
    """As LMCache 0.5.6's plugin loader builds it (``cls(Config.from_dict(adapter_params),
    l1_memory_desc=...)``), with an argument a later LMCache might add; twice."""
    for i in range(2):
        config = NVMeL2AdapterConfig.from_dict(params(tmp_path / f"c{i}"))
        adapter = NVMeL2Adapter(config, l1_memory_desc=None, reconfigure_hook=object(),
                                tenant="a")
        try:
            assert adapter.report_status()["is_healthy"]
        finally:
            adapter.close()
    (line,) = warnings_of(package_log, "ignoring arguments")
    version = importlib.metadata.version("lmcache")
    assert line == ("NVMe tier: ignoring arguments this version does not know: "
                    f"reconfigure_hook, tenant, from LMCache {version}; supported LMCache "
                    f"range {supported_range()} (NVMe L2 adapter).")


def test_the_config_accepts_unknown_keyword_arguments_too(
        tmp_path: Path, package_log: pytest.LogCaptureFixture,
        fresh_process_state: None) -> None:
    for _ in range(2):
        config = NVMeL2AdapterConfig.from_dict(params(tmp_path), strict=True)
        assert config.settings.max_size_gb == 1
    (line,) = warnings_of(package_log, "ignoring arguments")
    assert "does not know: strict, from LMCache" in line


def test_known_arguments_log_nothing(tmp_path: Path, package_log: pytest.LogCaptureFixture,
                                     fresh_process_state: None) -> None:
    NVMeL2Adapter(params(tmp_path)).close()
    assert warnings_of(package_log, "ignoring arguments") == []


# -- the start-up range check ----------------------------------------------------


def test_an_lmcache_outside_the_range_is_warned_about_once(
        tmp_path: Path, package_log: pytest.LogCaptureFixture, fresh_process_state: None,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(lmcache_range, "lmcache_version", lambda: "0.6.1")
    for i in range(2):
        NVMeL2Adapter(NVMeL2AdapterConfig.from_dict(params(tmp_path / f"c{i}"))).close()
    (line,) = warnings_of(package_log, "outside the range")
    spec = supported_range()
    assert line == (f"NVMe tier: LMCache 0.6.1 is installed, outside the range "
                    f"lmcache-nvme-backend {__version__} supports (lmcache{spec}). Starting "
                    f"anyway; if the tier misbehaves, install an LMCache in that range "
                    f"(pip install 'lmcache{spec}') or an lmcache-nvme-backend that supports "
                    f"LMCache 0.6.1.")


def test_the_installed_lmcache_starts_without_a_range_warning(
        tmp_path: Path, package_log: pytest.LogCaptureFixture,
        fresh_process_state: None) -> None:
    NVMeL2Adapter(params(tmp_path)).close()
    assert warnings_of(package_log, "outside the range") == []
    assert _common._range_checked


# -- guarded imports --------------------------------------------------------------


def test_a_name_missing_from_lmcache_names_it_the_versions_and_the_fix() -> None:
    with pytest.raises(ImportError) as caught, lmcache_imports():
        from lmcache.v1.distributed.api import RenamedObjectKey  # noqa: F401
    message = str(caught.value)
    version = importlib.metadata.version("lmcache")
    assert message.startswith(f"NVMe tier: lmcache-nvme-backend {__version__} cannot import "
                              f"from LMCache {version}: cannot import name 'RenamedObjectKey' "
                              "from 'lmcache.v1.distributed.api'")
    assert f"supports lmcache{supported_range()}, which includes {version}" in message
    assert caught.value.name == "lmcache.v1.distributed.api"


def test_a_module_missing_from_a_newer_lmcache_says_what_to_install(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(lmcache_range, "lmcache_version", lambda: "0.7.0")
    with pytest.raises(ImportError) as caught, lmcache_imports():
        from lmcache.v1.distributed.l2_adapters.renamed_base import (  # noqa: F401
            L2AdapterInterface,
        )
    spec = supported_range()
    assert str(caught.value) == (
        f"NVMe tier: lmcache-nvme-backend {__version__} cannot import from LMCache 0.7.0: "
        "No module named 'lmcache.v1.distributed.l2_adapters.renamed_base'. "
        f"lmcache-nvme-backend {__version__} supports lmcache{spec}: install an LMCache in "
        f"that range (pip install 'lmcache{spec}') or upgrade lmcache-nvme-backend to a "
        "release that supports LMCache 0.7.0.")
    assert isinstance(caught.value.__cause__, ModuleNotFoundError)


def test_an_attribute_error_is_guarded_too() -> None:
    import lmcache.utils

    with pytest.raises(ImportError, match="cannot import from LMCache .*NoSuchKey"), \
            lmcache_imports():
        lmcache.utils.NoSuchKey  # type: ignore[attr-defined]  # noqa: B018


def test_every_module_level_lmcache_import_in_the_adapters_is_guarded() -> None:
    """A bare ``from lmcache...`` at the top of an adapter module would fail unexplained."""
    for module in sorted((ROOT / "lmcache_nvme_backend" / "adapters").glob("*.py")):
        for line in module.read_text().splitlines():
            assert not re.match(r"(from|import) lmcache\b", line), (module.name, line)
