"""GPU path decisions without a GPU: mode selection, strict refusals, pool sizing, settings,
the GPU checksum (on CPU tensors) and its header field."""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from lmcache_nvme_backend.config import MIB, NVMeConfigError, NVMeSettings
from lmcache_nvme_backend.disk.format import (
    FLAG_GPU_CHECKSUM,
    HEADER_SIZE,
    FormatError,
    TensorMeta,
    decode_header,
    encode_header,
    max_key_bytes,
)
from lmcache_nvme_backend.disk.gpusum import (
    DeviceWeights,
    device_checksum,
    host_checksum,
    to_unsigned,
)
from lmcache_nvme_backend.gpu.select import (
    GpuProbe,
    check_pool_size,
    chunk_bytes_of,
    gpu_extra_for,
    kvikio_install_hint,
    select_read_path,
    torch_cuda_version,
)
from lmcache_nvme_backend.store import ReadPath

GDS_READY = GpuProbe(cuda_devices=1, kvikio_version="26.10.0", libcufile_version="1.20",
                     compat_mode_preferred=False, compat_mode_setting="AUTO", nvidia_fs=True)
COMPAT = GpuProbe(cuda_devices=1, kvikio_version="26.10.0", libcufile_version="1.20",
                  compat_mode_preferred=True, compat_mode_setting="AUTO", nvidia_fs=False)
NO_CUFILE = GpuProbe(cuda_devices=1, kvikio_version="26.10.0", libcufile_version=None,
                     compat_mode_preferred=True, compat_mode_setting="AUTO")
NO_KVIKIO = GpuProbe(cuda_devices=1, kvikio_error="No module named 'kvikio'")
NO_GPU = GpuProbe(cuda_devices=0, cuda_error="torch.cuda.is_available() is False",
                  kvikio_version="26.10.0", libcufile_version="1.20", compat_mode_preferred=True)
POOL = 1024 * MIB

# (mode, dst_device, pool bytes, probe, expected path, refusal fragment or None)
CASES: list[tuple[str, str, int, GpuProbe, str, str | None]] = [
    ("auto", "cuda:0", POOL, GDS_READY, ReadPath.KVIKIO_GDS, None),
    ("auto", "cuda:0", POOL, COMPAT, ReadPath.KVIKIO_COMPAT, None),
    ("auto", "cuda:0", POOL, NO_CUFILE, ReadPath.KVIKIO_COMPAT, None),
    ("auto", "cuda:0", POOL, NO_KVIKIO, ReadPath.HOST_BOUNCE, None),
    ("auto", "cuda:0", POOL, NO_GPU, ReadPath.HOST_BOUNCE, None),
    ("auto", "cuda:0", 0, GDS_READY, ReadPath.POSIX, None),
    ("auto", "cpu", POOL, GDS_READY, ReadPath.POSIX, None),
    ("off", "cuda:0", POOL, GDS_READY, ReadPath.HOST_BOUNCE, None),
    ("off", "cuda:0", POOL, NO_KVIKIO, ReadPath.HOST_BOUNCE, None),
    ("off", "cuda:0", 0, GDS_READY, ReadPath.POSIX, None),
    ("off", "cpu", POOL, GpuProbe(), ReadPath.POSIX, None),
    ("on", "cuda:0", POOL, GDS_READY, ReadPath.KVIKIO_GDS, None),
    ("on", "cuda:0", POOL, COMPAT, ReadPath.KVIKIO_GDS, "kvikio reports compat mode"),
    ("on", "cuda:0", POOL, NO_CUFILE, ReadPath.KVIKIO_GDS, "cannot load libcufile"),
    ("on", "cuda:0", POOL, NO_KVIKIO, ReadPath.KVIKIO_GDS, "kvikio cannot be imported"),
    ("on", "cuda:0", POOL, NO_GPU, ReadPath.KVIKIO_GDS, "no usable CUDA GPU"),
    ("on", "cpu", POOL, GDS_READY, ReadPath.POSIX, "there is no GPU to read into"),
    ("on", "cuda:0", 0, GDS_READY, ReadPath.POSIX, "nvme.gpu_pool_mb: 0"),
]


@pytest.mark.parametrize(("mode", "dst", "pool", "probe", "path", "refusal"), CASES)
def test_mode_selection_covers_every_branch(mode: str, dst: str, pool: int, probe: GpuProbe,
                                            path: str, refusal: str | None) -> None:
    decision = select_read_path(mode, dst, pool, probe)
    assert decision.path == path
    assert decision.reason
    if refusal is None:
        assert decision.refusal is None
    else:
        assert decision.refusal is not None
        assert refusal in decision.refusal
        # every refusal names the key it is about and says what to do
        assert decision.refusal.startswith(("nvme.gds_mode:", "nvme.gpu_pool_mb:"))
        assert "auto" in decision.refusal


