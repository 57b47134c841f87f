#!/usr/bin/env bash
# Everything a GPU machine without a package index can check, in one run (docs/gpu.md):
# the GPU suite, the GPU read benchmark, the drive's ceiling and one process's ceiling
# (bench/instruments/bench_ceiling.py: this tier against LMCache's fs_native, GIL-held
# seconds per GiB).
#
# On a machine with pip access, once:    bash tests/gpu/prepare_wheels.sh
# Then, on the GPU machine, from the repository root with `.whl` copied along:
#     bash tests/gpu/run_on_device.sh
# Results go to $OUT (8 files at most): env.txt, build.log, gpu_tests.log, disk.log,
# bench_gpu.log, bench_gpu.json, ceiling.log, ceiling.json.
# Optional: STEPS (a comma list of build,tests,disk,gpu,ceiling; default all of them),
# QUICK=1 (shorter benchmarks), BENCH_ARGS / CEILING_ARGS (extra arguments),
# BENCH_DIR (a directory on the drive; default /var/tmp/nvme-bench),
# NVME_GPU_TEST_DIR (where test chunk files go; default $BENCH_DIR/tests),
# NO_WHEELS=1 (use the packages already installed: a dry run of the plumbing on CPU).
set -uo pipefail
OUT=${OUT:-/tmp/nvme-gpu-out}
STEPS=",${STEPS:-build,tests,disk,gpu,ceiling},"
BENCH_DIR=${BENCH_DIR:-/var/tmp/nvme-bench}
mkdir -p "$OUT" "$BENCH_DIR"
cd "$(dirname "$0")/../.."
step() { [[ $STEPS == *",$1,"* ]]; }
status=0
note() { echo "== $* ($(date -u +%T), ${SECONDS}s)"; }

