"""Where things are in the repository, for tests wherever they sit under ``tests/``."""

from __future__ import annotations

from pathlib import Path

TESTS_DIR = Path(__file__).resolve().parents[1]
REPO_ROOT = TESTS_DIR.parent
EXAMPLES_DIR = REPO_ROOT / "examples"
DOCS_DIR = REPO_ROOT / "docs"
BENCH_DIR = REPO_ROOT / "bench"

EXAMPLE_YAML = EXAMPLES_DIR / "lmcache-nvme.yaml"
REMOTE_EXAMPLE_YAML = EXAMPLES_DIR / "lmcache-nvme-remote.yaml"
MP_SERVER_SCRIPT = EXAMPLES_DIR / "mp-server.sh"