def test_strict_refusal_lists_every_reason_and_the_fix() -> None:
    probe = GpuProbe(cuda_devices=0, cuda_error="no driver", kvikio_error="missing",
                     torch_cuda="13.0")
    refusal = select_read_path("on", "cuda:0", POOL, probe).refusal
    assert refusal is not None
    assert "no usable CUDA GPU (no driver)" in refusal
    assert ('kvikio cannot be imported (missing; pip install "lmcache-nvme-backend[cu13]" '
            "(kvikio-cu13, matching torch's CUDA 13.0))") in refusal
    assert "lmcache-nvme doctor" in refusal


@pytest.mark.parametrize(("cuda", "extra"), [("12.8", "cu12"), ("13.0", "cu13"), ("13", "cu13"),
                                             (None, None), ("", None), ("11.8", None),
                                             ("x", None)])
def test_the_gpu_extra_follows_torch_cuda_major(cuda: str | None, extra: str | None) -> None:
    assert gpu_extra_for(cuda) == extra


def test_the_kvikio_hint_names_the_extra_of_the_installed_torch() -> None:
    assert '"lmcache-nvme-backend[cu12]"' in kvikio_install_hint("12.4")
    assert "CPU build" in kvikio_install_hint(None)
    assert "CUDA 11.8" in kvikio_install_hint("11.8") and "[cu12]" in kvikio_install_hint("11.8")
    # this machine's torch decides which one the messages name
    expected = gpu_extra_for(torch.version.cuda)
    hint = kvikio_install_hint(torch_cuda_version())
    assert (f"[{expected}]" in hint) if expected else ("CPU build" in hint)


def test_without_kvikio_the_auto_path_is_host_bounce_and_says_how_to_install() -> None:
    probe = GpuProbe(cuda_devices=1, kvikio_error="No module named 'kvikio'", torch_cuda="12.8")
    decision = select_read_path("auto", "cuda:0", POOL, probe)
    assert decision.path == ReadPath.HOST_BOUNCE and decision.refusal is None
    assert "No module named 'kvikio'" in decision.reason
    assert '"lmcache-nvme-backend[cu12]"' in decision.reason


def test_compat_refusal_explains_the_gds_prerequisites() -> None:
    refusal = select_read_path("on", "cuda:1", POOL, COMPAT).refusal
    assert refusal is not None
    assert "compat_mode=AUTO" in refusal
    assert "nvidia-fs module loaded: no" in refusal
    assert "/run/udev" in refusal


def test_auto_reports_why_it_runs_compat_mode() -> None:
    decision = select_read_path("auto", "cuda:0", POOL, COMPAT)
    assert "compat mode" in decision.reason


def test_probe_detect_never_raises_and_is_consistent() -> None:
    probe = GpuProbe.detect()
    if not torch.cuda.is_available():
        assert probe.cuda_devices == 0
        assert probe.cuda_error
    if probe.kvikio_version is None:
        assert probe.kvikio_error
    # whatever this machine is, auto never refuses and strict says why it refuses
    assert select_read_path("auto", "cuda:0", POOL, probe).refusal is None
    strict = select_read_path("on", "cuda:0", POOL, probe)
    assert strict.refusal is None or strict.refusal.startswith("nvme.gds_mode:")


# -- pool sizing and settings ----------------------------------------------------


def test_pool_smaller_than_a_chunk_is_refused_with_the_minimum() -> None:
    with pytest.raises(NVMeConfigError,
                       match=r"nvme.gpu_pool_mb: 64 MiB cannot hold one KV chunk of this model "
                             r"\(80.0 MiB\). Set it to at least 80"):
        check_pool_size(64 * MIB, 80 * MIB, None)


def test_pool_larger_than_free_gpu_memory_is_refused() -> None:
    with pytest.raises(NVMeConfigError, match=r"nvme.gpu_pool_mb: 4096 MiB is more than the "
                                              r"1024 MiB of GPU memory free now"):
        check_pool_size(4096 * MIB, 16 * MIB, 1024 * MIB)


def test_pool_that_fits_passes() -> None:
    check_pool_size(2048 * MIB, 80 * MIB, 10 * 1024 * MIB)
    check_pool_size(2048 * MIB, None, None)  # nothing known: nothing to refuse


def test_chunk_bytes_from_lmcache_metadata() -> None:
    class Meta:
        kv_shape = (32, 2, 256, 8, 128)
        kv_dtype = torch.bfloat16

    assert chunk_bytes_of(Meta()) == 32 * 2 * 256 * 8 * 128 * 2
    assert chunk_bytes_of(None) is None


def settings(tmp_path: Path, **extra: Any) -> NVMeSettings:
    return NVMeSettings.from_extra_config({"nvme.path": str(tmp_path / "c"),
                                           "nvme.max_size_gb": 1,
                                           **{f"nvme.{k}": v for k, v in extra.items()}})


