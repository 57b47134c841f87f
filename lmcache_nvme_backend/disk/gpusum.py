"""A payload checksum that a GPU can compute where the payload lands (``lin32x2``).

On the GPU read path the payload lands in device memory, where copying it back to hash it
would cost the bandwidth the path saves.  So the writer also records this checksum, which
torch computes on the device and numpy on the host, to the same bits: the payload as
little-endian u32 words in rows of ``ROW_WORDS``, each weighted by odd ``splitmix64`` column
and row weights of two lanes (``sum_a``, ``sum_b``, modulo 2**64; ``docs/format.md``).  It
detects errors, it does not authenticate.  ``device_checksum`` imports torch when called.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import torch

ALGORITHM = "lin32x2"
ROW_WORDS = 4096  # 16 KiB of payload per row
# Rows summed per step: bounds the temporaries at 2 x 8 x ROW_WORDS x 256 bytes (16 MiB).
ROWS_PER_STEP = 256
_MASK64 = (1 << 64) - 1
_SEED_A, _SEED_B, _SEED_G, _SEED_H = (0x243F6A8885A308D3, 0x13198A2E03707344,
                                      0xA4093822299F31D0, 0x082EFA98EC4E6C89)


def splitmix64(index: np.ndarray, seed: int) -> np.ndarray:
    """splitmix64 of ``index + seed`` (uint64 arithmetic, wrapping), forced odd."""
    with np.errstate(over="ignore"):
        z = index.astype(np.uint64) + np.uint64(seed)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    return z | np.uint64(1)


class _Weights:
    """Column weights (fixed) and row weights (grown on demand), shared by all threads: uint64
    arrays, or what ``convert`` makes of them."""

    def __init__(self, convert: Callable[[np.ndarray], Any] = lambda values: values) -> None:
        self._convert = convert
        cols = np.arange(ROW_WORDS, dtype=np.uint64)
        self.col_a = convert(splitmix64(cols, _SEED_A))
        self.col_b = convert(splitmix64(cols, _SEED_B))
        self.row_g = self.row_h = convert(np.empty(0, dtype=np.uint64))
        self._lock = threading.Lock()

    def rows(self, n: int) -> tuple[Any, Any]:
        if len(self.row_g) < n:
            with self._lock:
                if len(self.row_g) < n:
                    idx = np.arange(max(n, 2 * len(self.row_g), 64), dtype=np.uint64)
                    # row_h first: a reader that finds row_g long enough finds row_h so too
                    self.row_h = self._convert(splitmix64(idx, _SEED_H))
                    self.row_g = self._convert(splitmix64(idx, _SEED_G))
        return self.row_g[:n], self.row_h[:n]


_WEIGHTS = _Weights()


def _words(payload: memoryview | bytes | np.ndarray) -> np.ndarray:
    raw = np.frombuffer(payload, dtype=np.uint8) if not isinstance(payload, np.ndarray) \
        else payload.reshape(-1).view(np.uint8)
    whole = len(raw) // 4 * 4
    words = raw[:whole].view("<u4")
    if whole == len(raw):
        return words
    tail = np.zeros(4, dtype=np.uint8)
    tail[: len(raw) - whole] = raw[whole:]
    return np.concatenate([words, tail.view("<u4")])


def host_checksum(payload: memoryview | bytes | np.ndarray) -> tuple[int, int]:
    """``(sum_a, sum_b)`` of a payload in host memory (what the writer records)."""
    words = _words(payload)
    full_rows, tail = divmod(len(words), ROW_WORDS)
    row_g, row_h = _WEIGHTS.rows(full_rows + (1 if tail else 0))
    col_a, col_b = _WEIGHTS.col_a, _WEIGHTS.col_b
    sum_a = sum_b = np.uint64(0)
    with np.errstate(over="ignore"):
        for start in range(0, full_rows, ROWS_PER_STEP):
            stop = min(full_rows, start + ROWS_PER_STEP)
            block = words[start * ROW_WORDS : stop * ROW_WORDS].astype(np.uint64)
            block = block.reshape(stop - start, ROW_WORDS)
            sum_a += ((block * col_a).sum(axis=1, dtype=np.uint64) * row_g[start:stop]).sum(
                dtype=np.uint64)
            sum_b += ((block * col_b).sum(axis=1, dtype=np.uint64) * row_h[start:stop]).sum(
                dtype=np.uint64)
        if tail:
            last = words[full_rows * ROW_WORDS :].astype(np.uint64)
            sum_a += (last * col_a[:tail]).sum(dtype=np.uint64) * row_g[full_rows]
            sum_b += (last * col_b[:tail]).sum(dtype=np.uint64) * row_h[full_rows]
    return int(sum_a), int(sum_b)


class DeviceWeights(_Weights):
    """The weights as int64 tensors on one device (uploaded once, rows grown on demand)."""

    def __init__(self, device: torch.device | str) -> None:
        import torch

        self.device = torch.device(device)

        def upload(values: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(values.view(np.int64).copy()).to(self.device)

        super().__init__(upload)


def device_checksum(data: torch.Tensor, nbytes: int, weights: DeviceWeights) -> torch.Tensor:
    """``[sum_a, sum_b]`` of the first ``nbytes`` of a contiguous uint8 tensor, as an int64
    tensor on its device (int64 wraps as uint64 does: ``to_unsigned`` gives the header's
    bits).  Kernels are queued on the current stream; reading the result synchronizes."""
    import torch

    flat = data.reshape(-1)[:nbytes]
    whole = nbytes // 4 * 4
    if whole and flat.data_ptr() % 4 == 0:
        words = flat[:whole].view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    else:
        words = torch.empty(0, dtype=torch.int64, device=flat.device)
        if whole:  # unaligned start: realign through a copy
            words = flat[:whole].clone().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    if whole != nbytes:
        tail = torch.zeros(4, dtype=torch.uint8, device=flat.device)
        tail[: nbytes - whole] = flat[whole:]
        words = torch.cat([words, tail.view(torch.int32).to(torch.int64) & 0xFFFFFFFF])
    full_rows, tail_words = divmod(words.numel(), ROW_WORDS)
    row_g, row_h = weights.rows(full_rows + (1 if tail_words else 0))
    sums = torch.zeros(2, dtype=torch.int64, device=flat.device)
    for start in range(0, full_rows, ROWS_PER_STEP):
        stop = min(full_rows, start + ROWS_PER_STEP)
        block = words[start * ROW_WORDS : stop * ROW_WORDS].view(stop - start, ROW_WORDS)
        sums[0] += ((block * weights.col_a).sum(dim=1) * row_g[start:stop]).sum()
        sums[1] += ((block * weights.col_b).sum(dim=1) * row_h[start:stop]).sum()
    if tail_words:
        last = words[full_rows * ROW_WORDS :]
        sums[0] += (last * weights.col_a[:tail_words]).sum() * row_g[full_rows]
        sums[1] += (last * weights.col_b[:tail_words]).sum() * row_h[full_rows]
    return sums


def to_unsigned(value: int) -> int:
    """An int64 result of ``device_checksum`` as the unsigned value the header stores."""
    return value & _MASK64
