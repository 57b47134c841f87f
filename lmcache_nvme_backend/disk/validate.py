"""The one validator every reader of a chunk file uses: the store, the GPU reader, ``verify``.

A reader hands over the raw header and the facts it knows (key, name, directory, size, the
index's payload length); :func:`judge_chunk` checks each against the decoded header, and the
payload last (the expensive part).  ``docs/format.md`` lists the same checks.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass

from .format import ChunkHeader, FormatError, TensorMeta, decode_header
from .layout import key_digest, namespace_id


class Defect(enum.Enum):
    """Why a chunk file must not be served; the value is the message readers log."""

    NOT_A_CHUNK = "not a valid chunk file"
    SHORT = "chunk file shorter than its payload"
    WRONG_KEY = "file holds another key"
    WRONG_NAME = "the stored key does not hash to this file's name"
    WRONG_NAMESPACE = "the stored namespace does not match the directory"
    WRONG_LENGTH = "payload length differs from the index"
    WRONG_SIZE = "file size differs from what its header implies"
    WRONG_META = "tensor metadata differs from the index"
    CHECKSUM = "payload checksum mismatch"


@dataclass(frozen=True)
class Verdict:
    """Outcome of validating one chunk file: ``header`` when good, else the defect."""

    header: ChunkHeader | None
    defect: Defect | None = None
    detail: str = ""

    @property
    def ok(self) -> bool:
        return self.defect is None

    @property
    def reason(self) -> str:
        """What is wrong, as a reader logs it (empty for a good file)."""
        return "" if self.defect is None else self.detail or self.defect.value

    def __str__(self) -> str:
        return self.reason or "valid chunk file"


@dataclass(frozen=True)
class Expected:
    """What the reader knows about the file; ``None`` means "not known, not checked"."""

    key: str | None = None  # the key the reader asked for
    digest: str | None = None  # the file's name (digest of the key it should hold)
    ns_id: str | None = None  # the namespace directory the file was found in
    payload_len: int | None = None  # the payload length the reader's index holds
    file_size: int | None = None  # the file's size as found on disk
    meta: TensorMeta | None = None  # the tensor metadata the reader allocated from


def defect(kind: Defect, detail: str = "") -> Verdict:
    """A verdict for a defect found before the header could be judged (a short read)."""
    return Verdict(None, kind, detail)


def judge_chunk(raw_header: bytes | memoryview, expected: Expected,
                payload_ok: Callable[[ChunkHeader], bool] | None = None) -> Verdict:
    """Decode ``raw_header`` and check it, then the payload (``payload_ok(header)``; None:
    the header alone), against what the reader knows."""
    try:
        header = decode_header(raw_header)
    except FormatError as exc:
        return Verdict(None, Defect.NOT_A_CHUNK, str(exc))
    if expected.key is not None and header.key != expected.key:
        return Verdict(header, Defect.WRONG_KEY)
    if expected.digest is not None and key_digest(header.key) != expected.digest:
        return Verdict(header, Defect.WRONG_NAME)
    if expected.ns_id is not None and namespace_id(header.namespace) != expected.ns_id:
        return Verdict(header, Defect.WRONG_NAMESPACE)
    if expected.payload_len is not None and header.payload_len != expected.payload_len:
        return Verdict(header, Defect.WRONG_LENGTH)
    if expected.file_size is not None and expected.file_size != header.file_size:
        return Verdict(header, Defect.WRONG_SIZE, f"file is {expected.file_size} bytes, its "
                       f"header implies {header.file_size}")
    if expected.meta is not None and header.tensor_meta != expected.meta:
        return Verdict(header, Defect.WRONG_META)
    if payload_ok is not None and not payload_ok(header):
        return Verdict(header, Defect.CHECKSUM)
    return Verdict(header)
