"""Which build of a model's weights a chunk belongs to (``nvme.model_build``).

LMCache keys chunks by model name, not weights, so a model redeployed under the same name
would be served KV of its old weights.  The namespace names the build too
(``<model>[@salt]#<build>``), so chunks of another build are never looked up.

* ``auto``: for a model that is a local directory or in the Hugging Face cache, a digest of
  its weight files' names, sizes and up to 16 sampled 64 KiB blocks each (the first holds a
  safetensors header), taken once; the files are stat-ed again every 10 s, so replaced
  weights get a new build.  Any other model is bound to its name only, with a warning.
* any other value: that revision for every model; ``off``: namespaces are model names.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

from ..disk.layout import BUILD_SEP, split_build

logger = logging.getLogger("lmcache_nvme_backend")

#: Files whose contents make a build (the top level of the model's directory).
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".npz")
SAMPLE_BYTES = 64 * 1024
SAMPLES_PER_FILE = 16
MAX_WEIGHT_FILES = 4096
RECHECK_S = 10.0

Signature = tuple[tuple[str, int, int, int], ...]


def weights_dir(model: str) -> Path | None:
    """The directory holding ``model``'s weights on this host, if there is one (LMCache's
    vLLM connector may add its DCP layout after ``##``)."""
    model = model.split("##", 1)[0]
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    if model.count("/") != 1 or model.startswith((".", "/")):
        return None
    hub = os.environ.get("HF_HUB_CACHE") or os.path.join(
        os.environ.get("HF_HOME") or os.path.expanduser("~/.cache/huggingface"), "hub")
    repo = Path(hub) / ("models--" + model.replace("/", "--"))
    try:
        with open(repo / "refs" / "main", encoding="ascii") as ref:
            commit = ref.read(64).strip()
    except (OSError, ValueError):
        return None
    snapshot = repo / "snapshots" / commit
    return snapshot if commit.isalnum() and snapshot.is_dir() else None


def weight_files(directory: Path) -> list[Path]:
    """The weight files of a model directory, by name (at most ``MAX_WEIGHT_FILES``)."""
    return sorted(entry for entry in directory.iterdir()
                  if entry.name.endswith(WEIGHT_SUFFIXES) and entry.is_file()
                  )[:MAX_WEIGHT_FILES]


def signature(files: Sequence[Path]) -> Signature:
    """What changes when a file is replaced: name, size, modification time, inode."""
    stats = [(path.name, path.stat()) for path in files]
    return tuple((name, st.st_size, st.st_mtime_ns, st.st_ino) for name, st in stats)


