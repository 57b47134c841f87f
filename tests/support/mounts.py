"""Small filesystems for tests: a tmpfs of a given size and inode count, and filling one."""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest


@contextlib.contextmanager
def tmpfs(mountpoint: Path, size: str, inodes: int | None = None) -> Iterator[Path]:
    """Mount a tmpfs at ``mountpoint`` (created), unmounted afterwards; the test is skipped
    where mounting is not permitted."""
    options = f"size={size}" + (f",nr_inodes={inodes}" if inodes else "")
    with _mounted(["-t", "tmpfs", "-o", options, "tmpfs"], mountpoint, "a test tmpfs"):
        yield mountpoint


@contextlib.contextmanager
def ext4_image(mountpoint: Path, size_mb: int, journal: bool) -> Iterator[Path]:
    """Mount a fresh ext4 of ``size_mb`` (with or without a journal) from an image file
    beside ``mountpoint``, through a loop device; the test is skipped where that is not
    permitted or ``mkfs.ext4`` is missing."""
    image = mountpoint.with_name(mountpoint.name + ".img")
    with open(image, "wb") as f:
        f.truncate(size_mb << 20)
    features = [] if journal else ["-O", "^has_journal"]
    try:
        made = subprocess.run(["mkfs.ext4", "-q", "-F", *features, str(image)],
                              capture_output=True, text=True)
    except FileNotFoundError:
        pytest.skip("mkfs.ext4 is not installed (Debian package e2fsprogs)")
    if made.returncode != 0:
        pytest.skip(f"mkfs.ext4 failed: {made.stderr.strip()}")
    try:
        with _mounted(["-o", "loop", str(image)], mountpoint, "a loop device"):
            yield mountpoint
    finally:
        image.unlink(missing_ok=True)


@contextlib.contextmanager
def _mounted(mount_args: list[str], mountpoint: Path, what: str) -> Iterator[None]:
    """``mount MOUNT_ARGS MOUNTPOINT`` (created), lazily unmounted afterwards; the test is
    skipped, naming ``what``, where that is not permitted."""
    mountpoint.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(["mount", *mount_args, str(mountpoint)], capture_output=True,
                       text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount {what} here: {r.stderr.strip()}")
    try:
        yield
    finally:
        subprocess.run(["umount", "-l", str(mountpoint)], check=False)


def fill_bytes(directory: Path) -> Path:
    """Write a file in ``directory`` until the filesystem has no free block left."""
    filler = directory / "filler"
    block = b"\xa5" * (64 * 1024)
    with open(filler, "wb", buffering=0) as f:
        with contextlib.suppress(OSError):
            while True:
                f.write(block)
        with contextlib.suppress(OSError):
            while True:
                f.write(b"\xa5" * 4096)
    return filler


def fill_inodes(directory: Path) -> list[Path]:
    """Create empty files in ``directory`` until the filesystem has no free inode left."""
    directory.mkdir(exist_ok=True)
    made: list[Path] = []
    while True:
        p = directory / f"f{len(made)}"
        try:
            os.close(os.open(p, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
        except OSError as exc:
            if exc.errno != errno.ENOSPC:
                raise
            return made
        made.append(p)
