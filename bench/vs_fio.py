"""Engine efficiency against fio: ``lmcache-nvme bench --vs-fio`` over a grid, as one table.

Runs sequential reads and writes at 2 MiB and 16 MiB blocks, direct I/O, the
engine and fio at the same total queue depth, interleaved repetitions
(``--repeat``, default 6), and prints a Markdown table of the medians.

    LMCACHE_TRACK_USAGE=false python bench/vs_fio.py /mnt/nvme0/bench-dir

Root can add ``--drop-caches`` (dropped before every read run).  The engine's
buffers of 2 MiB and more are transparent huge pages; fio gets huge pages
(``mem=shmhuge``) when the hugetlb pool has room (``echo 128 >
/proc/sys/vm/nr_hugepages``), else 4 KiB pages (``--fio-mem malloc`` forces that).  Each row
writes ``--size`` bytes of chunk files (twice for writes) into a private
subdirectory of the path, removed afterwards.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")

# (rw, block size, chunks per read_chunks() call, concurrent callers)
ROWS = [("read", "2M", 8, 1), ("read", "2M", 8, 2), ("read", "16M", 8, 1), ("read", "16M", 8, 2),
        ("write", "2M", 8, 1), ("write", "16M", 8, 1)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("path", type=Path, help="directory on the drive to test")
    parser.add_argument("--size", default="4G", help="bytes per run (default 4G)")
    parser.add_argument("--repeat", default="6", help="repetitions per tool (default 6)")
    parser.add_argument("--threads", default="8", help="engine threads (default 8)")
    parser.add_argument("--drop-caches", action="store_true",
                        help="drop the page cache before every read run (root)")
    parser.add_argument("--fio-mem", default="auto",
                        help="fio's buffer memory, passed to --fio-mem (default auto: huge "
                             "pages from the hugetlb pool when it has room)")
    parser.add_argument("--json-out", type=Path, help="also save every run's JSON here")
    args = parser.parse_args()
    print("| rw | bs | batch x callers | queue depth | fio shape | engine MiB/s "
          "| fio MiB/s | ratio of medians | median paired ratio |")
    print("|---|---|---|---|---|---|---|---|---|")
    docs = []
    for rw, bs, batch, callers in ROWS:
        cmd = [sys.executable, "-m", "lmcache_nvme_backend", "bench", str(args.path),
               "--rw", rw, "--bs", bs, "--size", args.size, "--threads", args.threads,
               "--iodepth", str(batch), "--callers", str(callers), "--direct", "--vs-fio",
               "--repeat", args.repeat, "--fio-mem", args.fio_mem, "--json"]
        if args.drop_caches:
            cmd.append("--drop-caches")
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            print(proc.stderr, file=sys.stderr)
            return proc.returncode
        doc = json.loads(proc.stdout)
        docs.append(doc)
        c = doc["comparison"][rw]
        fio = doc["fio"]
        print(f"| {rw} | {bs} | {f'{batch} x {callers}' if rw == 'read' else '-'} | "
              f"{doc['config']['in_flight']} | {fio['numjobs']} jobs x iodepth "
              f"{fio['iodepth']}, mem={fio['mem']} | {c['ours_median_mib_s']:.0f} | "
              f"{c['fio_median_mib_s']:.0f} | {c['ratio_of_medians']:.2f}x | "
              f"{c['median_paired_ratio']:.2f}x |", flush=True)
    if args.json_out:
        args.json_out.write_text(json.dumps(docs, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
