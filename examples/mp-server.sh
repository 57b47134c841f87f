#!/usr/bin/env bash
# LMCache multiprocess server with the NVMe tier as its L2 (NVMeL2Adapter).
# vLLM connects with LMCacheMPConnector (see examples/vllm-recipes.md); SGLang with
# --enable-lmcache --lmcache-config-file examples/sglang-lmcache.yaml (examples/sglang-recipe.md).  adapter_params take the nvme.<name> settings without the prefix
# (docs/configuration.md); a bad value stops the server at start with the field named.
#
#   CACHE_DIR=/mnt/nvme0/lmcache MAX_SIZE_GB=500 examples/mp-server.sh
set -euo pipefail

export LMCACHE_TRACK_USAGE=false      # no telemetry
export PYTHONHASHSEED=0

CACHE_DIR=${CACHE_DIR:-/mnt/nvme0/lmcache}   # several drives: /mnt/nvme0/c,/mnt/nvme1/c
MAX_SIZE_GB=${MAX_SIZE_GB:-500}              # byte budget on disk, LRU-evicted
PORT=${PORT:-5555}                           # vLLM's lmcache.mp.port
HTTP_PORT=${HTTP_PORT:-8080}                 # /status, /cache/clear, /metrics (docs/metrics.md)
MIN_FREE_GB=${MIN_FREE_GB:-1}                # keep this much of the filesystem free
L1_GB=${L1_GB:-20}                           # host memory (L1) in front of the drives

exec lmcache server \
  --host 127.0.0.1 --port "$PORT" \
  --http-host 127.0.0.1 --http-port "$HTTP_PORT" \
  --chunk-size 256 \
  --l1-size-gb "$L1_GB" --no-l1-use-lazy --eviction-policy LRU \
  --supported-transfer-mode auto \
  --l2-adapter "{\"type\": \"plugin\", \"module_path\": \"lmcache_nvme_backend\",
                 \"class_name\": \"NVMeL2Adapter\",
                 \"adapter_params\": {\"path\": \"$CACHE_DIR\", \"max_size_gb\": $MAX_SIZE_GB,
                                      \"min_free_gb\": $MIN_FREE_GB,
                                      \"direct_io\": \"auto\", \"io_threads\": 8,
                                      \"stats_log_interval_s\": 60}}"

# What the tier does: curl -s 127.0.0.1:$HTTP_PORT/status | jq '.storage_manager.l2_adapters'
# Prometheus: curl -s 127.0.0.1:$HTTP_PORT/metrics | grep ^lmcache_nvme_
# Several servers (or nodes) on one shared directory: add "shared": true to adapter_params.
