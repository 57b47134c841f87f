"""End to end with SGLang 0.5.23's own code: ``LMCacheUnifiedRadixCache`` (SGLang 0.5.21+)
on CPU, through LMCache's ``UnifiedLMCacheMPConnector``, to a real ``lmcache server`` whose
L2 is NVMeL2Adapter -- with several object groups per chunk and ``cache_salt``.

Each phase is a fresh process of SGLang 0.5.23's environment
(``support.engine_env.SGLANG_UNIFIED``; ``support.e2e_sglang_unified_driver`` plays the
scheduler around SGLang's tree cache, pools and requests), configured with the recipe's
config file (only the port changed, plus LMCache's shared-memory transfer for the hybrid
model).  Two models, the same tiny random-weight Llama:

* ``hybrid-swa``: declared hybrid sliding-window (SGLang's ``is_hybrid_swa`` opt-in: layer 0
  full attention, layers 1-2 a 64-token window), so SGLang builds its ``SWAKVPool`` and the
  connector registers two KV groups; the server (examples/mp-server.sh
  ``--separate-object-groups``) stores each chunk as two objects of different sizes, object
  group 0 (full attention: one layer) and 1 (sliding window: two layers).
* ``llama``: one object group, with the CPU defaults (what a plain model gets).

1. ``store``: A (no salt), B (salt ``alice``) and a short prompt arrive cold and finish:
   two whole chunks each of A and B, every object group, land on the drive, B's under its
   own namespace; the short prompt stores nothing.
2. ``load`` after ``POST /cache/clear``: a fresh SGLang process hits A (no salt) and B
   (``alice``) in full and loads them from the NVMe files, byte for byte in every group
   (full attention over the whole hit, the window of the sliding layers); B as ``bob``, B
   without a salt and A as ``alice`` miss.  With L1 emptied again and 320 tokens of B in its
   radix tree, only the rest of B's hit loads, byte for byte.
3. ``load`` after a server restart: the same, from the files the new server recovered.
"""

from __future__ import annotations

import json
import shutil
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

from lmcache_nvme_backend.adapters.object_keys import parse_object_key_string
from lmcache_nvme_backend.disk.format import HEADER_SIZE, decode_header

pytestmark = [pytest.mark.sglang, pytest.mark.slow, pytest.mark.timeout(1800)]

DRIVER = "support.e2e_sglang_unified_driver"
RUN_S = 300
ENV = {**QUIET_ENV, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
       "TRANSFORMERS_OFFLINE": "1"}
#: The hybrid model: layer 0 full attention, layers 1 and 2 a sliding window of 64 tokens.
HYBRID = {"num_hidden_layers": 3, "is_hybrid_swa": True, "hybrid_layer_pattern": [0, 1, 1],
          "sliding_window": 64}
FULL_LAYERS, SWA_LAYERS, LLAMA_LAYERS = 1, 2, 2
KV_WIDTH, BF16 = 2 * 32, 2  # KV heads x head dim; bytes a value
SALT = "alice"
CHUNKS = 2  # whole chunks in each of A (700 tokens) and B (600)


@pytest.fixture(scope="module")
def models(sglang_unified_python: Path, tmp_path_factory: pytest.TempPathFactory
           ) -> dict[str, Path]:
    """The tiny Llama (``support.e2e_vllm_driver build-model``), and a copy declared hybrid
    sliding-window (its config only: nothing runs its weights)."""
    llama = tmp_path_factory.mktemp("tiny-llama")
    subprocess.run(module_command("support.e2e_vllm_driver", "build-model", llama,
                                  python=sglang_unified_python),
                   check=True, timeout=300, env=child_env(**ENV), capture_output=True)
    hybrid = tmp_path_factory.mktemp("tiny-hybrid-swa") / "model"
    shutil.copytree(llama, hybrid)
    config = json.loads((hybrid / "config.json").read_text())
    (hybrid / "config.json").write_text(json.dumps({**config, **HYBRID}, indent=2))
    return {"llama": llama, "hybrid-swa": hybrid}


