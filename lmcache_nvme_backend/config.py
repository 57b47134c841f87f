"""Settings of the NVMe tier: ``nvme.<name>`` keys in LMCache's ``extra_config``, the bare
``<name>`` in an L2 adapter's ``adapter_params``.

Each :class:`NVMeSettings` field carries its validation rule in its ``metadata``; a problem
is an ``NVMeConfigError`` naming the key and the fix (the tier raises the first, ``review``
lists all).  Validating writes nothing: paths are only looked at.
"""

from __future__ import annotations

import difflib
import enum
from collections.abc import Callable, Mapping
from dataclasses import MISSING, Field, dataclass, field, fields
from pathlib import Path
from typing import Any

from .disk.layout import BUILD_RE
from .disk.probe import path_problem, probe_path
from .disk.safe_fs import dir_mode_for

EXTRA_CONFIG_PREFIX = "nvme."
# The L2 adapter's settings are JSON fields: errors name them as adapter_params.<name>.
ADAPTER_PARAMS_PREFIX = "adapter_params."
GIB = 1024**3
MIB = 1024**2
# nvme.min_free_gb "auto": this share of the filesystem, at most MIN_FREE_AUTO_CAP.
MIN_FREE_AUTO_FRACTION = 0.05
MIN_FREE_AUTO_CAP = GIB
# nvme.io_deadline_s at most this (a deadline longer than a network filesystem's own
# timeouts, e.g. GlusterFS's 42 s ping-timeout, would never fire)
IO_DEADLINE_MAX_S = 600.0
# nvme.io_deadline_s "auto": this deadline on a network filesystem, none on a local one
IO_DEADLINE_AUTO_S = 5.0


def adapter_params_of(params: Mapping[str, Any]) -> dict[str, Any]:
    """The settings in an L2 adapter's ``adapter_params`` (LMCache may pass its ``type``)."""
    return {k: v for k, v in params.items() if k != "type"}


def min_free_bytes_for(min_free_gb: float | None, filesystem_bytes: int) -> int:
    """The free-space guard in bytes on a filesystem of ``filesystem_bytes``: ``min_free_gb``
    GiB, or for ``None`` (``auto``) 5% of the filesystem, at most 1 GiB."""
    if min_free_gb is not None:
        return int(min_free_gb * GIB)
    return min(MIN_FREE_AUTO_CAP, int(filesystem_bytes * MIN_FREE_AUTO_FRACTION))


def io_deadline_for(io_deadline_s: float | None, network_filesystem: bool) -> float:
    """The read deadline of one path in seconds (0: none, reads go straight into the
    caller's buffers): ``io_deadline_s``, or for ``None`` (``auto``) ``IO_DEADLINE_AUTO_S``
    on a network filesystem and none on a local one."""
    if io_deadline_s is not None:
        return io_deadline_s
    return IO_DEADLINE_AUTO_S if network_filesystem else 0.0


class NVMeConfigError(ValueError):
    """A setting of the NVMe tier is missing or invalid; the message names it and the fix."""


class StrChoice(str, enum.Enum):
    """An enum member that is also its string: ``str()``, f-strings, ``%s`` and JSON give
    ``full``, not ``FsyncPolicy.FULL``."""

    def __str__(self) -> str:
        return str.__str__(self)

    def __format__(self, format_spec: str) -> str:
        return str.__format__(str.__str__(self), format_spec)


class DirectIOMode(StrChoice):
    """``direct_io``: probe O_DIRECT and fall back, require it, or never use it."""

    AUTO = "auto"
    ON = "on"
    OFF = "off"


class QueueFullPolicy(StrChoice):
    """``queue_full_policy``: what a store does when the write-back queue is full."""

    DROP = "drop"
    WAIT = "wait"


class FsyncPolicy(StrChoice):
    """``fsync``: how durable a published chunk file is."""

    NONE = "none"
    DATA = "data"
    FULL = "full"


class NativeIOMode(StrChoice):
    """``native_io``: the compiled I/O engine (``io/native.py``) when built, required, or never."""

    AUTO = "auto"
    ON = "on"
    OFF = "off"


class GdsMode(StrChoice):
    """``gds_mode``: the GPU read path (``docs/gpu.md``)."""

    AUTO = "auto"
    ON = "on"
    OFF = "off"


