"""NVMeSettings: defaults, path forms, and errors that name the offending key.

Validating creates and writes nothing: the store creates and probes its directories when
it opens them (``tests/store/test_roots.py``), and the errors found there name the setting
as these do.
"""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from lmcache_nvme_backend.config import (
    GIB,
    IO_DEADLINE_AUTO_S,
    MIB,
    NVMeConfigError,
    NVMeSettings,
    io_deadline_for,
    min_free_bytes_for,
)
from lmcache_nvme_backend.disk.mounts import is_network_filesystem
from lmcache_nvme_backend.store.roots import Roots


@pytest.fixture
def extra(cache_dir: Path) -> dict[str, Any]:
    """A minimal valid extra_config, to be extended or broken per test."""
    return {"nvme.path": str(cache_dir), "nvme.max_size_gb": 10}


@pytest.fixture
def params(cache_dir: Path) -> dict[str, Any]:
    """A minimal valid adapter_params mapping (bare names)."""
    return {"path": str(cache_dir), "max_size_gb": 10}


def config_error(extra_config: dict[str, Any]) -> str:
    with pytest.raises(NVMeConfigError) as info:
        NVMeSettings.from_extra_config(extra_config)
    return str(info.value)


def start_error(settings: NVMeSettings) -> str:
    """The error of a setting that validates but is refused when the store opens its
    directories at start (before it serves anything)."""
    with pytest.raises(NVMeConfigError) as info:
        Roots.open(settings.paths, settings.direct_io, settings.file_mode, settings.min_free_gb,
                   settings.shared, settings.key_prefix)
    return str(info.value)


# -- accepted values --------------------------------------------------------------------------


def test_defaults(extra: dict[str, Any], cache_dir: Path) -> None:
    s = NVMeSettings.from_extra_config(extra)
    assert s.paths == (cache_dir,)
    assert not cache_dir.exists()  # validation creates nothing; the store does, at start
    assert s.max_size_gb == 10.0
    assert s.max_size_bytes == 10 * GIB
    # "auto": 5% of each path's filesystem, at most 1 GiB
    assert s.min_free_gb is None
    assert min_free_bytes_for(s.min_free_gb, 1000 * GIB) == GIB
    assert min_free_bytes_for(s.min_free_gb, 8 * 2**20) == 8 * 2**20 // 20
    assert s.direct_io == "auto"
    assert (s.io_threads, s.write_threads) == (8, 0)
    assert isinstance(s.io_threads, int)
    assert s.task_size_bytes == 64 * MIB  # one I/O per chunk up to 64 MiB
    assert s.write_queue_bytes == 1024 * MIB
    assert s.queue_full_policy == "drop"
    assert s.fsync == "none"
    assert s.file_mode == 0o600
    assert (s.manifest_interval_s, s.close_timeout_s) == (60.0, 30.0)
    # "auto": a deadline on network filesystems, none on local ones
    assert s.io_deadline_s is None
    assert io_deadline_for(s.io_deadline_s, True) == IO_DEADLINE_AUTO_S == 5.0
    assert io_deadline_for(s.io_deadline_s, False) == 0.0


def test_foreign_extra_config_keys_are_ignored(extra: dict[str, Any], cache_dir: Path) -> None:
    extra.update({"storage_plugin.nvme.module_path": "x", "other.max_size_gib": 1, "nvmepath": 2})
    assert NVMeSettings.from_extra_config(extra).paths == (cache_dir,)


def test_every_setting_can_be_given(extra: dict[str, Any]) -> None:
    extra.update({
        "nvme.min_free_gb": 0, "nvme.direct_io": " OFF ", "nvme.io_threads": "4",
        "nvme.write_threads": 3.0, "nvme.task_size_mb": 0.5, "nvme.write_queue_mb": "64",
        "nvme.queue_full_policy": "Wait", "nvme.fsync": "full", "nvme.file_mode": "0640",
        "nvme.manifest_interval_s": 0, "nvme.close_timeout_s": "1.5",
        "nvme.io_deadline_s": "0.25",
    })
    s = NVMeSettings.from_extra_config(extra)
    assert s.min_free_gb == 0
    assert s.direct_io == "off"
    assert (s.io_threads, s.write_threads) == (4, 3)
    assert isinstance(s.io_threads, int) and isinstance(s.write_threads, int)
    assert s.task_size_bytes == 512 * 1024
    assert s.write_queue_bytes == 64 * MIB
    assert (s.queue_full_policy, s.fsync) == ("wait", "full")
    assert s.file_mode == 0o640
    assert (s.manifest_interval_s, s.close_timeout_s) == (0.0, 1.5)
    assert s.io_deadline_s == 0.25