if [ "${NO_WHEELS:-0}" != 1 ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || { echo "wheel install failed: carry .whl" >&2; exit 3; }
  export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
export LMCACHE_TRACK_USAGE=false DO_NOT_TRACK=1 VLLM_NO_USAGE_STATS=1 \
  LMCACHE_DISABLE_BANNER=1 PYTHONUNBUFFERED=1

# LMCache's GdsBackend dlopens "libcufile.so" (cufile-python, use_gds true) and
# "libcudart.so" (use_gds false); the CUDA wheels ship only versioned names.
find_lib() {
  python3 - "$1" <<'PY'
import glob, os, site, sys
name = sys.argv[1]
roots = site.getsitepackages() + [p for p in sys.path if p]
found = [f for r in roots for f in glob.glob(os.path.join(r, "nvidia", "*", "lib", name + ".so.*"))]
found += glob.glob(f"/usr/local/cuda*/lib64/{name}.so.*")
print(sorted(found)[0] if found else "")
PY
}
mkdir -p /tmp/cuda-libs
CUFILE=$(find_lib libcufile); CUDART=$(find_lib libcudart)
[ -n "$CUFILE" ] && ln -sf "$CUFILE" /tmp/cuda-libs/libcufile.so
[ -n "$CUDART" ] && ln -sf "$CUDART" /tmp/cuda-libs/libcudart.so
export LD_LIBRARY_PATH="/tmp/cuda-libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"

# The native engine and the key strings, built with this machine's compiler and Python.
if step build; then
  note build
  { cc --version | head -1; python3 --version
    python3 setup.py -q build_ext --inplace && echo "native extensions built"
    python3 -c "from lmcache_nvme_backend.io import native; print('native engine:', native.available())"
  } > "$OUT/build.log" 2>&1
  tail -3 "$OUT/build.log"
fi

{
  note env
  date -u; nvidia-smi -L; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  uname -r; nproc; lscpu | grep -E "^Model name"; free -g | head -2; python3 --version
  df -hT "$BENCH_DIR" /tmp; lsblk -o NAME,SIZE,ROTA,MODEL,SCHED 2>&1
  ls /proc/driver/nvidia-fs 2>&1; ls -d /run/udev 2>&1
  echo "libcufile: ${CUFILE:-not found}; libcudart: ${CUDART:-not found}"
  python3 -c "import torch, kvikio, lmcache, lmcache_nvme_backend as m; \
print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.is_available()); \
print('kvikio', kvikio.__version__); print('lmcache import ok'); \
from lmcache_nvme_backend.gpu.select import GpuProbe; print(GpuProbe.detect())"
  LMCACHE_FS=no
  for ext in cuda_ops lmcache_fs; do  # LMCache's compiled parts, built for another torch
    if why=$(python3 -c "import torch, lmcache.$ext" 2>&1); then
      echo "lmcache.$ext loads"; [ $ext = lmcache_fs ] && LMCACHE_FS=yes
    else echo "lmcache.$ext does not load: $(tail -1 <<<"$why")"; fi
  done
  command -v fio || echo "fio: not installed"
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

if step tests; then
  note tests
  export NVME_GPU_TEST_DIR=${NVME_GPU_TEST_DIR:-$BENCH_DIR/tests}
  mkdir -p "$NVME_GPU_TEST_DIR"
  timeout 240 python3 -m pytest -p no:cacheprovider -o timeout=90 -q -rA -s tests/gpu \
    > "$OUT/gpu_tests.log" 2>&1
  rc=$?; tail -25 "$OUT/gpu_tests.log"; echo "gpu tests exit $rc"; status=$(( status | rc ))
fi

# The drive's own ceiling beside the tier's: fio where installed, else the engine's bench.
if step disk; then
  note disk
  {
    if command -v fio >/dev/null; then
      for rw in write read; do
        fio --name=ceiling --directory="$BENCH_DIR" --rw=$rw --bs=16M --size=4G --direct=1 \
          --ioengine=libaio --iodepth=16 --numjobs=2 --group_reporting --runtime=10 \
          | grep -E "^ *(READ|WRITE):"
      done
      rm -f "$BENCH_DIR"/ceiling.*
    fi
    for rw in write read; do
      python3 -c "import sys; from lmcache_nvme_backend.cli import main; sys.exit(main())" \
        bench "$BENCH_DIR" --rw $rw --bs 16M --size 4G --threads 16 --iodepth 16 --callers 2 \
        --repeat 3 --drop-caches
    done
  } > "$OUT/disk.log" 2>&1
  rc=$?; cat "$OUT/disk.log"; status=$(( status | rc ))
fi

if step gpu; then
  note bench_gpu
  if [ "${QUICK:-0}" = 1 ]; then SIZES="--chunk-mb 4,16 --chunks 32 --reps 3"; else
    SIZES="--chunk-mb 4,16,64 --chunks 32 --reps 3"; fi
  # shellcheck disable=SC2086
  timeout 200 python3 bench/bench_gpu.py --dir "$BENCH_DIR/gpu" --drop-caches $SIZES \
    --json "$OUT/bench_gpu.json" ${BENCH_ARGS:-} > "$OUT/bench_gpu.log" 2>&1
  rc=$?; cat "$OUT/bench_gpu.log"; echo "bench_gpu exit $rc"; status=$(( status | rc ))
fi

# fs_native needs lmcache.lmcache_fs (compiled against another torch); LMCache's Python
# fs adapter stands in where it does not load, and the log says so.
if step ceiling; then
  note ceiling
  if [ $LMCACHE_FS = yes ]; then PEER=fs_native; else
    PEER=fs; echo "lmcache_fs does not load: measuring against fs"; fi
  if [ "${QUICK:-0}" = 1 ]; then WIN="--windows 2 --seconds 1"; else
    WIN="--windows 4 --seconds 1.5"; fi
  # shellcheck disable=SC2086
  timeout 240 python3 bench/instruments/bench_ceiling.py "$BENCH_DIR/ceiling" --paired \
    --systems nvme,$PEER --sizes-mb 2,16,64 $WIN --json "$OUT/ceiling.json" \
    ${CEILING_ARGS:-} > "$OUT/ceiling.log" 2>&1
  rc=$?; grep -v Warning "$OUT/ceiling.log" | tail -30; echo "ceiling exit $rc"
  status=$(( status | rc ))
fi
note done
exit $status
