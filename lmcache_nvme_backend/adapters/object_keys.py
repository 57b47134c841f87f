"""Names of the multiprocess server's chunks: an ``ObjectKey`` as a key string and namespace.

The key string is the same reversible ``model@rank@group@hash[@salt]`` form
LMCache's ``fs`` L2 adapter uses for file names; the namespace is the model (and
``cache_salt``), so every model and salt gets its own directory.
"""

from __future__ import annotations

import functools

from lmcache.v1.distributed.api import ObjectKey

_SEP = "@"


def object_key_string(key: ObjectKey) -> str:
    """The chunk's key string: ``model@0xRANK@GROUP@HASH`` plus ``@salt`` when salted.

    ``@`` cannot occur in a model name or a salt (``ObjectKey`` rejects it), so
    the string is reversible (:func:`parse_object_key_string`).
    """
    return object_key_parts(key)[0]


def object_key_parts(key: ObjectKey) -> tuple[str, str]:
    """:func:`object_key_string` and :func:`object_key_namespace` of ``key``, together (the
    store path asks for both for every chunk)."""
    head, tail, namespace = _key_affixes(key.model_name, key.kv_rank, key.object_group_id,
                                         key.cache_salt)
    return head + key.chunk_hash.hex() + tail, namespace


@functools.lru_cache(maxsize=4096)
def _key_affixes(model_name: str, kv_rank: int, group: int, salt: str) -> tuple[str, str, str]:
    """What a key string has before and after the chunk hash, and the namespace: a process
    sees few models, ranks and salts, and formats them once each."""
    head = f"{model_name}{_SEP}{kv_rank:#010x}{_SEP}{group:x}{_SEP}"
    if salt:
        return head, f"{_SEP}{salt}", f"{model_name}{_SEP}{salt}"
    return head, "", model_name


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