def test_gpu_settings_defaults(tmp_path: Path) -> None:
    s = settings(tmp_path)
    assert (s.gds_mode, s.gpu_pool_mb, s.kvikio_threads, s.kvikio_task_size_mb) == \
        ("auto", 2048.0, 16, 4.0)
    assert s.gpu_pool_bytes == 2048 * MIB
    assert s.kvikio_task_size_bytes == 4 * MIB


@pytest.mark.parametrize(("extra", "message"), [
    ({"gds_mode": "strict"}, "nvme.gds_mode: 'strict' is not a valid choice. Use one of: auto, "
                             "on, off."),
    ({"gpu_pool_mb": -1}, "nvme.gpu_pool_mb: -1 is out of range. It must be at least 0."),
    ({"gpu_pool_mb": "lots"}, "nvme.gpu_pool_mb: 'lots' is not a number"),
    ({"kvikio_threads": 0}, "nvme.kvikio_threads: 0 is out of range. It must be at least 1."),
    ({"kvikio_threads": 2.5}, "nvme.kvikio_threads: '2.5' is not a whole number"),
    ({"kvikio_task_size_mb": 0}, "nvme.kvikio_task_size_mb: 0 is out of range. It must be "
                                 "greater than 0."),
    ({"gds_mod": "on"}, "nvme.gds_mod: unknown setting. did you mean 'nvme.gds_mode'"),
])
def test_gpu_settings_errors_name_the_key(tmp_path: Path, extra: dict[str, Any],
                                          message: str) -> None:
    with pytest.raises(NVMeConfigError, match=message.replace("(", r"\(").replace(")", r"\)")
                       .replace(".", r"\.")):
        settings(tmp_path, **extra)


def test_yaml_booleans_are_modes(tmp_path: Path) -> None:
    assert settings(tmp_path, gds_mode=True).gds_mode == "on"
    assert settings(tmp_path, gds_mode=False).gds_mode == "off"


def test_bare_names_for_the_l2_adapter(tmp_path: Path) -> None:
    with pytest.raises(NVMeConfigError, match=r"^gpu_pool_mb: -2 is out of range"):
        NVMeSettings.from_params({"path": str(tmp_path / "c"), "max_size_gb": 1,
                                  "gpu_pool_mb": -2})


# -- the GPU checksum, computed on CPU tensors ------------------------------------


