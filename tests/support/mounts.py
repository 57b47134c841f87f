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
    mountpoint.mkdir(parents=True, exist_ok=True)
    options = f"size={size}" + (f",nr_inodes={inodes}" if inodes else "")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(mountpoint)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a test tmpfs here: {r.stderr.strip()}")
    try:
        yield mountpoint
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
