"""``bench --plot``: PNG charts of bandwidth and latency (matplotlib, Agg backend; the
optional ``[plot]`` extra)."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

from ..common import CLIError, short_size
from .model import RunResult
from .report import median_run

LAT_KEYS = ("p50", "p90", "p99", "p99.9")


def require_matplotlib() -> None:
    """Fail early (before a long run) when matplotlib is missing."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as exc:
        raise CLIError("--plot needs matplotlib: pip install 'lmcache-nvme-backend[plot]' "
                       "(or pip install matplotlib)") from exc


def _figure(height: float) -> tuple[Any, Any, Any]:
    """A figure of two axes side by side, without pyplot: no display, no global state."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(13, height))
    return (fig, *fig.subplots(1, 2))


def _save(fig: Any, run: RunResult, where: str, out: Path) -> None:
    """Title the figure with the configuration and ``where``, and write it."""
    c = run.config
    fig.suptitle(f"lmcache-nvme bench: {c.rw}, {short_size(c.bs)} chunks, "
                 f"{'O_DIRECT' if c.direct else 'buffered'}, {c.dest} destination\n{where}",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def plot_sweep(points: list[RunResult], groups: list[list[RunResult]], out: Path,
               where: str) -> None:
    """Bandwidth (each point's median run, its ``groups`` range as error bars) and latency
    against threads, one line per batch (and task) size; legends below the axes."""
    reads = points[0].config.reads
    direction = "read" if reads else "write"
    several_tasks = len({p.config.task_size for p in points}) > 1
    series: dict[tuple[int, int], list[tuple[RunResult, list[RunResult]]]] = defaultdict(list)
    for p, runs in zip(points, groups, strict=True):
        series[(p.config.iodepth if reads else 0, p.config.task_size)].append((p, runs))
    fig, ax_bw, ax_lat = _figure(6.4)
    threads = sorted({p.config.threads for p in points})
    for k, ((iodepth, task), line) in enumerate(sorted(series.items())):
        parts = [f"iodepth {iodepth} (chunks per batch)"] if reads else []
        if several_tasks or not parts:
            parts.append(f"task {short_size(task)}")
        name = ", ".join(parts)
        line.sort(key=lambda pr: pr[0].config.threads)
        x = [p.config.threads for p, _ in line]
        color = f"C{k}"  # the colour cycle's k-th, wrapping around
        median = [p.bw_bytes() / 1e9 for p, _ in line]
        bws = [[r.bw_bytes() / 1e9 for r in runs] for _, runs in line]
        ax_bw.errorbar(x, median, yerr=[[m - min(b) for m, b in zip(median, bws, strict=True)],
                                        [max(b) - m for m, b in zip(median, bws, strict=True)]],
                       marker="o", color=color, capsize=3, label=name)
        for q, marker, style in (("p50", "o", "-"), ("p99", "^", "--")):
            ax_lat.plot(x, [p.dirs[direction].lat_ms.get(q, 0.0) for p, _ in line],
                        marker=marker, linestyle=style, color=color, label=f"{q}, {name}")
    for ax in (ax_bw, ax_lat):
        ax.set_xscale("log", base=2)
        ax.set_xticks(threads)
        ax.set_xticklabels([str(t) for t in threads])
        ax.set_xlabel("I/O threads (nvme.io_threads)" if reads
                      else "writer threads (nvme.write_threads)")
        ax.grid(True, which="major", alpha=0.3)
    ax_bw.set(ylabel="bandwidth (GB/s, 10^9 bytes per second)", ylim=(0, None),
              title=f"Bandwidth (payload bytes): median of {len(groups[0])} run(s), bars "
                    "from the slowest to the fastest")
    ax_bw.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=2)
    ax_lat.set(ylabel="latency per chunk (ms, log scale)", yscale="log",
               title="Latency per chunk as the caller sees it (median run)")
    ax_lat.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=2)
    _save(fig, points[0], where, out)


def plot_runs(ours: list[RunResult], fio: list[RunResult], out: Path, where: str) -> None:
    """Bandwidth of every repetition and latency percentiles of the median run, of the
    engine alone or against fio (without ``--sweep``)."""
    fig, ax_bw, ax_lat = _figure(5.2)
    tools = [("lmcache-nvme", ours, "tab:blue")] + ([("fio", fio, "tab:orange")] if fio else [])
    directions = sorted({d for r in ours for d in r.dirs})
    labels = [f"{d} {q}" for d in directions for q in LAT_KEYS]
    width = 0.8 / len(tools)
    for t, (tool, runs, color) in enumerate(tools):
        shift = (t - (len(tools) - 1) / 2) * width
        for k, direction in enumerate(directions):
            values = [r.dirs[direction].bw_bytes / 1e9 for r in runs if direction in r.dirs]
            median = sorted(values)[len(values) // 2] if values else 0.0
            ax_bw.bar(k + shift if values else k, median, width=width * 0.9, color=color,
                      alpha=0.5, label=f"{tool} (median)" if k == 0 else None)
            ax_bw.scatter([k + shift] * len(values), values, color=color, s=18, zorder=3,
                          label=f"{tool} (each repetition)" if k == 0 else None)
        run = median_run(runs)
        ax_lat.bar([i + shift for i in range(len(labels))],
                   [run.dirs[d].lat_ms.get(q, 0.0) if d in run.dirs else 0.0
                    for d in directions for q in LAT_KEYS],
                   width=width * 0.9, color=color, label=tool)
    ax_bw.set_xticks(range(len(directions)))
    ax_bw.set_xticklabels(directions)
    ax_bw.set(xlabel="direction", ylabel="bandwidth (GB/s, 10^9 bytes per second)",
              title=f"Bandwidth over {len(ours)} repetition(s)")
    ax_lat.set_xticks(range(len(labels)))
    ax_lat.set_xticklabels(labels, rotation=30, ha="right")
    ax_lat.set(xlabel="percentile", ylabel="latency (ms)",
               title="Latency percentiles of the median run")
    for ax in (ax_bw, ax_lat):
        ax.legend(fontsize=8)
        ax.grid(True, axis="y", alpha=0.3)
    _save(fig, ours[0], where, out)
