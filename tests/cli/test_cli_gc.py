"""``lmcache-nvme gc``: budgets, namespaces, temp files; safe while a store uses the tree."""

from __future__ import annotations

import json
import os
from pathlib import Path

from support.cli import (
    CHUNK,
    KEYS_PER_NAMESPACE,
    NAMESPACES,
    RunCLI,
    cache_keys,
    chunk_path,
    payload_for,
    read_chunk,
)
from support.stores import StoreFactory

from lmcache_nvme_backend.disk.format import file_size_for
from lmcache_nvme_backend.disk.layout import RootLayout


def test_budget_removes_least_recently_used_first(run_cli: RunCLI, cache_dir: Path) -> None:
    keep = 3
    budget_gb = keep * file_size_for(CHUNK) / 2**30
    proc = run_cli("gc", cache_dir, "--max-size-gb", f"{budget_gb:.12f}", "--json")
    assert proc.returncode == 0, proc.stderr
    (root,) = json.loads(proc.stdout)["roots"]
    assert root["budget"]["remaining_files"] == keep
    survivors = [key for ns, key in cache_keys() if chunk_path(cache_dir, ns, key).exists()]
    # the fixture wrote the keys in order, so the newest ones survive
    assert survivors == [key for _ns, key in cache_keys()[-keep:]]


def test_clear_namespace_while_a_store_serves(run_cli: RunCLI, cache_dir: Path,
                                             open_store: StoreFactory) -> None:
    store = open_store(cache_dir)
    try:
        proc = run_cli("gc", cache_dir, "--namespace", NAMESPACES[0])
        assert proc.returncode == 0, proc.stderr
        assert f"removed {KEYS_PER_NAMESPACE} chunk files" in proc.stdout
        for ns, key in cache_keys():
            got = read_chunk(store, key)
            assert got == (None if ns == NAMESPACES[0] else payload_for(key))
    finally:
        store.close()


def test_dry_run_deletes_nothing(run_cli: RunCLI, cache_dir: Path) -> None:
    proc = run_cli("gc", cache_dir, "--namespace", NAMESPACES[1], "--dry-run")
    assert proc.returncode == 0, proc.stderr
    assert "would remove 5 chunk files" in proc.stdout
    assert all(chunk_path(cache_dir, ns, key).exists() for ns, key in cache_keys())


def test_temp_files_of_dead_writers_are_removed(run_cli: RunCLI, cache_dir: Path) -> None:
    ns, key = cache_keys()[0]
    final = chunk_path(cache_dir, ns, key)
    layout = RootLayout(cache_dir)
    live = layout.temp_path(final)  # this process: alive
    live.write_bytes(b"x" * 10)
    dead = final.with_name(live.name.rsplit("-", 2)[0] + "-999999999-1")
    dead.write_bytes(b"y" * 10)
    proc = run_cli("gc", cache_dir, "--temp")
    assert proc.returncode == 0, proc.stderr
    assert live.exists() and not dead.exists()
    old = os.stat(live).st_mtime - 7200
    os.utime(live, (old, old))
    assert run_cli("gc", cache_dir, "--temp", "--temp-age-s", "3600").returncode == 0
    assert not live.exists()


def test_unknown_namespace_is_an_error_and_deletes_nothing(run_cli: RunCLI,
                                                           cache_dir: Path) -> None:
    proc = run_cli("gc", cache_dir, "--namespace", "no-such-model", "--max-size-gb", "0")
    assert proc.returncode == 1
    assert "no namespace 'no-such-model'" in proc.stderr
    assert all(chunk_path(cache_dir, ns, key).exists() for ns, key in cache_keys())


def test_gc_without_an_action_is_a_usage_error(run_cli: RunCLI, cache_dir: Path) -> None:
    proc = run_cli("gc", cache_dir)
    assert proc.returncode == 2
    assert "nothing to do" in proc.stderr


def test_negative_budget_is_a_usage_error(run_cli: RunCLI, cache_dir: Path) -> None:
    proc = run_cli("gc", cache_dir, "--max-size-gb", "-1")
    assert proc.returncode == 2
    assert "--max-size-gb" in proc.stderr
