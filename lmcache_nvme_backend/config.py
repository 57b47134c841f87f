"""Settings of the NVMe tier, shared by every LMCache hook.

One vocabulary everywhere: ``nvme.<name>`` keys in LMCache's ``extra_config``,
the bare ``<name>`` in an L2 adapter's ``adapter_params``.  Every problem is
reported at construction as an ``NVMeConfigError`` that names the key and says
how to fix it.
"""

from __future__ import annotations

import difflib
import errno
import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

EXTRA_CONFIG_PREFIX = "nvme."
GIB = 1024**3
MIB = 1024**2

FSYNC_POLICIES = ("none", "data", "full")
QUEUE_FULL_POLICIES = ("drop", "wait")
DIRECT_IO_MODES = ("auto", "on", "off")
GDS_MODES = ("auto", "on", "off")


class NVMeConfigError(ValueError):
    """A setting of the NVMe tier is missing or invalid; the message names it and the fix."""


@dataclass(frozen=True)
class NVMeSettings:
    """Validated settings.  ``docs/configuration.md`` documents each one."""

    paths: tuple[Path, ...]
    max_size_gb: float
    min_free_gb: float = 1.0
    direct_io: str = "auto"
    io_threads: int = 8
    write_threads: int = 0  # 0: one writer per path
    task_size_mb: float = 4.0
    write_queue_mb: float = 1024.0
    queue_full_policy: str = "drop"
    fsync: str = "none"
    file_mode: int = 0o600
    manifest_interval_s: float = 60.0
    close_timeout_s: float = 30.0
    shared: bool = False  # other processes write the same directories
    # GPU read path (docs/gpu.md): used by NVMeBackend on a CUDA dst_device only
    gds_mode: str = "auto"
    gpu_pool_mb: float = 2048.0  # 0: no pool of its own, retrieved chunks stay in host memory
    kvikio_threads: int = 16
    kvikio_task_size_mb: float = 4.0
    # Observability (docs/metrics.md)
    metrics_port: int = 0  # 0: no endpoint of its own; the default registry is always filled
    stats_log_interval_s: float = 0.0  # 0: no periodic stats line

    @property
    def max_size_bytes(self) -> int:
        return int(self.max_size_gb * GIB)

    @property
    def min_free_bytes(self) -> int:
        return int(self.min_free_gb * GIB)

    @property
    def task_size_bytes(self) -> int:
        return max(4096, int(self.task_size_mb * MIB) // 4096 * 4096)

    @property
    def write_queue_bytes(self) -> int:
        return int(self.write_queue_mb * MIB)

    @property
    def gpu_pool_bytes(self) -> int:
        return int(self.gpu_pool_mb * MIB) // 4096 * 4096

    @property
    def kvikio_task_size_bytes(self) -> int:
        return max(4096, int(self.kvikio_task_size_mb * MIB) // 4096 * 4096)

    @classmethod
    def setting_names(cls) -> list[str]:
        return ["path" if f.name == "paths" else f.name for f in fields(cls)]

    @classmethod
    def from_extra_config(cls, extra_config: Mapping[str, Any] | None) -> NVMeSettings:
        """Read the ``nvme.*`` keys of LMCache's ``extra_config``."""
        extra_config = extra_config or {}
        params = {
            key[len(EXTRA_CONFIG_PREFIX) :]: value
            for key, value in extra_config.items()
            if key.startswith(EXTRA_CONFIG_PREFIX)
        }
        return cls.from_params(params, key_prefix=EXTRA_CONFIG_PREFIX)

    @classmethod
    def from_params(cls, params: Mapping[str, Any], key_prefix: str = "") -> NVMeSettings:
        """Validate bare setting names (``path``, ``max_size_gb``, ...)."""
        return _Parser(params, key_prefix).parse()


class _Parser:
    def __init__(self, params: Mapping[str, Any], key_prefix: str) -> None:
        self.params = dict(params)
        self.prefix = key_prefix

    def fail(self, name: str, problem: str, fix: str) -> NVMeConfigError:
        return NVMeConfigError(f"{self.prefix}{name}: {problem}. {fix}")

    def parse(self) -> NVMeSettings:
        known = NVMeSettings.setting_names()
        for name in self.params:
            if name not in known:
                close = difflib.get_close_matches(name, known, n=1)
                hint = f"did you mean '{self.prefix}{close[0]}'? " if close else ""
                raise self.fail(
                    name, "unknown setting",
                    f"{hint}Known settings: {', '.join(self.prefix + k for k in known)}.")
        defaults = NVMeSettings(paths=(Path("."),), max_size_gb=1.0)
        return NVMeSettings(
            paths=self.paths(),
            max_size_gb=self.number("max_size_gb", None, minimum=0.0, exclusive=True),
            min_free_gb=self.number("min_free_gb", defaults.min_free_gb, minimum=0.0),
            direct_io=self.choice("direct_io", defaults.direct_io, DIRECT_IO_MODES),
            io_threads=int(self.number("io_threads", defaults.io_threads, minimum=1,
                                       integer=True)),
            write_threads=int(self.number("write_threads", defaults.write_threads, minimum=0,
                                          integer=True)),
            task_size_mb=self.number("task_size_mb", defaults.task_size_mb, minimum=0.0,
                                     exclusive=True),
            write_queue_mb=self.number("write_queue_mb", defaults.write_queue_mb, minimum=0.0,
                                       exclusive=True),
            queue_full_policy=self.choice("queue_full_policy", defaults.queue_full_policy,
                                          QUEUE_FULL_POLICIES),
            fsync=self.choice("fsync", defaults.fsync, FSYNC_POLICIES),
            file_mode=self.file_mode(defaults.file_mode),
            manifest_interval_s=self.number("manifest_interval_s", defaults.manifest_interval_s,
                                            minimum=0.0),
            close_timeout_s=self.number("close_timeout_s", defaults.close_timeout_s,
                                        minimum=0.0),
            shared=self.flag("shared", defaults.shared),
            gds_mode=self.choice("gds_mode", defaults.gds_mode, GDS_MODES),
            gpu_pool_mb=self.number("gpu_pool_mb", defaults.gpu_pool_mb, minimum=0.0),
            kvikio_threads=int(self.number("kvikio_threads", defaults.kvikio_threads, minimum=1,
                                           integer=True)),
            kvikio_task_size_mb=self.number("kvikio_task_size_mb", defaults.kvikio_task_size_mb,
                                            minimum=0.0, exclusive=True),
            metrics_port=int(self.number("metrics_port", defaults.metrics_port, minimum=0,
                                         maximum=65535, integer=True)),
            stats_log_interval_s=self.number("stats_log_interval_s",
                                             defaults.stats_log_interval_s, minimum=0.0),
        )

    def paths(self) -> tuple[Path, ...]:
        raw = self.params.get("path")
        if raw is None or raw == "" or raw == []:
            raise self.fail("path", "missing",
                            "Set it to a directory on the NVMe drive, or a list of directories "
                            "(one per drive), e.g. /mnt/nvme0/lmcache.")
        if isinstance(raw, str):
            items = [p.strip() for p in raw.split(",") if p.strip()]
        elif isinstance(raw, (list, tuple)):
            items = [str(p) for p in raw]
        else:
            raise self.fail("path", f"expected a directory or a list of directories, got "
                            f"{type(raw).__name__}", "Give a string or a list of strings.")
        paths: list[Path] = []
        for item in items:
            path = Path(item.removeprefix("file://")).expanduser().absolute()
            if path in paths:
                raise self.fail("path", f"'{path}' is listed twice", "List each directory once.")
            self.check_directory(path)
            paths.append(path)
        return tuple(paths)

    def check_directory(self, path: Path) -> None:
        if path.exists() and not path.is_dir():
            raise self.fail("path", f"'{path}' exists and is not a directory",
                            "Point it at a directory (it is created if missing).")
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise self.fail("path", f"cannot create '{path}': {exc.strerror}",
                            "Create it yourself or choose a writable location.") from exc
        try:
            fd, probe = tempfile.mkstemp(prefix=".write-probe-", dir=path)
            os.close(fd)
            os.unlink(probe)
        except OSError as exc:
            why = "read-only filesystem" if exc.errno == errno.EROFS else exc.strerror
            raise self.fail("path", f"'{path}' is not writable ({why})",
                            "Grant this process write access or choose another directory."
                            ) from exc

    def number(self, name: str, default: float | None, minimum: float,
               exclusive: bool = False, integer: bool = False,
               maximum: float | None = None) -> float:
        raw = self.params.get(name, default)
        if raw is None:
            raise self.fail(name, "missing", "Set it to the tier's byte budget in GiB, e.g. 100.")
        try:
            value = float(raw)
        except (TypeError, ValueError):
            raise self.fail(name, f"'{raw}' is not a number", "Give a number.") from None
        if value != value or value in (float("inf"), float("-inf")):
            raise self.fail(name, f"'{raw}' is not a finite number", "Give a finite number.")
        if integer and value != int(value):
            raise self.fail(name, f"'{raw}' is not a whole number", "Give an integer.")
        if value < minimum or (exclusive and value == minimum):
            bound = f"greater than {minimum:g}" if exclusive else f"at least {minimum:g}"
            raise self.fail(name, f"{raw} is out of range", f"It must be {bound}.")
        if maximum is not None and value > maximum:
            raise self.fail(name, f"{raw} is out of range", f"It must be at most {maximum:g}.")
        return value

    def choice(self, name: str, default: str, allowed: tuple[str, ...]) -> str:
        raw = self.params.get(name, default)
        if isinstance(raw, bool) and "on" in allowed:
            raw = "on" if raw else "off"  # YAML 1.1 reads unquoted on/off as booleans
        value = str(raw).strip().lower()
        if value not in allowed:
            raise self.fail(name, f"'{value}' is not a valid choice",
                            f"Use one of: {', '.join(allowed)}.")
        return value

    def flag(self, name: str, default: bool) -> bool:
        raw = self.params.get(name, default)
        if isinstance(raw, bool):
            return raw
        value = str(raw).strip().lower()
        if value in ("true", "1", "yes", "on"):
            return True
        if value in ("false", "0", "no", "off"):
            return False
        raise self.fail(name, f"'{raw}' is not a boolean", "Use true or false.")

    def file_mode(self, default: int) -> int:
        raw = self.params.get("file_mode", default)
        try:
            mode = int(raw, 8) if isinstance(raw, str) else int(raw)
        except (TypeError, ValueError):
            raise self.fail("file_mode", f"'{raw}' is not an octal mode",
                            "Give an octal string such as '0600'.") from None
        if not 0 <= mode <= 0o777 or not mode & 0o600 == 0o600:
            raise self.fail("file_mode", f"{oct(mode)} is not usable",
                            "The owner needs read and write (e.g. '0600' or '0640').")
        return mode
