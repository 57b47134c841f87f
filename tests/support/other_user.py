"""Run the store or ``lmcache-nvme`` as another user, for trees owned by someone else.

``python -m support.other_user USER open-store CACHE_DIR``
    opens a ``ChunkStore`` on CACHE_DIR and prints ``OPENED <entries>``, or
    ``REFUSED <message>`` when the settings or the tree are refused.
``python -m support.other_user USER check-paths CACHE_DIR``
    runs ``check_paths`` on CACHE_DIR's settings and prints ``USABLE``, or
    ``REFUSED <message>``.
``python -m support.other_user USER cli ARGS...``
    runs ``lmcache-nvme ARGS`` and exits with its status.

Started as root: everything the command needs is imported first (the interpreter's
own files may not be readable by USER), then the process switches to USER for good.
"""

from __future__ import annotations

import importlib.metadata
import os
import pwd
import sys

import yaml  # noqa: F401  (check-config reads YAML after the switch)

from lmcache_nvme_backend.cli import main as cli_main
from lmcache_nvme_backend.config import NVMeConfigError
from lmcache_nvme_backend.store.access import check_paths

from .stores import open_store, store_settings


def become(user: str) -> None:
    """Switch this process to ``user`` (its primary group, no supplementary groups)."""
    entry = pwd.getpwnam(user)
    os.setgroups([])
    os.setgid(entry.pw_gid)
    os.setuid(entry.pw_uid)


def main() -> int:
    user, command, *args = sys.argv[1:]
    importlib.metadata.version("lmcache")  # imports what the version check reads with
    become(user)
    if command == "cli":
        return cli_main(args)
    if command == "check-paths":
        try:
            check_paths(store_settings(args[0]))
        except NVMeConfigError as exc:
            print(f"REFUSED {exc}", flush=True)
            return 0
        print("USABLE", flush=True)
        return 0
    try:
        store = open_store(args[0])
    except NVMeConfigError as exc:
        print(f"REFUSED {exc}", flush=True)
        return 0
    print(f"OPENED {store.usage()['entries']}", flush=True)
    store.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
