"""object_keys: the key strings and namespaces, from the native formatter and from Python.

The key string names the chunk file (its digest) and sits in its header, so the native
formatter (``adapters/csrc/keys.c``) must give exactly what ``_format_key_strings`` /
``_format_namespaces`` define, and pass on whatever it does not format.
"""

from __future__ import annotations

import importlib

import pytest
from lmcache.v1.distributed.api import ObjectKey
from support.prerequisites import missing_prerequisite

from lmcache_nvme_backend.adapters import object_keys
from lmcache_nvme_backend.adapters.object_keys import (
    _format_key_strings,
    _format_namespaces,
    object_key_columns,
    object_key_strings,
    parse_object_key_string,
)


@pytest.fixture(scope="module")
def native_columns() -> object:
    """The native formatter (built by ``pip install``, which a C compiler makes possible)."""
    try:
        return importlib.import_module("lmcache_nvme_backend.adapters._keys").columns
    except ImportError as exc:
        missing_prerequisite(f"the native key formatter was not built ({exc}): install the "
                             "package where a C compiler is (cc)")


def key(rank: int = 5, group: int = 26, salt: str = "", model: str = "org/model",
        chunk_hash: bytes = bytes(range(32))) -> ObjectKey:
    return ObjectKey(chunk_hash=chunk_hash, model_name=model, kv_rank=rank,
                     object_group_id=group, cache_salt=salt)


FORMATTED = [
    key(),
    key(rank=0, group=0),
    key(rank=2**32 - 1),
    key(rank=2**32, group=2**40),  # wider than the 8-digit minimum
    key(rank=2**64 - 1, group=2**64 - 1),
    key(salt="u1"),
    key(salt="x" * 128),
    key(chunk_hash=b""),
    key(chunk_hash=b"\x00\xff" * 300),  # longer than the formatter's stack buffer
    key(model="m" * 600),
    key(model=""),
]

PASSED_ON = [  # the formatter answers None; Python formats them
    key(rank=-1),
    key(rank=2**64),
    key(model="модель/é"),
    key(salt="sél"),
    key(rank=True),  # an int subclass: what %x makes of it is Python's business
]


@pytest.mark.parametrize("k", FORMATTED, ids=range(len(FORMATTED)))
def test_the_native_strings_are_the_defined_ones(native_columns, k: ObjectKey) -> None:
    names, namespaces = native_columns([k, key()], True)
    assert names == _format_key_strings([k, key()])
    assert namespaces == _format_namespaces([k, key()])
    assert native_columns([k], False) == (names[:1], None)
    assert parse_object_key_string(names[0]) == k


@pytest.mark.parametrize("k", PASSED_ON, ids=range(len(PASSED_ON)))
def test_keys_the_formatter_passes_on_are_formatted_in_python(native_columns,
                                                             k: ObjectKey) -> None:
    assert native_columns([key(), k], True) is None
    assert native_columns([k], False) is None
    assert object_key_columns([key(), k]) == (_format_key_strings([key(), k]),
                                              _format_namespaces([key(), k]))
    assert object_key_strings([k, key()]) == _format_key_strings([k, key()])


def test_unsalted_namespaces_are_the_model_name_itself(native_columns) -> None:
    k = key(model="org/" + "model")
    _, namespaces = native_columns([k], True)
    assert namespaces[0] is k.model_name


def test_the_formatter_rejects_what_is_not_a_list_of_keys(native_columns) -> None:
    with pytest.raises(TypeError):
        native_columns(5, True)
    with pytest.raises(AttributeError):
        native_columns([key(), object()], True)
    assert native_columns([], True) == ([], [])


def test_without_the_native_formatter_the_strings_are_the_same(
        monkeypatch: pytest.MonkeyPatch) -> None:
    keys = FORMATTED + PASSED_ON
    with_native = object_key_columns(keys), object_key_strings(keys)
    monkeypatch.setattr(object_keys, "_native_columns", None)
    assert (object_key_columns(keys), object_key_strings(keys)) == with_native
    assert with_native[1] == _format_key_strings(keys)
