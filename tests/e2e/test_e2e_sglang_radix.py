"""End to end with SGLang's own code: SGLang 0.5.20's ``LMCRadixCache`` (MP mode) on CPU,
through LMCache's SGLang connector, to a real ``lmcache server`` whose L2 is NVMeL2Adapter.

Each phase is a fresh process of SGLang's environment (``support.engine_env.SGLANG``;
``support.e2e_sglang_driver`` plays the scheduler around SGLang's tree cache, pools and
requests), configured with the recipe's config file (only the port changed):

1. ``store``: three prompts arrive cold and finish; LMCRadixCache stores the whole chunks
   (four: the short prompt has none).
2. ``load`` after ``POST /cache/clear``: a fresh SGLang process (empty radix tree) hits
   both long prompts in full, loads them from the NVMe files, byte for byte; with L1
   emptied again and 320 tokens of one in its radix tree, it loads only the rest of the
   hit (one chunk from its file), byte for byte.
3. ``load`` after a server restart: the same, from the files the new server recovered.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from support import reports
from support.mp_server import QUIET_ENV, MPServer, ServerFactory, shm_segments
from support.paths import EXAMPLES_DIR
from support.process import child_env, module_command
from support.sglang_workload import CHUNK

pytestmark = [pytest.mark.sglang, pytest.mark.slow, pytest.mark.timeout(1200)]

DRIVER = "support.e2e_sglang_driver"
RUN_S = 300
ENV = {**QUIET_ENV, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
       "TRANSFORMERS_OFFLINE": "1"}


@pytest.fixture(scope="module")
def tiny_model(sglang_python: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tiny-llama")
    subprocess.run(module_command("support.e2e_vllm_driver", "build-model", out,
                                  python=sglang_python),
                   check=True, timeout=300, env=child_env(**ENV), capture_output=True)
    return out


def run_sglang(python: Path, model: Path, server: MPServer, page_size: int, phase: str,
               tmp_path: Path) -> dict[str, Any]:
    config = yaml.safe_load((EXAMPLES_DIR / "sglang-lmcache.yaml").read_text())
    config["mp_port"] = server.port
    config_file = tmp_path / "sglang-lmcache.yaml"
    config_file.write_text(yaml.safe_dump(config))
    proc = subprocess.run(module_command(DRIVER, "radix", "--model", model, "--config",
                                         config_file, "--page-size", str(page_size),
                                         "--phase", phase, "--http", server.http,
                                         python=python),
                          capture_output=True, text=True, timeout=RUN_S, env=child_env(**ENV))
    report = reports.find(proc.stdout)
    if report is not None:
        assert not shm_segments(report.pop("pid")), "SGLang's KV pools left in /dev/shm"
        return report
    raise AssertionError(f"SGLang phase '{phase}' produced no report (rc {proc.returncode}):"
                         f"\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}\n--- server log ---\n"
                         f"{server.log_tail(3000)}")


def assert_loaded(report: dict[str, Any]) -> None:
    """A and B loaded in full from the files (two chunks each), byte for byte; then, with
    320 tokens of B in the radix tree and B's first chunk in L1, the rest of B's hit (its
    second chunk) from the file."""
    assert (report["ab_reads"], report["partial_reads"]) == (4, 1), report
    for name in ("a", "b"):
        assert report[name] == {"host_hit_length": 2 * CHUNK, "radix": 0,
                                "loaded": 2 * CHUNK, "mismatches": 0}, name
    assert report["b_partial"] == {"host_hit_length": 2 * CHUNK - 320, "radix": 320,
                                   "loaded": 2 * CHUNK - 320, "mismatches": 0,
                                   "radix_mismatches": 0}


@pytest.mark.parametrize("page_size", [1, 64])
def test_sglang_lmc_radix_cache_through_nvme_l2(page_size: int, sglang_python: Path,
                                                tiny_model: Path, start_server: ServerFactory,
                                                tmp_path: Path) -> None:
    cache_dir = tmp_path / "nvme"
    server = start_server(cache_dir, "server1")
    stored = run_sglang(sglang_python, tiny_model, server, page_size, "store", tmp_path)
    assert all(stored[name]["host_hit_length"] == 0 for name in ("a", "b", "short"))
    status = server.wait_persisted(4)
    assert status["entries"] == 4 and len(list(cache_dir.glob("ns/**/*.kv"))) == 4

    server.clear_l1()
    assert_loaded(run_sglang(sglang_python, tiny_model, server, page_size, "load", tmp_path))
    assert server.status()["read_chunks"] - status["read_chunks"] == 5  # from the files
    server.stop()

    server = start_server(cache_dir, "server2")
    assert server.status()["recovered_entries"] == 4
    assert_loaded(run_sglang(sglang_python, tiny_model, server, page_size, "load", tmp_path))
    after = server.status()
    assert after["read_chunks"] == 5 and after["checksum_failures"] == 0
