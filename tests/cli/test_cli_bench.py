"""``lmcache-nvme bench``: the engine benchmark, its fio comparison, sweep and plot."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.cli import RunCLI
from support.system_packages import ensure_programs

from lmcache_nvme_backend.cli.bench.fio import build_jobfile, choose_fio_mem, fio_shape
from lmcache_nvme_backend.cli.bench.iobench import BenchConfig

SMALL = ("--bs", "256k", "--size", "4M")


def bench_json(run_cli: RunCLI, path: Path, *args: str) -> dict:
    proc = run_cli("bench", path, *SMALL, "--json", *args)
    assert proc.returncode == 0, proc.stderr
    doc: dict = json.loads(proc.stdout)
    return doc


@pytest.mark.parametrize("rw", ["read", "randread", "write", "randwrite", "rw"])
def test_every_pattern_moves_the_requested_bytes(run_cli: RunCLI, tmp_path: Path,
                                                 rw: str) -> None:
    doc = bench_json(run_cli, tmp_path, "--rw", rw, "--threads", "2", "--iodepth", "2")
    (result,) = doc["results"]
    median = result["median"]
    directions = [d for d in ("read", "write") if d in median]
    assert directions == {"read": ["read"], "randread": ["read"], "write": ["write"],
                          "randwrite": ["write"], "rw": ["read", "write"]}[rw]
    assert sum(median[d]["bytes"] for d in directions) == 4 * 2**20
    for d in directions:
        assert median[d]["ios"] * 256 * 1024 == median[d]["bytes"]
        assert median[d]["bw_bytes"] > 0
        assert set(median[d]["lat_ms"]) >= {"p50", "p90", "p99", "p99.9", "max"}
    assert [p.name for p in tmp_path.iterdir()] == [], "the bench files were not removed"


def test_text_summary_looks_like_fio(run_cli: RunCLI, tmp_path: Path) -> None:
    proc = run_cli("bench", tmp_path, *SMALL, "--rw", "read", "--checksum")
    assert proc.returncode == 0, proc.stderr
    assert "rw=read, bs=256KiB, size=4MiB" in proc.stdout
    assert "read: IOPS=" in proc.stdout and "BW=" in proc.stdout
    assert "lat (ms): p50=" in proc.stdout


def test_sweep_prints_a_paste_ready_recommendation(run_cli: RunCLI, tmp_path: Path) -> None:
    proc = run_cli("bench", tmp_path, *SMALL, "--rw", "read", "--sweep",
                   "--sweep-threads", "1,2", "--sweep-iodepth", "1,4")
    assert proc.returncode == 0, proc.stderr
    assert "3 run(s) per point in interleaved rounds" in proc.stdout
    rows = [line.split() for line in proc.stdout.splitlines()
            if line.strip() and line.split()[0] in ("1", "2", "8")]
    assert len(rows) == 6  # the default's 8 threads are always measured too
    for row in rows:  # the range of the three runs holds their median
        low, high = map(float, row[4].split("-"))
        assert low <= float(row[3]) <= high
    lines = proc.stdout.splitlines()
    assert any(x.startswith("  default  nvme.io_threads 8, nvme.task_size_mb 64: ")
               for x in lines)
    assert any(x.startswith("  -> ") for x in lines)
    advice = lines[lines.index(next(x for x in lines if x.startswith("paste under"))) + 1:]
    assert advice[0].split(": ")[0] == "nvme.io_threads"
    assert int(advice[0].split(": ")[1]) in (1, 2, 8)
    assert advice[1].startswith("nvme.task_size_mb: ")


def test_plot_writes_a_png(run_cli: RunCLI, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    png = tmp_path / "sweep.png"
    work = tmp_path / "work"
    proc = run_cli("bench", work, *SMALL, "--rw", "write", "--sweep", "--sweep-threads",
                   "1,2", "--plot", png)
    assert proc.returncode == 0, proc.stderr
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width = int.from_bytes(data[16:20], "big")
    height = int.from_bytes(data[20:24], "big")
    assert width >= 800 and height >= 300


@pytest.fixture
def fio() -> str:
    """Debian's ``fio``, installed on first use as the tests install GlusterFS and Prometheus
    (under ``CI`` a missing one fails the test instead of skipping it)."""
    return ensure_programs({"fio": "fio"})["fio"]


def test_vs_fio_reports_both_tools_and_the_ratio(run_cli: RunCLI, tmp_path: Path,
                                                 fio: str) -> None:
    doc = bench_json(run_cli, tmp_path, "--rw", "read", "--vs-fio", "--repeat", "2",
                     "--threads", "2", "--iodepth", "2")
    assert doc["mode"] == "vs-fio"
    assert len(doc["ours"]) == 2 and len(doc["fio_runs"]) == 2
    assert doc["fio"]["numjobs"] * doc["fio"]["iodepth"] == doc["config"]["in_flight"]
    for run in doc["fio_runs"]:
        assert run["read"]["bytes"] == 4 * 2**20
    read = doc["comparison"]["read"]
    assert read["ratio_of_medians"] == pytest.approx(
        read["ours_median_mib_s"] / read["fio_median_mib_s"])


def test_fio_job_matches_the_engine_queue_depth(tmp_path: Path) -> None:
    cfg = BenchConfig(rw="read", bs=2 * 2**20, size=64 * 2**20, threads=8, iodepth=8,
                      task_size=4 * 2**20, direct=True)
    shape = fio_shape(cfg, None, "libaio", cfg.nchunks)
    assert shape.total == cfg.in_flight() == 8
    job = build_jobfile(cfg, shape, tmp_path, cfg.nchunks)
    assert "direct=1" in job and f"bs={2 * 2**20}" in job and "offset=4096" in job
    assert job.count("[job") == shape.numjobs
    nrfiles = [int(line[8:]) for line in job.splitlines() if line.startswith("nrfiles=")]
    assert sum(nrfiles) == cfg.nchunks and max(nrfiles) - min(nrfiles) <= 1


@pytest.mark.parametrize(("args", "message"), [
    (("--bs", "5000"), "--bs: must be a multiple of 4k"),
    (("--bs", "lots"), "invalid size 'lots'"),
    (("--size", "1M", "--bs", "2M"), "--size: 1MiB is smaller than --bs 2MiB"),
    (("--threads", "0"), "--threads/--numjobs: must be at least 1"),
    (("--rw", "trim"), "--rw: invalid choice: 'trim'"),
    (("--sweep", "--vs-fio"), "cannot be combined with --sweep"),
    (("--sweep-threads", "a,b"), "'a' is not a whole number"),
])
def test_bad_arguments_are_usage_errors(run_cli: RunCLI, tmp_path: Path,
                                        args: tuple[str, ...], message: str) -> None:
    proc = run_cli("bench", tmp_path, *args)
    assert proc.returncode == 2
    assert "usage: lmcache-nvme bench" in proc.stderr
    assert message in proc.stderr
    assert list(tmp_path.iterdir()) == []


def test_gpu_destination_without_a_gpu_says_what_is_missing(run_cli: RunCLI,
                                                            tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible; tests/gpu covers --dest gpu")
    proc = run_cli("bench", tmp_path, *SMALL, "--dest", "gpu")
    assert proc.returncode == 1
    assert "--dest gpu needs a CUDA GPU" in proc.stderr and "--dest host" in proc.stderr


def test_missing_fio_binary_is_named(run_cli: RunCLI, tmp_path: Path) -> None:
    proc = run_cli("bench", tmp_path, *SMALL, "--vs-fio", "--fio-binary", "/no/such/fio")
    assert proc.returncode == 1
    assert "fio not found" in proc.stderr and "--fio-binary" in proc.stderr


def test_path_that_is_a_file_is_refused(run_cli: RunCLI, tmp_path: Path) -> None:
    file = tmp_path / "file"
    file.write_text("x")
    proc = run_cli("bench", file, *SMALL)
    assert proc.returncode == 1
    assert "file" in proc.stderr


def test_module_entry_point_matches_the_script(tmp_path: Path) -> None:
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "lmcache_nvme_backend", "--help"],
                          capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0
    assert "usage: lmcache-nvme" in proc.stdout
    for command in ("bench", "doctor", "inspect", "verify", "gc"):
        assert command in proc.stdout


def test_no_command_is_a_usage_error(run_cli: RunCLI) -> None:
    proc = run_cli()
    assert proc.returncode == 2
    assert "usage: lmcache-nvme" in proc.stderr


@pytest.mark.parametrize(("bs", "free_pages", "expect", "noted"), [
    (2 * 2**20, 1000, "shmhuge", False),   # the pool has room: same buffers as the engine
    (2 * 2**20, 3, "malloc", True),        # no room: fio's default, and a note saying so
    (256 * 1024, 1000, "malloc", False),   # small blocks: the engine uses 4 KiB pages too
])
def test_fio_buffers_match_the_engine_when_possible(bs: int, free_pages: int, expect: str,
                                                    noted: bool) -> None:
    cfg = BenchConfig(rw="read", bs=bs, size=64 * bs, threads=8, iodepth=8,
                      task_size=4 * 2**20, direct=True)
    mem, note = choose_fio_mem("auto", cfg, numjobs=8, iodepth=1, free_pages=free_pages)
    assert mem == expect
    assert (note is not None) == noted
    if note:
        assert "nr_hugepages" in note and "--fio-mem" in note
    assert choose_fio_mem("mmap", cfg, 8, 1, free_pages) == ("mmap", None)
