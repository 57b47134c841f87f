"""What the scripts under ``bench/`` share: the L2 adapters as ``lmcache server`` configures
them, LMCache's own bench loop driving one of them, the page cache, and this package as of
another git revision.

Not a script.  The scripts in ``bench/`` import it as ``common`` (Python puts a script's
own directory first on ``sys.path``); those in ``bench/instruments/`` put ``bench/`` on the
path first, in the two lines at their top.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
GIB = 1 << 30

#: The package each of our systems loads: ``base`` is another revision of this one, which
#: ``build_baseline`` builds and puts on the path under that name.
NVME_PACKAGES = {"nvme": "lmcache_nvme_backend", "base": "lmcache_nvme_backend_base"}
BASELINE = "base"

#: LMCache's bench shape the scripts share: 16 MiB of objects per task (one object per task
#: when objects are larger), 4 tasks in flight.
TASK_MB = 16
IN_FLIGHT = 4
WARMUP_ROUNDS = 2
LOAD_SET_ROUNDS = 6


def adapter_params(extra_json: str = "{}") -> dict[str, Any]:
    """``NVMeL2Adapter``'s parameters in a bench: a budget no run fills, no free-space floor,
    and ``extra_json`` (a script's ``--nvme-params``) over them."""
    return {"max_size_gb": 64, "min_free_gb": 0, **json.loads(extra_json)}


def adapter_json(system: str, path: Path, nvme_params: dict[str, Any]) -> str:
    """The ``--l2-adapter`` JSON of ``lmcache server`` (and ``lmcache bench l2``) for one
    system: ours (or ``base``) as a plugin, LMCache's ``fs_native`` and ``fs`` with
    O_DIRECT."""
    if system in NVME_PACKAGES:
        return json.dumps({"type": "plugin", "module_path": NVME_PACKAGES[system],
                           "class_name": "NVMeL2Adapter",
                           "adapter_params": {"path": str(path), **nvme_params}})
    if system == "fs_native":
        return json.dumps({"type": "fs_native", "base_path": str(path), "use_odirect": True})
    if system == "fs":
        return json.dumps({"type": "fs", "base_path": str(path), "use_odirect": True})
    raise ValueError(system)


def drop_caches() -> bool:
    """``sync; echo 3 > /proc/sys/vm/drop_caches``; False where that is not allowed (not
    root)."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def add_drop_caches_option(parser: argparse.ArgumentParser) -> None:
    """``--drop-caches`` (the default: loads read from the drive, as root) and
    ``--no-drop-caches`` (the page cache is left alone: a dry run beside other work)."""
    parser.add_argument("--drop-caches", action=argparse.BooleanOptionalAction, default=True,
                        help="drop the page cache before cold reads (root; default: yes)")


def cpu_seconds() -> float:
    """User and system CPU seconds of this process so far, every thread."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def build_baseline(revision: str, into: Path) -> Path:
    """This package as of git ``revision``, its native extension built, under the name
    ``lmcache_nvme_backend_base`` in a directory of ``into`` (returned: for ``PYTHONPATH``),
    so that one process can hold both revisions' adapters (system ``base``)."""
    source, packages = into / "baseline-source", into / "baseline"
    source.mkdir()
    packages.mkdir()
    archive = subprocess.run(["git", "-C", str(REPO_ROOT), "archive", revision],
                             stdout=subprocess.PIPE, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(source)], input=archive, check=True)
    subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--inplace"], cwd=source,
                   stdout=subprocess.DEVNULL, check=True)
    package = source / NVME_PACKAGES["nvme"]
    if not list((package / "io").glob("_native*.so")):
        raise SystemExit(f"--baseline {revision}: its native extension did not build")
    package.rename(packages / NVME_PACKAGES[BASELINE])
    return packages


# -- one L2 adapter in this process, driven by LMCache's bench functions --------------------


@dataclass
class Side:
    """One adapter under test, with its own L1 buffer and directory."""

    system: str
    path: Path
    adapter: Any
    buffer: Any
    store_objs: list[list[Any]] = field(default_factory=list)
    load_objs: list[list[Any]] = field(default_factory=list)


