"""Every LMCache engine a test builds is capped in host memory (tests/support/memory_cap.py).

The example YAMLs ask for 20 GB of host memory, as a server would; a test that loads one
unchanged must fail at once, naming the fix, instead of taking most of the machine.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
from support import memory_cap
from support.process import child_env

CHILD = """
import os, sys
from support import memory_cap
memory_cap.install()
from support.paths import EXAMPLE_YAML
from lmcache_nvme_backend.testing.engine import build_engine, load_config
config = load_config(EXAMPLE_YAML, {{"extra_config": {{"nvme.path": sys.argv[1]}}}}{extra})
try:
    build_engine(config, instance_id="uncapped")
    print("BUILT", flush=True)
except memory_cap.HostMemoryCapExceeded as exc:
    print("CAPPED", exc, flush=True)
os._exit(0)  # an engine that failed half-way leaves LMCache's event-loop thread behind
"""


def run_child(tmp_path: object, extra: str = "") -> str:
    proc = subprocess.run([sys.executable, "-c", CHILD.format(extra=extra), str(tmp_path)],
                          capture_output=True, text=True, timeout=180, env=child_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


@pytest.mark.slow
def test_the_example_yaml_unchanged_is_refused_with_the_fix(tmp_path: object) -> None:
    out = run_child(tmp_path)
    assert "CAPPED this test asks LMCache for 20 GB of host memory" in out
    assert "override max_local_cpu_size" in out


def test_the_cap_is_installed_in_the_test_process() -> None:
    from lmcache.v1.memory_allocators.mixed_memory_allocator import MixedMemoryAllocator

    assert getattr(MixedMemoryAllocator.__init__, "_memory_cap", False)
    assert memory_cap.MAX_HOST_GB <= 2.0


def test_an_uncapped_allocation_fails_the_test_here() -> None:
    from lmcache.v1.memory_allocators.mixed_memory_allocator import MixedMemoryAllocator

    with pytest.raises(pytest.fail.Exception, match="override max_local_cpu_size"):
        MixedMemoryAllocator(int(20 * 2**30))  # refused before any memory is taken
