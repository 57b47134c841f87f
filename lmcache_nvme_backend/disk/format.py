"""On-disk chunk file format (version 2; version 1 files are still read).

One KV chunk is one file::

    offset 0      4 KiB header (this module)
    offset 4096   payload (the memory object's bytes), zero padded to a 4 KiB multiple

so O_DIRECT and GPUDirect Storage can read the payload in place (``docs/format.md``).  A
checksum covers every header byte and the full key is stored; decoding never allocates
more than the header.  Version 2's payload checksum is the xxh3-64 of the xxh3-64 of each
``BLOCK_SIZE`` block (hashed as it lands); version 1's is one xxh3-64 over the payload.
"""

from __future__ import annotations

import functools
import json
import math
import re
import struct
import time
from collections.abc import Sequence
from dataclasses import dataclass

import xxhash

MAGIC = b"LMCNVME\x00"
FORMAT_VERSION = 2  # what writers write
READABLE_VERSIONS = (1, 2)
# Version 2: payload bytes per checksummed block (a reader's I/O pieces are multiples of it).
BLOCK_SIZE = 1 << 20
HEADER_SIZE = 4096
ALIGNMENT = 4096
# Largest payload any reader accepts; a header claiming more is corrupt.
MAX_PAYLOAD_BYTES = 1 << 36

# magic, version, header_size, flags, payload_len, payload_xxh3_64,
# created_unix_ns, key_len, namespace_len, tensor_meta_len
_FIXED = struct.Struct("<8sHHIQQQHHH")
_HEADER_CHECKSUM = struct.Struct("<Q")
_HEADER_CHECKSUM_OFFSET = HEADER_SIZE - _HEADER_CHECKSUM.size
_VARIABLE_SPACE = _HEADER_CHECKSUM_OFFSET - _FIXED.size
# Optional field (flag bit 0): the payload's GPU checksum (``gpusum.py``, lin32x2),
# two u64 just before the header checksum.  Readers that ignore flags still accept
# the file: the field lies in the zero fill that the header checksum covers.
FLAG_GPU_CHECKSUM = 0x1
_GPU_CHECKSUM = struct.Struct("<QQ")
_GPU_CHECKSUM_OFFSET = _HEADER_CHECKSUM_OFFSET - _GPU_CHECKSUM.size


class FormatError(ValueError):
    """A file is not a valid chunk file of this format (corrupt, foreign or mismatched)."""


# What tensor metadata a real chunk can hold; anything outside is a FormatError.
MAX_TENSORS = 64
MAX_DIMS = 8
MAX_FMT = 255
_MAX_META_DEPTH = 3  # {"shapes": [[...]]}
_DTYPE_RE = re.compile(r"^[a-z][a-z0-9_]{0,31}$")
# Bytes per element of the dtypes LMCache uses; an unknown (future) dtype name counts as
# the largest, so the allocation a header can ask for stays bounded.
DTYPE_SIZES = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "complex128": 16,
    "complex64": 8, "complex32": 4, "uint8": 1, "uint16": 2, "uint32": 4, "uint64": 8,
    "int8": 1, "int16": 2, "int32": 4, "int64": 8, "bool": 1, "float8_e4m3fn": 1,
    "float8_e4m3fnuz": 1, "float8_e5m2": 1, "float8_e5m2fnuz": 1, "float8_e8m0fnu": 1,
    "float4_e2m1fn_x2": 1,
}
_MAX_DTYPE_SIZE = 16


def _reject_constant(name: str) -> object:
    raise FormatError(f"non-finite number {name} in tensor metadata")


def _reject_float(text: str) -> object:
    raise FormatError(f"fractional number {text[:20]} in tensor metadata")


def _json_depth(raw: bytes) -> int:
    """Deepest nesting of brackets (strings not excluded: our strings hold none)."""
    depth = deepest = 0
    for byte in raw:
        if byte in (0x5B, 0x7B):  # [ {
            depth += 1
            deepest = max(deepest, depth)
        elif byte in (0x5D, 0x7D):
            depth -= 1
    return deepest


def _whole(value: object, what: str, high: int) -> int:
    """A JSON integer (never a bool or a float) within 0..high."""
    if type(value) is not int or not 0 <= value <= high:
        raise FormatError(f"tensor metadata {what} {str(value)[:40]!s} is out of range")
    return value


