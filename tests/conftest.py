"""Test-wide environment: no telemetry, no banner, before anything imports LMCache."""

import os

os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")
os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("LMCACHE_DISABLE_BANNER", "1")
