"""The LMCache versions this package supports, and what happens outside them.

The range is the ``lmcache`` requirement of ``pyproject.toml``, read from the installed
metadata (``FALLBACK_RANGE`` without one).  ``lmcache_imports()`` wraps every LMCache import
of ``adapters/`` so that a renamed module or name fails with a message naming the versions
and the fix; ``range_warning()`` is logged once at start outside the range (a warning, not a
refusal: a newer LMCache often changes nothing the adapters use).  Imports no LMCache.
"""

from __future__ import annotations

import functools
import importlib.metadata
import re
from collections.abc import Iterator
from contextlib import contextmanager

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version

#: The range when the package metadata cannot be read; keep it equal to pyproject.toml's.
FALLBACK_RANGE = ">=0.5.6,<0.6"

DISTRIBUTION = "lmcache-nvme-backend"

_REQUIREMENT = re.compile(r"^\s*lmcache\s*(?:\[[^\]]*\])?\s*(?P<spec>[^;]*)(?:;.*)?$",
                          re.IGNORECASE)


@functools.cache
def supported_range() -> str:
    """The ``lmcache`` version specifier this package declares, e.g. ``>=0.5.6,<0.6``."""
    try:
        requirements = importlib.metadata.requires(DISTRIBUTION) or []
    except importlib.metadata.PackageNotFoundError:
        return FALLBACK_RANGE
    for line in requirements:
        match = _REQUIREMENT.match(line)
        if match and "extra" not in line.partition(";")[2]:
            specs = [s.strip() for s in match.group("spec").strip("() ").split(",") if s.strip()]
            if specs:
                # lower bounds first: ">=0.5.6,<0.6" reads better than the metadata's order
                return ",".join(sorted(specs, key=lambda s: (not s.startswith(">"), s)))
    return FALLBACK_RANGE


def lmcache_version() -> str | None:
    """The installed LMCache's version, None when it is not installed."""
    try:
        return importlib.metadata.version("lmcache")
    except importlib.metadata.PackageNotFoundError:
        return None


def our_version() -> str:
    from .. import __version__

    return __version__


def in_range(version: str, spec: str) -> bool | None:
    """Whether ``version`` satisfies ``spec``; None when either cannot be parsed."""
    try:
        return SpecifierSet(spec).contains(Version(version), prereleases=True)
    except (InvalidSpecifier, InvalidVersion):
        return None


def describe_lmcache() -> str:
    version = lmcache_version()
    return f"LMCache {version}" if version else "no LMCache (not installed)"


def range_warning() -> str | None:
    """The warning for an installed LMCache outside the supported range, else None."""
    version = lmcache_version()
    if version is None:
        return None  # an import of LMCache fails first, with lmcache_imports' message
    spec = supported_range()
    if in_range(version, spec) is not False:
        return None
    return (f"NVMe tier: LMCache {version} is installed, outside the range "
            f"lmcache-nvme-backend {our_version()} supports (lmcache{spec}). Starting "
            f"anyway; if the tier misbehaves, install an LMCache in that range "
            f"(pip install 'lmcache{spec}') or an lmcache-nvme-backend that supports "
            f"LMCache {version}.")


def import_error_message(exc: BaseException) -> str:
    """What ``lmcache_imports`` raises: the missing module or name, both versions, the fix."""
    spec = supported_range()
    version = lmcache_version()
    head = (f"NVMe tier: lmcache-nvme-backend {our_version()} cannot import from "
            f"{describe_lmcache()}: {exc}. lmcache-nvme-backend {our_version()} supports "
            f"lmcache{spec}")
    if version is not None and in_range(version, spec):
        return (f"{head}, which includes {version}: the LMCache install looks incomplete; "
                f"reinstall it (pip install --force-reinstall 'lmcache=={version}').")
    return (f"{head}: install an LMCache in that range (pip install 'lmcache{spec}')"
            + (f" or upgrade lmcache-nvme-backend to a release that supports LMCache "
               f"{version}." if version else "."))


@contextmanager
def lmcache_imports() -> Iterator[None]:
    """Run LMCache imports; a missing module or name becomes an ``ImportError`` that says
    which, the installed LMCache, the supported range and what to do."""
    try:
        yield
    except (ImportError, AttributeError) as exc:
        error = ImportError(import_error_message(exc))
        error.name = getattr(exc, "name", None)
        raise error from exc
