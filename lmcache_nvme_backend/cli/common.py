"""Helpers shared by the ``lmcache-nvme`` commands: argument types, units, progress bar."""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from ..config import GIB, MIB

T = TypeVar("T")
KIB = 1024

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgtp]?)(i?b?)\s*$", re.IGNORECASE)
_SIZE_UNITS = {"": 1, "k": KIB, "m": MIB, "g": GIB, "t": 1024**4, "p": 1024**5}

# Exit status of a CLIError (argparse itself exits 2 on usage errors).
EXIT_PROBLEM = 1


class CLIError(Exception):
    """A problem the user must fix; ``main`` prints ``error: <message>`` and exits non-zero."""

    def __init__(self, message: str, status: int = EXIT_PROBLEM) -> None:
        super().__init__(message)
        self.status = status


def parse_size(text: str) -> int:
    """``4k``, ``2M``, ``16MiB``, ``1.5G`` or plain bytes -> bytes (binary units, like fio)."""
    match = _SIZE_RE.match(text)
    if not match:
        raise ValueError(text)
    number, unit, _ = match.groups()
    value = float(number) * _SIZE_UNITS[unit.lower()]
    if value != int(value):
        raise ValueError(text)
    return int(value)


def size_arg(text: str) -> int:
    """argparse type: a positive size such as ``2M``."""
    try:
        value = parse_size(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"invalid size '{text}' (use bytes or a number with K, M, G or T, "
            "e.g. 4k, 2M, 16M, 1G)") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"size must be greater than 0, got '{text}'")
    return value


def _converted(text: str, convert: Callable[[str], T], what: str) -> T:
    """``convert(text)``, or the argparse error "'<text>' is not <what>"."""
    try:
        return convert(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not {what}") from None


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    value = _converted(text, int, "a whole number")
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _finite_number(text: str) -> float:
    value = _converted(text, float, "a number")
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"'{text}' is not a finite number")
    return value


def positive_float(text: str) -> float:
    """argparse type: a finite number > 0."""
    value = _finite_number(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a number greater than 0, got '{text}'")
    return value


def non_negative_float(text: str) -> float:
    """argparse type: a finite number >= 0."""
    value = _finite_number(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be a number of at least 0, got '{text}'")
    return value


def _list_arg(text: str, item: Callable[[str], int], example: str) -> list[int]:
    """Comma-separated items, sorted and deduplicated."""
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list such as {example}")
    return sorted({item(t) for t in items})


def int_list_arg(text: str) -> list[int]:
    """argparse type: comma-separated positive integers, e.g. ``1,2,4,8``."""
    return _list_arg(text, positive_int, "1,2,4,8")


def size_list_arg(text: str) -> list[int]:
    """argparse type: comma-separated sizes, e.g. ``1M,4M,16M``."""
    return _list_arg(text, size_arg, "1M,4M,16M")


def human_age(seconds: float | None, digits: int = 0) -> str:
    """A duration in the largest unit it fills (``3.5 h``; ``-`` for none); seconds with
    ``digits`` decimals."""
    if seconds is None:
        return "-"
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f} {unit}"
    return f"{seconds:.{digits}f} s"


def human_bytes(n: float) -> str:
    """Binary units with one decimal: ``1.5 GiB``."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def short_size(n: int) -> str:
    """fio-style compact size: ``2MiB``, ``16MiB``, ``4KiB``, ``1536B``."""
    for unit, factor in (("GiB", GIB), ("MiB", MIB), ("KiB", KIB)):
        if n >= factor and n % factor == 0:
            return f"{n // factor}{unit}"
    return f"{n}B"


PATHS_HELP = "cache directory (nvme.path); give each path of a multi-drive cache"


def cache_dir_command(sub: Any, name: str, summary: str, description: str, epilog: str,
                      paths_help: str = PATHS_HELP) -> argparse.ArgumentParser:
    """The parser of a command on cache directories, with its ``PATH...`` argument."""
    parser: argparse.ArgumentParser = sub.add_parser(name, help=summary,
                                                     description=description, epilog=epilog)
    parser.add_argument("paths", metavar="PATH", type=Path, nargs="+", help=paths_help)
    return parser


def add_namespace_option(parser: argparse._ActionsContainer, what: str) -> None:
    """``--namespace NAME|ID`` (repeatable): ``what`` is done to each."""
    parser.add_argument("--namespace", action="append", default=[], metavar="NAME|ID",
                        help=f"{what}: its name as inspect shows it (the model, @salt, "
                             "#build) or its 16-hex directory id (repeatable)")


def add_output_options(parser: argparse.ArgumentParser, dry_run: str | None = None) -> None:
    """``--dry-run`` (when ``dry_run`` says what it lists) and ``--json``."""
    if dry_run is not None:
        parser.add_argument("--dry-run", action="store_true",
                            help=f"list what would be {dry_run}, change nothing")
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")


def print_json(doc: Any) -> None:
    """Pretty JSON on stdout."""
    json.dump(doc, sys.stdout, indent=2)
    sys.stdout.write("\n")


class Progress:
    """A one-line progress bar on stderr, drawn at most a few times a second; every method
    is a no-op unless ``enabled`` (callers pass ``stderr.isatty() or --progress``)."""

    WIDTH = 28

    def __init__(self, enabled: bool, total: float, label: str, unit: str = "bytes") -> None:
        self.enabled = enabled and total > 0
        self.total = total
        self.label = label
        self.unit = unit
        self.done = 0.0
        self.stream = sys.stderr
        self._started = time.monotonic()
        self._last_draw = 0.0

    def advance(self, nbytes: int) -> None:
        """Count ``nbytes`` done (byte bars) or show the elapsed time (time bars)."""
        if self.unit == "bytes":
            self.done += nbytes
        else:
            self.done = time.monotonic() - self._started
        self._draw()

    def _draw(self, force: bool = False) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if not force and now - self._last_draw < 0.2 and self.done < self.total:
            return
        self._last_draw = now
        frac = min(1.0, self.done / self.total)
        filled = int(frac * self.WIDTH)
        bar = "#" * filled + "." * (self.WIDTH - filled)
        elapsed = now - self._started
        extra = ""
        if self.unit == "bytes" and elapsed > 0:
            extra = f" {human_bytes(self.done)} {self.done / elapsed / 1e9:.2f} GB/s"
        eta = (elapsed / frac - elapsed) if frac > 0 else 0.0
        self.stream.write(f"\r{self.label} [{bar}] {frac * 100:3.0f}%{extra} "
                          f"eta {eta:4.0f}s ")
        self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            self._draw(force=True)
            self.stream.write("\n")
            self.stream.flush()