def cpu_sum(data: bytes, offset: int = 0) -> tuple[int, int]:
    """device_checksum on a CPU tensor, optionally starting at an unaligned address."""
    buf = torch.zeros(len(data) + offset + 8, dtype=torch.uint8)
    if data:
        buf[offset : offset + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    sums = device_checksum(buf[offset:], len(data), DeviceWeights("cpu")).tolist()
    return to_unsigned(sums[0]), to_unsigned(sums[1])


@pytest.mark.parametrize("size", [0, 1, 2, 3, 4, 5, 4095, 4096, 16384, 16385, 65536 + 6,
                                  256 * 16384 + 4, 3 * 1024 * 1024 + 1])
def test_device_checksum_on_cpu_equals_what_the_writer_records(size: int) -> None:
    data = random.Random(size).randbytes(size)
    assert cpu_sum(data) == host_checksum(data)
    assert cpu_sum(data, offset=1) == host_checksum(data)  # unaligned source


def test_checksum_ignores_padding_beyond_the_payload() -> None:
    data = os.urandom(10_000)
    t = torch.full((16384,), 0xAB, dtype=torch.uint8)
    t[:10_000] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    sums = device_checksum(t, 10_000, DeviceWeights("cpu")).tolist()
    assert tuple(to_unsigned(v) for v in sums) == host_checksum(data)


def test_host_checksum_accepts_numpy_and_memoryview() -> None:
    data = os.urandom(50_000)
    assert host_checksum(np.frombuffer(data, dtype=np.uint8)) == host_checksum(memoryview(data))


def corruptions(data: bytes) -> dict[str, bytes]:
    n = len(data)
    b = bytearray(data)
    out: dict[str, bytes] = {}
    for bit in (0, 7, 31, 63):
        flipped = bytearray(b)
        flipped[(n // 3) + bit // 8] ^= 1 << (bit % 8)
        out[f"bit{bit}"] = bytes(flipped)
    top_two = bytearray(b)  # the top bit of two 64-bit words: a linear-sum blind spot
    top_two[7] ^= 0x80
    top_two[15] ^= 0x80
    out["top-bits-of-two-words"] = bytes(top_two)
    zeroed = bytearray(b)
    zeroed[8192:12288] = bytes(4096)  # a torn write leaving a zero page
    out["zero-page"] = bytes(zeroed)
    swapped = bytearray(b)
    swapped[0:4096], swapped[4096:8192] = b[4096:8192], b[0:4096]
    out["swapped-pages"] = bytes(swapped)
    rows = bytearray(b)
    rows[0:16384], rows[16384:32768] = b[16384:32768], b[0:16384]
    out["swapped-rows"] = bytes(rows)
    moved = bytearray(b)
    moved[4:8], moved[8:12] = b[8:12], b[4:8]
    out["swapped-words"] = bytes(moved)
    return out


def test_checksum_detects_the_corruptions_that_matter() -> None:
    data = os.urandom(256 * 1024)
    good = host_checksum(data)
    for name, bad in corruptions(data).items():
        assert bad != data, name
        sums = host_checksum(bad)
        assert sums[0] != good[0] and sums[1] != good[1], name


def test_checksum_detects_every_single_word_change_in_a_sample() -> None:
    rng = random.Random(7)
    data = bytearray(rng.randbytes(64 * 1024))
    good = host_checksum(bytes(data))
    for _ in range(200):
        pos = rng.randrange(0, len(data) // 4) * 4
        old = bytes(data[pos : pos + 4])
        data[pos : pos + 4] = rng.randbytes(4) if rng.random() < 0.5 else bytes(4)
        if bytes(data[pos : pos + 4]) != old:
            assert host_checksum(bytes(data)) != good
        data[pos : pos + 4] = old


# -- header field ---------------------------------------------------------------


META = TensorMeta(shapes=((64,),), dtypes=("uint8",), fmt=1, nbytes=64)


def test_header_round_trips_the_gpu_checksum() -> None:
    raw = encode_header("k", "ns", META, 64, 123, gpu_checksum=(2**64 - 1, 5))
    flags = int.from_bytes(raw[12:16], "little")
    assert flags == FLAG_GPU_CHECKSUM
    assert int.from_bytes(raw[4072:4080], "little") == 2**64 - 1
    assert int.from_bytes(raw[4080:4088], "little") == 5
    assert decode_header(raw).gpu_checksum == (2**64 - 1, 5)


def test_header_without_the_field_is_unchanged() -> None:
    raw = encode_header("k", "ns", META, 64, 123, created_unix_ns=1)
    assert int.from_bytes(raw[12:16], "little") == 0
    assert raw[4072:4088] == bytes(16)
    assert decode_header(raw).gpu_checksum is None


def test_gpu_checksum_is_left_out_when_the_key_needs_the_space() -> None:
    key = "k" * max_key_bytes("ns", META)
    raw = encode_header(key, "ns", META, 64, 1, gpu_checksum=(1, 2))
    header = decode_header(raw)
    assert header.key == key and header.gpu_checksum is None


def test_flag_with_strings_over_the_field_is_rejected() -> None:
    import xxhash

    key = "k" * max_key_bytes("ns", META)
    body = bytearray(encode_header(key, "ns", META, 64, 1)[:4088])
    body[12:16] = FLAG_GPU_CHECKSUM.to_bytes(4, "little")
    raw = bytes(body) + xxhash.xxh3_64_intdigest(bytes(body)).to_bytes(8, "little")
    with pytest.raises(FormatError, match="overlap the GPU checksum"):
        decode_header(raw)
    assert len(raw) == HEADER_SIZE


NO_KVIKIO_CHILD = """
import json, sys
sys.modules["kvikio"] = None  # as if not installed: import kvikio raises ImportError
import lmcache_nvme_backend.io.kvikio, lmcache_nvme_backend.gpu.reader
import lmcache_nvme_backend.gpu.pool, lmcache_nvme_backend.cli.doctor
import lmcache_nvme_backend.cli.bench.gpu_reads
from lmcache_nvme_backend.gpu.select import GpuProbe, select_read_path
probe = GpuProbe.detect()
decision = select_read_path("on", "cuda:0", 1 << 30, probe)
print(json.dumps({"version": probe.kvikio_version, "error": probe.kvikio_error,
                  "torch_cuda": probe.torch_cuda, "refusal": decision.refusal}))
"""


def test_without_kvikio_every_module_imports_and_the_probe_says_why() -> None:
    """A CPU install has no kvikio (it is the [cu12]/[cu13] extra): the GPU modules still
    import, the probe reports kvikio as absent, and strict mode's refusal says how to get
    it for this torch."""
    import json
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", NO_KVIKIO_CHILD], capture_output=True,
                         text=True, timeout=120, check=True).stdout
    report = json.loads(out.strip().splitlines()[-1])
    assert report["version"] is None and "kvikio" in report["error"]
    assert report["torch_cuda"] == torch.version.cuda
    assert f"kvikio cannot be imported ({report['error']}; " in report["refusal"]
    assert kvikio_install_hint(torch.version.cuda) in report["refusal"]
