#!/usr/bin/env bash
# Build SGLang's CPU kernels (sglang-kernel-cpu, the `sgl_kernel` module of SGLang's CPU
# engine) from an SGLang source checkout and install them into the SGLang environment of
# the end-to-end tests, so that tests/e2e/test_e2e_sglang_server.py runs:
#
#     bash tests/e2e/build_sglang_cpu_kernel.sh /path/to/sglang      # a checkout of
#                                                                    # sgl-project/sglang
#     python -m pytest -m sglang_server
#
# The same steps as SGLang's docker/xeon.Dockerfile (pyproject_cpu.toml of
# python/sglang/kernels/aot), built against this environment's torch (no build
# isolation: the kernel's own pin is another torch) with libnuma. Its CMakeLists compiles
# for -march=x86-64-v4 with AVX512-BF16/VNNI and AMX whatever the build machine: the
# result runs on CPUs with AVX-512 (AMX is used only where present). About 4 minutes on
# 2 cores. Run from the repository root, with the interpreter that runs the tests.
set -euo pipefail
SRC=${1:?usage: $0 SGLANG_SOURCE_CHECKOUT}
KERNEL="$SRC/python/sglang/kernels/aot"
[[ -f $KERNEL/pyproject_cpu.toml ]] || {
  echo "$0: $KERNEL/pyproject_cpu.toml not found; give a checkout of sgl-project/sglang" >&2
  exit 2
}
cd "$(git rev-parse --show-toplevel)"
PYTHON=${PYTHON:-python}

if ! ldconfig -p | grep -q 'libnuma\.so '; then
  if [[ $(id -u) == 0 ]] && command -v apt-get > /dev/null; then
    apt-get install -y libnuma-dev
  else
    echo "$0: libnuma's development files are missing: apt-get install libnuma-dev" >&2
    exit 2
  fi
fi

# The SGLang environment of the tests (built here if it does not exist yet).
ENV_PYTHON=$(PYTHONPATH=tests "$PYTHON" -c \
  'from support.engine_env import SGLANG, ensure_env; print(ensure_env(SGLANG, say=lambda _: None).python)')
"$ENV_PYTHON" -m pip install --disable-pip-version-check "scikit-build-core>=0.10" wheel

BUILD=$(mktemp -d)
trap 'rm -rf "$BUILD"' EXIT
cp -r "$KERNEL/." "$BUILD"
cp "$BUILD/pyproject_cpu.toml" "$BUILD/pyproject.toml"
CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)} \
  "$ENV_PYTHON" -m pip install --disable-pip-version-check --no-build-isolation --no-deps "$BUILD"
SGLANG_USE_CPU_ENGINE=1 "$ENV_PYTHON" -c 'import sgl_kernel; print("sgl_kernel:", sgl_kernel.__file__)'
