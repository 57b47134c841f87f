"""Names of the multiprocess server's chunks: an ``ObjectKey`` as a key string (LMCache's
``fs`` adapter's reversible ``model@rank@group@hash[@salt]``) and namespace (model[@salt]).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import cast

from .lmcache_range import lmcache_imports

with lmcache_imports():
    from lmcache.v1.distributed.api import ObjectKey

#: ``columns(keys, namespaces)`` of ``adapters/csrc/keys.c``: ``(names, namespaces or None)``,
#: or None when a key is one only this module formats.
_NativeColumns = Callable[[Sequence[ObjectKey], bool], "tuple[list[str], list[str] | None] | None"]
_native_columns: _NativeColumns | None
try:  # the same strings, formatted in C (setup.py builds it where a compiler is)
    from ._keys import columns as _built_columns
    _native_columns = _built_columns
except ImportError:  # a build without a C compiler: formatted below
    _native_columns = None

_SEP = "@"
# printf-style: one C call per key (310 ns a key against 405 for the f-string, whose two
# format specs each go through a format call)
_KEY_FORMAT = f"%s{_SEP}%#010x{_SEP}%x{_SEP}%s"


def object_key_string(key: ObjectKey) -> str:
    """The chunk's key string: ``model@0xRANK@GROUP@HASH`` plus ``@salt`` when salted;
    reversible, since ``ObjectKey`` rejects ``@`` in a model name or salt."""
    return object_key_strings([key])[0]


def object_key_parts(key: ObjectKey) -> tuple[str, str]:
    """:func:`object_key_string` and :func:`object_key_namespace` of ``key``, together."""
    names, namespaces = object_key_columns([key])
    return names[0], namespaces[0]


def object_key_strings(keys: Sequence[ObjectKey]) -> list[str]:
    """:func:`object_key_string` of each key."""
    return _key_columns(keys, False)[0]


def _key_columns(keys: Sequence[ObjectKey], with_namespaces: bool
                 ) -> tuple[list[str], list[str] | None]:
    """The key strings (and the namespaces when asked): the native formatter's when it takes
    every key (``adapters/csrc/keys.c``: about a fifth of the interpreter's instructions),
    else this module's definitions'."""
    if _native_columns is not None:
        formatted = _native_columns(keys, with_namespaces)
        if formatted is not None:
            return formatted
    return _format_key_strings(keys), _format_namespaces(keys) if with_namespaces else None


def _format_key_strings(keys: Sequence[ObjectKey]) -> list[str]:
    """The definition of the key strings: one list comprehension, no call per key.
    Formatted afresh each time: a cache of the parts around the chunk hash saved ~0.2 µs a
    key with a few ranks, and cost ~0.7 µs a key where every key has a rank of its own
    (LMCache's ``bench l2``)."""
    names = [_KEY_FORMAT % (key.model_name, key.kv_rank, key.object_group_id,
                            key.chunk_hash.hex()) for key in keys]
    salts = [key.cache_salt for key in keys]
    if any(salts):
        return [f"{name}{_SEP}{salt}" if salt else name
                for name, salt in zip(names, salts, strict=True)]
    return names


def object_key_columns(keys: Sequence[ObjectKey]) -> tuple[list[str], list[str]]:
    """The key strings and the namespaces of ``keys``, as two lists."""
    names, namespaces = _key_columns(keys, True)
    return names, cast("list[str]", namespaces)


def _format_namespaces(keys: Sequence[ObjectKey]) -> list[str]:
    """The definition of the namespaces (:func:`object_key_namespace`)."""
    return [f"{key.model_name}{_SEP}{key.cache_salt}" if key.cache_salt else key.model_name
            for key in keys]


def parse_object_key_string(text: str) -> ObjectKey | None:
    """Inverse of :func:`object_key_string`; None for anything else."""
    parts = text.split(_SEP)
    if len(parts) not in (4, 5):
        return None
    try:
        return ObjectKey(chunk_hash=bytes.fromhex(parts[3]), model_name=parts[0],
                         kv_rank=int(parts[1], 16), object_group_id=int(parts[2], 16),
                         cache_salt=parts[4] if len(parts) == 5 else "")
    except ValueError:
        return None


def object_key_namespace(key: ObjectKey) -> str:
    """Per-model, per-``cache_salt`` namespace (its own directory in each root)."""
    return object_key_parts(key)[1]
