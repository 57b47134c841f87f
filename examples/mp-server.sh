#!/usr/bin/env bash
# LMCache multiprocess server with the NVMe tier as its L2 (NVMeL2Adapter).
# vLLM connects with LMCacheMPConnector (see examples/vllm-recipes.md); SGLang with
# --enable-lmcache --lmcache-config-file examples/sglang-lmcache.yaml (examples/sglang-recipe.md).
# adapter_params take the nvme.<name> settings without the prefix (docs/configuration.md).
# The variables below are checked, the adapter's settings validated and its directories
# checked before the server starts: a mistake is the first thing printed, naming the variable
# (exit status 2).
#
#   CACHE_DIR=/mnt/nvme0/lmcache MAX_SIZE_GB=500 examples/mp-server.sh
#
# Arguments are passed on to `lmcache server`, after the script's own: e.g.
# `examples/mp-server.sh --separate-object-groups` for SGLang 0.5.21+ serving a model with
# sliding-window or Mamba layers (examples/sglang-recipe.md).
# An engine on CPU (vLLM's CPU backend) on the same host: add `--shm-name lmcache_kv`, so that
# the KV moves through shared memory; without it LMCache pickles every hit over ZMQ (about
# 250 ms of a 3k-token hit on a 2-vCPU machine). bench/bench_e2e.py runs with it
# (docs/benchmarks.md). GPU engines move KV by CUDA IPC and need nothing.
set -euo pipefail

export LMCACHE_TRACK_USAGE=false      # no telemetry

CACHE_DIR=${CACHE_DIR:-/mnt/nvme0/lmcache}   # several drives: /mnt/nvme0/c,/mnt/nvme1/c
MAX_SIZE_GB=${MAX_SIZE_GB:-500}              # byte budget on disk in GB (a number), LRU-evicted
PORT=${PORT:-5555}                           # vLLM's lmcache.mp.port
HTTP_PORT=${HTTP_PORT:-8080}                 # /status, /cache/clear, /metrics (docs/metrics.md)
MIN_FREE_GB=${MIN_FREE_GB:-1}                # keep this much of the filesystem free (auto: 5%, at most 1)
L1_GB=${L1_GB:-20}                           # host memory (L1) in front of the drives
# More of the --l2-adapter JSON, merged into what this script builds: LMCache's own keys
# (e.g. '{"serde": {"type": "fp8"}}') and "adapter_params" (any nvme.<name> setting, e.g.
# '{"shared": true, "adapter_params": {"shared": true}}' for several servers on one directory).
L2_ADAPTER_EXTRA=${L2_ADAPTER_EXTRA:-"{}"}
# The interpreter of the environment lmcache is installed in (default: the python next to
# the lmcache command, else python3).
LMCACHE_BIN=$(command -v lmcache || true)
if [[ -z ${PYTHON:-} ]]; then
  if [[ -n $LMCACHE_BIN && -x $(dirname "$LMCACHE_BIN")/python ]]; then
    PYTHON=$(dirname "$LMCACHE_BIN")/python
  else
    PYTHON=python3
  fi
fi
if [[ -z $LMCACHE_BIN ]]; then
  echo "mp-server.sh: the lmcache command is not on PATH; activate the environment where" \
       "lmcache and this package are installed (pip install -e .)" >&2
  exit 2
fi