# -- validation rules, one per kind of setting -----------------------------------------------

_Fail = Callable[[str, str], NVMeConfigError]  # (problem, fix) -> error naming the key
_RULE = "nvme_rule"
_KEY = "nvme_key"


class _Rule:
    """How one setting's raw value becomes its validated value."""

    def parse(self, raw: Any, fail: _Fail) -> Any:
        raise NotImplementedError


@dataclass(frozen=True)
class _Number(_Rule):
    minimum: float
    exclusive: bool = False  # the minimum itself is out of range
    integer: bool = False
    maximum: float | None = None

    def parse(self, raw: Any, fail: _Fail) -> float | int:
        if raw is None:
            raise fail("missing", "Set it to the tier's byte budget in GiB, e.g. 100.")
        try:
            value = float(raw)
        except (TypeError, ValueError):
            raise fail(f"'{raw}' is not a number", "Give a number.") from None
        if value != value or value in (float("inf"), float("-inf")):
            raise fail(f"'{raw}' is not a finite number", "Give a finite number.")
        if self.integer and value != int(value):
            raise fail(f"'{raw}' is not a whole number", "Give an integer.")
        if value < self.minimum or (self.exclusive and value == self.minimum):
            bound = (f"greater than {self.minimum:g}" if self.exclusive
                     else f"at least {self.minimum:g}")
            raise fail(f"{raw} is out of range", f"It must be {bound}.")
        if self.maximum is not None and value > self.maximum:
            raise fail(f"{raw} is out of range", f"It must be at most {self.maximum:g}.")
        return int(value) if self.integer else value


@dataclass(frozen=True)
class _NumberOrAuto(_Rule):
    """A number, or ``auto`` / unset (None): a value the store derives at start."""

    number: _Number

    def parse(self, raw: Any, fail: _Fail) -> float | int | None:
        if raw is None or (isinstance(raw, str) and raw.strip().lower() == "auto"):
            return None
        try:
            float(raw)
        except (TypeError, ValueError):
            raise fail(f"'{raw}' is neither a number nor auto",
                       f"Give 'auto' or a number of at least {self.number.minimum:g}.") from None
        return self.number.parse(raw, fail)


@dataclass(frozen=True)
class _Choice(_Rule):
    choices: type[StrChoice]

    def parse(self, raw: Any, fail: _Fail) -> StrChoice:
        allowed = [str(member) for member in self.choices]
        if isinstance(raw, bool) and "on" in allowed:
            raw = "on" if raw else "off"  # YAML 1.1 reads unquoted on/off as booleans
        value = str(raw).strip().lower()
        if value not in allowed:
            raise fail(f"'{value}' is not a valid choice", f"Use one of: {', '.join(allowed)}.")
        return self.choices(value)


class _Flag(_Rule):
    def parse(self, raw: Any, fail: _Fail) -> bool:
        if isinstance(raw, bool):
            return raw
        value = str(raw).strip().lower()
        if value in ("true", "1", "yes", "on"):
            return True
        if value in ("false", "0", "no", "off"):
            return False
        raise fail(f"'{raw}' is not a boolean", "Use true or false.")


class _FileMode(_Rule):
    def parse(self, raw: Any, fail: _Fail) -> int:
        try:
            mode = int(raw, 8) if isinstance(raw, str) else int(raw)
        except (TypeError, ValueError):
            raise fail(f"'{raw}' is not an octal mode",
                       "Give an octal string such as '0600'.") from None
        if not 0 <= mode <= 0o777 or not mode & 0o600 == 0o600:
            raise fail(f"{oct(mode)} is not usable",
                       "The owner needs read and write (e.g. '0600' or '0640').")
        return mode


class _ModelBuild(_Rule):
    """``auto``, ``off``, or a revision of the model's weights (``disk.layout.BUILD_RE``)."""

    def parse(self, raw: Any, fail: _Fail) -> str:
        value = str(raw).strip()
        if value.lower() in ("auto", "off"):
            return value.lower()
        if not BUILD_RE.fullmatch(value):
            raise fail(f"'{value}' is not a usable revision",
                       "Give auto, off, or up to 64 letters, digits, '.', '_' or '-' "
                       "(e.g. a commit or registry version of the weights).")
        return value


