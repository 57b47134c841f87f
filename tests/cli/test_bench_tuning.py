"""``bench --sweep``'s advice (cli/bench/tuning.py) from fixed measurements: a default is
changed only when another setting beats it beyond the spread of the runs."""

from __future__ import annotations

import pytest

from lmcache_nvme_backend.cli.bench.model import BenchConfig, DirStats, RunResult
from lmcache_nvme_backend.cli.bench.tuning import Setting, advice_doc, advise, measure

MIB = 2**20
DEFAULT = Setting(threads=8, task_size=64 * MIB)


def runs(threads: int, gbps: list[float], iodepth: int = 4, task_mb: int = 64,
         rw: str = "read") -> list[RunResult]:
    """One sweep point measured ``len(gbps)`` times at these bandwidths (GB/s)."""
    cfg = BenchConfig(rw=rw, bs=2 * MIB, size=64 * MIB, threads=threads, iodepth=iodepth,
                      task_size=task_mb * MIB, direct=True)
    direction = "read" if rw == "read" else "write"
    return [RunResult("lmcache-nvme", cfg, {direction: DirStats(direction, int(g * 1e9), 1.0,
                                                                  32, {})}) for g in gbps]


def test_the_noise_of_the_reported_sweep_keeps_the_defaults() -> None:
    # one run per point chose 16 threads on 2 cores; repeated, every range overlaps
    groups = [runs(1, [2.34, 1.30, 2.05]), runs(2, [1.19, 2.21, 1.90]),
              runs(8, [1.62, 2.30, 2.01]), runs(16, [2.52, 1.41, 2.10])]
    advice = advise(groups, DEFAULT)
    assert not advice.changed and advice.chosen.setting == DEFAULT
    assert advice.best.setting.threads == 16  # the best median, not beyond the noise
    assert advice.reason.startswith("no setting beat the defaults beyond the run-to-run spread")


def test_a_clear_gain_picks_the_fewest_threads_as_good_as_the_best() -> None:
    groups = [runs(2, [1.20, 1.30, 1.25]),   # clearly above the default, short of the best
              runs(4, [1.50, 1.60, 1.55]),   # clearly above, and reaches the best's range
              runs(8, [1.00, 1.10, 1.05]),   # the default
              runs(16, [1.58, 1.62, 1.60])]  # the best median
    advice = advise(groups, DEFAULT)
    assert advice.changed and advice.chosen.setting == Setting(4, 64 * MIB)
    assert advice.reason.startswith("+48% over the defaults")
    doc = advice_doc(advice, reads=True)
    assert doc["settings"] == {"nvme.io_threads": 4, "nvme.task_size_mb": 64}
    assert doc["default"]["range_bw_gb_s"] == [1.0, 1.1]
    assert doc["changed"] is True and doc["runs_per_point"] == 3


def test_one_run_per_point_never_changes_a_default() -> None:
    advice = advise([runs(1, [2.34]), runs(8, [1.19])], DEFAULT)
    assert not advice.changed
    assert "one run per point shows no spread" in advice.reason


def test_settings_are_scored_over_every_batch_size() -> None:
    # 4 threads win big at batch 16 and lose at batch 1: averaged, within the default's spread
    groups = [runs(4, [3.0, 3.1, 3.05], iodepth=16), runs(4, [0.5, 0.6, 0.55], iodepth=1),
              runs(8, [1.9, 2.0, 1.95], iodepth=16), runs(8, [1.4, 1.5, 1.45], iodepth=1)]
    measured = measure(groups)
    assert measured[Setting(4, 64 * MIB)].median == pytest.approx((3.05 + 0.55) / 2 * 1e9)
    assert measured[Setting(4, 64 * MIB)].low == pytest.approx((3.0 + 0.5) / 2 * 1e9)
    assert not advise(groups, DEFAULT).changed


def test_write_sweeps_advise_writer_threads_and_task_sizes() -> None:
    one_writer = Setting(1, 64 * MIB)
    groups = [runs(1, [0.9, 1.0, 0.95], rw="write"), runs(1, [0.9, 1.0, 0.95], rw="write",
                                                        task_mb=4),
              runs(2, [1.6, 1.7, 1.65], rw="write", task_mb=4),
              runs(2, [1.2, 1.3, 1.25], rw="write")]
    advice = advise(groups, one_writer)
    assert advice.chosen.setting == Setting(2, 4 * MIB)
    assert advice_doc(advice, reads=False)["settings"] == {"nvme.write_threads": 2,
                                                           "nvme.task_size_mb": 4}