# Check the variables and build the --l2-adapter JSON (validated by the adapter's own config
# class, as the server will; the cache directories checked with check_paths, as the store will
# when it opens them), so that a bad value stops here with its variable named.
L2_ADAPTER=$(CACHE_DIR=$CACHE_DIR MAX_SIZE_GB=$MAX_SIZE_GB MIN_FREE_GB=$MIN_FREE_GB \
             PORT=$PORT HTTP_PORT=$HTTP_PORT L1_GB=$L1_GB L2_ADAPTER_EXTRA=$L2_ADAPTER_EXTRA \
             LMCACHE_LOG_LEVEL=${LMCACHE_LOG_LEVEL:-WARNING} "$PYTHON" - <<'PY'
import json, math, os, sys

def fail(message):
    print(f"mp-server.sh: {message}", file=sys.stderr)
    sys.exit(2)

def number(name, example, minimum, above=False, integer=False, maximum=None, auto=False):
    raw = os.environ[name].strip()
    if auto and raw.lower() == "auto":
        return "auto"
    try:
        value = int(raw) if integer else float(raw)
    except ValueError:
        kind = "a whole number" if integer else "a number (GB, no unit)"
        fail(f"{name}={raw!r} is not {kind}; e.g. {name}={example}")
    bad_low = value <= minimum if above else value < minimum
    if not math.isfinite(value) or bad_low or (maximum is not None and value > maximum):
        limits = (f"more than {minimum:g}" if above else f"at least {minimum:g}") + (
            f" and at most {maximum}" if maximum is not None else "")
        fail(f"{name}={raw!r} must be {limits}; e.g. {name}={example}")
    return int(value) if not integer and float(value).is_integer() else value

cache_dir = os.environ["CACHE_DIR"].strip()
if not cache_dir:
    fail("CACHE_DIR is empty; give the cache directory, e.g. CACHE_DIR=/mnt/nvme0/lmcache "
         "(several drives: comma-separated)")
params = {"path": cache_dir,
          "max_size_gb": number("MAX_SIZE_GB", 500, 0, above=True),
          "min_free_gb": number("MIN_FREE_GB", 1, 0, auto=True),
          "direct_io": "auto", "io_threads": 8, "stats_log_interval_s": 60}
number("L1_GB", 20, 0, above=True)
try:
    extra = json.loads(os.environ["L2_ADAPTER_EXTRA"])
except ValueError as exc:
    fail(f"L2_ADAPTER_EXTRA is not JSON ({exc}); e.g. L2_ADAPTER_EXTRA='{{\"serde\": "
         "{\"type\": \"fp8\"}}'")
if not isinstance(extra, dict) or not isinstance(extra.get("adapter_params", {}), dict):
    fail("L2_ADAPTER_EXTRA must be a JSON object (its adapter_params too); e.g. "
         "L2_ADAPTER_EXTRA='{\"shared\": true, \"adapter_params\": {\"shared\": true}}'")
fixed = sorted({"type", "module_path", "class_name"} & set(extra))
if fixed:
    fail(f"L2_ADAPTER_EXTRA sets {', '.join(fixed)}, which this script sets: remove them")
params.update(extra.pop("adapter_params", {}))
number("PORT", 5555, 1, integer=True, maximum=65535)
number("HTTP_PORT", 8080, 1, integer=True, maximum=65535)
try:
    from lmcache_nvme_backend import NVMeConfigError, NVMeL2AdapterConfig, check_paths
except ImportError as exc:
    fail(f"{sys.executable} cannot import lmcache_nvme_backend ({exc}); install this package "
         "(pip install -e .) where lmcache is installed, or set PYTHON to that interpreter")
try:
    check_paths(NVMeL2AdapterConfig.from_dict(params).settings)
except NVMeConfigError as exc:
    fail(f"the NVMe tier would not start (CACHE_DIR={cache_dir!r}, "
         f"MAX_SIZE_GB={os.environ['MAX_SIZE_GB']!r}, "
         f"MIN_FREE_GB={os.environ['MIN_FREE_GB']!r}): {exc}")
print(json.dumps({"type": "plugin", "module_path": "lmcache_nvme_backend",
                  "class_name": "NVMeL2Adapter", "adapter_params": params, **extra}))
PY
) || exit 2

exec lmcache server \
  --host 127.0.0.1 --port "$PORT" \
  --http-host 127.0.0.1 --http-port "$HTTP_PORT" \
  --chunk-size 256 \
  --l1-size-gb "$L1_GB" --no-l1-use-lazy --eviction-policy LRU \
  --supported-transfer-mode auto \
  --l2-adapter "$L2_ADAPTER" "$@"

# What the tier does: curl -s 127.0.0.1:$HTTP_PORT/status | jq '.storage_manager.l2_adapters'
# Prometheus: curl -s 127.0.0.1:$HTTP_PORT/metrics | grep ^lmcache_nvme_
# Several servers (or nodes) on one shared directory: add "shared": true to adapter_params.
