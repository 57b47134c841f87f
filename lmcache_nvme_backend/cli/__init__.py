"""The ``lmcache-nvme`` command line (also ``python -m lmcache_nvme_backend``), one module
per command.  Exit statuses: 0 success, 1 a problem found or the command could not run
(``doctor``, ``check-config``: 1 warnings, 2 failures), 2 usage error (or no command).
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from .. import __version__
from . import bench, check_config, doctor, forget, gc, inspect, verify
from .common import CLIError

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with one subcommand per module."""
    parser = argparse.ArgumentParser(
        prog="lmcache-nvme",
        description="Tools for the LMCache NVMe tier: benchmark a drive with the backend's "
                    "own I/O engine, check a config before a deploy, check a path, and "
                    "inspect, verify or trim a cache directory, or drop a model build from it "
                    "(safe while a server uses it).",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log debug messages")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", title="commands")
    for module in (bench, check_config, doctor, inspect, verify, gc, forget):
        subparser = module.add_parser(sub)
        subparser.set_defaults(parser=subparser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``lmcache-nvme`` console script; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:  # usage error, but show what there is to run
        parser.print_help(sys.stderr)
        print(f"\n{parser.prog}: error: give a command, e.g. `{parser.prog} doctor PATH`; "
              f"`{parser.prog} COMMAND --help` describes each", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        status: int = args.func(args)
    except CLIError as exc:
        print(f"lmcache-nvme {args.command}: error: {exc}", file=sys.stderr)
        return exc.status
    except KeyboardInterrupt:
        print(f"lmcache-nvme {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 1
    return status


if __name__ == "__main__":
    sys.exit(main())
