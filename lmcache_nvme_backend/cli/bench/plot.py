"""``bench --plot``: PNG charts of bandwidth and latency (matplotlib, Agg backend).

matplotlib is an optional dependency: ``pip install 'lmcache-nvme-backend[plot]'``.
"""

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


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _title(run: RunResult, where: str) -> str:
    c = run.config
    return (f"lmcache-nvme bench: {c.rw}, {short_size(c.bs)} chunks, "
            f"{'O_DIRECT' if c.direct else 'buffered'}, {c.dest} destination\n{where}")


def plot_sweep(points: list[RunResult], groups: list[list[RunResult]], out: Path,
               where: str) -> None:
    """Bandwidth (median, with the range of the runs as error bars) and latency against I/O
    threads, one line per batch size (and task size).

    ``points`` are the median runs of each sweep configuration, ``groups`` all its runs.
    Legends sit below the axes, where they cover no line.
    """
    plt = _pyplot()
    first = points[0].config
    series: dict[str, list[tuple[RunResult, list[RunResult]]]] = defaultdict(list)
    task_sizes = {p.config.task_size for p in points}
    for p, runs in zip(points, groups, strict=True):
        parts = []
        if first.reads:
            parts.append(f"iodepth {p.config.iodepth} (chunks per batch)")
        if len(task_sizes) > 1 or not parts:
            parts.append(f"task {short_size(p.config.task_size)}")
        series[", ".join(parts)].append((p, runs))
    fig, (ax_bw, ax_lat) = plt.subplots(1, 2, figsize=(13, 6.4))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    threads = sorted({p.config.threads for p in points})
    for k, (name, line) in enumerate(sorted(series.items(), key=lambda kv: _series_key(kv[0]))):
        line.sort(key=lambda pr: pr[0].config.threads)
        x = [p.config.threads for p, _ in line]
        color = colors[k % len(colors)]
        median = [p.bw_bytes() / 1e9 for p, _ in line]
        low = [m - min(r.bw_bytes() for r in runs) / 1e9 for m, (_, runs) in zip(median, line,
                                                                                strict=True)]
        high = [max(r.bw_bytes() for r in runs) / 1e9 - m for m, (_, runs) in zip(median, line,
                                                                                 strict=True)]
        ax_bw.errorbar(x, median, yerr=[low, high], marker="o", color=color, capsize=3,
                       label=name)
        direction = "read" if first.reads else "write"
        p50 = [p.dirs[direction].lat_ms.get("p50", 0.0) for p, _ in line]
        p99 = [p.dirs[direction].lat_ms.get("p99", 0.0) for p, _ in line]
        ax_lat.plot(x, p50, marker="o", color=color, label=f"p50, {name}")
        ax_lat.plot(x, p99, marker="^", linestyle="--", color=color, label=f"p99, {name}")
    thread_label = ("I/O threads (nvme.io_threads)" if first.reads
                    else "writer threads (nvme.write_threads)")
    for ax in (ax_bw, ax_lat):
        ax.set_xscale("log", base=2)
        ax.set_xticks(threads)
        ax.set_xticklabels([str(t) for t in threads])
        ax.set_xlabel(thread_label)
        ax.grid(True, which="major", alpha=0.3)
    ax_bw.set_ylabel("bandwidth (GB/s, 10^9 bytes per second)")
    ax_bw.set_ylim(bottom=0)
    ax_bw.set_title(f"Bandwidth (payload bytes): median of {len(groups[0])} run(s), bars "
                    "from the slowest to the fastest")
    ax_bw.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=2)
    ax_lat.set_ylabel("latency per chunk (ms, log scale)")
    ax_lat.set_yscale("log")
    ax_lat.set_title("Latency per chunk as the caller sees it (median run)")
    ax_lat.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=2)
    fig.suptitle(_title(points[0], where), fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def _series_key(name: str) -> tuple[int, ...]:
    return tuple(int(t) for t in name.replace("(", " ").split() if t.isdigit())


def plot_runs(ours: list[RunResult], fio: list[RunResult], out: Path, where: str) -> None:
    """Bandwidth of every repetition and latency percentiles of the median run.

    Used without ``--sweep``: the engine alone, or the engine against fio.
    """
    plt = _pyplot()
    fig, (ax_bw, ax_lat) = plt.subplots(1, 2, figsize=(13, 5.2))
    tools = [("lmcache-nvme", ours, "tab:blue")] + ([("fio", fio, "tab:orange")] if fio else [])
    directions = sorted({d for r in ours for d in r.dirs})
    width = 0.8 / len(tools)
    for t, (tool, runs, color) in enumerate(tools):
        for k, direction in enumerate(directions):
            values = [r.dirs[direction].bw_bytes / 1e9 for r in runs if direction in r.dirs]
            xs = [k + (t - (len(tools) - 1) / 2) * width] * len(values)
            median = sorted(values)[len(values) // 2] if values else 0.0
            ax_bw.bar(xs[0] if xs else k, median, width=width * 0.9, color=color, alpha=0.5,
                      label=f"{tool} (median)" if k == 0 else None)
            ax_bw.scatter(xs, values, color=color, s=18, zorder=3,
                          label=f"{tool} (each repetition)" if k == 0 else None)
    ax_bw.set_xticks(range(len(directions)))
    ax_bw.set_xticklabels(directions)
    ax_bw.set_xlabel("direction")
    ax_bw.set_ylabel("bandwidth (GB/s, 10^9 bytes per second)")
    ax_bw.set_title(f"Bandwidth over {len(ours)} repetition(s)")
    ax_bw.legend(fontsize=8)
    ax_bw.grid(True, axis="y", alpha=0.3)
    median_runs = [(tool, median_run(runs), color) for tool, runs, color in tools]
    labels = [f"{d} {q}" for d in directions for q in LAT_KEYS]
    for t, (tool, run, color) in enumerate(median_runs):
        values = [run.dirs[d].lat_ms.get(q, 0.0) if d in run.dirs else 0.0
                  for d in directions for q in LAT_KEYS]
        xs = [i + (t - (len(tools) - 1) / 2) * width for i in range(len(labels))]
        ax_lat.bar(xs, values, width=width * 0.9, color=color, label=tool)
    ax_lat.set_xticks(range(len(labels)))
    ax_lat.set_xticklabels(labels, rotation=30, ha="right")
    ax_lat.set_xlabel("percentile")
    ax_lat.set_ylabel("latency (ms)")
    ax_lat.set_title("Latency percentiles of the median run")
    ax_lat.legend(fontsize=8)
    ax_lat.grid(True, axis="y", alpha=0.3)
    fig.suptitle(_title(ours[0], where), fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)

