"""The dependencies pyproject.toml declares are the ones the package imports.

Every third-party module imported anywhere under ``lmcache_nvme_backend/`` is provided by
a declared dependency or, for optional features (the kvikio GPU path, plots), by an extra;
a module imported when the package is imported (module level) is a core dependency; and
every core dependency is imported somewhere (nothing installed for nothing).
"""

from __future__ import annotations

import ast
import re
import sys
from importlib import metadata
from pathlib import Path

import pytest
from support.paths import REPO_ROOT

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

PACKAGE = "lmcache_nvme_backend"
PACKAGE_DIR = REPO_ROOT / PACKAGE
PYPROJECT = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]

# Import name -> the distributions that provide it, where the names differ. One import
# name with several distributions is the RAPIDS convention of one wheel per CUDA major.
DISTRIBUTIONS: dict[str, set[str]] = {
    "yaml": {"pyyaml"},
    "prometheus_client": {"prometheus-client"},
    "kvikio": {"kvikio-cu12", "kvikio-cu13"},
    "cupy": {"cupy-cuda12x", "cupy-cuda13x"},
}
# Extras that hold tools for developers, not features of the package.
TOOL_EXTRAS = {"test"}


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_name(requirement: str) -> str:
    match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement)
    assert match, requirement
    return normalize(match.group(1))


CORE = {requirement_name(r) for r in PYPROJECT["dependencies"]}
EXTRAS = {extra: {requirement_name(r) for r in reqs}
          for extra, reqs in PYPROJECT["optional-dependencies"].items()}


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imports_of(tree: ast.Module) -> tuple[set[str], set[str]]:
    """(every absolute top-level module name imported, those imported at module level)."""
    everywhere: set[str] = set()
    module_level: set[str] = set()

    def names(node: ast.AST) -> set[str]:
        if isinstance(node, ast.Import):
            return {alias.name.split(".")[0] for alias in node.names}
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            return {node.module.split(".")[0]}
        return set()

    for node in ast.walk(tree):
        everywhere |= names(node)

    def visit_body(body: list[ast.stmt]) -> None:  # statements run at import time
        for stmt in body:
            module_level.update(names(stmt))
            if isinstance(stmt, ast.If) and not _is_type_checking(stmt):
                visit_body(stmt.body)
                visit_body(stmt.orelse)
            elif isinstance(stmt, ast.Try):
                # try/except ImportError around an import is how optional modules are
                # probed; only the body's imports are unconditional.
                visit_body(stmt.body)

    visit_body(tree.body)
    return everywhere, module_level


def third_party(modules: set[str]) -> set[str]:
    return {m for m in modules if m not in sys.stdlib_module_names and m != PACKAGE
            and m != "__future__"}


def scan() -> tuple[dict[str, set[Path]], dict[str, set[Path]]]:
    everywhere: dict[str, set[Path]] = {}
    module_level: dict[str, set[Path]] = {}
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        found, top = imports_of(ast.parse(path.read_text(), str(path)))
        for name in third_party(found):
            everywhere.setdefault(name, set()).add(path.relative_to(REPO_ROOT))
        for name in third_party(top):
            module_level.setdefault(name, set()).add(path.relative_to(REPO_ROOT))
    return everywhere, module_level


IMPORTED, IMPORTED_AT_MODULE_LEVEL = scan()


def distributions_of(module: str) -> set[str]:
    return DISTRIBUTIONS.get(module, {normalize(module)})


def test_the_scan_sees_the_known_imports() -> None:
    assert {"lmcache", "torch", "numpy", "xxhash", "yaml", "prometheus_client",
            "kvikio"} <= set(IMPORTED)


def test_every_imported_module_is_declared() -> None:
    declared = CORE.union(*EXTRAS.values())
    undeclared = {m: sorted(map(str, IMPORTED[m])) for m in IMPORTED
                  if not distributions_of(m) & declared}
    assert not undeclared, (
        f"imported but not declared in pyproject.toml: {undeclared}; add the distribution "
        "to [project] dependencies (or an extra for an optional feature), and to "
        "DISTRIBUTIONS here when its name differs from the import name")


def test_module_level_imports_are_core_dependencies() -> None:
    """The package imports without any extra installed: optional modules are imported
    lazily, inside the function that needs them."""
    optional = {m: sorted(map(str, paths)) for m, paths in IMPORTED_AT_MODULE_LEVEL.items()
                if not distributions_of(m) & CORE}
    assert not optional, f"optional modules imported at module level: {optional}"


def test_every_core_dependency_is_imported() -> None:
    provided = set().union(*(distributions_of(m) for m in IMPORTED))
    unused = CORE - provided
    assert not unused, (f"declared in [project] dependencies but never imported by "
                        f"{PACKAGE}: {sorted(unused)}; drop them")


def test_every_feature_extra_is_imported() -> None:
    provided = set().union(*(distributions_of(m) for m in IMPORTED))
    for extra, names in EXTRAS.items():
        if extra not in TOOL_EXTRAS:
            assert names <= provided, f"extra [{extra}] installs {names - provided}, unused"


def test_gpu_extras_follow_the_cuda_major_convention() -> None:
    assert EXTRAS["cu12"] == {"kvikio-cu12"} and EXTRAS["cu13"] == {"kvikio-cu13"}
    assert not {d for d in CORE if "cu1" in d or d.startswith(("kvikio", "cupy", "nvidia"))}


def test_installed_distributions_match_the_table() -> None:
    """Where a module is installed here, the distribution providing it is the one the
    table (or the import name) says."""
    installed = metadata.packages_distributions()
    for module in IMPORTED:
        for dist in installed.get(module, []):
            assert normalize(dist) in distributions_of(module), (module, dist)
