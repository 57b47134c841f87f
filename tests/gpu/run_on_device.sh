#!/usr/bin/env bash
# Run the GPU suite and the GPU benchmark on a GPU machine that has no package index.
#
# On a machine with pip access, once:    bash tests/gpu/prepare_wheels.sh
# Then, on the GPU machine, from the repository root with `.whl` copied along:
#     bash tests/gpu/run_on_device.sh
# Results go to $OUT: gpu_tests.log, bench_gpu.log, bench_gpu.json, env.txt.
# Optional: QUICK=1 (small benchmark), BENCH_ARGS="..." (extra bench_gpu.py arguments),
# NVME_GPU_TEST_DIR (where test chunk files go; default /var/tmp/nvme-gpu-tests).
set -uo pipefail
OUT=${OUT:-/tmp/nvme-gpu-out}
mkdir -p "$OUT"
cd "$(dirname "$0")/../.."

python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || { echo "wheel install failed: carry .whl" >&2; exit 3; }
export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
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

{
  date -u; nvidia-smi -L; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  uname -r; df -hT /var/tmp /tmp; ls /proc/driver/nvidia-fs 2>&1; ls -d /run/udev 2>&1
  echo "libcufile: ${CUFILE:-not found}; libcudart: ${CUDART:-not found}"
  python3 -c "import torch, kvikio, lmcache, lmcache_nvme_backend as m; \
print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.is_available()); \
print('kvikio', kvikio.__version__); print('lmcache import ok'); \
from lmcache_nvme_backend.gpu.select import GpuProbe; print(GpuProbe.detect())"
} 2>&1 | tee "$OUT/env.txt"

export NVME_GPU_TEST_DIR=${NVME_GPU_TEST_DIR:-/var/tmp/nvme-gpu-tests}
mkdir -p "$NVME_GPU_TEST_DIR"
python3 -m pytest -p no:cacheprovider -q -rA -s tests/gpu 2>&1 | tee "$OUT/gpu_tests.log"
TESTS=${PIPESTATUS[0]}

if [ "${QUICK:-0}" = 1 ]; then SIZES="--chunk-mb 4,16 --chunks 32 --reps 3"; else
  SIZES="--chunk-mb 4,16,64 --chunks 64 --reps 5"; fi
# shellcheck disable=SC2086
timeout 420 python3 bench/bench_gpu.py --dir /var/tmp/nvme-gpu-bench --drop-caches $SIZES \
  --json "$OUT/bench_gpu.json" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench_gpu.log"
BENCH=${PIPESTATUS[0]}
echo "gpu tests exit $TESTS, bench exit $BENCH"
exit $(( TESTS != 0 ? TESTS : BENCH ))
