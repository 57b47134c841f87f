"""disk/safe_fs.py: operations beneath a cache root never follow a link, with openat2 and
with the portable walk that replaces it where the kernel lacks it."""

from __future__ import annotations

import os
import shutil
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from lmcache_nvme_backend.disk import safe_fs
from lmcache_nvme_backend.disk.safe_fs import (
    NotAChunkFile,
    create_beneath,
    create_in,
    dir_mode_for,
    exists_beneath,
    makedirs_beneath,
    open_beneath,
    open_dirs_beneath,
    open_regular,
    rename_beneath,
    scandir_beneath,
    unlink_beneath,
)


@pytest.fixture(params=["openat2", "walk"])
def resolver(request: pytest.FixtureRequest) -> Iterator[str]:
    old = safe_fs.use_openat2(request.param == "openat2")
    try:
        yield request.param
    finally:
        safe_fs.use_openat2(old)


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    root = tmp_path / "root"
    (root / "a" / "b").mkdir(parents=True)
    (root / "a" / "b" / "f").write_bytes(b"data")
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "f").write_bytes(b"secret")
    os.symlink(tmp_path / "outside", root / "a" / "link")
    os.symlink(tmp_path / "outside" / "f", root / "a" / "b" / "flink")
    return root


def test_opens_below_the_root_and_refuses_links_in_any_component(tree: Path,
                                                                  resolver: str) -> None:
    fd = open_beneath(tree, "a/b/f", os.O_RDONLY)
    assert os.read(fd, 10) == b"data"
    os.close(fd)
    for rel in ("a/link/f", "a/b/flink"):
        with pytest.raises(NotAChunkFile):
            open_beneath(tree, rel, os.O_RDONLY)
    with pytest.raises(NotAChunkFile):  # a file where a directory belongs
        open_beneath(tree, "a/b/f/x", os.O_RDONLY)
    with pytest.raises(FileNotFoundError):
        open_beneath(tree, "a/b/none", os.O_RDONLY)
    with pytest.raises(ValueError):
        open_beneath(tree, "../outside/f", os.O_RDONLY)


def test_exists_is_an_lstat_beneath_the_root(tree: Path, resolver: str) -> None:
    assert exists_beneath(tree, "a/b/f") and exists_beneath(tree, "a/b/flink")  # the link
    assert not exists_beneath(tree, "a/b/none")
    assert not exists_beneath(tree, "a/link/f")  # not through a linked directory
    assert not exists_beneath(tree, "../outside/f")


def test_only_regular_files_are_opened_for_reading(tree: Path, resolver: str) -> None:
    os.mkfifo(tree / "a" / "fifo")
    for rel in ("a/fifo", "a/b"):
        with pytest.raises(NotAChunkFile):
            open_regular(tree, rel)


def test_makedirs_and_create_use_exact_modes_and_refuse_links(tree: Path, resolver: str) -> None:
    old = os.umask(0)
    try:
        makedirs_beneath(tree, "x/y/z", 0o750)
        fd = create_beneath(tree, "x/y/z/new", 0o640)
        os.close(fd)
    finally:
        os.umask(old)
    assert stat.S_IMODE((tree / "x" / "y").stat().st_mode) == 0o750
    assert stat.S_IMODE((tree / "x" / "y" / "z" / "new").stat().st_mode) == 0o640
    with pytest.raises(NotAChunkFile):
        makedirs_beneath(tree, "a/link/sub", 0o700)
    assert not (tree.parent / "outside" / "sub").exists()
    with pytest.raises(FileExistsError):  # O_EXCL: never an existing name, never a link
        create_beneath(tree, "a/b/flink", 0o600)
    assert (tree.parent / "outside" / "f").read_bytes() == b"secret"


def test_open_dirs_then_create_in_that_directory(tree: Path, resolver: str) -> None:
    """The writer's path: one descriptor of the shard directory, files created in it."""
    old = os.umask(0o077)
    try:
        dir_fd = open_dirs_beneath(tree, "a/b/new/deeper", 0o750)
        try:
            fd = create_in(dir_fd, "chunk", 0o640)
            os.write(fd, b"bytes")
            os.close(fd)
            with pytest.raises(FileExistsError):
                create_in(dir_fd, "chunk", 0o640)
            for bad in ("", ".", "..", "x/y"):
                with pytest.raises(ValueError, match="not a file name"):
                    create_in(dir_fd, bad, 0o640)
        finally:
            os.close(dir_fd)
    finally:
        os.umask(old)
    made = tree / "a" / "b" / "new" / "deeper"
    assert (made / "chunk").read_bytes() == b"bytes"
    assert stat.S_IMODE((made / "chunk").stat().st_mode) == 0o640
    assert stat.S_IMODE(made.stat().st_mode) == 0o750
    with pytest.raises(NotAChunkFile):
        open_dirs_beneath(tree, "a/link/new", 0o700)
    with pytest.raises(FileExistsError):  # a planted link at the name is never written
        dir_fd = open_dirs_beneath(tree, "a/b", 0o700)
        try:
            create_in(dir_fd, "flink", 0o600)
        finally:
            os.close(dir_fd)
    assert (tree.parent / "outside" / "f").read_bytes() == b"secret"


def test_rename_unlink_and_listing_stay_in_the_tree(tree: Path, resolver: str) -> None:
    rename_beneath(tree, "a/b/f", "a/g")
    assert (tree / "a" / "g").read_bytes() == b"data"
    with pytest.raises(NotAChunkFile):
        rename_beneath(tree, "a/g", "a/link/g")
    with pytest.raises(NotAChunkFile):
        unlink_beneath(tree, "a/link/f")
    unlink_beneath(tree, "a/b/flink")  # the link goes, its target stays
    assert (tree.parent / "outside" / "f").read_bytes() == b"secret"
    assert list(scandir_beneath(tree, "a/link")) == []
    assert sorted(e.name for e in scandir_beneath(tree, "a")) == ["b", "g", "link"]


def test_a_root_deleted_and_recreated_is_opened_again(tree: Path, resolver: str) -> None:
    os.close(open_beneath(tree, "a/b/f", os.O_RDONLY))  # the root's descriptor is cached
    shutil.rmtree(tree)
    (tree / "a").mkdir(parents=True)
    (tree / "a" / "f").write_bytes(b"again")
    fd = open_beneath(tree, "a/f", os.O_RDONLY)
    assert os.read(fd, 10) == b"again"
    os.close(fd)
    shutil.rmtree(tree)
    tree.mkdir()  # and the directories made in the new root, not in the deleted one
    os.close(open_dirs_beneath(tree, "x/y", 0o700))
    assert (tree / "x" / "y").is_dir()


def test_dir_mode_adds_search_where_read_is_granted() -> None:
    assert [dir_mode_for(m) for m in (0o600, 0o640, 0o644, 0o660)] == [0o700, 0o750, 0o755,
                                                                       0o770]
