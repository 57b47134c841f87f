"""``lmcache-nvme inspect``: counts and bytes per namespace, through the installed script."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.chunks import CHUNK as WRITTEN
from support.chunks import put
from support.cli import CHUNK, KEYS_PER_NAMESPACE, NAMESPACES, RunCLI, write_chunks
from support.stores import StoreFactory

from lmcache_nvme_backend.disk.format import file_size_for
from lmcache_nvme_backend.disk.layout import namespace_id
from lmcache_nvme_backend.store.shared.janitor import Janitor
from lmcache_nvme_backend.store.shared.ledger import Account, LedgerChain


def test_inspect_counts_every_namespace(run_cli: RunCLI, cache_dir: Path) -> None:
    proc = run_cli("inspect", cache_dir, "--json")
    assert proc.returncode == 0, proc.stderr
    (root,) = json.loads(proc.stdout)["roots"]
    per_file = file_size_for(CHUNK)
    assert root["files"] == len(NAMESPACES) * KEYS_PER_NAMESPACE
    assert root["bytes"] == root["files"] * per_file
    by_name = {ns["name"]: ns for ns in root["namespaces"]}
    assert set(by_name) == set(NAMESPACES)
    for ns in NAMESPACES:
        assert by_name[ns]["files"] == KEYS_PER_NAMESPACE
        assert by_name[ns]["bytes"] == KEYS_PER_NAMESPACE * per_file
    assert sum(b["files"] for b in root["age_histogram"]) == root["files"]


def test_inspect_text_names_the_namespaces(run_cli: RunCLI, cache_dir: Path) -> None:
    proc = run_cli("inspect", cache_dir)
    assert proc.returncode == 0, proc.stderr
    assert f"{len(NAMESPACES) * KEYS_PER_NAMESPACE} chunk files" in proc.stdout
    for ns in NAMESPACES:
        assert ns in proc.stdout
    assert "time since last access" in proc.stdout


def test_inspect_refuses_a_directory_that_is_not_a_cache(run_cli: RunCLI,
                                                          tmp_path: Path) -> None:
    proc = run_cli("inspect", tmp_path)
    assert proc.returncode == 1
    assert "not an LMCache NVMe cache root" in proc.stderr
    assert "nvme.path" in proc.stderr


def test_inspect_without_a_path_is_a_usage_error(run_cli: RunCLI) -> None:
    proc = run_cli("inspect")
    assert proc.returncode == 2
    assert "usage: lmcache-nvme inspect" in proc.stderr


def test_inspect_shows_a_shared_directorys_budget_and_members(
        run_cli: RunCLI, tmp_path: Path, open_store: StoreFactory,
        monkeypatch: pytest.MonkeyPatch) -> None:
    # The members' janitor would take the dead account over (and out of the ledger)
    # between the two inspections; inspect reads the ledger as it is, so hold it.
    monkeypatch.setattr(Janitor, "tick", lambda self, leases, now: None)
    cache = tmp_path / "shared"
    a = open_store(cache, shared=True, max_size_gb=0.01)
    b = open_store(cache, shared=True, max_size_gb=0.01)
    put(a, "k1")
    assert a.flush(30)
    dead = "vm-999997-deadbee1"  # an account whose process (on this host) is gone
    LedgerChain(cache, dead, 0o600, 0o700).update(
        lambda doc: doc.accounts.__setitem__(dead, Account(4096)) or True)
    proc = run_cli("inspect", cache, "--json")
    assert proc.returncode == 0, proc.stderr
    shared = json.loads(proc.stdout)["roots"][0]["shared"]
    assert shared["budget_bytes"] == int(0.01 * 2**30)
    states = {m["member"]: m for m in shared["members"]}
    (a_id,), (b_id,) = a.shared_members(), b.shared_members()
    assert states[a_id]["state"] == "live" and states[b_id]["state"] == "live"
    assert states[dead]["state"] == "dead (process gone)"
    assert states[a_id]["share_bytes"] >= file_size_for(WRITTEN)  # its chunk is in its share
    text = run_cli("inspect", cache).stdout
    assert "shared budget: 10.2 MiB for every member" in text and dead in text


def test_inspect_shows_each_namespaces_model_and_build(run_cli: RunCLI, cache_dir: Path,
                                                       open_store: StoreFactory) -> None:
    store = open_store(cache_dir)  # the fixture's two namespaces are bound to no build
    write_chunks(store, [("m@s1#abc123", "m@s1#abc123@0"), ("m#abd999", "m#abd999@0")])
    store.close()
    proc = run_cli("inspect", cache_dir, "--json")
    assert proc.returncode == 0, proc.stderr
    rows = {ns["name"]: ns for ns in json.loads(proc.stdout)["roots"][0]["namespaces"]}
    assert (rows["m@s1#abc123"]["model"], rows["m@s1#abc123"]["build"]) == ("m@s1", "abc123")
    assert (rows["m#abd999"]["model"], rows["m#abd999"]["build"]) == ("m", "abd999")
    assert (rows[NAMESPACES[0]]["model"], rows[NAMESPACES[0]]["build"]) == (NAMESPACES[0], None)
    lines = run_cli("inspect", cache_dir).stdout.splitlines()
    header = next(line.split() for line in lines if line.split()[:2] == ["model", "build"])
    assert header == ["model", "build", "id", "files", "bytes"]
    cells = {tuple(line.split()[:3]) for line in lines}
    assert ("m@s1", "abc123", namespace_id("m@s1#abc123")) in cells
    assert (NAMESPACES[0], "-", namespace_id(NAMESPACES[0])) in cells
