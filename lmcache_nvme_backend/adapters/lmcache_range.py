"""The LMCache versions this package supports, and what happens outside them.

One place says which LMCache releases the adapters are written for: the ``lmcache``
requirement in ``pyproject.toml``, read back from the installed package's metadata
(``supported_range``; ``FALLBACK_RANGE`` only where the metadata is missing, e.g. a
source tree on ``sys.path`` without an install).  Two things use it:

* ``lmcache_imports()``: every module-level ``from lmcache... import ...`` in
  ``adapters/`` runs inside it, so a module or name that a newer LMCache renamed fails
  with an ``ImportError`` that names it, the installed LMCache, the supported range and
  what to do, instead of a bare ``cannot import name``;
* ``range_warning()``: the start-up chain (``_common.loading``, which every adapter enters)
  logs it once when the installed LMCache is outside the range.  A warning, not a refusal:
  LMCache publishes releases after ours (a patch release of the next minor often changes
  nothing the adapters use), and an interface that did change fails on its own, at import
  (``lmcache_imports``) or at the first call.

This module imports no LMCache (it is what guards those imports) and no torch.
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