@pytest.mark.parametrize(("raw", "local", "network"),
                         [("auto", 0.0, 5.0), (" AUTO ", 0.0, 5.0), (None, 0.0, 5.0),
                          (0, 0.0, 0.0), ("0", 0.0, 0.0), (0.25, 0.25, 0.25),
                          ("600", 600.0, 600.0)])
def test_io_deadline_is_auto_or_a_number_for_every_path(
        extra: dict[str, Any], raw: Any, local: float, network: float) -> None:
    """``auto`` (the default): a deadline on a network filesystem's paths only; a number:
    that deadline on every path (0: none anywhere)."""
    s = NVMeSettings.from_extra_config({**extra, "nvme.io_deadline_s": raw})
    assert io_deadline_for(s.io_deadline_s, False) == local
    assert io_deadline_for(s.io_deadline_s, True) == network


@pytest.mark.parametrize(("fstype", "network"),
                         [("nfs", True), ("nfs4", True), ("fuse.glusterfs", True),
                          ("glusterfs", True), ("cifs", True), ("smb3", True), ("ceph", True),
                          ("lustre", True), ("beegfs", True), ("gpfs", True), ("9p", True),
                          ("fuse.sshfs", True), ("fuse", True), ("ext4", False),
                          ("xfs", False), ("tmpfs", False), ("overlay", False),
                          ("fuseblk", False), ("", False)])
def test_network_filesystems_are_known_by_type(fstype: str, network: bool) -> None:
    assert is_network_filesystem(fstype) is network


def test_task_size_rounds_to_4k_and_never_below(extra: dict[str, Any]) -> None:
    extra["nvme.task_size_mb"] = 0.001
    assert NVMeSettings.from_extra_config(extra).task_size_bytes == 4096
    extra["nvme.task_size_mb"] = 1.003
    assert NVMeSettings.from_extra_config(extra).task_size_bytes % 4096 == 0


def test_recycle_mb_is_capped_at_one_percent_of_the_budget_and_off_in_shared_mode(
        extra: dict[str, Any]) -> None:
    assert NVMeSettings.from_extra_config(extra).recycle_bytes == 10 * GIB // 100  # 10 GiB
    extra["nvme.max_size_gb"] = 100
    assert NVMeSettings.from_extra_config(extra).recycle_bytes == 256 * MIB  # the default
    extra["nvme.recycle_mb"] = 64
    assert NVMeSettings.from_extra_config(extra).recycle_bytes == 64 * MIB
    extra["nvme.recycle_mb"] = 0
    assert NVMeSettings.from_extra_config(extra).recycle_bytes == 0
    extra.update({"nvme.recycle_mb": 64, "nvme.shared": True})
    assert NVMeSettings.from_extra_config(extra).recycle_bytes == 0
    extra.update({"nvme.recycle_mb": -1, "nvme.shared": False})
    assert "nvme.recycle_mb" in config_error(extra)


def test_path_comma_list(tmp_path: Path, extra: dict[str, Any]) -> None:
    extra["nvme.path"] = f" {tmp_path / 'a'} ,{tmp_path / 'b'},, "
    s = NVMeSettings.from_extra_config(extra)
    assert s.paths == (tmp_path / "a", tmp_path / "b")
    assert not any(p.exists() for p in s.paths)


@pytest.mark.parametrize("container", [list, tuple])
def test_path_list(tmp_path: Path, extra: dict[str, Any], container: type) -> None:
    extra["nvme.path"] = container([str(tmp_path / "a"), tmp_path / "b"])
    assert NVMeSettings.from_extra_config(extra).paths == (tmp_path / "a", tmp_path / "b")


def test_path_file_url_prefix(tmp_path: Path, extra: dict[str, Any]) -> None:
    extra["nvme.path"] = f"file://{tmp_path / 'u'}"
    assert NVMeSettings.from_extra_config(extra).paths == (tmp_path / "u",)


