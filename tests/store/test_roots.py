"""store/roots.py: opening cache directories, rendezvous placement, health, quarantine."""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

import pytest

from lmcache_nvme_backend.config import NVMeConfigError
from lmcache_nvme_backend.disk.layout import MARKER_NAME, key_digest
from lmcache_nvme_backend.store import roots as roots_mod
from lmcache_nvme_backend.store.roots import Roots, quarantine_file


@pytest.fixture
def roots(tmp_path: Path) -> Roots:
    return Roots.open([tmp_path / f"r{i}" for i in range(4)], "auto")


def test_open_creates_the_tree_and_the_marker(roots: Roots) -> None:
    for root in roots:
        assert (root.layout.root / MARKER_NAME).is_file()
        assert root.layout.quarantine_dir.is_dir() and root.layout.namespaces_dir.is_dir()
    assert [info.path for info in roots.describe()] == [r.layout.root for r in roots]
    assert all(info.healthy for info in roots.describe())


def test_a_missing_directory_and_its_parents_are_created_with_the_dir_mode(
        tmp_path: Path) -> None:
    """Validation creates nothing (tests/unit/test_config.py): opening the roots does, each
    missing directory with ``nvme.file_mode`` plus search bits, whatever the umask."""
    path = tmp_path / "a" / "b" / "cache"
    old = os.umask(0o077)
    try:
        Roots.open([path], "off", file_mode=0o640)
    finally:
        os.umask(old)
    for created in (tmp_path / "a", tmp_path / "a" / "b", path, path / "ns"):
        assert stat.S_IMODE(created.stat().st_mode) == 0o750, created
    assert (path / MARKER_NAME).is_file()


def test_a_path_that_became_a_file_is_refused_naming_the_key(tmp_path: Path) -> None:
    """Between validation and start the path may change: opening checks it again."""
    a_file = tmp_path / "file"
    a_file.write_text("x")
    with pytest.raises(NVMeConfigError, match=r"^adapter_params\.path: '.*' exists and is "
                       r"not a directory\. Point it at a directory"):
        Roots.open([a_file], "auto", key_prefix="adapter_params.")
    with pytest.raises(NVMeConfigError, match=r"^nvme\.path: cannot create '.*/file/sub': "
                       "Not a directory"):
        Roots.open([a_file / "sub"], "auto")
    assert a_file.read_text() == "x"


def test_direct_io_on_refuses_a_filesystem_without_it(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    # Whether tmpfs takes O_DIRECT depends on the kernel (6.6 and later do): stub the probe.
    monkeypatch.setattr(roots_mod, "probe_direct_io", lambda path, existing=None: False)
    with pytest.raises(NVMeConfigError, match=r"^nvme\.direct_io: .* does not support O_DIRECT"):
        Roots.open([tmp_path / "r"], "on")
    assert not Roots.open([tmp_path / "r"], "auto")[0].direct
    assert not Roots.open([tmp_path / "r"], "off")[0].direct


def test_placement_is_a_stable_ranking_of_healthy_roots(roots: Roots) -> None:
    digests = [key_digest(f"key-{i}") for i in range(400)]
    orders = [roots.in_placement_order(d) for d in digests]
    assert all(sorted(r.index for r in order) == [0, 1, 2, 3] for order in orders)
    assert orders == [roots.in_placement_order(d) for d in digests]  # deterministic
    chosen = [roots.choose(d) for d in digests]
    assert all(c is order[0] for c, order in zip(chosen, orders, strict=True))
    per_root = [sum(c is r for c in chosen) for r in roots]
    assert min(per_root) > 60  # spread over all four (100 each on average)


def test_a_root_out_of_service_loses_only_its_own_keys(
        roots: Roots, monkeypatch: pytest.MonkeyPatch,
        package_log: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(roots_mod, "ROOT_RETRY_S", 3600)
    digests = [key_digest(f"key-{i}") for i in range(200)]
    before = {d: roots.choose(d) for d in digests}
    failing = roots[2]
    with package_log.at_level(logging.WARNING):
        for _ in range(roots_mod.ROOT_ERROR_LIMIT):
            roots.record_error(failing, OSError(5, "injected EIO"))
    assert not failing.healthy and not roots.healthy(2)
    assert "taking" in package_log.text and "out of service" in package_log.text
    after = {d: roots.choose(d) for d in digests}
    assert all(after[d] is before[d] for d in digests if before[d] is not failing)
    assert all(after[d] is not failing for d in digests)


@pytest.mark.parametrize("count", [4, 1])
def test_group_sends_each_item_where_choose_does(tmp_path: Path, count: int,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Items grouped by root agree with ``choose`` (one root: every item in one group, in
    order); with every root out of service, every item is left without a root."""
    roots = Roots.open([tmp_path / f"r{i}" for i in range(count)], "auto")
    digests = [key_digest(f"key-{i}") for i in range(100)]
    groups, homeless = roots.group(digests, lambda d: d)
    assert homeless == []
    assert sorted(d for _, mine in groups for d in mine) == sorted(digests)
    assert all(roots.choose(d) is root for root, mine in groups for d in mine)
    if count == 1:
        assert groups == [(roots[0], digests)]
    monkeypatch.setattr(roots_mod, "ROOT_RETRY_S", 3600)
    for root in roots:
        for _ in range(roots_mod.ROOT_ERROR_LIMIT):
            roots.record_error(root, OSError(5, "injected EIO"))
    assert roots.group(digests, lambda d: d) == ([], digests)


def test_fewer_errors_than_the_limit_keep_the_root_in_service(roots: Roots) -> None:
    for _ in range(roots_mod.ROOT_ERROR_LIMIT - 1):
        roots.record_error(roots[0], OSError(5, "injected EIO"))
    assert roots[0].healthy


def test_every_root_out_of_service_means_no_placement(roots: Roots,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(roots_mod, "ROOT_RETRY_S", 3600)
    for root in roots:
        for _ in range(roots_mod.ROOT_ERROR_LIMIT):
            roots.record_error(root, OSError(5, "injected EIO"))
    assert roots.choose(key_digest("k")) is None


def test_quarantine_moves_the_file_and_keeps_a_bounded_number(roots: Roots,
                                                               monkeypatch: pytest.MonkeyPatch
                                                               ) -> None:
    monkeypatch.setattr(roots_mod, "MAX_QUARANTINED_FILES", 3)
    root = roots[0]
    for i in range(5):
        digest = key_digest(f"bad-{i}")
        bad = root.layout.root / f"bad-{i}.kv"
        bad.write_bytes(b"x" * 10)
        assert quarantine_file(root, digest, bad)
        assert not bad.exists()
    kept = sorted(p.name for p in root.layout.quarantine_dir.iterdir())
    assert len(kept) == 3 and all(name.endswith(".bad") for name in kept)


def test_a_file_that_cannot_be_moved_is_deleted(roots: Roots) -> None:
    root = roots[0]
    bad = root.layout.root / "bad.kv"
    bad.write_bytes(b"x")
    root.layout.quarantine_dir.rmdir()  # nowhere to move it
    assert not quarantine_file(root, key_digest("bad"), bad)
    assert not bad.exists()
