"""disk/validate.py: the one validator every reader uses, one verdict per file."""

from __future__ import annotations

import pytest

from lmcache_nvme_backend.disk.format import HEADER_SIZE, TensorMeta, encode_header, file_size_for
from lmcache_nvme_backend.disk.layout import key_digest, namespace_id
from lmcache_nvme_backend.disk.validate import Defect, Expected, Verdict, defect, judge_chunk

KEY, NAMESPACE, NBYTES = "model@0@0@00ff@bfloat16", "model", 8192 + 100
META = TensorMeta(shapes=((NBYTES,),), dtypes=("uint8",), fmt=1, nbytes=NBYTES)


@pytest.fixture
def header() -> bytes:
    return encode_header(KEY, NAMESPACE, META, NBYTES, checksum=1234)


def everything_known() -> Expected:
    return Expected(key=KEY, digest=key_digest(KEY), ns_id=namespace_id(NAMESPACE),
                    payload_len=NBYTES, file_size=file_size_for(NBYTES))


def test_a_good_file_gets_its_header(header: bytes) -> None:
    verdict = judge_chunk(header, everything_known(), lambda h: h.payload_checksum == 1234)
    assert verdict.ok and verdict.defect is None and verdict.reason == ""
    assert verdict.header is not None and verdict.header.key == KEY
    assert verdict.header.tensor_meta == META
    assert str(verdict) == "valid chunk file"


def test_nothing_known_only_decodes(header: bytes) -> None:
    assert judge_chunk(header, Expected()).ok


@pytest.mark.parametrize(("expected", "kind"), [
    (Expected(key="another key"), Defect.WRONG_KEY),
    (Expected(digest=key_digest("another key")), Defect.WRONG_NAME),
    (Expected(ns_id=namespace_id("another model")), Defect.WRONG_NAMESPACE),
    (Expected(payload_len=NBYTES - 1), Defect.WRONG_LENGTH),
    (Expected(file_size=file_size_for(NBYTES) + 4096), Defect.WRONG_SIZE),
])
def test_each_known_fact_that_disagrees_is_its_defect(header: bytes, expected: Expected,
                                                      kind: Defect) -> None:
    verdict = judge_chunk(header, expected)
    assert not verdict.ok and verdict.defect is kind
    assert verdict.header is not None  # the header itself decoded
    assert verdict.reason


def test_the_size_defect_names_both_sizes(header: bytes) -> None:
    verdict = judge_chunk(header, Expected(file_size=HEADER_SIZE))
    assert verdict.reason == f"file is {HEADER_SIZE} bytes, its header implies " \
                             f"{file_size_for(NBYTES)}"


def test_a_payload_mismatch_is_a_checksum_defect(header: bytes) -> None:
    verdict = judge_chunk(header, everything_known(), lambda h: False)
    assert verdict.defect is Defect.CHECKSUM and verdict.reason == "payload checksum mismatch"


def test_the_payload_is_checked_last_and_only_when_all_else_holds(header: bytes) -> None:
    calls: list[int] = []

    def payload_ok(h: object) -> bool:
        calls.append(1)
        return True

    assert judge_chunk(header, Expected(key="another key"), payload_ok).defect is Defect.WRONG_KEY
    assert calls == []
    assert judge_chunk(header, everything_known(), payload_ok).ok and calls == [1]


@pytest.mark.parametrize("raw", [b"", b"\0" * HEADER_SIZE, b"not a chunk file" * 512])
def test_foreign_bytes_are_not_a_chunk(raw: bytes) -> None:
    verdict = judge_chunk(raw, everything_known(), lambda h: True)
    assert verdict.defect is Defect.NOT_A_CHUNK and verdict.header is None
    assert verdict.reason  # the decoder's reason, e.g. "bad magic: ..."


def test_a_damaged_header_is_not_a_chunk(header: bytes) -> None:
    damaged = bytearray(header)
    damaged[100] ^= 0x01
    verdict = judge_chunk(bytes(damaged), Expected())
    assert verdict.defect is Defect.NOT_A_CHUNK and "checksum" in verdict.reason


def test_a_defect_found_before_judging_has_no_header() -> None:
    verdict = defect(Defect.SHORT, "unexpected end of chunk file")
    assert verdict == Verdict(None, Defect.SHORT, "unexpected end of chunk file")
    assert not verdict.ok and verdict.reason == "unexpected end of chunk file"
    assert defect(Defect.SHORT).reason == Defect.SHORT.value