class _Directories(_Rule):
    """One directory or several (a list, or a comma-separated string), only looked at (the
    store creates a missing one)."""

    def parse(self, raw: Any, fail: _Fail) -> tuple[Path, ...]:
        if raw is None or raw == "" or raw == []:
            raise fail("missing", "Set it to a directory on the NVMe drive, or a list of "
                       "directories (one per drive), e.g. /mnt/nvme0/lmcache.")
        if isinstance(raw, str):
            items = [p.strip() for p in raw.split(",") if p.strip()]
        elif isinstance(raw, (list, tuple)):
            items = [str(p) for p in raw]
        else:
            raise fail(f"expected a directory or a list of directories, got "
                       f"{type(raw).__name__}", "Give a string or a list of strings.")
        paths: list[Path] = []
        for item in items:
            path = Path(item.removeprefix("file://")).expanduser().absolute()
            if path in paths:
                raise fail(f"'{path}' is listed twice", "List each directory once.")
            problem = path_problem(probe_path(path, look_only=True))
            if problem is not None:
                raise fail(*problem)
            paths.append(path)
        return tuple(paths)


def _setting(rule: _Rule, default: Any = MISSING, key: str | None = None) -> Any:
    """A settings field: its rule, and its key when it differs from the field name."""
    return field(default=default, metadata={_RULE: rule, _KEY: key})