def run_sglang(python: Path, model: Path, server: MPServer, page_size: int, phase: str,
               hybrid: bool, tmp_path: Path) -> dict[str, Any]:
    config = yaml.safe_load((EXAMPLES_DIR / "sglang-lmcache.yaml").read_text())
    config["mp_port"] = server.port
    if hybrid:  # several KV groups on CPU: LMCache's shared-memory transfer (recipe)
        config["extra_config"]["lmcache.mp.mp_transfer_mode"] = "lmcache_driven"
    config_file = tmp_path / "sglang-lmcache.yaml"
    config_file.write_text(yaml.safe_dump(config))
    proc = subprocess.run(module_command(DRIVER, "run", "--model", model, "--config",
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


def assert_layout(report: dict[str, Any], hybrid: bool) -> None:
    """SGLang chose its LMCache radix cache, and the connector registered the model's groups:
    K and V of each layer, the sliding-window layers as a group of their own."""
    layout = report["layout"]
    assert layout["cache"] == "LMCacheUnifiedRadixCache"
    if hybrid:
        assert layout["components"] == ["FULL", "SWA"]
        assert layout["groups"] == [["full", 2 * FULL_LAYERS, -1], ["swa", 2 * SWA_LAYERS, 64]]
        assert layout["transfer_mode"] == "lmcache_driven" and layout["shared_pools"]
    else:
        assert layout["components"] == ["FULL"]
        assert layout["groups"] == [["full", 2 * LLAMA_LAYERS, -1]]
        assert layout["transfer_mode"] == "auto"


def assert_on_disk(cache_dir: Path, hybrid: bool) -> None:
    """Each of A's and B's whole chunks is one file per object group holding K and V of the
    group's layers for the whole chunk (group 1, two sliding-window layers, twice the size of
    group 0), B's keyed and filed under its salt."""
    found: dict[tuple[int, str], list[int]] = {}
    namespaces: dict[str, set[str]] = {}
    for path in cache_dir.glob("ns/*/*/*.kv"):
        with open(path, "rb") as f:
            header = decode_header(f.read(HEADER_SIZE))
        key = parse_object_key_string(header.key)
        assert key is not None, header.key
        found.setdefault((key.object_group_id, key.cache_salt), []).append(header.payload_len)
        namespaces.setdefault(key.cache_salt, set()).add(path.parent.parent.name)
    layers = {0: FULL_LAYERS, 1: SWA_LAYERS} if hybrid else {0: LLAMA_LAYERS}
    assert found == {(group, salt): [2 * n * CHUNK * KV_WIDTH * BF16] * CHUNKS
                     for group, n in layers.items() for salt in ("", SALT)}
    assert len(namespaces[""]) == len(namespaces[SALT]) == 1
    assert namespaces[""] != namespaces[SALT]


def assert_loaded(report: dict[str, Any], groups: int) -> None:
    """A and B (``alice``) loaded in full from the files, every group byte for byte; the other
    salts missed; then, with 320 tokens of B in the radix tree, the rest of B's hit loaded."""
    window = 64 if groups > 1 else 0
    clean = {"full": 0, "swa": 0, "swa_tokens": window}
    for name in ("a", "b_alice"):
        assert report[name] == {"host_hit_length": CHUNKS * CHUNK, "radix": 0,
                                "loaded": CHUNKS * CHUNK, "mismatches": clean}, name
    assert report["probes"] == {"b_bob": 0, "b_none": 0, "a_alice": 0}
    # Full attention: both chunks; sliding window: only the last chunk's object (the
    # window of a 512-token hit lies in it).
    assert report["reads"] == 2 * (CHUNKS + groups - 1)
    assert report["b_partial"] == {"host_hit_length": CHUNKS * CHUNK - 320, "radix": 320,
                                   "loaded": CHUNKS * CHUNK - 320, "mismatches": clean,
                                   "radix_mismatches": clean}
    # The 320-token request loads its one whole chunk (every group), and B's lookup brings
    # both chunks' full-attention objects and the last one's sliding-window object back.
    assert report["partial_reads"] == groups + CHUNKS + groups - 1


@pytest.mark.parametrize(("model", "page_size"),
                         [("hybrid-swa", 1), ("hybrid-swa", 64), ("llama", 64)])
def test_sglang_unified_radix_cache_through_nvme_l2(model: str, page_size: int,
                                                    sglang_unified_python: Path,
                                                    models: dict[str, Path],
                                                    start_server: ServerFactory,
                                                    tmp_path: Path) -> None:
    hybrid = model == "hybrid-swa"
    groups = 2 if hybrid else 1
    objects = 2 * CHUNKS * groups  # A's and B's whole chunks, one object per group
    server_args = ("--separate-object-groups",) if hybrid else ()
    cache_dir = tmp_path / "nvme"

    def run(server: MPServer, phase: str) -> dict[str, Any]:
        report = run_sglang(sglang_unified_python, models[model], server, page_size, phase,
                            hybrid, tmp_path)
        assert_layout(report, hybrid)
        return report

    server = start_server(cache_dir, "server1", server_args=server_args)
    stored = run(server, "store")
    assert all(stored[name]["host_hit_length"] == 0 for name in ("a", "b_alice", "short"))
    status = server.wait_persisted(objects)
    assert status["entries"] == objects
    assert_on_disk(cache_dir, hybrid)

    server.clear_l1()
    assert_loaded(run(server, "load"), groups)
    assert server.status()["checksum_failures"] == 0
    server.stop()

    server = start_server(cache_dir, "server2", server_args=server_args)
    assert server.status()["recovered_entries"] == objects
    assert_loaded(run(server, "load"), groups)
    after = server.status()
    assert after["entries"] == objects and after["checksum_failures"] == 0
