"""``lmcache-nvme verify``: finds damaged files, quarantines on request, safe beside a store."""

from __future__ import annotations

import json
from pathlib import Path

from support.cli import (
    KEYS_PER_NAMESPACE,
    NAMESPACES,
    RunCLI,
    cache_keys,
    chunk_path,
    payload_for,
    read_chunk,
)
from support.stores import StoreFactory

from lmcache_nvme_backend.disk.format import HEADER_SIZE


def flip_payload_bit(path: Path) -> None:
    with open(path, "r+b") as f:
        f.seek(HEADER_SIZE + 100)
        byte = f.read(1)[0]
        f.seek(HEADER_SIZE + 100)
        f.write(bytes([byte ^ 0x01]))


def test_verify_passes_an_intact_cache(run_cli: RunCLI, cache_dir: Path) -> None:
    proc = run_cli("verify", cache_dir, "--json")
    assert proc.returncode == 0, proc.stderr
    (root,) = json.loads(proc.stdout)["roots"]
    assert root["ok"] == len(NAMESPACES) * KEYS_PER_NAMESPACE
    assert root["bad"] == []


def test_verify_reports_then_quarantines_damaged_files(run_cli: RunCLI, cache_dir: Path,
                                                       open_store: StoreFactory) -> None:
    (ns, flipped), (ns2, truncated) = cache_keys()[0], cache_keys()[-1]
    flip_payload_bit(chunk_path(cache_dir, ns, flipped))
    with open(chunk_path(cache_dir, ns2, truncated), "r+b") as f:
        f.truncate(HEADER_SIZE + 10)

    report = run_cli("verify", cache_dir)
    assert report.returncode == 1
    assert report.stdout.count("BAD ") == 2
    assert "payload checksum mismatch" in report.stdout
    assert chunk_path(cache_dir, ns, flipped).exists(), "verify without --quarantine moved a file"

    moved = run_cli("verify", cache_dir, "--quarantine")
    assert moved.returncode == 1
    assert not chunk_path(cache_dir, ns, flipped).exists()
    assert not chunk_path(cache_dir, ns2, truncated).exists()
    assert len(list((cache_dir / "quarantine").iterdir())) == 2

    again = run_cli("verify", cache_dir)
    assert again.returncode == 0, again.stdout
    store = open_store(cache_dir)
    try:
        assert not store.contains(flipped) and not store.contains(truncated)
        for _ns, key in cache_keys()[1:-1]:
            assert read_chunk(store, key) == payload_for(key)
    finally:
        store.close()


def test_quarantine_while_a_store_serves_the_directory(run_cli: RunCLI, cache_dir: Path,
                                                       open_store: StoreFactory) -> None:
    store = open_store(cache_dir)
    try:
        ns, key = cache_keys()[3]
        flip_payload_bit(chunk_path(cache_dir, ns, key))
        assert run_cli("verify", cache_dir, "--quarantine").returncode == 1
        assert read_chunk(store, key) is None
        for _ns, other in cache_keys():
            if other != key:
                assert read_chunk(store, other) == payload_for(other)
    finally:
        store.close()


def test_verify_rejects_a_missing_path(run_cli: RunCLI, tmp_path: Path) -> None:
    proc = run_cli("verify", tmp_path / "nowhere")
    assert proc.returncode == 1
    assert "nowhere" in proc.stderr and "is not a directory" in proc.stderr


def test_verify_rejects_zero_threads(run_cli: RunCLI, cache_dir: Path) -> None:
    proc = run_cli("verify", cache_dir, "--threads", "0")
    assert proc.returncode == 2
    assert "--threads" in proc.stderr and "at least 1" in proc.stderr
