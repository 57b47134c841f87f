"""Chunk file header (format version 2, and 1 for old caches): byte layout, round trip, block
checksums and rejection of bad input.

The field offsets used here are the ones ``docs/format.md`` specifies, so these tests also
pin the on-disk format independently of the implementation's own struct definitions.
"""

from __future__ import annotations

import random
import struct
import tracemalloc

import pytest
import xxhash

from lmcache_nvme_backend.disk.format import (
    ALIGNMENT,
    BLOCK_SIZE,
    FORMAT_VERSION,
    HEADER_SIZE,
    MAGIC,
    MAX_PAYLOAD_BYTES,
    FormatError,
    TensorMeta,
    block_digests,
    combine_block_digests,
    decode_header,
    encode_header,
    file_size_for,
    max_key_bytes,
    padded_length,
    payload_checksum,
    stated_version,
    text_bytes,
    texts_bytes,
)

# docs/format.md: magic, version, header_size, flags, payload_len, payload_checksum,
# created_unix_ns, key_len, namespace_len, meta_len; header checksum at 4088.
FIXED = struct.Struct("<8sHHIQQQHHH")
CHECKSUM_OFFSET = 4088
KEY = "llama-3-8b@1@0@00deadbeef@bfloat16"
NS = "llama-3-8b"


def meta(nbytes: int, shapes=((2, 4),), dtypes=("bfloat16",), fmt: int = 1) -> TensorMeta:
    return TensorMeta(shapes=tuple(tuple(s) for s in shapes), dtypes=tuple(dtypes), fmt=fmt,
                      nbytes=nbytes)


def reseal(raw: bytes, **fields: int | bytes) -> bytes:
    """Rewrite fixed header fields and recompute the header checksum, like a careful forger."""
    names = ["magic", "version", "header_size", "flags", "payload_len", "payload_checksum",
             "created", "key_len", "ns_len", "meta_len"]
    values = dict(zip(names, FIXED.unpack_from(raw), strict=True))
    values.update(fields)
    body = bytearray(raw[:HEADER_SIZE])
    FIXED.pack_into(body, 0, *(values[n] for n in names))
    digest = xxhash.xxh3_64_intdigest(bytes(body[:CHECKSUM_OFFSET]))
    struct.pack_into("<Q", body, CHECKSUM_OFFSET, digest)
    return bytes(body)


@pytest.fixture
def header() -> bytes:
    return encode_header(KEY, NS, meta(16), 16, 0x1234, created_unix_ns=42)


# -- round trip -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("shapes", "dtypes", "fmt", "nbytes"),
    [
        (((2, 32, 256, 8, 128),), ("bfloat16",), 1, 2 * 32 * 256 * 8 * 128 * 2),
        (((256, 1024), (256, 1024)), ("float16", "float16"), 3, 2 * 256 * 1024 * 2),
        (((7,), (3, 3), (1, 1, 1)), ("uint8", "float32", "int64"), 0, 7 + 36 + 8),
        (((0,),), ("float8_e4m3fn",), 2, 0),
        (((1 << 20, 1 << 14),), ("float32",), 1, MAX_PAYLOAD_BYTES),
    ],
)
def test_round_trip_preserves_every_field(shapes, dtypes, fmt, nbytes) -> None:
    tm = TensorMeta(shapes=shapes, dtypes=dtypes, fmt=fmt, nbytes=nbytes)
    raw = encode_header(KEY, NS, tm, nbytes, 0xFEEDFACECAFEBEEF, created_unix_ns=123456789)

    assert len(raw) == HEADER_SIZE
    got = decode_header(raw)
    assert got.key == KEY
    assert got.namespace == NS
    assert got.tensor_meta == tm
    assert got.payload_len == nbytes
    assert got.payload_checksum == 0xFEEDFACECAFEBEEF
    assert got.created_unix_ns == 123456789
    assert got.file_size == file_size_for(nbytes)


def test_round_trip_non_ascii_key_and_namespace() -> None:
    key, ns = "modèle/../\u4e2d\u6587@1@0@ab@bf16", "mod\u00e8le-\U0001f600"
    got = decode_header(encode_header(key, ns, meta(8), 8, 0))
    assert (got.key, got.namespace) == (key, ns)


