"""Shared mode on a network filesystem: two processes acting as two nodes on one tree, one
writing while the other looks up, reads, evicts and restarts (docs/robustness.md, "Shared
mode on NFS").  ``nfs`` runs on an NFS export served on this machine over loopback and is
skipped, with the reason, where that cannot be set up; ``local`` runs the same on the local
disk: the reference for the figures the test prints."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.chunks import NS, read
from support.hostile import run_cli
from support.nfs import nfs_mount
from support.process import child_env, module_command
from support.shared_node import CHUNKS, SIZE, node_payload
from support.stores import StoreFactory

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


@pytest.fixture(params=["local", "nfs"])
def shared_dir(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Path]:
    if request.param == "local":
        yield tmp_path / "local"
        return
    with nfs_mount(tmp_path / "nfs") as mnt:
        yield mnt


def _node(role: str, cache: Path, marker: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(module_command("support.shared_node", role, cache, "--marker",
                                           marker), env=child_env(), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def test_two_nodes_share_one_tree(shared_dir: Path, tmp_path: Path,
                                  open_store: StoreFactory) -> None:
    cache = shared_dir / "cache"
    marker = tmp_path / "writer.done"
    reader = _node("reader", cache, marker)
    writer = _node("writer", cache, marker)
    results = {}
    for role, proc in (("writer", writer), ("reader", reader)):
        out, err = proc.communicate(timeout=240)
        assert proc.returncode == 0, f"{role} failed:\n{err[-3000:]}"
        results[role] = json.loads(out.strip().splitlines()[-1])
    w, r = results["writer"], results["reader"]
    assert w["written"] == CHUNKS
    assert r["wrong"] == 0 and r["served"] > 0 and r["finished"]
    # a node restarted after both finished serves every chunk left on disk, byte-exact
    store = open_store(cache, shared=True)
    left = 0
    for i in range(CHUNKS):
        key = f"node-{i}"
        if store.lookup(key, NS):
            assert read(store, key, SIZE) == node_payload(key)
            left += 1
    assert left == CHUNKS - r["removed"]
    store.close()
    status, out, err = run_cli("verify", cache)
    assert status == 0, out + err
    print(f"\n{shared_dir}: {CHUNKS} chunks of {SIZE} bytes written at {w['write_mb_s']:.0f} "
          f"MB/s; the other node served {r['served']} ({r['wrong']} wrong bytes), "
          f"{r['misses']} misses, evicted {r['removed']}, restarted {r['restarts']} times, "
          f"read {r['read_mb_s']:.0f} MB/s; {left} chunks served after a restart")
