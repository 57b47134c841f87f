"""The tuning advice of ``bench --sweep``: change a default only for a measured, clear gain.

A setting (threads, task size) scores its points' median bandwidths, averaged over the swept
batch sizes, with their runs' range as the noise.  The defaults stay unless a setting's
lowest runs beat their highest; of those, the fewest threads whose range reaches the best's.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from ..common import MIB
from .model import RunResult


@dataclass(frozen=True)
class Setting:
    """What a sweep varies that becomes a setting: I/O (or writer) threads, piece size."""

    threads: int
    task_size: int


@dataclass(frozen=True)
class Measured:
    """One setting's bandwidth (bytes/s), averaged over the swept batch sizes: the median
    of its runs, and the lowest and highest run."""

    setting: Setting
    median: float
    low: float
    high: float


@dataclass(frozen=True)
class Advice:
    """The recommendation: ``chosen`` (the defaults unless something beat them clearly)."""

    chosen: Measured
    default: Measured
    best: Measured
    runs_per_point: int
    reason: str

    @property
    def changed(self) -> bool:
        return self.chosen.setting != self.default.setting


def measure(groups: list[list[RunResult]]) -> dict[Setting, Measured]:
    """Each swept setting's median, low and high bandwidth (``groups``: the runs of each
    point of the sweep)."""
    per_setting: dict[Setting, list[list[float]]] = {}
    for runs in groups:
        c = runs[0].config
        per_setting.setdefault(Setting(c.threads, c.task_size), []).append(
            [r.bw_bytes() for r in runs])
    return {s: Measured(s, statistics.mean(statistics.median(p) for p in points),
                        statistics.mean(min(p) for p in points),
                        statistics.mean(max(p) for p in points))
            for s, points in per_setting.items()}


def advise(groups: list[list[RunResult]], default: Setting) -> Advice:
    """The setting to recommend; ``default`` must be one of the swept settings."""
    measured = measure(groups)
    base = measured[default]
    best = max(measured.values(), key=lambda m: m.median)
    runs = min(len(runs) for runs in groups)
    if runs < 2:  # one run per point gives no spread to judge a difference against
        return Advice(base, base, best, runs, "one run per point shows no spread, so no "
                      "difference can be told from noise: keep the defaults (--repeat 3, "
                      "the default with --sweep, measures the spread)")
    clear = [m for m in measured.values() if m.low > base.high]
    if not clear:
        return Advice(base, base, best, runs, "no setting beat the defaults beyond the "
                      "run-to-run spread: keep them")
    top = max(clear, key=lambda m: m.median)
    as_good = [m for m in clear if m.high >= top.low]
    chosen = min(as_good, key=lambda m: (m.setting.threads, -m.median))
    gain = chosen.median / base.median - 1 if base.median else float("inf")
    return Advice(chosen, base, best, runs, f"{gain:+.0%} over the defaults, its slowest run "
                  "faster than their fastest; the fewest threads within the spread of the best")


def advice_doc(advice: Advice, reads: bool) -> dict[str, object]:
    """The ``--json`` form of ``advice``, with the settings to paste."""
    def one(m: Measured) -> dict[str, object]:
        return {"settings": settings_of(m.setting, reads),
                "median_bw_gb_s": round(m.median / 1e9, 3),
                "range_bw_gb_s": [round(m.low / 1e9, 3), round(m.high / 1e9, 3)]}

    return {"settings": settings_of(advice.chosen.setting, reads),
            "changed": advice.changed, "reason": advice.reason,
            "runs_per_point": advice.runs_per_point,
            "mean_bw_gb_s": round(advice.chosen.median / 1e9, 3),
            "best_mean_bw_gb_s": round(advice.best.median / 1e9, 3),
            "chosen": one(advice.chosen), "default": one(advice.default),
            "best": one(advice.best)}


def settings_of(setting: Setting, reads: bool) -> dict[str, float | int]:
    """The LMCache YAML lines of ``setting`` (reads: the I/O pool; writes: the writers)."""
    key = "io_threads" if reads else "write_threads"
    return {f"nvme.{key}": setting.threads,
            "nvme.task_size_mb": round(setting.task_size / MIB, 3)}