@dataclass(frozen=True)
class NVMeSettings:
    """Validated settings.  ``docs/configuration.md`` documents each one."""

    paths: tuple[Path, ...] = _setting(_Directories(), key="path")
    max_size_gb: float = _setting(_Number(0.0, exclusive=True))
    # None ("auto"): min_free_bytes_for each path's filesystem
    min_free_gb: float | None = _setting(_NumberOrAuto(_Number(0.0)), None)
    direct_io: DirectIOMode = _setting(_Choice(DirectIOMode), DirectIOMode.AUTO)
    io_threads: int = _setting(_Number(1, integer=True), 8)
    # 0: one writer per path
    write_threads: int = _setting(_Number(0, integer=True), 0)
    task_size_mb: float = _setting(_Number(0.0, exclusive=True), 64.0)
    # removed chunk files kept for writes of their size to overwrite (native engine); 0: none
    recycle_mb: float = _setting(_Number(0.0), 256.0)
    # the compiled batch engine (io/native.py): auto = when built, on = refuse without it
    native_io: NativeIOMode = _setting(_Choice(NativeIOMode), NativeIOMode.AUTO)
    write_queue_mb: float = _setting(_Number(0.0, exclusive=True), 1024.0)
    queue_full_policy: QueueFullPolicy = _setting(_Choice(QueueFullPolicy), QueueFullPolicy.DROP)
    fsync: FsyncPolicy = _setting(_Choice(FsyncPolicy), FsyncPolicy.NONE)
    file_mode: int = _setting(_FileMode(), 0o600)
    manifest_interval_s: float = _setting(_Number(0.0), 60.0)
    close_timeout_s: float = _setting(_Number(0.0), 30.0)
    # a read not answered by then is a miss and its path goes out of service; 0: no deadline;
    # None ("auto"): io_deadline_for each path's filesystem
    io_deadline_s: float | None = _setting(
        _NumberOrAuto(_Number(0.0, maximum=IO_DEADLINE_MAX_S)), None)
    # other processes write the same directories
    shared: bool = _setting(_Flag(), False)
    model_build: str = _setting(_ModelBuild(), "auto")
    # GPU read path (docs/gpu.md): used by NVMeBackend on a CUDA dst_device only
    gds_mode: GdsMode = _setting(_Choice(GdsMode), GdsMode.AUTO)
    # 0: no pool of its own, retrieved chunks stay in host memory
    gpu_pool_mb: float = _setting(_Number(0.0), 2048.0)
    kvikio_threads: int = _setting(_Number(1, integer=True), 16)
    kvikio_task_size_mb: float = _setting(_Number(0.0, exclusive=True), 4.0)
    # Observability (docs/metrics.md)
    # 0: no endpoint of its own; the default registry is always filled
    metrics_port: int = _setting(_Number(0, integer=True, maximum=65535), 0)
    # 0: no periodic stats line
    stats_log_interval_s: float = _setting(_Number(0.0), 0.0)
    # Not a setting: the prefix of the keys these were read from (``nvme.``, ``adapter_params.``
    # or none), so that errors found when the store opens its directories name the key too.
    key_prefix: str = field(default=EXTRA_CONFIG_PREFIX, compare=False, repr=False,
                            metadata={_RULE: None, _KEY: None})

    @property
    def max_size_bytes(self) -> int:
        return int(self.max_size_gb * GIB)

    @property
    def dir_mode(self) -> int:
        """Mode of the directories the tier creates (``file_mode`` plus search bits)."""
        return dir_mode_for(self.file_mode)

    @property
    def recycle_bytes(self) -> int:
        """Bytes of removed chunk files the native engine keeps for reuse: ``recycle_mb``, at
        most 1 % of the budget; none in shared mode (removals are the ledger's to record)."""
        return 0 if self.shared else min(int(self.recycle_mb * MIB), self.max_size_bytes // 100)

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
        return list(_settings())

    @classmethod
    def from_extra_config(cls, extra_config: Mapping[str, Any] | None) -> NVMeSettings:
        """Read the ``nvme.*`` keys of LMCache's ``extra_config``."""
        return cls.from_params(cls.extra_config_params(extra_config),
                               key_prefix=EXTRA_CONFIG_PREFIX)

    @classmethod
    def from_params(cls, params: Mapping[str, Any], key_prefix: str = "") -> NVMeSettings:
        """Validate bare setting names (``path``, ``max_size_gb``, ...); raise the first problem."""
        review = cls.review(params, key_prefix)
        if review.settings is None:
            raise review.errors[0]
        return review.settings

    @classmethod
    def review(cls, params: Mapping[str, Any], key_prefix: str = "") -> SettingsReview:
        """Every problem of bare setting names (unknown keys first, then in field order) and
        the values that passed."""
        known = _settings()
        errors: list[NVMeConfigError] = []
        for name in params:
            if name not in known:
                close = difflib.get_close_matches(name, list(known), n=1)
                hint = f"did you mean '{key_prefix}{close[0]}'? " if close else ""
                errors.append(_error(
                    key_prefix, name, "unknown setting",
                    f"{hint}Known settings: {', '.join(key_prefix + k for k in known)}."))
        values: dict[str, Any] = {}
        for name, f in known.items():
            default = None if f.default is MISSING else f.default
            try:
                values[f.name] = f.metadata[_RULE].parse(params.get(name, default),
                                                         _failer(key_prefix, name))
            except NVMeConfigError as exc:
                errors.append(exc)
        settings = None if errors else cls(**values, key_prefix=key_prefix)
        return SettingsReview(settings, errors, values)

    @classmethod
    def extra_config_params(cls, extra_config: Mapping[str, Any] | None) -> dict[str, Any]:
        """The ``nvme.*`` keys of LMCache's ``extra_config``, without the prefix."""
        return {key[len(EXTRA_CONFIG_PREFIX):]: value
                for key, value in (extra_config or {}).items()
                if key.startswith(EXTRA_CONFIG_PREFIX)}

    @classmethod
    def parse_setting(cls, name: str, raw: Any, key_prefix: str = EXTRA_CONFIG_PREFIX) -> Any:
        """One setting's value as the tier reads it (``name`` bare, e.g. ``gds_mode``); raises
        :class:`NVMeConfigError`."""
        f = _settings().get(name)
        if f is None:
            raise _error(key_prefix, name, "unknown setting",
                         f"Known settings: {', '.join(cls.setting_names())}.")
        return f.metadata[_RULE].parse(raw, _failer(key_prefix, name))


def _settings() -> dict[str, Field[Any]]:
    """The fields of :class:`NVMeSettings` that are settings (each has a rule), by key."""
    return {f.metadata[_KEY] or f.name: f for f in fields(NVMeSettings)
            if f.metadata[_RULE] is not None}


def _error(prefix: str, name: str, problem: str, fix: str) -> NVMeConfigError:
    return NVMeConfigError(f"{prefix}{name}: {problem}. {fix}")


def _failer(prefix: str, name: str) -> _Fail:
    return lambda problem, fix: _error(prefix, name, problem, fix)


@dataclass(frozen=True)
class SettingsReview:
    """What :meth:`NVMeSettings.review` found: the settings (None on a problem), every
    problem, and each value that passed (by field name)."""

    settings: NVMeSettings | None
    errors: list[NVMeConfigError]
    values: dict[str, Any]
