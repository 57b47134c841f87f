"""Will the in-process engine's chunk keys be the same after a restart?

The in-process engine names chunks by a hash chain over tokens (``pre_caching_hash_algorithm``).
Where vLLM is installed, vLLM's function hashes and derives the chain's first link:

* ``sha256_cbor`` / ``sha256``: from a fixed seed, so keys are the same in every process;
* ``builtin`` (LMCache's default; vLLM has no such function, so LMCache falls back to
  Python's ``hash()``): ``hash()`` of a seed string, which differs per process unless
  ``PYTHONHASHSEED`` is fixed;
* ``xxhash`` / ``xxhash_cbor``: from random bytes unless ``PYTHONHASHSEED`` is set.

Without vLLM, LMCache's ``hash()`` of integer tuples is the same in every process.  The
multiprocess server hashes with blake3.  Imports neither LMCache nor vLLM (doctor uses it).
"""

from __future__ import annotations

import difflib
import importlib.util
import os
from collections.abc import Mapping
from dataclasses import dataclass

#: The value to put in the LMCache config: stable across processes with no variable set.
RECOMMENDED_ALGORITHM = "sha256_cbor"
#: vLLM hash functions whose chain starts from a fixed seed (PYTHONHASHSEED not needed).
STABLE_WITH_VLLM = frozenset({"sha256_cbor", "sha256_cbor_64bit", "sha256"})
#: LMCache's default.
DEFAULT_ALGORITHM = "builtin"
#: The names LMCache 0.5.6 resolves (vLLM's hash functions, and its own fallback); any
#: other name silently falls back to ``builtin``.
KNOWN_ALGORITHMS = ("builtin", "sha256", "sha256_cbor", "sha256_cbor_64bit", "xxhash",
                    "xxhash_cbor")
TROUBLESHOOTING = "docs/troubleshooting.md#no-hits-after-a-restart-or-from-another-process"
FIX = (f"Set pre_caching_hash_algorithm: {RECOMMENDED_ALGORITHM} in the LMCache config "
       "(stable without any environment variable), or export PYTHONHASHSEED=0 (any fixed "
       "value, the same everywhere) for every engine process")


def vllm_installed() -> bool:
    """Whether ``vllm`` can be found (not imported) in this environment."""
    try:
        return importlib.util.find_spec("vllm") is not None
    except (ImportError, ValueError):
        return False


@dataclass(frozen=True)
class TokenHashing:
    """The facts that decide whether in-process chunk keys survive a restart."""

    algorithm: str
    hashseed: str | None  # PYTHONHASHSEED, None when unset
    vllm: bool  # vLLM (and with it its hash functions) is installed

    @property
    def stable(self) -> bool:
        """Keys computed in this process equal those of the next process."""
        if self.hashseed is not None or not self.vllm:
            return True
        return self.algorithm in STABLE_WITH_VLLM

    def describe(self) -> str:
        """One sentence: what hashes the tokens, and whether that is stable."""
        if self.vllm and self.algorithm in STABLE_WITH_VLLM:
            return (f"pre_caching_hash_algorithm '{self.algorithm}' (vLLM's, from a fixed "
                    "seed): chunk keys are the same in every process")
        if self.hashseed is not None:
            return (f"pre_caching_hash_algorithm '{self.algorithm}' with "
                    f"PYTHONHASHSEED={self.hashseed}: chunk keys are the same in every "
                    "process that sets the same value")
        if not self.vllm:
            later = ("it is used once vLLM is installed, and is stable there too"
                     if self.algorithm in STABLE_WITH_VLLM else
                     f"once vLLM is installed, set {RECOMMENDED_ALGORITHM}")
            return (f"pre_caching_hash_algorithm '{self.algorithm}', vLLM not installed: "
                    "LMCache hashes token ids with Python's hash() of integers, which is the "
                    f"same in every process ({later})")
        return (f"pre_caching_hash_algorithm '{self.algorithm}' with vLLM installed and "
                "PYTHONHASHSEED unset: vLLM seeds the first hash of every prompt per "
                "process, so chunk keys change at every restart")

    def warning(self, tier: str) -> str:
        """The load-time warning for an unstable configuration."""
        return (f"{tier}: chunk keys will change at every restart, so chunks on disk are "
                f"never found again: LMCache hashes tokens with pre_caching_hash_algorithm "
                f"'{self.algorithm}' and PYTHONHASHSEED is not set, so vLLM seeds the hash "
                f"chain per process. {FIX} ({TROUBLESHOOTING}).")


def unknown_algorithm(algorithm: str | None) -> str | None:
    """What is wrong with a ``pre_caching_hash_algorithm`` LMCache does not know (None: known
    or unset): LMCache would log a warning and hash with ``builtin`` instead."""
    if algorithm is None or algorithm in KNOWN_ALGORITHMS:
        return None
    close = difflib.get_close_matches(str(algorithm), KNOWN_ALGORITHMS, n=1)
    hint = f"did you mean '{close[0]}'? " if close else ""
    return (f"pre_caching_hash_algorithm '{algorithm}' is not a hash LMCache knows, so it "
            f"falls back to '{DEFAULT_ALGORITHM}' (Python's hash()); {hint}known: "
            f"{', '.join(KNOWN_ALGORITHMS)}")


def token_hashing(algorithm: str | None, environ: Mapping[str, str] | None = None,
                  vllm: bool | None = None) -> TokenHashing:
    """The hashing facts for ``algorithm`` (LMCache's ``pre_caching_hash_algorithm``)
    in ``environ`` (default: this process's) with or without vLLM (default: detected)."""
    env = os.environ if environ is None else environ
    return TokenHashing(algorithm=algorithm or DEFAULT_ALGORITHM,
                        hashseed=env.get("PYTHONHASHSEED"),
                        vllm=vllm_installed() if vllm is None else vllm)


def restart_miss_warning(tier: str, recovered: int, lookups: int,
                         hashing: TokenHashing) -> str:
    """The run-time warning: chunks were found at start, but nothing hits."""
    if hashing.stable:
        cause = ("the keys changed: a different model name, tensor-parallel size, KV dtype "
                 "or chunk_size than when the chunks were written, or token hashing seeded "
                 "per process in the process that wrote them")
    else:
        cause = (f"the keys changed: this process hashes tokens with "
                 f"pre_caching_hash_algorithm '{hashing.algorithm}' and no PYTHONHASHSEED, "
                 f"so every restart makes new keys. {FIX}")
    return (f"{tier}: {recovered} chunks were on disk at start, but none of the first "
            f"{lookups} lookups since then hit. If these requests repeat prompts from before "
            f"the restart, {cause} ({TROUBLESHOOTING}).")
