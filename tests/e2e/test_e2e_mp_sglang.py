"""End to end, SGLang's path: LMCache's own SGLang connector against a real ``lmcache
server`` whose L2 is NVMeL2Adapter, on CPU.

The SGLang side (``support.sglang_side``) makes the connector calls of SGLang's
``LMCRadixCache`` with KV pools in SGLang's layout and SGLang's page sizes (1, its default,
and 64), from the config file of examples/sglang-recipe.md with only the port changed; the
server is examples/mp-server.sh.  What a user would see:

1. Two prompts stored (one with SGLang 0.5.20's blocking ``store_kv``, one with
   ``store_kv_async``, whose pages are reused as soon as the future resolves) and a short
   one (under 256 tokens: never stored, LMCache #4007); L1 emptied; the first prompt loads
   back from the NVMe files, every byte of the KV pools as stored.
2. The server restarted on the same directory and a fresh SGLang side (empty pools, other
   pages): both prompts load from the files, every byte as stored (LMCache #4492 saw
   corrupted output after a restart with ``fs_native``).
3. A prompt sharing 300 tokens with a stored one hits only the shared chunk (256 tokens),
   byte for byte; storing it adds only its new chunk.  A request whose radix tree already
   holds 320 tokens loads only the rest of the hit, and the slots of the radix part are
   left as they were.
"""

from __future__ import annotations

import gc
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
import yaml
from support.mp_server import MPServer, ServerFactory, shm_segments
from support.paths import EXAMPLES_DIR
from support.sglang_side import KVPools, ModelShape, RadixSide, Request, prompt_kv
from support.sglang_workload import CHUNK, PROMPT_A, PROMPT_B, SHARED, SHORT

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

MODEL = "tiny-llama-sglang"
SHAPE = ModelShape()
POOL_TOKENS = 8192
SGLANG_CONFIG = EXAMPLES_DIR / "sglang-lmcache.yaml"
ConfigFor = Callable[[MPServer], Path]


@pytest.fixture
def config_for(tmp_path: Path) -> ConfigFor:
    """``config_for(server)``: the recipe's config file, pointed at ``server``."""
    def write(server: MPServer) -> Path:
        config = yaml.safe_load(SGLANG_CONFIG.read_text())
        config["mp_port"] = server.port
        path = tmp_path / f"sglang-lmcache-{server.port}.yaml"
        path.write_text(yaml.safe_dump(config))
        return path
    return write


@pytest.fixture
def sides() -> Iterator[list[RadixSide]]:
    """SGLang sides opened by a test (and not closed by it), closed at teardown."""
    opened: list[RadixSide] = []
    yield opened
    for side in opened:
        side.close()


def open_side(server: MPServer, config_for: ConfigFor, page_size: int, seed: int,
              opened: list[RadixSide]) -> RadixSide:
    side = RadixSide(config_for(server), KVPools(SHAPE, page_size, POOL_TOKENS, seed=seed),
                     MODEL)
    opened.append(side)
    return side