def test_header_bytes_follow_documented_layout() -> None:
    tm = meta(5000)
    raw = encode_header(KEY, NS, tm, 5000, 0xAABBCCDD, created_unix_ns=777)
    (magic, version, header_size, flags, payload_len, checksum, created, key_len, ns_len,
     meta_len) = FIXED.unpack_from(raw)
    assert magic == MAGIC == b"LMCNVME\x00"
    assert (version, header_size, flags) == (FORMAT_VERSION, HEADER_SIZE, 0) == (2, 4096, 0)
    assert (payload_len, checksum, created) == (5000, 0xAABBCCDD, 777)
    key_b, ns_b, meta_b = KEY.encode(), NS.encode(), tm.to_json()
    assert (key_len, ns_len, meta_len) == (len(key_b), len(ns_b), len(meta_b))
    pos = FIXED.size
    assert pos == 46
    end = pos + key_len + ns_len + meta_len
    assert raw[pos:end] == key_b + ns_b + meta_b
    assert raw[end:CHECKSUM_OFFSET] == bytes(CHECKSUM_OFFSET - end)
    (stored,) = struct.unpack_from("<Q", raw, CHECKSUM_OFFSET)
    assert stored == xxhash.xxh3_64_intdigest(raw[:CHECKSUM_OFFSET])


def test_decode_accepts_memoryview_and_ignores_trailing_payload(header: bytes) -> None:
    blob = header + b"payload bytes that follow"
    assert decode_header(memoryview(blob)).key == KEY


def test_created_defaults_to_now() -> None:
    got = decode_header(encode_header(KEY, NS, meta(1), 1, 0))
    assert got.created_unix_ns > 1_600_000_000 * 10**9


def test_version_1_payload_checksum_is_xxh3_64() -> None:
    data = bytes(range(256)) * 3
    assert payload_checksum(data, version=1) == xxhash.xxh3_64_intdigest(data)
    assert payload_checksum(memoryview(data), version=1) == payload_checksum(data, version=1)


@pytest.mark.parametrize("n", [0, 1, BLOCK_SIZE - 1, BLOCK_SIZE, BLOCK_SIZE + 1,
                               3 * BLOCK_SIZE + 17])
def test_version_2_payload_checksum_is_xxh3_of_block_digests(n: int) -> None:
    data = bytes((i * 131 + 7) & 0xFF for i in range(n))
    blocks = [data[i : i + BLOCK_SIZE] for i in range(0, n, BLOCK_SIZE)]
    digests = [xxhash.xxh3_64_intdigest(b) for b in blocks]
    assert block_digests(data) == digests
    expected = xxhash.xxh3_64_intdigest(struct.pack(f"<{len(digests)}Q", *digests))
    assert payload_checksum(data) == combine_block_digests(digests) == expected


def test_block_digests_of_block_aligned_parts_combine_to_the_whole() -> None:
    data = bytes((i * 7) & 0xFF for i in range(5 * BLOCK_SIZE + 100))
    parts = [data[:2 * BLOCK_SIZE], data[2 * BLOCK_SIZE : 4 * BLOCK_SIZE], data[4 * BLOCK_SIZE:]]
    assert combine_block_digests([d for part in parts for d in block_digests(part)]) == \
        payload_checksum(data)


def test_any_changed_byte_or_swapped_blocks_change_the_checksum() -> None:
    data = bytearray(random.Random(3).randbytes(3 * BLOCK_SIZE))
    reference = payload_checksum(bytes(data))
    for offset in (0, BLOCK_SIZE - 1, BLOCK_SIZE, 3 * BLOCK_SIZE - 1):
        flipped = bytearray(data)
        flipped[offset] ^= 0x01
        assert payload_checksum(bytes(flipped)) != reference
    swapped = data[BLOCK_SIZE : 2 * BLOCK_SIZE] + data[:BLOCK_SIZE] + data[2 * BLOCK_SIZE:]
    assert payload_checksum(bytes(swapped)) != reference


def test_version_1_headers_still_decode() -> None:
    raw = encode_header(KEY, NS, meta(10), 10, 99, version=1)
    assert FIXED.unpack_from(raw)[1] == 1
    got = decode_header(raw)
    assert (got.version, got.payload_checksum, got.key) == (1, 99, KEY)
    assert decode_header(encode_header(KEY, NS, meta(10), 10, 99)).version == 2


