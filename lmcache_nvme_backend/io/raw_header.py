"""Chunk headers from and against raw bytes, as the engines see them.

An engine is handed a chunk's key, namespace and tensor metadata already encoded (the
batch shapes of ``engine.py``), and checks a header that landed against the bytes it was
asked for.  ``disk/format.py`` is the format's reference (text and ``TensorMeta`` in,
every field decoded and judged out); these are the same bytes and checks on raw values,
step for step as ``csrc/chunkio.c`` (``chunk_encode_header``, ``quick_verdict``) does them:
``encode_raw_header`` writes what ``format.encode_header`` writes for the same values, and
``quick_verdict`` passes exactly the headers that ``disk/validate.judge_chunk`` would serve
for that key, length and metadata (anything else goes to it, which names the defect).
"""

from __future__ import annotations

import struct

import xxhash

from ..disk.format import (
    FLAG_GPU_CHECKSUM,
    FORMAT_VERSION,
    HEADER_SIZE,
    MAGIC,
    MAX_PAYLOAD_BYTES,
    READABLE_VERSIONS,
)

# magic, version, header_size, flags, payload_len, payload checksum, created_unix_ns,
# key_len, namespace_len, tensor_meta_len (docs/format.md)
_FIXED = struct.Struct("<8sHHIQQQHHH")
_U64 = struct.Struct("<Q")
_GPU = struct.Struct("<QQ")
_CHECKSUM_AT = HEADER_SIZE - _U64.size
_GPU_AT = _CHECKSUM_AT - _GPU.size
_VARIABLE_SPACE = _CHECKSUM_AT - _FIXED.size


def encode_raw_header(key: bytes, namespace: bytes, meta: bytes, payload_len: int,
                      checksum: int, created_unix_ns: int,
                      gpu_checksum: tuple[int, int] | None = None) -> bytes:
    """The 4 KiB version 2 header of a chunk; ``ValueError`` when the strings do not fit
    or the payload is longer than the format allows.  ``gpu_checksum`` is left out (flag
    clear) when the strings leave no room for its 16 bytes."""
    strings = len(key) + len(namespace) + len(meta)
    if strings > _VARIABLE_SPACE or not 0 <= payload_len <= MAX_PAYLOAD_BYTES:
        raise ValueError(f"key, namespace and metadata need {strings} bytes (a header holds "
                         f"{_VARIABLE_SPACE}), payload {payload_len} bytes")
    if gpu_checksum is not None and _FIXED.size + strings > _GPU_AT:
        gpu_checksum = None
    body = bytearray(HEADER_SIZE)
    _FIXED.pack_into(body, 0, MAGIC, FORMAT_VERSION, HEADER_SIZE,
                     0 if gpu_checksum is None else FLAG_GPU_CHECKSUM, payload_len, checksum,
                     created_unix_ns, len(key), len(namespace), len(meta))
    at = _FIXED.size
    body[at : at + strings] = key + namespace + meta
    if gpu_checksum is not None:
        _GPU.pack_into(body, _GPU_AT, *gpu_checksum)
    _U64.pack_into(body, _CHECKSUM_AT, xxhash.xxh3_64_intdigest(memoryview(body)[:_CHECKSUM_AT]))
    return bytes(body)


def quick_verdict(header: bytes, key: bytes, meta: bytes, payload_len: int,
                  computed: int) -> bool:
    """Whether ``header`` is ours, intact, and names exactly ``key``, ``payload_len`` and
    ``meta``, and ``computed`` (the checksum of the payload that landed) is its payload
    checksum: then ``judge_chunk`` would serve the chunk too."""
    if len(header) < HEADER_SIZE or header[:8] != MAGIC:
        return False
    (_, version, header_size, flags, stored_len, stored_sum, _, key_len, ns_len,
     meta_len) = _FIXED.unpack_from(header)
    if version not in READABLE_VERSIONS or header_size != HEADER_SIZE:
        return False
    if xxhash.xxh3_64_intdigest(header[:_CHECKSUM_AT]) != _U64.unpack_from(header,
                                                                          _CHECKSUM_AT)[0]:
        return False
    strings_end = _FIXED.size + key_len + ns_len + meta_len
    if strings_end > _CHECKSUM_AT or (flags & FLAG_GPU_CHECKSUM and strings_end > _GPU_AT):
        return False
    at = _FIXED.size
    if stored_len != payload_len or header[at : at + key_len] != key:
        return False
    try:  # a namespace judge_chunk could decode (lone surrogates pass, as keys may hold them)
        header[at + key_len : at + key_len + ns_len].decode("utf-8", "surrogatepass")
    except UnicodeDecodeError:
        return False
    return header[at + key_len + ns_len : strings_end] == meta and stored_sum == computed
