"""RootLayout: hash-derived paths that stay inside the root; directory walks that trust nothing."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest
import xxhash
from support.process import child_env, module_command

from lmcache_nvme_backend.disk.layout import (
    CHUNK_SUFFIX,
    LEGACY_SHARD_LEVELS,
    MARKER_NAME,
    SHARD_LEVELS,
    ChunkLocation,
    RootLayout,
    key_digest,
    marker_text,
    namespace_id,
    shard_levels_of,
    split_tree_path,
    this_host,
)
from lmcache_nvme_backend.store.index import IndexEntry

HOSTILE = [
    "../../../../etc/passwd",
    "/absolute/key",
    "..",
    ".",
    "",
    "a/b/../../..",
    "nul\x00byte",
    "x" * 10_000,
    "\u4e2d\u6587/\u00e9\u00e8/\U0001f600",
    "back\\slash\\..\\..",
    "\n\r\t",
    "~root",
]


@pytest.fixture(params=[SHARD_LEVELS, LEGACY_SHARD_LEVELS], ids=["one-level", "two-level"])
def layout(tmp_path: Path, request: pytest.FixtureRequest) -> RootLayout:
    """A root of this version's layout, and one of the layout roots made by 0.2 keep."""
    root = tmp_path / "root"
    root.mkdir()
    return RootLayout(root, request.param)


def shards(layout: RootLayout, digest: str) -> tuple[str, ...]:
    """The shard directory names a chunk's path has in ``layout``."""
    return (digest[0:2], digest[2:4])[:layout.shard_levels]


def touch(path: Path, data: bytes = b"x") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def place(layout: RootLayout, key: str, ns: str = "model") -> Path:
    return touch(layout.chunk_path(namespace_id(ns), key_digest(key)))


# -- digests ----------------------------------------------------------------------------------


def test_key_digest_is_xxh3_128_hex() -> None:
    key = "model@1@0@abcdef@bfloat16"
    d = key_digest(key)
    assert re.fullmatch(r"[0-9a-f]{32}", d)
    assert d == xxhash.xxh3_128_hexdigest(key.encode()) == key_digest(key)
    assert key_digest(key + "x") != d


@pytest.mark.parametrize("key", HOSTILE)
def test_key_digest_shape_for_hostile_keys(key: str) -> None:
    assert re.fullmatch(r"[0-9a-f]{32}", key_digest(key))


def test_key_digest_stable_across_processes() -> None:
    keys = ["a", "model@1@0@ff@bf16", "\u00e9"]
    # the child prints key_digest(k) + namespace_id(k) of each key (support/store_child.py)
    env = child_env(PYTHONHASHSEED="12345")
    out = subprocess.run(module_command("support.store_child", "digests", *keys), env=env,
                         check=True, capture_output=True, text=True).stdout.split()
    assert out == [key_digest(k) + namespace_id(k) for k in keys]


def test_namespace_id_is_xxh3_64_hex() -> None:
    n = namespace_id("meta-llama/Llama-3-8B")
    assert re.fullmatch(r"[0-9a-f]{16}", n)
    assert n == xxhash.xxh3_64_hexdigest(b"meta-llama/Llama-3-8B")


# -- paths ------------------------------------------------------------------------------------


@pytest.mark.parametrize("key", HOSTILE)
@pytest.mark.parametrize("ns", ["model", "../..", "/", "a\x00b", "\u00e9/.."])
def test_chunk_path_stays_inside_root(layout: RootLayout, key: str, ns: str) -> None:
    path = layout.chunk_path(namespace_id(ns), key_digest(key))
    root = layout.root.resolve()
    resolved = path.resolve()
    assert resolved.is_relative_to(root)
    rel = resolved.relative_to(root).parts
    d = key_digest(key)
    assert rel == ("ns", namespace_id(ns), *shards(layout, d), d + CHUNK_SUFFIX)


def test_chunk_path_can_be_created_for_hostile_keys(layout: RootLayout) -> None:
    paths = {place(layout, key) for key in HOSTILE}
    assert len(paths) == len(HOSTILE)
    assert all(p.is_file() and p.resolve().is_relative_to(layout.root.resolve()) for p in paths)


def test_named_directories(layout: RootLayout) -> None:
    assert layout.index_dir == layout.root / "index"
    assert layout.quarantine_dir == layout.root / "quarantine"
    assert layout.namespace_name_file("0" * 16) == layout.root / "ns" / ("0" * 16) / "NAMESPACE"