@pytest.mark.parametrize("raw", [b"", b"LMCNVME", bytes(HEADER_SIZE), b"\x7fELF" + bytes(60)],
                         ids=["empty", "short", "zeros", "elf"])
def test_stated_version_of_anything_not_ours_is_none(raw: bytes) -> None:
    assert stated_version(raw) is None


def test_stated_version_reads_the_claim_before_any_check() -> None:
    assert stated_version(encode_header(KEY, NS, meta(10), 10, 99, version=1)) == 1
    assert stated_version(memoryview(encode_header(KEY, NS, meta(10), 10, 99))) == 2
    damaged = bytearray(encode_header(KEY, NS, meta(10), 10, 99, version=1))
    damaged[CHECKSUM_OFFSET] ^= 0xFF  # decode_header rejects it; the claim is still 1
    assert stated_version(damaged) == 1


def test_encode_refuses_unknown_versions() -> None:
    with pytest.raises(FormatError, match="cannot write format version 3"):
        encode_header(KEY, NS, meta(10), 10, 99, version=3)


# -- sizes ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("n", "padded"),
    [(0, 0), (1, 4096), (4095, 4096), (4096, 4096), (4097, 8192),
     (3 * 2**20 + 17, 3 * 2**20 + 4096)],
)
def test_padded_length_and_file_size(n: int, padded: int) -> None:
    assert padded_length(n) == padded
    assert padded % ALIGNMENT == 0
    assert file_size_for(n) == HEADER_SIZE + padded


def test_max_key_bytes_is_exact() -> None:
    tm = meta(4)
    limit = max_key_bytes(NS, tm)
    assert decode_header(encode_header("k" * limit, NS, tm, 4, 0)).key == "k" * limit
    with pytest.raises(FormatError):
        encode_header("k" * (limit + 1), NS, tm, 4, 0)


# -- encode rejects ---------------------------------------------------------------------------


def test_encode_rejects_key_too_long() -> None:
    with pytest.raises(FormatError, match="header holds"):
        encode_header("x" * HEADER_SIZE, NS, meta(4), 4, 0)


def test_encode_rejects_multibyte_key_too_long_in_utf8() -> None:
    # Fewer characters than the header space, but more UTF-8 bytes.
    key = "\u00e9" * (max_key_bytes(NS, meta(4)) // 2 + 1)
    with pytest.raises(FormatError):
        encode_header(key, NS, meta(4), 4, 0)


@pytest.mark.parametrize("payload_len", [0, 15, 17])
def test_encode_rejects_meta_nbytes_mismatch(payload_len: int) -> None:
    with pytest.raises(FormatError, match="16"):
        encode_header(KEY, NS, meta(16), payload_len, 0)


def test_encode_rejects_payload_over_format_limit() -> None:
    n = MAX_PAYLOAD_BYTES + 1
    with pytest.raises(FormatError):
        encode_header(KEY, NS, meta(n), n, 0)


# -- decode rejects ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "foreign",
    [
        b"\x7fELF\x02\x01\x01" + bytes(HEADER_SIZE),
        b"PK\x03\x04" + bytes(HEADER_SIZE),
        bytes(HEADER_SIZE),
        b"LMCNVME\x01" + bytes(HEADER_SIZE),
    ],
    ids=["elf", "zip", "zeros", "magic-off-by-one"],
)
def test_decode_rejects_foreign_bytes(foreign: bytes) -> None:
    with pytest.raises(FormatError, match="magic"):
        decode_header(foreign)


@pytest.mark.parametrize("version", [0, 3, 0xFFFF])
def test_decode_rejects_other_version_even_with_valid_checksum(header: bytes,
                                                               version: int) -> None:
    forged = reseal(header, version=version)
    with pytest.raises(FormatError, match=f"format version {version}"):
        decode_header(forged)


def test_decode_rejects_other_header_size(header: bytes) -> None:
    with pytest.raises(FormatError, match="header size"):
        decode_header(reseal(header, header_size=8192))


def test_reseal_helper_produces_accepted_header(header: bytes) -> None:
    # Guards the forgery helper: unchanged fields must still decode.
    assert reseal(header) == header
    assert decode_header(reseal(header, created=99)).created_unix_ns == 99


