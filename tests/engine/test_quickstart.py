"""examples/quickstart.py, the README's first command, as a user runs it (no
PYTHONHASHSEED: the quick start no longer sets it behind the user's back)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from support.paths import EXAMPLES_DIR
from support.process import child_env

from lmcache_nvme_backend.adapters.hashing import vllm_installed
from lmcache_nvme_backend.disk.layout import MARKER_NAME, marker_text

QUICKSTART = EXAMPLES_DIR / "quickstart.py"


def quickstart(*args: str | Path) -> subprocess.CompletedProcess[str]:
    env = child_env()
    env.pop("PYTHONHASHSEED", None)
    return subprocess.run([sys.executable, str(QUICKSTART), *map(str, args)],
                          capture_output=True, text=True, timeout=300, env=env)


@pytest.mark.slow
def test_the_second_run_finds_every_chunk_of_the_first(tmp_path: Path) -> None:
    cache = tmp_path / "demo"
    first = quickstart("--cache-dir", cache, "--tokens", "1024")
    assert first.returncode == 0, first.stderr[-3000:]
    lines = first.stdout.splitlines()
    assert lines[0].startswith("token hashing: pre_caching_hash_algorithm 'sha256_cbor'")
    if not vllm_installed():  # LMCache's hashing warnings are explained before the engine
        assert lines[1].startswith("note: without vLLM, LMCache logs \"Could not load "
                                   "'sha256_cbor' from vLLM. Using builtin hash\"")
        assert "They matter on a vLLM server" in lines[1]
    assert "MUST set PYTHONHASHSEED" not in first.stderr  # LMCache's log: errors only
    assert "bytes identical to what was stored: True" in first.stdout
    second = quickstart("--cache-dir", cache, "--tokens", "1024")
    assert second.returncode == 0, second.stderr[-3000:]
    assert "restart: all 4 chunks found on the NVMe tier from an earlier run" in second.stdout
    assert "retrieve:" in second.stdout and "for 1024 of 1024 tokens" in second.stdout
    assert "bytes identical to what was stored: True" in second.stdout


def test_a_file_as_cache_dir_exits_with_the_message(tmp_path: Path) -> None:
    a_file = tmp_path / "not-a-dir"
    a_file.write_text("x")
    proc = quickstart("--cache-dir", a_file)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1] == (
        f"quickstart: nvme.path: '{a_file}' exists and is not a directory. Point it at a "
        "directory (it is created if missing).")
    assert "Traceback" not in proc.stderr


def test_a_cache_dir_from_a_newer_layout_exits_before_the_engine_starts(tmp_path: Path) -> None:
    """The settings parse; the directory check (check_paths) refuses the tree, before
    LMCache would turn the same error into a log line."""
    newer = tmp_path / "cache"
    newer.mkdir()
    (newer / MARKER_NAME).write_bytes(marker_text(3))
    proc = quickstart("--cache-dir", newer)
    assert proc.returncode == 1, proc.stdout + proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"quickstart: nvme.path: {newer / MARKER_NAME} says shard_levels 3, ")
    assert "Upgrade lmcache-nvme-backend" in last
    assert "token hashing" not in proc.stdout  # stopped before anything else
    assert sorted(p.name for p in newer.iterdir()) == [MARKER_NAME]