def test_temp_path_sits_beside_final_and_names_its_writer(layout: RootLayout) -> None:
    final = layout.chunk_path(namespace_id("m"), key_digest("k"))
    tmp = layout.temp_path(final)
    assert tmp.parent == final.parent
    assert tmp.name.startswith(final.name + ".tmp-")
    assert f"-{os.getpid()}-" in tmp.name
    assert this_host() in tmp.name
    assert "-" not in this_host() and "." not in this_host()


def test_chunk_rels_are_each_chunk_rel(layout: RootLayout) -> None:
    ns_id, digest = namespace_id("m"), key_digest("k")
    assert layout.chunk_rel(ns_id, digest).startswith(layout.shard_rel(ns_id, digest) + "/")
    entries = [IndexEntry(digest, ns_id, 0, 1, None),
               IndexEntry(key_digest("j"), namespace_id("n"), 0, 1, None)]
    assert layout.chunk_rels(entries) == (layout.chunk_rel(ns_id, digest),
                                          layout.chunk_rel(namespace_id("n"), key_digest("j")))


# -- walking ----------------------------------------------------------------------------------


def test_iter_chunks_finds_well_named_files(layout: RootLayout) -> None:
    keys = [f"k{i}" for i in range(20)] + HOSTILE
    placed = {place(layout, k) for k in keys}
    found = list(layout.iter_chunks())
    assert {loc.path for loc in found} == placed
    for loc in found:
        assert isinstance(loc, ChunkLocation)
        assert loc.namespace_id == namespace_id("model")
        assert loc.path.name == loc.digest + CHUNK_SUFFIX


def test_iter_chunks_by_namespace(layout: RootLayout) -> None:
    a = place(layout, "k", ns="a")
    b = place(layout, "k", ns="b")
    assert [loc.path for loc in layout.iter_chunks(namespace_id("a"))] == [a]
    assert [loc.path for loc in layout.iter_chunks(namespace_id("b"))] == [b]
    assert sorted(layout.iter_namespace_ids()) == sorted([namespace_id("a"), namespace_id("b")])
    assert list(layout.iter_chunks("f" * 16)) == []


def test_iter_chunks_on_missing_or_empty_root(tmp_path: Path) -> None:
    assert list(RootLayout(tmp_path / "absent").iter_chunks()) == []
    assert list(RootLayout(tmp_path).iter_chunks()) == []
    touch(tmp_path / "ns")  # "ns" is a file, not a directory
    assert list(RootLayout(tmp_path).iter_chunks()) == []


def test_iter_chunks_ignores_foreign_names(layout: RootLayout) -> None:
    good = place(layout, "good")
    ns = namespace_id("model")
    d = key_digest("other")
    shard = layout.chunk_path(ns, d).parent
    wrong = key_digest("elsewhere")
    for name in [
        "README", d, d + ".kv.bak", d.upper() + ".kv", d[:31] + ".kv", d + "0.kv",
        wrong + ".kv",  # a valid digest, but not one of this shard
        ".kv", d + ".KV", " " + d + ".kv",
    ]:
        touch(shard / name)
    touch(layout.root / "ns" / ns / "NAMESPACE")
    touch(layout.root / "ns" / ns / "zz" / d[2:4] / (d + ".kv"))  # non-hex shard
    touch(layout.root / "ns" / ns / d[0:2] / "abc" / (d + ".kv"))  # 3-char shard
    touch(layout.root / "ns" / "not-a-namespace" / d[0:2] / d[2:4] / (d + ".kv"))
    touch(layout.root / "ns" / ns.upper() / d[0:2] / d[2:4] / (d + ".kv"))
    touch(layout.root / (d + ".kv"))
    (shard / (key_digest("dir") + ".kv")).mkdir()  # a directory with a chunk name
    assert [loc.path for loc in layout.iter_chunks()] == [good]


def test_iter_chunks_never_follows_symlinks(layout: RootLayout, tmp_path: Path) -> None:
    good = place(layout, "good")
    outside = tmp_path / "outside"
    ns = namespace_id("model")
    d = key_digest("linked")
    # A correctly named symlink to a file outside the root.
    real = touch(outside / "file.kv")
    link = layout.chunk_path(ns, d)
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(real)
    # Symlinked shard directories and a symlinked namespace directory, each holding a
    # well-named chunk file outside the root.
    e = key_digest("via-shard")
    touch(outside / "s2" / (e + ".kv"))
    (layout.root / "ns" / ns / e[0:2]).mkdir(parents=True, exist_ok=True)
    (layout.root / "ns" / ns / e[0:2] / e[2:4]).symlink_to(outside / "s2")
    f = key_digest("via-shard1")
    touch(outside / "s1" / f[2:4] / (f + ".kv"))
    if not (layout.root / "ns" / ns / f[0:2]).exists():
        (layout.root / "ns" / ns / f[0:2]).symlink_to(outside / "s1")
    g = key_digest("via-ns")
    other_ns = namespace_id("other")
    touch(outside / "ns" / g[0:2] / g[2:4] / (g + ".kv"))
    (layout.root / "ns" / other_ns).symlink_to(outside / "ns")

    assert [loc.path for loc in layout.iter_chunks()] == [good]
    assert other_ns not in set(layout.iter_namespace_ids())
    assert list(layout.iter_temp_files()) == []