@dataclass(frozen=True)
class TensorMeta:
    """What a reader needs to allocate the destination memory object (``nbytes``: the
    payload length)."""

    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]
    fmt: int
    nbytes: int

    def to_json(self) -> bytes:
        """Compact JSON as stored in the header (built once per instance)."""
        return self._json

    @functools.cached_property
    def _json(self) -> bytes:
        return json.dumps({"shapes": [list(s) for s in self.shapes], "dtypes": list(self.dtypes),
                           "fmt": self.fmt, "nbytes": self.nbytes}, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> TensorMeta:
        """Parse stored metadata defensively: any value a real chunk cannot hold is a
        ``FormatError``.  Results (not errors) are cached by the raw bytes."""
        return _parse_meta(bytes(raw))


@functools.lru_cache(maxsize=1024)
def _parse_meta(raw: bytes) -> TensorMeta:
    if len(raw) > HEADER_SIZE:
        raise FormatError(f"tensor metadata of {len(raw)} bytes")
    if _json_depth(raw) > _MAX_META_DEPTH:
        raise FormatError("tensor metadata nested too deeply")
    try:
        doc = json.loads(raw, parse_constant=_reject_constant, parse_float=_reject_float)
    except FormatError:
        raise
    except (ValueError, RecursionError) as exc:
        raise FormatError(f"unreadable tensor metadata: {exc}") from exc
    if not isinstance(doc, dict):
        raise FormatError("tensor metadata is not an object")
    shapes_doc, dtypes_doc = doc.get("shapes"), doc.get("dtypes")
    if not isinstance(shapes_doc, list) or not isinstance(dtypes_doc, list):
        raise FormatError("tensor metadata lacks shapes or dtypes lists")
    if not 1 <= len(shapes_doc) <= MAX_TENSORS or len(shapes_doc) != len(dtypes_doc):
        raise FormatError("tensor metadata has mismatched shapes and dtypes")
    shapes = []
    for shape in shapes_doc:
        if not isinstance(shape, list) or len(shape) > MAX_DIMS:
            raise FormatError("tensor metadata shape is not a list of at most "
                              f"{MAX_DIMS} sizes")
        shapes.append(tuple(_whole(d, "dimension", MAX_PAYLOAD_BYTES) for d in shape))
    dtypes = []
    for dtype in dtypes_doc:
        if not isinstance(dtype, str) or not _DTYPE_RE.match(dtype):
            raise FormatError(f"tensor metadata dtype {str(dtype)[:40]!r} is not a dtype name")
        dtypes.append(dtype)
    fmt = _whole(doc.get("fmt"), "fmt", MAX_FMT)
    nbytes = _whole(doc.get("nbytes"), "nbytes", MAX_PAYLOAD_BYTES)
    allocation = sum(math.prod(shape) * DTYPE_SIZES.get(dtype, _MAX_DTYPE_SIZE)
                     for shape, dtype in zip(shapes, dtypes, strict=True))
    if allocation > MAX_PAYLOAD_BYTES:
        raise FormatError(f"tensor metadata asks for {allocation} bytes")
    return TensorMeta(shapes=tuple(shapes), dtypes=tuple(dtypes), fmt=fmt, nbytes=nbytes)


@dataclass(frozen=True)
class ChunkHeader:
    """Decoded header of one chunk file."""

    key: str
    namespace: str
    tensor_meta: TensorMeta
    payload_len: int
    payload_checksum: int  # v2: xxh3-64 of the block digests; v1: xxh3-64 of the payload
    created_unix_ns: int
    # (sum_a, sum_b) of gpusum.host_checksum, when the writer recorded it
    gpu_checksum: tuple[int, int] | None = None
    version: int = FORMAT_VERSION

    @property
    def file_size(self) -> int:
        return file_size_for(self.payload_len)


def padded_length(n: int) -> int:
    """``n`` rounded up to the 4 KiB alignment."""
    return (n + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT


@functools.lru_cache(maxsize=256)
def file_size_for(payload_len: int) -> int:
    """Bytes a chunk file with this payload occupies, header and padding included."""
    return HEADER_SIZE + padded_length(payload_len)


def block_digests(data: memoryview | bytes) -> list[int]:
    """xxh3-64 of each ``BLOCK_SIZE`` block of ``data`` (which starts at a block boundary
    of the payload; the last block may be short)."""
    view = memoryview(data).cast("B") if not isinstance(data, bytes) else memoryview(data)
    return [xxhash.xxh3_64_intdigest(view[start : start + BLOCK_SIZE])
            for start in range(0, len(view), BLOCK_SIZE)]


def combine_block_digests(digests: Sequence[int]) -> int:
    """The version 2 payload checksum: xxh3-64 of the block digests as little-endian u64."""
    return xxhash.xxh3_64_intdigest(struct.pack(f"<{len(digests)}Q", *digests))


def payload_checksum(payload: memoryview | bytes, version: int = FORMAT_VERSION) -> int:
    """The payload checksum a header of ``version`` stores for ``payload``."""
    if version == 1:
        return xxhash.xxh3_64_intdigest(payload)
    return combine_block_digests(block_digests(payload))


def text_bytes(text: str) -> bytes:
    """UTF-8 of a key or namespace; lone surrogates (names decoded from raw bytes) pass."""
    try:
        return text.encode()  # the strict codec's fast path: the same bytes where it succeeds
    except UnicodeEncodeError:
        return text.encode("utf-8", "surrogatepass")


def texts_bytes(texts: Sequence[str]) -> list[bytes]:
    """``text_bytes`` of each text, without a Python call per text unless one holds a lone
    surrogate."""
    try:
        return list(map(str.encode, texts))
    except UnicodeEncodeError:
        return list(map(text_bytes, texts))


#: ``text_bytes`` of a namespace, cached (a process sees a few).
namespace_bytes = functools.lru_cache(maxsize=1024)(text_bytes)


def max_key_bytes(namespace: str, tensor_meta: TensorMeta) -> int:
    """How many UTF-8 bytes of key still fit beside this namespace and metadata."""
    return _VARIABLE_SPACE - len(namespace_bytes(namespace)) - len(tensor_meta.to_json())


def encode_header(key: str, namespace: str, tensor_meta: TensorMeta, payload_len: int,
                  checksum: int, created_unix_ns: int | None = None,
                  gpu_checksum: tuple[int, int] | None = None,
                  version: int = FORMAT_VERSION) -> bytes:
    """Build the 4 KiB header (``FormatError`` when the strings do not fit; ``gpu_checksum``
    left out when they leave no room); ``version`` 1 only for tests of old caches."""
    if version not in READABLE_VERSIONS:
        raise FormatError(f"cannot write format version {version}")
    if tensor_meta.nbytes != payload_len:
        raise FormatError(f"tensor metadata says {tensor_meta.nbytes} bytes, payload is "
                          f"{payload_len}")
    return encode_raw_header(text_bytes(key), text_bytes(namespace), tensor_meta.to_json(),
                             payload_len, checksum,
                             time.time_ns() if created_unix_ns is None else created_unix_ns,
                             gpu_checksum, version)


def encode_raw_header(key: bytes, namespace: bytes, meta: bytes, payload_len: int,
                      checksum: int, created_unix_ns: int,
                      gpu_checksum: tuple[int, int] | None = None,
                      version: int = FORMAT_VERSION) -> bytes:
    """``encode_header`` from the strings already encoded, as the Python engine has them
    (``csrc/chunkio.c`` ``chunk_encode_header`` writes the same bytes)."""
    strings = len(key) + len(namespace) + len(meta)
    if strings > _VARIABLE_SPACE:
        raise FormatError(f"key, namespace and tensor metadata need {strings} bytes; a "
                          f"header holds {_VARIABLE_SPACE}")
    if not 0 <= payload_len <= MAX_PAYLOAD_BYTES:
        raise FormatError(f"payload length {payload_len} out of range")
    if gpu_checksum is not None and _FIXED.size + strings > _GPU_CHECKSUM_OFFSET:
        gpu_checksum = None
    body = bytearray(HEADER_SIZE)
    _FIXED.pack_into(body, 0, MAGIC, version, HEADER_SIZE,
                     0 if gpu_checksum is None else FLAG_GPU_CHECKSUM, payload_len, checksum,
                     created_unix_ns, len(key), len(namespace), len(meta))
    body[_FIXED.size : _FIXED.size + strings] = key + namespace + meta
    if gpu_checksum is not None:
        _GPU_CHECKSUM.pack_into(body, _GPU_CHECKSUM_OFFSET, *gpu_checksum)
    _HEADER_CHECKSUM.pack_into(body, _HEADER_CHECKSUM_OFFSET, xxhash.xxh3_64_intdigest(
        memoryview(body)[:_HEADER_CHECKSUM_OFFSET]))
    return bytes(body)


def quick_verdict(header: bytes, key: bytes, meta: bytes, payload_len: int,
                  computed: int) -> bool:
    """Whether ``validate.judge_chunk`` would serve ``header`` for exactly ``key``,
    ``payload_len``, ``meta`` and payload checksum ``computed`` (as ``csrc/chunkio.c``)."""
    if len(header) < HEADER_SIZE or header[:8] != MAGIC:
        return False
    (_, version, header_size, flags, stored_len, stored_sum, _, key_len, ns_len,
     meta_len) = _FIXED.unpack_from(header)
    if version not in READABLE_VERSIONS or header_size != HEADER_SIZE:
        return False
    if xxhash.xxh3_64_intdigest(header[:_HEADER_CHECKSUM_OFFSET]) != \
            _HEADER_CHECKSUM.unpack_from(header, _HEADER_CHECKSUM_OFFSET)[0]:
        return False
    strings_end = _FIXED.size + key_len + ns_len + meta_len
    if strings_end > _HEADER_CHECKSUM_OFFSET or \
            (flags & FLAG_GPU_CHECKSUM and strings_end > _GPU_CHECKSUM_OFFSET):
        return False
    at = _FIXED.size
    if stored_len != payload_len or header[at : at + key_len] != key:
        return False
    try:  # a namespace judge_chunk could decode (lone surrogates pass, as keys may hold them)
        header[at + key_len : at + key_len + ns_len].decode("utf-8", "surrogatepass")
    except UnicodeDecodeError:
        return False
    return header[at + key_len + ns_len : strings_end] == meta and stored_sum == computed


def stated_version(raw: bytes | memoryview) -> int | None:
    """The format version a raw header claims before any check (None: not ours), so a
    reader can skip work only one version needs; ``decode_header`` judges it later."""
    if len(raw) < _FIXED.size or bytes(raw[: len(MAGIC)]) != MAGIC:
        return None
    return int.from_bytes(raw[len(MAGIC) : len(MAGIC) + 2], "little")


def decode_header(raw: bytes | memoryview) -> ChunkHeader:
    """Parse and validate a header.  Raises ``FormatError`` for anything not ours or damaged."""
    if len(raw) < HEADER_SIZE:
        raise FormatError(f"header is {len(raw)} bytes, expected {HEADER_SIZE}")
    raw = bytes(raw[:HEADER_SIZE])
    (magic, version, header_size, flags, payload_len, checksum, created, key_len, ns_len,
     meta_len) = _FIXED.unpack_from(raw)
    if magic != MAGIC:
        raise FormatError("bad magic: not a chunk file of this format")
    if version not in READABLE_VERSIONS:
        raise FormatError(f"format version {version}, this reader understands "
                          f"{' and '.join(map(str, READABLE_VERSIONS))}")
    if header_size != HEADER_SIZE:
        raise FormatError(f"header size {header_size}, expected {HEADER_SIZE}")
    (stored,) = _HEADER_CHECKSUM.unpack_from(raw, _HEADER_CHECKSUM_OFFSET)
    if xxhash.xxh3_64_intdigest(raw[:_HEADER_CHECKSUM_OFFSET]) != stored:
        raise FormatError("header checksum mismatch")
    if key_len + ns_len + meta_len > _VARIABLE_SPACE:
        raise FormatError("header string lengths exceed the header")
    if payload_len > MAX_PAYLOAD_BYTES:
        raise FormatError(f"payload length {payload_len} exceeds the format limit")
    pos = _FIXED.size
    try:
        key = raw[pos : pos + key_len].decode("utf-8", "surrogatepass")
        namespace = raw[pos + key_len : pos + key_len + ns_len].decode("utf-8", "surrogatepass")
    except UnicodeDecodeError as exc:
        raise FormatError("key or namespace is not UTF-8") from exc
    meta = TensorMeta.from_json(raw[pos + key_len + ns_len : pos + key_len + ns_len + meta_len])
    if meta.nbytes != payload_len:
        raise FormatError("tensor metadata and payload length disagree")
    gpu_checksum: tuple[int, int] | None = None
    if flags & FLAG_GPU_CHECKSUM:
        if pos + key_len + ns_len + meta_len > _GPU_CHECKSUM_OFFSET:
            raise FormatError("header strings overlap the GPU checksum field")
        gpu_checksum = _GPU_CHECKSUM.unpack_from(raw, _GPU_CHECKSUM_OFFSET)
    return ChunkHeader(key, namespace, meta, payload_len, checksum, created, gpu_checksum,
                       version)
