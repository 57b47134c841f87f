"""The end-to-end benchmark's smoke run: ``bench/bench_e2e.py --smoke`` (a tiny model, two
users, two rounds) with this tier, through all its phases, as a user runs it.

It measures nothing; it checks the machinery the real run's figures rest on: every request
answered and timed, the restart's hits read from the drive (the server's bytes read from
files), the shared phase's second engine getting hits from what the first stored with the
same greedy answers, and the table, JSON and plot written.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from support.mp_server import QUIET_ENV
from support.paths import BENCH_DIR
from support.process import child_env

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(1500)]


def test_bench_e2e_smoke_run(vllm_python: Path, tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, str(BENCH_DIR / "bench_e2e.py"), str(tmp_path), "--smoke",
         "--configs", "nvme", "--phases", "steady,restart,shared"],
        env=child_env(**QUIET_ENV), capture_output=True, text=True, timeout=1400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    report = json.loads((tmp_path / "bench_e2e.json").read_text())
    assert (tmp_path / "bench_e2e.png").stat().st_size > 0
    rows = {row["phase"]: row for row in report["rows"]}
    assert set(rows) == {"steady", "restart", "shared-first", "shared"}
    assert all(row["config"] == "nvme" for row in rows.values())
    runs = {run["phase"]: run for run in report["runs"]}
    # 2 users x 2 rounds, each answered with a first token
    assert [len(runs[p]["results"]) for p in ("steady", "restart")] == [4, 4]
    assert all(r["ttft_ms"] > 0 and r["text"] for run in runs.values()
               for r in run["results"])
    # After the restart L1 is empty: the first round's full chunks come from the drive.
    assert rows["restart"]["l2_hits"] >= 2 and rows["restart"]["hit_tokens"]["l2"] >= 2 * 256
    assert runs["restart"]["adapter"]["read_chunks"] >= 2
    assert runs["restart"]["adapter"]["checksum_failures"] == 0
    # The second engine, its own server on the same directory: hits, and the cold answers.
    assert rows["shared"]["hit_tokens"]["l2"] >= 256
    assert report["shared_outputs_equal_cold"] == [True, True]
    assert "| nvme | restart |" in proc.stdout
    assert "no floor: it needs vLLM alone" in proc.stdout  # vLLM alone was not asked for