def test_iter_chunks_with_namespace_never_follows_symlinked_namespace(
        layout: RootLayout, tmp_path: Path) -> None:
    g = key_digest("via-ns")
    touch(tmp_path / "outside" / g[0:2] / g[2:4] / (g + ".kv"))
    other_ns = namespace_id("other")
    (layout.root / "ns").mkdir()
    (layout.root / "ns" / other_ns).symlink_to(tmp_path / "outside")
    assert list(layout.iter_chunks(other_ns)) == []


def test_iter_chunks_ignores_temp_files(layout: RootLayout) -> None:
    good = place(layout, "good")
    final = layout.chunk_path(namespace_id("model"), key_digest("in-flight"))
    touch(layout.temp_path(final))
    touch(layout.temp_path(good))
    assert [loc.path for loc in layout.iter_chunks()] == [good]


def test_iter_temp_files_parses_writer(layout: RootLayout) -> None:
    ns = namespace_id("model")
    own = touch(layout.temp_path(layout.chunk_path(ns, key_digest("a"))))
    d = key_digest("b")
    shard = layout.chunk_path(ns, d).parent
    foreign = touch(shard / f"{d}.kv.tmp-otherhost-4242-139900")
    garbled = touch(shard / f"{d}.kv.tmp-weird")
    nonnumeric = touch(shard / f"{d}.kv.tmp-h-pid-1")
    place(layout, "final")
    got = {t.path: (t.host, t.pid) for t in layout.iter_temp_files()}
    assert got == {
        own: (this_host(), os.getpid()),
        foreign: ("otherhost", 4242),
        garbled: ("weird", -1),
        nonnumeric: ("h", -1),
    }


