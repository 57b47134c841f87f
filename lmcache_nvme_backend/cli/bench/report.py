"""What ``lmcache-nvme bench`` prints, text and JSON, from finished ``RunResult`` records:
the comparison with fio and the ``--sweep``'s advice (decided in ``tuning.py``)."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from ..common import MIB, short_size
from .model import BenchConfig, RunResult
from .tuning import Advice, Measured, settings_of


def median_run(runs: list[RunResult]) -> RunResult:
    """The run of median total bandwidth (the lower middle one of an even count)."""
    return sorted(runs, key=lambda r: r.bw_bytes())[(len(runs) - 1) // 2]


def compare(ours: list[RunResult], theirs: list[RunResult]) -> dict[str, dict[str, Any]]:
    """Per direction: both tools' bandwidths, their medians, and the ratios ours / fio."""
    out: dict[str, dict[str, Any]] = {}
    for direction in ours[0].dirs:
        a = [r.dirs[direction].bw_bytes for r in ours]
        b = [r.dirs[direction].bw_bytes for r in theirs if direction in r.dirs]
        if not b:
            continue
        paired = [x / y for x, y in zip(a, b, strict=False) if y > 0]
        out[direction] = {
            "ours_mib_s": [round(x / MIB, 1) for x in a],
            "fio_mib_s": [round(x / MIB, 1) for x in b],
            "ours_median_mib_s": statistics.median(a) / MIB,
            "fio_median_mib_s": statistics.median(b) / MIB,
            "ratio_of_medians": statistics.median(a) / statistics.median(b),
            "median_paired_ratio": statistics.median(paired) if paired else float("nan"),
        }
    return out


def json_doc(plot: Path | None, **fields: Any) -> dict[str, Any]:
    """A ``--json`` document: ``fields`` in order, then the chart's path if one was written."""
    doc: dict[str, Any] = {"command": "bench", **fields}
    if plot is not None:
        doc["plot"] = str(plot)
    return doc


def print_summary(runs: list[RunResult], where: str, header: str | None = None) -> None:
    """fio-style summary of one configuration's runs (the median run in detail); ``header``
    replaces the description of our configuration (for fio's runs)."""
    median = median_run(runs)
    c = median.config
    if header is None:
        print(f"lmcache-nvme: rw={c.rw}, bs={short_size(c.bs)}, size="
              f"{short_size(c.nchunks * c.bs)}, threads={c.threads}, iodepth={c.iodepth}, "
              f"callers={c.callers}, task_size={short_size(c.task_size)}, "
              f"direct={int(c.direct)}, dest={c.dest} (up to {c.in_flight()} I/Os in flight)")
        print(f"  path: {where}")
        print(f"  files: {c.nchunks} chunk files of {short_size(c.bs)} payload + 4KiB header")
    else:
        print(header)
    if len(runs) > 1:
        for direction in median.dirs:
            each = ", ".join(f"{r.dirs[direction].bw_bytes / MIB:.0f}" for r in runs
                             if direction in r.dirs)
            print(f"  {direction} MiB/s of {len(runs)} runs: {each} (median run below)")
    for d in median.dirs.values():
        print(f"  {d.direction}: IOPS={d.iops:.1f}, BW={d.bw_bytes / MIB:.0f}MiB/s "
              f"({d.bw_bytes / 1e9:.2f}GB/s)({d.bytes / MIB:.0f}MiB/{d.seconds:.3f}s)")
        if d.lat_ms:
            print("    lat (ms): " + ", ".join(f"{k}={v:.2f}" for k, v in d.lat_ms.items()))


def print_sweep(medians: list[RunResult], groups: list[list[RunResult]], where: str,
                advice: Advice) -> None:
    """One table row per swept configuration (its median run, and the range of its runs),
    then the advice and why, and the settings as YAML lines to paste."""
    c = medians[0].config
    print(f"lmcache-nvme bench sweep: rw={c.rw}, bs={short_size(c.bs)}, "
          f"size={short_size(c.nchunks * c.bs)}, direct={int(c.direct)}, dest={c.dest}, "
          f"{len(groups[0])} run(s) per point in interleaved rounds (median, and the range "
          "of the runs)")
    print(f"  path: {where}")
    direction = "read" if c.reads else "write"
    print(f"  {'threads':>7} {'iodepth':>7} {'task':>6} {'MiB/s':>8} {'range MiB/s':>13} "
          f"{'GB/s':>6} {'IOPS':>8} {'p50 ms':>8} {'p99 ms':>8} {'p99.9 ms':>9}")
    for m, runs in zip(medians, groups, strict=True):
        d = m.dirs[direction]
        iodepth = str(m.config.iodepth) if m.config.reads else "-"
        bws = [r.bw_bytes() / MIB for r in runs]
        spread = f"{min(bws):.0f}-{max(bws):.0f}"
        print(f"  {m.config.threads:>7} {iodepth:>7} {short_size(m.config.task_size):>6} "
              f"{m.bw_bytes() / MIB:>8.0f} {spread:>13} {m.bw_bytes() / 1e9:>6.2f} "
              f"{d.iops:>8.1f} {d.lat_ms.get('p50', 0):>8.2f} {d.lat_ms.get('p99', 0):>8.2f} "
              f"{d.lat_ms.get('p99.9', 0):>9.2f}")

    def line(label: str, m: Measured) -> str:
        named = ", ".join(f"{k} {v:g}" for k, v in settings_of(m.setting, c.reads).items())
        return (f"  {label:<8} {named}: {m.median / 1e9:.2f} GB/s (runs "
                f"{m.low / 1e9:.2f}-{m.high / 1e9:.2f})")

    print()
    print(f"Recommendation ({advice.runs_per_point} run(s) per point; median bandwidth and "
          "the range of the runs, averaged over the swept batch sizes):")
    print(line("default", advice.default))
    print(line("best", advice.best))
    if advice.changed:
        print(line("chosen", advice.chosen))
    print(f"  -> {advice.reason}")
    print("paste under extra_config in the LMCache YAML (bare names in adapter_params):")
    for k, v in settings_of(advice.chosen.setting, c.reads).items():
        print(f"{k}: {v:g}")


def print_vs_fio(ours: list[RunResult], theirs: list[RunResult], where: str, fio_desc: str,
                 repeat: int, cfg: BenchConfig, comparison: dict[str, dict[str, Any]]) -> None:
    """Both tools' summaries, then the table of bandwidth ratios."""
    print_summary(ours, where)
    print()
    print_summary(theirs, where, header=f"fio: {fio_desc}")
    print()
    print(f"lmcache-nvme vs fio, {repeat} interleaved repetitions, queue depth "
          f"{cfg.in_flight()} each:")
    print(f"  {'direction':<9} {'ours MiB/s':>11} {'fio MiB/s':>10} {'ratio of medians':>17} "
          f"{'paired median':>14}")
    for direction, c in comparison.items():
        print(f"  {direction:<9} {c['ours_median_mib_s']:>11.0f} {c['fio_median_mib_s']:>10.0f} "
              f"{c['ratio_of_medians']:>16.2f}x {c['median_paired_ratio']:>13.2f}x")
