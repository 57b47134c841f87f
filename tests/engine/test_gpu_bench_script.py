"""bench/bench_gpu.py without a GPU: a clear refusal, and its plumbing on CPU tensors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from support.paths import BENCH_DIR

SCRIPT = BENCH_DIR / "bench_gpu.py"
ENV = {**os.environ, "LMCACHE_TRACK_USAGE": "false", "DO_NOT_TRACK": "1"}


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only behaviour")
def test_without_a_gpu_it_says_so_and_measures_nothing(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, str(SCRIPT), "--dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=120, env=ENV)
    assert proc.returncode == 2
    assert "bench_gpu: needs a CUDA GPU" in proc.stderr
    assert "Nothing was measured" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not list(tmp_path.iterdir())


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_cpu_dry_run_exercises_every_variant(tmp_path: Path) -> None:
    report_path = tmp_path / "report.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--cpu-dry-run", "--dir", str(tmp_path / "d"),
         "--chunk-mb", "0.5", "--chunks", "6", "--batch", "4", "--reps", "2",
         "--json", str(report_path)],
        capture_output=True, text=True, timeout=280, env=ENV)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(report_path.read_text())
    entry = report["sizes"][0]
    assert set(entry["median_gbps"]) == {"kvikio", "kvikio-raw", "host-bounce"}
    assert "kvikio_over_bounce" in entry
    if not torch.cuda.is_available():  # GdsBackend cannot start without CUDA/cuFile
        assert set(entry["failures"]) == {"gds-true", "gds-false"}
    assert "kvikio / host-bounce" in proc.stdout
