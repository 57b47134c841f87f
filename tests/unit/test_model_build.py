"""``adapters/model_build.py``: which build of a model's weights a namespace is bound to."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from lmcache_nvme_backend.adapters import model_build
from lmcache_nvme_backend.adapters.model_build import (
    ModelBuilds,
    earlier_builds,
    fingerprint,
    weight_files,
    weights_dir,
)
from lmcache_nvme_backend.disk.layout import split_build

WEIGHTS = 3 * 1024 * 1024


def make_model(directory: Path, seed: int, size: int = WEIGHTS) -> Path:
    """A model directory: a config and two weight shards of ``size`` bytes each."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text('{"model_type": "llama"}')
    for shard in range(2):
        data = bytes((i * 7 + seed + shard) & 0xFF for i in range(256)) * (size // 256)
        (directory / f"model-0000{shard}.safetensors").write_bytes(data)
    return directory


def builds(setting: str, names: list[str] | None = None) -> ModelBuilds:
    return ModelBuilds(setting, lambda: names or [])


def test_a_local_model_directory_is_bound_to_a_digest_of_its_weights(tmp_path: Path) -> None:
    model = make_model(tmp_path / "llama", seed=1)
    bound = builds("auto").namespace(str(model))
    base, build = split_build(bound)
    assert base == str(model) and build == fingerprint(weight_files(model))
    assert [f.name for f in weight_files(model)] == ["model-00000.safetensors",
                                                     "model-00001.safetensors"]
    salted = builds("auto").namespaces([f"{model}@tenant", str(model)])
    assert salted == [f"{model}@tenant#{build}", bound]


def test_weights_changed_anywhere_give_another_build_with_the_same_sizes(
        tmp_path: Path) -> None:
    model = make_model(tmp_path / "m", seed=1)
    before = fingerprint(weight_files(model))
    shard = model / "model-00001.safetensors"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # a fine-tune: same shapes, other values
    shard.write_bytes(bytes(data))
    assert fingerprint(weight_files(model)) != before
    assert fingerprint(weight_files(make_model(tmp_path / "copy", seed=1))) == before


def test_a_hugging_face_id_is_found_in_the_local_cache(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    repo = tmp_path / "hub" / "models--org--name"
    make_model(repo / "snapshots" / "abc123", seed=2)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123\n")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    assert weights_dir("org/name") == repo / "snapshots" / "abc123"
    assert weights_dir("org/other") is None
    assert split_build(builds("auto").namespace("org/name"))[1] is not None


def test_lmcaches_dcp_layout_suffix_is_not_part_of_the_path(tmp_path: Path) -> None:
    model = make_model(tmp_path / "m", seed=3)
    assert weights_dir(f"{model}##lmcache-dcp-layout-v1-d2-interleave4") == model


def test_an_unknown_model_is_bound_to_its_name_and_the_log_says_what_to_set(
        package_log: pytest.LogCaptureFixture) -> None:
    with package_log.at_level(logging.WARNING, "lmcache_nvme_backend"):
        assert builds("auto").namespace("no-such-model") == "no-such-model"
    assert "Set nvme.model_build (adapter_params.model_build)" in package_log.text


@pytest.mark.parametrize(("setting", "expected"), [("off", "org/model"),
                                                   ("v7.1", "org/model#v7.1")])
def test_off_and_a_revision(setting: str, expected: str) -> None:
    assert builds(setting).namespaces(["org/model"]) == [expected]


def test_weights_replaced_while_running_get_the_new_build(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        package_log: pytest.LogCaptureFixture) -> None:
    model = make_model(tmp_path / "m", seed=1)
    builds_now = builds("auto")
    first = builds_now.namespace(str(model))
    make_model(model, seed=9)  # redeployed in place
    assert builds_now.namespace(str(model)) == first  # looked at again only after a while
    monkeypatch.setattr(model_build, "RECHECK_S", 0.0)
    builds_now._next_check = 0.0
    with package_log.at_level(logging.WARNING, "lmcache_nvme_backend"):
        second = builds_now.namespace(str(model))
    assert second != first and split_build(second)[0] == str(model)
    assert "changed" in package_log.text and "no longer served" in package_log.text


def test_earlier_builds_on_the_drive_are_named(tmp_path: Path,
                                               package_log: pytest.LogCaptureFixture) -> None:
    on_disk = ["org/m#aaaa", "org/m#bbbb", "org/m@salt#cccc", "org/other#dddd", "org/m"]
    assert earlier_builds("org/m#bbbb", on_disk) == ["aaaa"]
    with package_log.at_level(logging.WARNING, "lmcache_nvme_backend"):
        builds("rev2", on_disk).namespace("org/m")
    assert "earlier builds (aaaa, bbbb) are skipped" in package_log.text



def test_the_cache_is_listed_once_per_build_not_once_per_salt() -> None:
    """Every user's ``cache_salt`` is a namespace of its own: binding a new one must not
    read every NAMESPACE file of the cache again."""
    listed: list[int] = []
    model_builds = ModelBuilds("rev1", lambda: listed.append(1) or [])
    assert model_builds.namespaces([f"org/m@user{i}" for i in range(50)]) == \
        [f"org/m@user{i}#rev1" for i in range(50)]
    assert len(listed) == 1