def test_relative_path_is_made_absolute(tmp_path: Path, extra: dict[str, Any],
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    extra["nvme.path"] = "rel/cache"
    s = NVMeSettings.from_extra_config(extra)
    assert s.paths == (tmp_path / "rel" / "cache",)
    assert s.paths[0].is_absolute()


def test_home_is_expanded(tmp_path: Path, extra: dict[str, Any],
                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    extra["nvme.path"] = "~/kv"
    assert NVMeSettings.from_extra_config(extra).paths == (tmp_path / "kv",)


def test_from_params_bare_names(params: dict[str, Any], cache_dir: Path) -> None:
    params["fsync"] = "data"
    s = NVMeSettings.from_params(params)
    assert (s.paths, s.max_size_gb, s.fsync) == ((cache_dir,), 10.0, "data")


# -- path errors ------------------------------------------------------------------------------


@pytest.mark.parametrize("missing", [None, "", []])
def test_missing_path(extra: dict[str, Any], missing: Any) -> None:
    if missing is None:
        del extra["nvme.path"]
    else:
        extra["nvme.path"] = missing
    msg = config_error(extra)
    assert msg.startswith("nvme.path:")
    assert "missing" in msg


def test_no_extra_config_at_all() -> None:
    assert "nvme.path" in config_error(None)  # type: ignore[arg-type]


def test_path_that_is_a_file(tmp_path: Path, extra: dict[str, Any]) -> None:
    (tmp_path / "file").write_bytes(b"x")
    extra["nvme.path"] = str(tmp_path / "file")
    msg = config_error(extra)
    assert "nvme.path" in msg and "not a directory" in msg
    assert (tmp_path / "file").read_bytes() == b"x"


def test_path_below_a_file_cannot_be_created(tmp_path: Path, extra: dict[str, Any]) -> None:
    (tmp_path / "file").write_bytes(b"x")
    extra["nvme.path"] = str(tmp_path / "file" / "sub")
    msg = config_error(extra)
    assert "nvme.path" in msg and "cannot create" in msg


@pytest.fixture
def unwritable_dir(tmp_path: Path) -> Iterator[Path]:
    """A directory this process cannot create files in, even as root (immutable via chattr)."""
    ro = tmp_path / "ro"
    ro.mkdir()
    if os.geteuid() != 0:
        ro.chmod(0o500)
        yield ro
        ro.chmod(0o700)
        return
    if shutil.which("chattr") is None or subprocess.run(
            ["chattr", "+i", str(ro)], capture_output=True).returncode != 0:
        pytest.skip("root ignores directory modes and this filesystem has no chattr +i")
    yield ro
    subprocess.run(["chattr", "-i", str(ro)], check=True)


def test_unwritable_directory_is_refused_at_start(unwritable_dir: Path,
                                                  extra: dict[str, Any]) -> None:
    extra["nvme.path"] = str(unwritable_dir)
    settings = NVMeSettings.from_extra_config(extra)  # validation writes nothing
    why = os.strerror(errno.EACCES if os.geteuid() else errno.EPERM)  # mode 0500, chattr +i
    assert start_error(settings) == (
        f"nvme.path: '{unwritable_dir}' is not writable ({why}). Grant this process write "
        "access or choose another directory.")
    missing = unwritable_dir / "sub" / "cache"
    extra["nvme.path"] = str(missing)
    assert start_error(NVMeSettings.from_extra_config(extra)) == (
        f"nvme.path: cannot create '{missing}': {why}. Create it yourself or choose a "
        "writable location.")
    assert not (unwritable_dir / "sub").exists()


@pytest.mark.parametrize(("prefix", "key"), [("nvme.", "nvme.path"),
                                             ("adapter_params.", "adapter_params.path"),
                                             ("", "path")])
def test_errors_at_start_name_the_key_as_the_user_wrote_it(unwritable_dir: Path, prefix: str,
                                                          key: str) -> None:
    settings = NVMeSettings.from_params({"path": str(unwritable_dir / "c"), "max_size_gb": 1},
                                        key_prefix=prefix)
    assert settings.key_prefix == prefix
    assert start_error(settings).startswith(f"{key}: cannot create '{unwritable_dir / 'c'}'")


def test_path_listed_twice(tmp_path: Path, extra: dict[str, Any]) -> None:
    extra["nvme.path"] = [str(tmp_path / "a"), f"file://{tmp_path / 'a'}"]
    msg = config_error(extra)
    assert "nvme.path" in msg and "twice" in msg


@pytest.mark.parametrize("bad", [42, {"a": 1}])
def test_path_of_wrong_type(extra: dict[str, Any], bad: Any) -> None:
    msg = config_error({**extra, "nvme.path": bad})
    assert msg.startswith("nvme.path:") and type(bad).__name__ in msg


def test_validation_creates_and_writes_nothing(tmp_path: Path, params: dict[str, Any]) -> None:
    """Parsing a config that names directories that do not exist leaves them absent (and
    an existing one untouched): the store creates them when it opens them."""
    existing = tmp_path / "existing"
    existing.mkdir()
    before = existing.stat().st_mtime_ns
    missing = [tmp_path / "not" / "yet", tmp_path / "other"]
    paths = [str(p) for p in (*missing, existing)]
    for settings in (NVMeSettings.from_params({**params, "path": paths, "file_mode": "0640"}),
                     NVMeSettings.from_extra_config({"nvme.path": ",".join(paths),
                                                     "nvme.max_size_gb": 1,
                                                     "nvme.shared": True}),
                     NVMeSettings.review({**params, "path": paths}).settings):
        assert settings is not None and len(settings.paths) == 3
    assert not any(p.exists() for p in missing) and not (tmp_path / "not").exists()
    assert list(existing.iterdir()) == [] and existing.stat().st_mtime_ns == before


# -- numeric errors ---------------------------------------------------------------------------


def test_missing_max_size(extra: dict[str, Any]) -> None:
    del extra["nvme.max_size_gb"]
    msg = config_error(extra)
    assert msg.startswith("nvme.max_size_gb:") and "missing" in msg


@pytest.mark.parametrize(
    ("value", "why"),
    [(0, "out of range"), (-1, "out of range"), ("-0.5", "out of range"),
     ("ten", "not a number"), ([10], "not a number"), ("nan", "not a finite number"),
     (float("nan"), "not a finite number"), ("inf", "not a finite number"),
     (float("-inf"), "not a finite number")],
)
def test_bad_max_size(extra: dict[str, Any], value: Any, why: str) -> None:
    msg = config_error({**extra, "nvme.max_size_gb": value})
    assert msg.startswith("nvme.max_size_gb:")
    assert why in msg


def test_max_size_accepts_numeric_string(extra: dict[str, Any]) -> None:
    extra["nvme.max_size_gb"] = "0.25"
    assert NVMeSettings.from_extra_config(extra).max_size_bytes == GIB // 4


@pytest.mark.parametrize(
    ("name", "value", "why"),
    [("io_threads", 2.5, "not a whole number"), ("io_threads", "four", "not a number"),
     ("io_threads", 0, "out of range"), ("io_threads", "1e400", "not a finite number"),
     ("write_threads", -1, "out of range"), ("task_size_mb", 0, "out of range"),
     ("write_queue_mb", 0, "out of range"), ("min_free_gb", -0.1, "out of range"),
     ("close_timeout_s", "soon", "not a number"), ("io_deadline_s", -1, "out of range"),
     ("io_deadline_s", 601, "out of range"), ("io_deadline_s", "nan", "not a finite number"),
     ("io_deadline_s", "soon", "neither a number nor auto"),
     ("io_deadline_s", "", "neither a number nor auto")],
)
def test_bad_numbers_name_their_key(extra: dict[str, Any], name: str, value: Any,
                                    why: str) -> None:
    msg = config_error({**extra, f"nvme.{name}": value})
    assert msg.startswith(f"nvme.{name}:")
    assert why in msg


# -- unknown keys -----------------------------------------------------------------------------


def test_unknown_key_suggests_the_close_one(extra: dict[str, Any]) -> None:
    msg = config_error({**extra, "nvme.max_size_gib": 5})
    assert msg.startswith("nvme.max_size_gib:")
    assert "did you mean 'nvme.max_size_gb'" in msg


def test_unknown_key_without_close_match_lists_known(extra: dict[str, Any]) -> None:
    msg = config_error({**extra, "nvme.zzz": 1})
    assert "unknown setting" in msg and "did you mean" not in msg
    assert "nvme.queue_full_policy" in msg and "nvme.path" in msg


def test_paths_plural_suggests_path(extra: dict[str, Any]) -> None:
    assert "did you mean 'nvme.path'" in config_error({**extra, "nvme.paths": "/x"})


# -- choices ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "value", "allowed"),
    [("fsync", "sometimes", "none, data, full"), ("queue_full_policy", "block", "drop, wait"),
     ("direct_io", "yes", "auto, on, off"), ("direct_io", 1, "auto, on, off")],
)
def test_bad_choice(extra: dict[str, Any], name: str, value: Any, allowed: str) -> None:
    msg = config_error({**extra, f"nvme.{name}": value})
    assert msg.startswith(f"nvme.{name}:")
    assert "not a valid choice" in msg and allowed in msg


# -- file mode --------------------------------------------------------------------------------


@pytest.mark.parametrize(("raw", "mode"), [("0600", 0o600), ("640", 0o640), ("0o660", 0o660),
                                          (0o644, 0o644), ("0777", 0o777)])
def test_file_mode_accepted(extra: dict[str, Any], raw: Any, mode: int) -> None:
    assert NVMeSettings.from_extra_config({**extra, "nvme.file_mode": raw}).file_mode == mode


@pytest.mark.parametrize(("raw", "why"), [("rw-r--r--", "not an octal mode"),
                                          ("0899", "not an octal mode"),
                                          (None, "not an octal mode"),
                                          ("0400", "not usable"), ("0200", "not usable"),
                                          (0o1600, "not usable"), (-1, "not usable"),
                                          (600, "not usable")])
def test_bad_file_mode(extra: dict[str, Any], raw: Any, why: str) -> None:
    msg = config_error({**extra, "nvme.file_mode": raw})
    assert msg.startswith("nvme.file_mode:") and why in msg


# -- bare names through from_params -----------------------------------------------------------


def test_from_params_errors_name_the_bare_key(params: dict[str, Any]) -> None:
    with pytest.raises(NVMeConfigError) as info:
        NVMeSettings.from_params({**params, "max_size_gb": -3})
    assert str(info.value).startswith("max_size_gb:")
    assert "nvme." not in str(info.value)


def test_from_params_missing_path_names_bare_key() -> None:
    with pytest.raises(NVMeConfigError, match=r"^path: missing"):
        NVMeSettings.from_params({"max_size_gb": 1})


def test_from_params_unknown_key_suggests_bare_name(params: dict[str, Any]) -> None:
    with pytest.raises(NVMeConfigError) as info:
        NVMeSettings.from_params({**params, "fsynch": "data"})
    assert "did you mean 'fsync'" in str(info.value)
    assert "nvme." not in str(info.value)


def test_from_params_rejects_prefixed_keys(params: dict[str, Any]) -> None:
    with pytest.raises(NVMeConfigError, match="did you mean 'path'"):
        NVMeSettings.from_params({**params, "nvme.path": "/elsewhere"})


def test_config_error_is_a_value_error() -> None:
    assert issubclass(NVMeConfigError, ValueError)


@pytest.mark.parametrize(("yaml_value", "expected"), [(True, "on"), (False, "off")])
def test_unquoted_yaml_on_off_mean_on_off(extra: dict[str, Any], yaml_value: bool,
                                          expected: str) -> None:
    """YAML 1.1 loads an unquoted ``on``/``off`` as a boolean; it must still mean on/off."""
    settings = NVMeSettings.from_extra_config({**extra, "nvme.direct_io": yaml_value})
    assert settings.direct_io == expected


# -- review: every problem, nothing created ----------------------------------------------------


def test_review_reports_every_problem_and_creates_nothing(tmp_path: Path) -> None:
    target = tmp_path / "not" / "yet"
    review = NVMeSettings.review({"path": str(target), "max_size_gbb": 1, "io_threads": 0,
                                  "fsync": "always"}, key_prefix="nvme.")
    assert review.settings is None
    assert [str(e).split(":")[0] for e in review.errors] == [
        "nvme.max_size_gbb", "nvme.max_size_gb", "nvme.io_threads", "nvme.fsync"]
    assert "did you mean 'nvme.max_size_gb'?" in str(review.errors[0])
    assert review.values["paths"] == (target,)  # what passed is there for path checks
    assert not target.exists() and not target.parent.exists()


def test_review_of_good_params_matches_what_the_tier_reads(params: dict[str, Any]) -> None:
    review = NVMeSettings.review({**params, "fsync": "data"})
    assert review.errors == []
    assert review.settings == NVMeSettings.from_params({**params, "fsync": "data"})


def test_the_tier_still_raises_the_first_problem(params: dict[str, Any]) -> None:
    with pytest.raises(NVMeConfigError, match=r"^fsynch: unknown setting"):
        NVMeSettings.from_params({**params, "io_threads": 0, "fsynch": "data"})