def prefill(side: RadixSide, req: Request) -> torch.Tensor:
    """The request's KV computed into fresh slots (what the model's forward pass writes)."""
    slots = side.pools.alloc(-(-len(req.tokens) // side.pools.page_size)
                             * side.pools.page_size)[: len(req.tokens)]
    side.pools.write(slots, prompt_kv(req.tokens, SHAPE))
    return slots


def load(side: RadixSide, req: Request) -> torch.Tensor:
    """``match_prefix`` then, on a hit, ``init_load_back``; the loaded slots."""
    assert side.match_prefix(req) > 0, f"{req.rid}: no hit"
    return side.init_load_back(req)


def assert_kv(side: RadixSide, slots: torch.Tensor, expected: torch.Tensor) -> None:
    got = side.pools.read(slots)
    assert got.shape == expected.shape
    same = (got.view(torch.int16) == expected.view(torch.int16))
    assert bool(same.all()), f"{int((~same).sum())} of {same.numel()} KV values differ"


@pytest.mark.parametrize("page_size", [1, 64])
def test_sglang_connector_through_nvme_l2(page_size: int, start_server: ServerFactory,
                                          config_for: ConfigFor, sides: list[RadixSide],
                                          tmp_path: Path) -> None:
    cache_dir = tmp_path / "nvme"
    segments_before = set(shm_segments(os.getpid()))
    server = start_server(cache_dir, "server1")
    side = open_side(server, config_for, page_size, seed=1, opened=sides)
    assert side.connector.chunk_size() == CHUNK

    # -- 1. store, empty L1, load from the NVMe files ------------------------------------
    a, b, short = Request("a", PROMPT_A), Request("b", PROMPT_B), Request("short", SHORT)
    for req in (a, b, short):
        assert side.match_prefix(req) == 0  # cold
    side.cache_finished_req(a, prefill(side, a))  # SGLang 0.5.20: waits for the store
    b_slots = prefill(side, b)
    future = side.cache_finished_req(b, b_slots, wait=False)
    assert side.finish_store(b, future) is True
    side.pools.write(b_slots, torch.randn(2, SHAPE.layers, len(b_slots), SHAPE.kv_heads,
                                          SHAPE.head_dim).to(torch.bfloat16))  # pages reused
    side.cache_finished_req(short, prefill(side, short))
    stored = server.wait_persisted(4)
    assert stored["entries"] == 4  # A and B: two whole chunks each; the short prompt: none
    assert len(list(cache_dir.glob("ns/**/*.kv"))) == 4
    server.clear_l1()

    a1 = Request("a-again", PROMPT_A)
    assert side.match_prefix(a1) == 2 * CHUNK
    assert_kv(side, side.init_load_back(a1), prompt_kv(PROMPT_A[: 2 * CHUNK], SHAPE))
    side.connector.end_session(a1.rid)
    assert server.status()["read_chunks"] - stored["read_chunks"] == 2  # from the files
    assert side.match_prefix(Request("short-again", SHORT)) == 0
    side.close()
    sides.remove(side)
    server.stop()

    # -- 2. restart: a new server on the same files, a fresh SGLang side ----------------
    server = start_server(cache_dir, "server2")
    status = server.status()
    assert status["recovered_entries"] == 4 and status["read_chunks"] == 0
    side = open_side(server, config_for, page_size, seed=2, opened=sides)
    for rid, prompt in (("a-restart", PROMPT_A), ("b-restart", PROMPT_B)):
        req = Request(rid, prompt)
        assert_kv(side, load(side, req), prompt_kv(prompt[: 2 * CHUNK], SHAPE))
        side.connector.end_session(rid)
    after = server.status()
    assert after["read_chunks"] == 4 and after["checksum_failures"] == 0

    # -- 3. partial hits ---------------------------------------------------------------
    shared = Request("shared", SHARED)
    assert side.match_prefix(shared) == CHUNK  # A's first chunk only
    assert_kv(side, side.init_load_back(shared), prompt_kv(SHARED[:CHUNK], SHAPE))
    side.connector.end_session(shared.rid)
    done = Request("shared-done", SHARED)
    side.cache_finished_req(done, prefill(side, done))
    assert server.wait_persisted(5)["entries"] == 5  # its second chunk is new

    # The radix tree holds B's first 320 tokens (in slots of its own, left untouched).
    radix_slots = prefill(side, Request("b-radix", PROMPT_B[:320]))
    radix_kv = side.pools.read(radix_slots)
    partial = Request("b-partial", PROMPT_B, radix_len=320)
    assert side.match_prefix(partial) == 2 * CHUNK - 320
    loaded = side.init_load_back(partial)
    assert_kv(side, loaded, prompt_kv(PROMPT_B[: 2 * CHUNK], SHAPE)[:, :, 320:])
    assert_kv(side, radix_slots, radix_kv)
    side.connector.end_session(partial.rid)
    assert server.status()["checksum_failures"] == 0

    # The pools moved to shared memory when they registered; closed and collected, they
    # are gone from /dev/shm.
    side.close()
    sides.remove(side)
    del side
    gc.collect()
    assert set(shm_segments(os.getpid())) <= segments_before, "KV pools left in /dev/shm"
