#!/usr/bin/env bash
# Download, on a machine with pip access, the wheels that the GPU machine lacks
# (its image has torch 2.11+cu130, cupy, nvidia-cufile, numpy, xxhash, pytest,
# transformers... but no kvikio and no lmcache).  Run from the repository root:
#
#     bash tests/gpu/prepare_wheels.sh
#
# then copy `.whl` to the GPU machine with the checkout (docs/gpu.md).  The list
# was derived from an import trace of lmcache_nvme_backend.adapters.backend, LMCache's
# GdsBackend/allocators and kvikio, minus what a stock CUDA 13 / torch image
# already has.  One version per package; --no-deps.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
DEST=.whl
mkdir -p "$DEST" "$(git rev-parse --git-dir)/info"
grep -qx '/.whl/' "$(git rev-parse --git-dir)/info/exclude" 2>/dev/null \
  || echo '/.whl/' >> "$(git rev-parse --git-dir)/info/exclude"

PKGS=(
  kvikio-cu13==26.10.0 libkvikio-cu13==26.10.0 rapids-logger==0.3.0
  lmcache==0.5.6 cufile-python==0.2.0
  aiofile==3.12.3 caio==0.12.10 cachetools==8.0.1 msgspec==0.22.0 nvtx==0.2.17
  pyzmq==27.3.0 cryptography==48.0.0 cffi==2.0.0 pycparser
  opentelemetry-api==1.40.0 opentelemetry-sdk==1.40.0
  opentelemetry-semantic-conventions==0.61b0 importlib-metadata==8.7.1
)
PLATFORMS=()
for n in 17 24 27 28 31 34 35; do PLATFORMS+=(--platform "manylinux_2_${n}_x86_64"); done
PLATFORMS+=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any)

for pkg in "${PKGS[@]}"; do
  name=${pkg%%==*}
  if ls "$DEST" | grep -qi "^$(echo "$name" | tr '-' '_')-"; then continue; fi
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp "${PLATFORMS[@]}" -d "$DEST" "$pkg"
done
du -ch "$DEST"/*.whl | tail -1
ls -1 "$DEST"