def shape_for(size_mb: int, task_mb: int = TASK_MB, in_flight: int = IN_FLIGHT
              ) -> dict[str, int]:
    """A round of LMCache's bench: ``in_flight`` tasks of ``task_mb`` MiB of objects each
    (at least one object per task)."""
    return {"size": size_mb << 20, "num_keys": max(1, task_mb // size_mb),
            "in_flight": in_flight, "inner": 1}


def open_side(system: str, root: Path, shape: dict[str, int],
              nvme_params: dict[str, Any]) -> Side:
    """``system``'s adapter, made as ``lmcache server`` makes it, on ``root / system``
    (emptied), with aligned L1 objects for one round's stores and another's loads."""
    from lmcache.cli.commands.bench.l2_adapter_bench.data import (
        create_l1_memory_desc,
        make_aligned_tensor,
        make_memory_objects,
    )
    from lmcache.v1.distributed.l2_adapters import create_l2_adapter
    from lmcache.v1.distributed.l2_adapters.config import parse_args_to_l2_adapters_config

    path = root / system
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    per_round = shape["in_flight"] * shape["num_keys"] * shape["size"]
    buffer = make_aligned_tensor(2 * per_round, 4096)  # O_DIRECT needs aligned L1 buffers
    cfg = parse_args_to_l2_adapters_config(argparse.Namespace(
        l2_adapter=[adapter_json(system, path, nvme_params)])).adapters[0]
    adapter = create_l2_adapter(cfg, l1_memory_desc=create_l1_memory_desc(buffer, 4096))
    side = Side(system, path, adapter, buffer)
    batch = shape["num_keys"] * shape["size"]
    side.store_objs = [make_memory_objects(buffer, shape["num_keys"], shape["size"], i * batch)
                       for i in range(shape["in_flight"])]
    side.load_objs = [make_memory_objects(buffer, shape["num_keys"], shape["size"],
                                          per_round + i * batch, fill_offset=1)
                      for i in range(shape["in_flight"])]
    return side


def round_keys(shape: dict[str, int], round_index: int, inner: int) -> list[list[Any]]:
    """The object keys of one round (a list per task), distinct for every round."""
    from lmcache.cli.commands.bench.l2_adapter_bench.data import make_object_keys

    base = (round_index * shape["inner"] + inner) * shape["in_flight"] * shape["num_keys"]
    return [make_object_keys(shape["num_keys"], key_offset=base + i * shape["num_keys"])
            for i in range(shape["in_flight"])]


def fill_store_buffers(sides: list[Side], seed: int) -> None:
    """The same random bytes in every system's store objects (never all zero)."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    first = sides[0]
    for objs in first.store_objs:
        for obj in objs:
            obj.raw_data.copy_(torch.randint(0, 256, obj.raw_data.shape, dtype=torch.uint8,
                                             generator=generator))
    for side in sides[1:]:
        for mine, theirs in zip(side.store_objs, first.store_objs, strict=True):
            for a, b in zip(mine, theirs, strict=True):
                a.raw_data.copy_(b.raw_data)


class Driver:
    """One adapter in this process, driven round by round with LMCache's bench functions in
    steady state: a store round stores fresh keys and deletes those of the round before
    last (the directory stays small); a load round loads a working set stored first, and
    every byte loaded in the first round of each pass over it is compared."""

    def __init__(self, system: str, size_mb: int, root: Path, nvme_params: dict[str, Any],
                 task_mb: int = TASK_MB, in_flight: int = IN_FLIGHT):
        self.system = system
        self.shape = shape_for(size_mb, task_mb, in_flight)
        self.side = open_side(system, root, self.shape, nvme_params)
        package = NVME_PACKAGES.get(system)
        if package and not type(self.side.adapter).__module__.startswith(package + "."):
            raise SystemExit(f"{system}: LMCache loaded {type(self.side.adapter).__module__}, "
                             f"not {package}")
        fill_store_buffers([self.side], seed=size_mb)
        self.chunks_per_round = in_flight * self.shape["num_keys"]
        self.bytes_per_round = self.chunks_per_round * self.shape["size"]
        self.index, self.ok, self.verified = 0, True, True  # rounds done, and their outcome

    def round(self, op: str, index: int) -> bool:
        """One LMCache bench round; True when every key of it succeeded."""
        from lmcache.cli.commands.bench.l2_adapter_bench.runner import bench_load, bench_store

        keys = round_keys(self.shape, index, 0)
        bench = bench_store if op == "store" else bench_load
        objs = self.side.store_objs if op == "store" else self.side.load_objs
        result = bench(self.side.adapter, in_flight=self.shape["in_flight"],
                       num_keys=self.shape["num_keys"], data_size=self.shape["size"],
                       rounds=1, keys_for_round=lambda _r: keys,
                       objs_for_round=lambda _r: objs, log=lambda _msg: None)
        return not result.timed_out_rounds and sum(result.success_counts) == \
            self.chunks_per_round

    def delete(self, index: int) -> None:
        if index >= 0:
            self.side.adapter.delete([k for batch in round_keys(self.shape, index, 0)
                                      for k in batch])

    def loaded_equal(self) -> bool:
        import torch

        return all(torch.equal(s.raw_data, lo.raw_data)
                   for stored, loaded in zip(self.side.store_objs, self.side.load_objs,
                                             strict=True)
                   for s, lo in zip(stored, loaded, strict=True))

    def prepare(self, op: str) -> None:
        """Store the working set (loads), then the warm-up rounds."""
        if op == "load":
            for i in range(LOAD_SET_ROUNDS):
                if not self.round("store", i):
                    raise SystemExit(f"{self.system}: storing the working set failed")
        self.index, self.ok, self.verified = 0, True, True
        for _ in range(WARMUP_ROUNDS):
            self.step(op)

    def step(self, op: str) -> None:
        """One measured round (a store also deletes the keys of the round before last)."""
        if op == "store":
            self.ok &= self.round("store", LOAD_SET_ROUNDS + self.index)
            self.delete(LOAD_SET_ROUNDS + self.index - 2)
        else:
            self.ok &= self.round("load", self.index % LOAD_SET_ROUNDS)
            if self.index % LOAD_SET_ROUNDS == 0:
                self.verified &= self.loaded_equal()
        self.index += 1

    def close(self) -> None:
        self.side.adapter.close()
        shutil.rmtree(self.side.path, ignore_errors=True)
