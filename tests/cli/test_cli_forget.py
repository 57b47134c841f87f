"""``lmcache-nvme forget``: one build of a model (every salt), or namespaces by name or id,
renamed away and deleted; never through a link planted in the tree."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
from support.cli import CHUNK, NAMESPACES, RunCLI, chunk_path, write_chunks
from support.stores import StoreFactory

from lmcache_nvme_backend.disk.format import file_size_for
from lmcache_nvme_backend.disk.layout import (
    FORGOTTEN_KEEP_S,
    FORGOTTEN_PREFIX,
    RootLayout,
    key_digest,
    namespace_id,
    this_host,
)

# one model in two builds (one of them under a salt too), and a namespace bound to no build
BUILDS = ("m#abc123", "m@s1#abc123", "m#abd999", "other")
KEYS = 3
FILE = file_size_for(CHUNK)


def items(ns: str) -> list[tuple[str, str]]:
    return [(ns, f"{ns}@{i}") for i in range(KEYS)]


@pytest.fixture
def builds_dir(cache_dir: Path, open_store: StoreFactory) -> Path:
    """The ``cache_dir`` of tests/cli (``NAMESPACES``, bound to no build) and ``BUILDS``."""
    store = open_store(cache_dir)
    write_chunks(store, [item for ns in BUILDS for item in items(ns)])
    store.close()
    return cache_dir


def present(root: Path, ns: str) -> bool:
    """Whether the namespace's directory and every chunk file of it are there."""
    return (root / "ns" / namespace_id(ns)).is_dir() and \
        all(chunk_path(root, n, key).exists() for n, key in items(ns))


def left_in_ns(root: Path) -> list[str]:
    """The namespace directories; the renamed ones must be there and empty (kept a minute
    so that their inodes are not reused)."""
    names = sorted(os.listdir(root / "ns"))
    renamed = [n for n in names if n.startswith(FORGOTTEN_PREFIX)]
    assert not [f for n in renamed for f in os.listdir(root / "ns" / n)]
    return [n for n in names if n not in renamed]


def ids(*namespaces: str) -> list[str]:
    """The directories of ``namespaces`` and of the fixture's ``NAMESPACES``, sorted."""
    return sorted(namespace_id(ns) for ns in (*namespaces, *NAMESPACES))


def test_forget_drops_one_build_of_every_salt(run_cli: RunCLI, builds_dir: Path) -> None:
    proc = run_cli("forget", builds_dir, "--model", "m", "--build", "abc123", "--json")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert sorted(n["name"] for n in doc["namespaces"]) == ["m#abc123", "m@s1#abc123"]
    (root,) = doc["roots"]
    by_name = {n["name"]: n for n in root["namespaces"]}
    assert by_name["m@s1#abc123"]["model"] == "m@s1"
    assert by_name["m@s1#abc123"]["build"] == "abc123"
    for ns in ("m#abc123", "m@s1#abc123"):
        assert by_name[ns]["chunks"] == KEYS and by_name[ns]["bytes"] == KEYS * FILE
        assert by_name[ns]["complete"] and not present(builds_dir, ns)
    assert doc["total"] == {"chunks": 2 * KEYS, "bytes": 2 * KEYS * FILE}
    assert present(builds_dir, "m#abd999") and present(builds_dir, "other")
    # what was renamed is emptied
    assert left_in_ns(builds_dir) == ids("m#abd999", "other")


def test_a_unique_prefix_names_the_build(run_cli: RunCLI, builds_dir: Path) -> None:
    proc = run_cli("forget", builds_dir, "--model", "m", "--build", "abd")
    assert proc.returncode == 0, proc.stderr
    assert f"dropped m#abd999 ({namespace_id('m#abd999')}): {KEYS} chunk files" in proc.stdout
    assert not present(builds_dir, "m#abd999")
    assert all(present(builds_dir, ns) for ns in ("m#abc123", "m@s1#abc123", "other"))


def test_an_ambiguous_or_unknown_build_is_an_error(run_cli: RunCLI, builds_dir: Path) -> None:
    proc = run_cli("forget", builds_dir, "--model", "m", "--build", "ab")
    assert proc.returncode == 1
    assert "build 'ab' of model 'm' is ambiguous" in proc.stderr
    assert "abc123 (m, m@s1); abd999 (m)" in proc.stderr
    proc = run_cli("forget", builds_dir, "--model", "m", "--build", "zz")
    assert proc.returncode == 1
    assert "model 'm' has no build 'zz'" in proc.stderr and "abd999" in proc.stderr
    proc = run_cli("forget", builds_dir, "--model", "nope", "--build", "abc123")
    assert proc.returncode == 1
    assert "no namespace of model 'nope'" in proc.stderr
    assert "models here: m, model-a, model-b, other" in proc.stderr
    assert all(present(builds_dir, ns) for ns in BUILDS)


