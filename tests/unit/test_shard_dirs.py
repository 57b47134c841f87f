"""store/shard_dirs.py: a new namespace's shard directories made on a thread of their own,
with either engine: exactly the directory mode whatever the umask, nothing made through a
link or over a file planted in the tree, nothing for trees of two shard levels or after
close."""

from __future__ import annotations

import logging
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.prerequisites import missing_prerequisite

from lmcache_nvme_backend.disk.layout import LEGACY_SHARD_LEVELS, RootLayout
from lmcache_nvme_backend.io import native
from lmcache_nvme_backend.store.shard_dirs import ShardDirMaker

NS_ID = "0123456789abcdef"
ALL = [f"{i:02x}" for i in range(256)]


@pytest.fixture(params=["native", "python"])
def use_native(request: pytest.FixtureRequest) -> bool:
    if request.param == "native" and not native.available():
        missing_prerequisite(native.unavailable_reason())
    return bool(request.param == "native")


@pytest.fixture
def strict_umask() -> Iterator[None]:
    old = os.umask(0o077)  # would strip the group bits of a plain mkdir
    yield
    os.umask(old)


def made(root: Path) -> list[str]:
    ns_dir = root / "ns" / NS_ID
    return sorted(p.name for p in ns_dir.iterdir() if p.is_dir() and not p.is_symlink())


def test_every_shard_directory_is_made_with_exactly_the_mode(
        tmp_path: Path, use_native: bool, strict_umask: None) -> None:
    (tmp_path / "ns" / NS_ID / "3f").mkdir(parents=True)  # one made by a write meanwhile
    maker = ShardDirMaker(0o750, use_native)
    maker.namespace_made(RootLayout(tmp_path), NS_ID)
    maker.close()
    assert made(tmp_path) == ALL
    modes = {stat.S_IMODE((tmp_path / "ns" / NS_ID / name).stat().st_mode)
             for name in ALL if name != "3f"}
    assert modes == {0o750}


def test_a_planted_link_or_file_is_left_alone_and_the_rest_made(
        tmp_path: Path, use_native: bool, package_log: pytest.LogCaptureFixture) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    root = tmp_path / "cache"
    ns_dir = root / "ns" / NS_ID
    ns_dir.mkdir(parents=True)
    (ns_dir / "07").symlink_to(outside)
    (ns_dir / "08").write_bytes(b"not a directory")
    maker = ShardDirMaker(0o700, use_native)
    with package_log.at_level(logging.DEBUG, logger="lmcache_nvme_backend.store.shard_dirs"):
        maker.namespace_made(RootLayout(root), NS_ID)
        maker.close()
    assert made(root) == [name for name in ALL if name not in ("07", "08")]
    assert os.readlink(ns_dir / "07") == str(outside) and list(outside.iterdir()) == []
    assert (ns_dir / "08").read_bytes() == b"not a directory"
    assert "2 shard directories not made" in package_log.text


def test_nothing_is_made_for_two_levels_or_once_closed(tmp_path: Path, use_native: bool) -> None:
    legacy, late = tmp_path / "legacy", tmp_path / "late"
    for root in (legacy, late):
        (root / "ns" / NS_ID).mkdir(parents=True)
    maker = ShardDirMaker(0o700, use_native)
    maker.namespace_made(RootLayout(legacy, LEGACY_SHARD_LEVELS), NS_ID)
    maker.close()
    maker.namespace_made(RootLayout(late), NS_ID)
    assert made(legacy) == [] and made(late) == []


def test_a_vanished_root_makes_nothing_and_raises_nothing(tmp_path: Path,
                                                           use_native: bool) -> None:
    maker = ShardDirMaker(0o700, use_native)
    maker.namespace_made(RootLayout(tmp_path / "gone"), NS_ID)
    maker.close()
    assert not (tmp_path / "gone").exists()
