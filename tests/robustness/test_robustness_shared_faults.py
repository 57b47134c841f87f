"""The shared-mode fault harness, short and seeded (``support.fault_harness``): three
member processes on a small budget, on a local directory (a tmpfs of its own) and on
GlusterFS (two mounts of one volume), under every kind of fault in turn: damaged,
truncated, planted and special coordination files, SIGKILL of a member (a fresh one
started), a full filesystem, a member of an older format, and on GlusterFS a stopped
brick.  The invariants (budget, no wrong byte, bounded calls, recovery, nothing outside
the cache touched) are checked all along.  The seed is printed; set
``LMCNVME_FAULT_SEED`` to replay one.  ``bench/soak_shared.py`` runs the same for longer.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from support.fault_harness import (
    KILL,
    Layout,
    Plan,
    gluster_layout,
    local_layout,
    run_harness,
    seed_from_env,
)
from support.shared_faults import FAULTS

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

SEED = 47


@pytest.fixture(params=["local", "gluster"])
def layout(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Layout]:
    make = local_layout if request.param == "local" else gluster_layout
    with make(tmp_path) as where:
        yield where


def test_members_keep_the_invariants_under_seeded_faults(layout: Layout) -> None:
    plan = Plan(seed=seed_from_env(SEED))
    print(f"\nseed {plan.seed}")
    figures = run_harness(plan, layout)
    text = figures.report() + "\n" + "\n".join(figures.log)
    print(text)
    assert not figures.violations, text
    kinds = {*FAULTS, KILL} - ({"stopped brick"} if layout.brick_pid is None else set())
    assert set(figures.faults) == kinds, text  # each kind came, none was skipped
    assert figures.wrong == 0 and figures.served > 0
    assert figures.written * plan.file > 2 * plan.budget  # evictions really ran


