"""bench/bench_native_io.py end to end on a temporary directory: its figures and its table,
paired against this package as of HEAD (built by the script); nothing about speed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from support.paths import BENCH_DIR, REPO_ROOT
from support.prerequisites import missing_prerequisite

from lmcache_nvme_backend.io import native

if not native.available():
    missing_prerequisite(native.unavailable_reason())

SCRIPT = BENCH_DIR / "bench_native_io.py"
ENV = {**os.environ, "LMCACHE_TRACK_USAGE": "false", "DO_NOT_TRACK": "1"}
FIGURES = {"gibps", "user_s_per_gib", "sys_s_per_gib", "hash_s_per_gib",
           "cpu_outside_hash_s_per_gib", "voluntary_switches_per_chunk",
           "involuntary_switches_per_chunk", "overlapped_per_chunk"}


def bench(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True,
                          text=True, timeout=280, env=ENV, cwd=REPO_ROOT)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_writes_and_reads_are_measured_against_a_baseline(tmp_path: Path) -> None:
    if not (REPO_ROOT / ".git").exists():
        pytest.skip("--baseline builds a git revision: this tree is not a git checkout")
    out = tmp_path / "runs.json"
    proc = bench(str(tmp_path / "drive"), "--sizes-mb", "2", "--ops", "write,read",
                 "--seconds", "0.2", "--repeat", "2", "--files", "8", "--baseline", "HEAD",
                 "--json", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = json.loads(out.read_text())["runs"]
    assert sorted((r["op"], r["system"], r["rep"]) for r in runs) == [
        (op, system, rep) for op in ("read", "write") for system in ("base", "nvme")
        for rep in (0, 1)]
    for r in runs:
        assert set(r) >= FIGURES and r["chunks"] >= 4 and r["gibps"] > 0
    # 2 MiB chunks, O_DIRECT from page-aligned buffers: every write is overlapped
    assert {r["overlapped_per_chunk"] for r in runs if r["op"] == "write"} == {1.0}
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| 2 MiB |")]
    assert len(rows) == 4 and all("x [" in row for row in rows if "| nvme |" in row)
    assert not (tmp_path / "drive" / "native-io-nvme").exists()  # cleaned up


def test_a_working_set_that_is_not_whole_batches_is_refused(tmp_path: Path) -> None:
    proc = bench(str(tmp_path), "--files", "6")
    assert proc.returncode == 2
    assert "--files: a multiple of 4" in proc.stderr
    assert not list(tmp_path.iterdir())