@pytest.mark.parametrize("offset", [12, 16, 24, 32, 40, 46, 60, 200, 4000, CHECKSUM_OFFSET,
                                    HEADER_SIZE - 1])
def test_decode_rejects_any_flipped_byte(header: bytes, offset: int) -> None:
    damaged = bytearray(header)
    damaged[offset] ^= 0x01
    with pytest.raises(FormatError):
        decode_header(bytes(damaged))


def test_decode_flipped_payload_field_is_a_checksum_error(header: bytes) -> None:
    damaged = bytearray(header)
    damaged[16] ^= 0x80
    with pytest.raises(FormatError, match="header checksum"):
        decode_header(bytes(damaged))


def test_decode_rejects_absurd_payload_length_without_big_allocation(header: bytes) -> None:
    forged = reseal(header, payload_len=2**62)
    tracemalloc.start()
    try:
        with pytest.raises(FormatError, match="payload length"):
            decode_header(forged)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20


def test_decode_rejects_payload_len_disagreeing_with_meta(header: bytes) -> None:
    with pytest.raises(FormatError, match="disagree"):
        decode_header(reseal(header, payload_len=17))


def test_decode_rejects_string_lengths_beyond_header(header: bytes) -> None:
    with pytest.raises(FormatError, match="exceed"):
        decode_header(reseal(header, key_len=0xFFFF, ns_len=0xFFFF, meta_len=0xFFFF))


@pytest.mark.parametrize("length", [0, 1, 46, HEADER_SIZE - 1])
def test_decode_rejects_short_header(header: bytes, length: int) -> None:
    with pytest.raises(FormatError, match=f"header is {length} bytes"):
        decode_header(header[:length])


def test_decode_rejects_non_utf8_key(header: bytes) -> None:
    body = bytearray(header)
    body[FIXED.size] = 0xFF  # first key byte: never valid in UTF-8
    with pytest.raises(FormatError, match="UTF-8"):
        decode_header(reseal(bytes(body)))


def test_decode_rejects_non_utf8_namespace(header: bytes) -> None:
    body = bytearray(header)
    body[FIXED.size + len(KEY.encode())] = 0xC3  # truncated two-byte sequence
    body[FIXED.size + len(KEY.encode()) + 1] = 0x28
    with pytest.raises(FormatError, match="UTF-8"):
        decode_header(reseal(bytes(body)))


@pytest.mark.parametrize(
    "meta_json",
    [
        b"not json",
        b'{"shapes": [[1]], "dtypes": ["uint8"], "fmt": 1}',
        b'{"shapes": [[1], [2]], "dtypes": ["uint8"], "fmt": 1, "nbytes": 16}',
        b'{"shapes": [], "dtypes": [], "fmt": 1, "nbytes": 16}',
        b'{"shapes": [["x"]], "dtypes": ["uint8"], "fmt": 1, "nbytes": 16}',
        b'{"shapes": [[1]], "dtypes": ["uint8"], "fmt": 1, "nbytes": -1}',
    ],
    ids=["garbage", "no-nbytes", "mismatched", "empty", "bad-dim", "negative"],
)
def test_decode_rejects_bad_tensor_metadata(meta_json: bytes) -> None:
    good = encode_header(KEY, NS, meta(16), 16, 0)
    key_b, ns_b = KEY.encode(), NS.encode()
    body = bytearray(HEADER_SIZE)
    body[: FIXED.size] = good[: FIXED.size]
    pos = FIXED.size
    body[pos : pos + len(key_b) + len(ns_b) + len(meta_json)] = key_b + ns_b + meta_json
    with pytest.raises(FormatError):
        decode_header(reseal(bytes(body), meta_len=len(meta_json)))


def test_texts_bytes_is_utf8_and_lets_a_lone_surrogate_pass() -> None:
    plain = ["model@0x00000001@0@ab", "日本語", ""]
    assert texts_bytes(plain) == [t.encode("utf-8") for t in plain]
    raw = "raw-\udcff-decoded"  # os.fsdecode of bytes that are not UTF-8
    assert texts_bytes([*plain, raw]) == [*texts_bytes(plain), b"raw-\xed\xb3\xbf-decoded"]
    assert text_bytes(raw) == texts_bytes([raw])[0] and text_bytes("日本語") == "日本語".encode()