def test_forget_without_a_build_refuses(run_cli: RunCLI, builds_dir: Path) -> None:
    proc = run_cli("forget", builds_dir, "--model", "m")
    assert proc.returncode == 2
    assert "give --build" in proc.stderr and "abc123 (m, m@s1); abd999 (m)" in proc.stderr
    assert all(present(builds_dir, ns) for ns in BUILDS)
    assert run_cli("forget", builds_dir, "--build", "abc123").returncode == 2
    assert run_cli("forget", builds_dir, "--model", "m", "--namespace", "other",
                   "--build", "abc123").returncode == 2


def test_dry_run_changes_nothing(run_cli: RunCLI, builds_dir: Path) -> None:
    proc = run_cli("forget", builds_dir, "--model", "m", "--build", "abc", "--dry-run")
    assert proc.returncode == 0, proc.stderr
    assert "(dry run)" in proc.stdout
    assert f"would drop m@s1#abc123 ({namespace_id('m@s1#abc123')}): {KEYS} chunk files" \
        in proc.stdout
    assert all(present(builds_dir, ns) for ns in BUILDS)
    assert left_in_ns(builds_dir) == ids(*BUILDS)


def test_forget_by_namespace_name_or_id(run_cli: RunCLI, builds_dir: Path) -> None:
    proc = run_cli("forget", builds_dir, "--namespace", "other",
                   "--namespace", namespace_id("m#abd999"), "--json")
    assert proc.returncode == 0, proc.stderr
    (root,) = json.loads(proc.stdout)["roots"]
    assert {(n["name"], n["build"], n["chunks"]) for n in root["namespaces"]} == {
        ("other", None, KEYS), ("m#abd999", "abd999", KEYS)}
    assert not present(builds_dir, "other") and not present(builds_dir, "m#abd999")
    assert present(builds_dir, "m#abc123")
    proc = run_cli("forget", builds_dir, "--namespace", "no-such-model")
    assert proc.returncode == 1 and "no namespace 'no-such-model'" in proc.stderr
    proc = run_cli("forget", builds_dir, "--model", NAMESPACES[0], "--build", "-")
    assert proc.returncode == 0, proc.stderr  # '-': the namespace bound to no build
    assert not (builds_dir / "ns" / namespace_id(NAMESPACES[0])).exists()


def test_a_link_planted_in_the_namespace_is_not_followed(run_cli: RunCLI, builds_dir: Path,
                                                         tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_bytes(b"x" * 100)
    precious = outside / "precious.kv"
    precious.write_bytes(b"y" * 100)
    ns = "m#abd999"
    ns_dir = builds_dir / "ns" / namespace_id(ns)
    (ns_dir / "zz").symlink_to(outside)  # a directory link beside the shard directories
    digest = key_digest("planted")
    shard = RootLayout.of(builds_dir).chunk_path(namespace_id(ns), digest).parent
    shard.mkdir(exist_ok=True)
    (shard / f"{digest}.kv").symlink_to(precious)  # a link at a chunk file's name
    proc = run_cli("forget", builds_dir, "--model", "m", "--build", "abd999", "--json")
    assert proc.returncode == 0, proc.stderr
    (dropped,) = json.loads(proc.stdout)["roots"][0]["namespaces"]
    assert dropped["chunks"] == KEYS and dropped["bytes"] == KEYS * FILE  # links not counted
    assert not os.path.lexists(ns_dir)
    assert namespace_id(ns) not in left_in_ns(builds_dir)  # and the renamed one is empty
    assert (outside / "keep.txt").read_bytes() == b"x" * 100
    assert precious.read_bytes() == b"y" * 100


def test_what_earlier_forgets_left_is_removed_a_minute_on(run_cli: RunCLI,
                                                          builds_dir: Path) -> None:
    ns_dir = builds_dir / "ns"
    dead = ns_dir / f"{FORGOTTEN_PREFIX}{namespace_id('gone')}-{this_host()}-999999999-1"
    (dead / "ab").mkdir(parents=True)  # a forget that died midway
    (dead / "ab" / f"{key_digest('gone')}.kv").write_bytes(b"z" * FILE)
    (dead / "ab" / "NAMESPACE").write_bytes(b"gone\n")
    long_ago = time.time() - 2 * FORGOTTEN_KEEP_S
    os.utime(dead, (long_ago, long_ago))
    proc = run_cli("forget", builds_dir, "--namespace", "other")
    assert proc.returncode == 0, proc.stderr
    assert f"finished an earlier forget: 1 chunk files ({FILE / 1024:.1f} KiB)" in proc.stdout
    assert not dead.exists()
    (kept,) = [n for n in os.listdir(ns_dir) if n.startswith(FORGOTTEN_PREFIX)]
    assert run_cli("forget", builds_dir, "--namespace", "model-a").returncode == 0
    assert (ns_dir / kept).is_dir()  # emptied less than a minute ago: kept
    os.utime(ns_dir / kept, (long_ago, long_ago))
    assert run_cli("forget", builds_dir, "--namespace", "model-b").returncode == 0
    assert not (ns_dir / kept).exists()
