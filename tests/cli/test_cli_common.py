"""Argument types and units shared by the commands."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest

from lmcache_nvme_backend.cli.common import (
    human_bytes,
    int_list_arg,
    non_negative_float,
    parse_size,
    positive_float,
    short_size,
    size_arg,
)
from lmcache_nvme_backend.disk.mounts import mount_for


@pytest.mark.parametrize(("text", "expect"), [
    ("4096", 4096), ("4k", 4096), ("4K", 4096), ("2M", 2 * 2**20), ("16MiB", 16 * 2**20),
    ("1.5G", 3 * 2**29), ("1g", 2**30),
])
def test_sizes_use_binary_units(text: str, expect: int) -> None:
    assert parse_size(text) == expect


@pytest.mark.parametrize("text", ["", "M", "2X", "-1", "0.3"])
def test_bad_sizes_are_rejected(text: str) -> None:
    with pytest.raises(ValueError):
        parse_size(text)


def test_size_arg_rejects_zero_with_the_reason() -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="greater than 0"):
        size_arg("0")


@pytest.mark.parametrize("text", ["nan", "inf", "-0.5", "x"])
def test_numbers_must_be_finite_and_in_range(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        positive_float(text)
    if text != "-0.5":
        with pytest.raises(argparse.ArgumentTypeError):
            non_negative_float(text)
    assert non_negative_float("0") == 0.0


def test_lists_are_sorted_and_deduplicated() -> None:
    assert int_list_arg("8,1,2,2") == [1, 2, 8]
    with pytest.raises(argparse.ArgumentTypeError):
        int_list_arg(",")


def test_units_print_like_fio() -> None:
    assert short_size(2 * 2**20) == "2MiB"
    assert short_size(4096) == "4KiB"
    assert short_size(1536) == "1536B"
    assert human_bytes(1536) == "1.5 KiB"


def test_mount_lookup_picks_the_longest_mount_point(tmp_path: Path) -> None:
    mounts = tmp_path / "mounts"
    spaced_dir = tmp_path / "with space"
    spaced_dir.mkdir()
    mounts.write_text("/dev/vda / ext4 rw 0 0\n"
                      f"tmpfs {tmp_path} tmpfs rw 0 0\n"
                      f"server:/x {tmp_path}/with\\040space nfs rw 0 0\n")
    inside = mount_for(tmp_path / "a" / "b", str(mounts))
    assert inside is not None and inside.fstype == "tmpfs"
    root = mount_for(Path("/usr"), str(mounts))
    assert root is not None and root.fstype == "ext4"
    spaced = mount_for(spaced_dir / "cache", str(mounts))
    assert spaced is not None and spaced.fstype == "nfs"


def test_no_command_lists_the_commands(run_cli: Any) -> None:
    """``lmcache-nvme`` alone is a usage error (exit 2, like any other) that shows the
    commands instead of only 'COMMAND is required'."""
    proc = run_cli()
    assert proc.returncode == 2 and proc.stdout == ""
    for command in ("bench", "doctor", "inspect", "verify", "gc"):
        assert f"\n    {command} " in proc.stderr
    assert "error: give a command, e.g. `lmcache-nvme doctor PATH`" in proc.stderr