def test_scan_finds_what_both_walks_find_listing_each_directory_once(
        layout: RootLayout, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A restart walks the tree once for chunks and writers' temp files together."""
    from lmcache_nvme_backend.disk import layout as layout_module

    ns = namespace_id("model")
    chunks = {place(layout, f"k{i}") for i in range(40)} | {place(layout, "x", ns="other")}
    temps = {touch(layout.temp_path(layout.chunk_path(ns, key_digest(f"t{i}"))))
             for i in range(5)}
    touch(layout.chunk_path(ns, key_digest("k1")).parent / "README")  # neither
    (tmp_path / "outside.kv").write_bytes(b"x")
    layout.chunk_path(ns, key_digest("link")).parent.mkdir(parents=True, exist_ok=True)
    layout.chunk_path(ns, key_digest("link")).symlink_to(tmp_path / "outside.kv")
    listed: list[str] = []
    real = layout_module.scandir_beneath

    def counting(root: Path, rel: str) -> object:
        listed.append(rel)
        return real(root, rel)

    monkeypatch.setattr(layout_module, "scandir_beneath", counting)
    found, temp_files = layout.scan()
    assert {loc.path for loc in found} == chunks
    assert {t.path for t in temp_files} == temps
    assert len(listed) == len(set(listed))  # every directory listed once
    once = len(listed)
    assert sorted((loc.digest, loc.namespace_id, loc.stat.st_ino) for loc in found) == \
        sorted((loc.digest, loc.namespace_id, loc.stat.st_ino) for loc in layout.iter_chunks())
    assert {t.path: (t.host, t.pid) for t in temp_files} == \
        {t.path: (t.host, t.pid) for t in layout.iter_temp_files()}
    assert len(listed) == 3 * once  # the two walks list everything again, each


def test_iter_temp_files_ignores_temp_names_outside_shards(layout: RootLayout) -> None:
    touch(layout.root / "x.kv.tmp-host-1-2")
    touch(layout.root / "ns" / namespace_id("m") / "x.kv.tmp-host-1-2")
    assert list(layout.iter_temp_files()) == []


def test_tree_directories_are_walked_parents_first_without_links(layout: RootLayout) -> None:
    root, ns = layout.root, namespace_id("model")
    (root / "ns" / ns / "ab" / "cd").mkdir(parents=True)  # a shard (two levels), else foreign
    (root / "ns" / ns / "ab" / "zz").mkdir()  # not a shard name
    (root / "ns" / ns / "ef").symlink_to(root / "ns" / ns / "ab")  # never followed
    (root / "ns" / "not-a-namespace").mkdir()
    assert list(layout.iter_tree_dirs()) == \
        [f"ns/{ns}", f"ns/{ns}/ab", f"ns/{ns}/ab/cd"][:2 + layout.shard_levels - 1]


# -- which layout a root has -----------------------------------------------------------------


def test_a_new_root_has_one_shard_level_and_its_marker_says_so(tmp_path: Path) -> None:
    assert shard_levels_of(tmp_path / "absent") == shard_levels_of(tmp_path) == SHARD_LEVELS == 1
    (tmp_path / MARKER_NAME).write_bytes(marker_text(SHARD_LEVELS))
    (tmp_path / "ns" / namespace_id("m") / "ab" / "cd").mkdir(parents=True)  # the marker rules
    assert RootLayout.of(tmp_path).shard_levels == 1
    (tmp_path / MARKER_NAME).write_bytes(marker_text(LEGACY_SHARD_LEVELS))
    assert RootLayout.of(tmp_path).shard_levels == 2


def test_a_marker_from_before_shard_levels_means_two_levels(tmp_path: Path) -> None:
    (tmp_path / MARKER_NAME).write_bytes(b"lmcache-nvme-backend cache root, chunk format 1\n")
    layout = RootLayout.of(tmp_path)
    assert layout.shard_levels == LEGACY_SHARD_LEVELS
    d = key_digest("k")
    assert layout.chunk_rel("0" * 16, d) == f"ns/{'0' * 16}/{d[0:2]}/{d[2:4]}/{d}.kv"


@pytest.mark.parametrize("value", ["3", "0", "two", "1x"])
def test_a_marker_naming_an_unknown_layout_is_refused_by_name(tmp_path: Path, value: str) -> None:
    text = marker_text(SHARD_LEVELS).replace(b"levels 1", f"levels {value}".encode())
    (tmp_path / MARKER_NAME).write_bytes(text)
    with pytest.raises(ValueError, match=rf"{MARKER_NAME} says shard_levels {value}.*Upgrade"):
        RootLayout.of(tmp_path)


@pytest.mark.parametrize("levels", [SHARD_LEVELS, LEGACY_SHARD_LEVELS])
def test_a_tree_without_marker_is_read_by_where_its_files_sit(tmp_path: Path, levels: int) -> None:
    (tmp_path / "ns" / namespace_id("m")).mkdir(parents=True)
    (tmp_path / "ns" / namespace_id("m") / "zz").mkdir()  # foreign: says nothing
    assert shard_levels_of(tmp_path) == SHARD_LEVELS  # nothing stored yet
    place(RootLayout(tmp_path, levels), "k", ns="m")
    assert shard_levels_of(tmp_path) == levels


def test_a_marker_that_is_a_link_is_not_followed(tmp_path: Path) -> None:
    (tmp_path / "elsewhere").write_bytes(marker_text(LEGACY_SHARD_LEVELS))
    (tmp_path / MARKER_NAME).symlink_to(tmp_path / "elsewhere")
    assert shard_levels_of(tmp_path) == SHARD_LEVELS  # the tree decides: it holds nothing


def test_tree_paths_split_at_the_root_in_either_layout(tmp_path: Path) -> None:
    d, ns = key_digest("k"), namespace_id("m")
    for levels in (SHARD_LEVELS, LEGACY_SHARD_LEVELS):
        layout = RootLayout(tmp_path / "root", levels)
        rel = layout.chunk_rel(ns, d)
        assert split_tree_path(layout.chunk_path(ns, d)) == (str(tmp_path / "root"), rel)
        temp = layout.temp_path(layout.chunk_path(ns, d))
        assert split_tree_path(temp) == (str(tmp_path / "root"), layout.relative(temp))
    for other in (f"/r/ns/{ns}/{d}.kv", f"/r/ns/{ns}/a/{d}.kv", f"/r/ns/{ns}/ab/cd/ef/{d}.kv",
                  f"/r/ns/{ns[:-1]}/ab/{d}.kv", f"/r/index/{ns}/ab/{d}.kv", f"ns/{ns}/ab/{d}.kv"):
        assert split_tree_path(other) is None, other