def fingerprint(files: Sequence[Path]) -> str:
    """A digest of the files' names, sizes and ``SAMPLES_PER_FILE`` blocks of each."""
    digest = hashlib.blake2b(digest_size=8)
    for path in files:
        with open(path, "rb") as weights:
            size = os.fstat(weights.fileno()).st_size
            digest.update(f"{path.name}\0{size}\0".encode())
            step = max(SAMPLE_BYTES, size // SAMPLES_PER_FILE)
            for offset in range(0, min(size, step * SAMPLES_PER_FILE), step):
                weights.seek(offset)
                digest.update(weights.read(SAMPLE_BYTES))
    return digest.hexdigest()


class ModelBuilds:
    """Namespaces bound to model builds, for one adapter; when one is first bound, the log
    names the other builds of its model and salt in ``namespace_names()`` (skipped)."""

    def __init__(self, setting: str, namespace_names: Callable[[], Iterable[str]]) -> None:
        self._setting = setting
        self._namespace_names = namespace_names
        self._bound: dict[str, str] = {}
        self._models: dict[str, tuple[Path, Signature, str] | None] = {}
        self._lock = threading.Lock()
        self._next_check = time.monotonic() + RECHECK_S
        self._last: tuple[list[str], list[str]] = ([], [])
        self._announced: set[tuple[str, str | None]] = set()

    def namespace(self, namespace: str) -> str:
        """``namespace`` (a model name, or ``model@salt``) bound to its model's build."""
        self.recheck_if_due()
        return self.bound(namespace)

    def bound(self, namespace: str) -> str:
        """:meth:`namespace` without a recheck (the caller's to do, once per batch)."""
        return self._bound.get(namespace) or self._learn(namespace)

    def namespaces(self, namespaces: list[str]) -> list[str]:
        """:meth:`bound` of each; the same list as the last call's gets the last answer, not
        to be changed: no Python per chunk."""
        last = self._last
        if namespaces == last[0]:
            return last[1]
        answer = list(map(self.bound, namespaces))
        self._last = (namespaces, answer)
        return answer

    def recheck_if_due(self) -> None:
        if time.monotonic() >= self._next_check:
            self._recheck()

    def _learn(self, namespace: str) -> str:
        model = namespace.split("@", 1)[0]
        with self._lock:
            if model not in self._models:
                self._models[model] = self._find(model)
            build = self._build_of(model)
            bound = f"{namespace}{BUILD_SEP}{build}" if build else namespace
            self._bound[namespace] = bound
            # once per build of a model, not per salt: it lists the cache's namespaces
            announce = build is not None and (model, build) not in self._announced
            self._announced.add((model, build))
        if announce:
            self._announce(namespace, bound)
        return bound

    def _announce(self, namespace: str, bound: str) -> None:
        build = split_build(bound)[1]
        try:
            earlier = earlier_builds(bound, self._namespace_names())
        except OSError:
            earlier = []
        if not earlier:
            logger.info("NVMe tier: chunks of %r are stored under build %s of its weights.",
                        namespace, build)
            return
        logger.warning(
            "NVMe tier: %r is build %s of its weights now; chunks stored under its earlier "
            "builds (%s) are skipped, never served. They age out of the budget; `lmcache-nvme "
            "forget PATH --model %r --build <build>` drops one now.", namespace, build,
            ", ".join(earlier), namespace.split("@", 1)[0])

    def _build_of(self, model: str) -> str | None:
        if self._setting == "off":
            return None
        if self._setting != "auto":
            return self._setting
        found = self._models.get(model)
        return found[2] if found else None

    def _find(self, model: str) -> tuple[Path, Signature, str] | None:
        """The model's weights directory, its signature and build (auto only)."""
        if self._setting != "auto":
            return None
        try:
            directory = weights_dir(model)
            files = weight_files(directory) if directory is not None else []
            if directory is not None and files:
                return directory, signature(files), fingerprint(files)
        except OSError as exc:
            logger.warning("NVMe tier: cannot read the weights of model %r to tell its "
                           "build (%s).", model, exc)
            return None
        logger.warning(
            "NVMe tier: model %r is not a directory on this host with weight files, nor in "
            "the Hugging Face cache here, so its chunks are bound to its name only: weights "
            "replaced under the same name would be served the old KV. Set nvme.model_build "
            "(adapter_params.model_build) to a revision of the weights.", model)
        return None

    def _recheck(self) -> None:
        """Rebind the models whose weight files changed since their build was taken."""
        self._next_check = time.monotonic() + RECHECK_S
        for model, found in list(self._models.items()):
            if found is None:
                continue
            directory, seen, build = found
            try:
                files = weight_files(directory)
                if signature(files) == seen:
                    continue
                now = (directory, signature(files), fingerprint(files))
            except OSError:
                continue  # being replaced: looked at again next time
            with self._lock:
                self._models[model] = now
                if now[2] != build:
                    self._bound = {ns: bound for ns, bound in self._bound.items()
                                   if ns.split("@", 1)[0] != model}
                    self._last = ([], [])
            if now[2] != build:
                logger.warning("NVMe tier: the weights of model %r changed (build %s is now "
                               "%s); chunks of the earlier build are no longer served.",
                               model, build, now[2])


def earlier_builds(bound: str, names: Iterable[str]) -> list[str]:
    """The builds, other than ``bound``'s, of namespaces in ``names`` with its model and salt."""
    base, build = split_build(bound)
    return sorted({other for name in names
                   for other_base, other in [split_build(name)]
                   if other_base == base and other is not None and other != build})
