"""README.md's table of tested versions against the pins they come from: LMCache and kvikio
in pyproject.toml, vLLM and SGLang in the requirements files of the engines' environments
(tests/support/engine_env.py), torch in the test command CI runs, kvikio's measured version
in docs/gpu.md.  A pin changed without the table (or the other way round) fails here."""

from __future__ import annotations

import re

import pytest
from support.engine_env import SGLANG, SGLANG_UNIFIED, VLLM, EngineSpec
from support.paths import REPO_ROOT

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

PROJECT = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
README = (REPO_ROOT / "README.md").read_text()


def table() -> list[dict[str, str]]:
    """The rows of the table after "**Tested versions.**": component, version (the first
    backticked word of its cell), pinned in, what ran."""
    section = README.split("**Tested versions.**", 1)[1]
    lines = re.search(r"\n(\|.*\|\n)+", section)
    assert lines is not None, "no table after **Tested versions.**"
    rows = [[cell.strip() for cell in line.strip().strip("|").split("|")]
            for line in lines.group(0).strip().splitlines()]
    assert rows[0] == ["component", "version", "pinned in", "what ran"]
    out = []
    for cells in rows[2:]:
        version = re.match(r"`([^`]+)`", cells[1])
        assert version is not None, cells
        out.append({"component": cells[0], "version": version.group(1), "pinned": cells[2],
                    "ran": cells[3]})
    return out


def rows(component: str) -> list[dict[str, str]]:
    found = [row for row in table() if row["component"] == component]
    assert found, f"README's tested versions have no {component} row"
    return found


def lower_bound(requirement: str) -> str:
    match = re.search(r">=([\w.]+)", requirement)
    assert match is not None, requirement
    return match.group(1)


def requirement(name: str, requirements: list[str]) -> str:
    (found,) = [r for r in requirements if re.match(rf"{re.escape(name)}\s*[<>=!~]", r)]
    return found


def engine_pin(spec: EngineSpec) -> tuple[str, str]:
    """The engine a spec installs and its version, from its requirements file."""
    name, version = spec.pinned().split("==")
    return name, version


def test_the_table_names_each_component_once_but_sglangs_two_paths() -> None:
    components = [row["component"] for row in table()]
    assert sorted(components) == sorted(
        ["LMCache", "vLLM", "SGLang", "SGLang", "kvikio", "torch"])


def test_lmcache_is_the_lower_bound_of_the_supported_range() -> None:
    (row,) = rows("LMCache")
    pinned = requirement("lmcache", PROJECT["dependencies"])
    assert row["version"] == lower_bound(pinned)
    assert f"`{pinned}`" in row["pinned"]
    # and the sentence above the table says the same
    assert f"**Supported LMCache: `{pinned}`, tested with {row['version']}.**" in README


def test_vllm_is_the_vllm_environments_pin() -> None:
    (row,) = rows("vLLM")
    name, version = engine_pin(VLLM)
    assert row["version"] == version
    assert VLLM.requirements.relative_to(REPO_ROOT).as_posix() in row["pinned"]
    assert f"`{name}`" in row["pinned"]


def test_sglang_is_the_two_sglang_environments_pins() -> None:
    got = {(row["version"], row["pinned"]) for row in rows("SGLang")}
    want = set()
    for spec in (SGLANG, SGLANG_UNIFIED):
        name, version = engine_pin(spec)
        assert name == "sglang"
        pinned = next(p for v, p in got if v == version)  # StopIteration: no row for it
        assert f"`{spec.requirements.relative_to(REPO_ROOT).as_posix()}`" in pinned
        want.add((version, pinned))
    assert got == want
    radix, unified = (next(r["ran"] for r in rows("SGLang") if r["version"] == engine_pin(s)[1])
                      for s in (SGLANG, SGLANG_UNIFIED))
    assert "`LMCRadixCache`" in radix and "`LMCacheUnifiedRadixCache`" in unified


def test_kvikio_is_the_extras_range_and_the_version_measured() -> None:
    (row,) = rows("kvikio")
    extras = PROJECT["optional-dependencies"]
    bounds = {lower_bound(requirement(f"kvikio-{cuda}", extras[cuda]))
              for cuda in ("cu12", "cu13")}
    assert len(bounds) == 1, f"the [cu12] and [cu13] extras ask for different kvikio: {bounds}"
    assert f"`>={bounds.pop()}`" in row["pinned"]
    gpu = (REPO_ROOT / "docs" / "gpu.md").read_text().split("## Measured on a GPU machine")[1]
    measured = re.search(r"kvikio (\d+\.\d+\.\d+)", gpu)
    assert measured is not None and row["version"] == measured.group(1)


def test_torch_is_the_test_commands_pin() -> None:
    (row,) = rows("torch")
    ci = (REPO_ROOT / ".ci" / "run").read_text()
    pins = set(re.findall(r'"torch==([\w.+]+)"', ci))
    assert pins == {row["version"]}
    assert "`.ci/run`" in row["pinned"]


def test_every_file_the_table_names_exists() -> None:
    for row in table():
        for path in re.findall(r"`((?:tests|docs|examples)/[\w./-]+|pyproject\.toml|\.ci/run)`",
                               row["pinned"]):
            assert (REPO_ROOT / path).is_file(), f"{row['component']}: {path}"
