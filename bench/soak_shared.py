"""Soak of shared mode under randomized faults: the fault harness of the test suite
(tests/support/fault_harness.py) run for longer, every fault kind drawn at random.

    python bench/soak_shared.py DIR --seconds 180 [--seed S] [--gluster] [--members 3]

``DIR`` is a work directory (created): the cache goes on a tmpfs mounted below it, or with
``--gluster`` on a GlusterFS volume started there (both need root).  It prints the seed
(replay with ``--seed``), the duration, the count of each fault, and the invariant
figures: peak bytes against the budget, the worst time of each public call, wrong bytes,
the time until writes and evictions resumed after the last fault; then every fault with
its time.  Exit status 1 if an invariant failed (each is listed).  docs/robustness.md
records the figures measured.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR.parent / "tests"))
os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")

from support.fault_harness import (  # noqa: E402
    Plan,
    gluster_layout,
    local_layout,
    run_harness,
    seed_from_env,
)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dir", type=Path, help="work directory (created)")
    parser.add_argument("--seconds", type=float, default=180.0, help="seconds of faults")
    parser.add_argument("--seed", type=int, help="default: $LMCNVME_FAULT_SEED or random")
    parser.add_argument("--gluster", action="store_true", help="on a GlusterFS volume")
    parser.add_argument("--members", type=int, default=3)
    parser.add_argument("--chunks", type=int, default=32, help="the budget in chunks")
    args = parser.parse_args()
    # the harness reads the ledger to plant damage: its own warnings of what it planted
    logging.getLogger("lmcache_nvme_backend").setLevel(logging.ERROR)
    plan = Plan(seed=args.seed if args.seed is not None else seed_from_env(),
                seconds=args.seconds, members=args.members, chunks=args.chunks, cover=False)
    print(f"seed {plan.seed}", flush=True)
    args.dir.mkdir(parents=True, exist_ok=True)
    layout = gluster_layout if args.gluster else local_layout
    with layout(args.dir) as where:
        figures = run_harness(plan, where)
    print(figures.report())
    print("\n".join(figures.log))
    return 1 if figures.violations else 0


if __name__ == "__main__":
    sys.exit(main())
