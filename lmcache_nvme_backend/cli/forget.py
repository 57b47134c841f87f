"""``lmcache-nvme forget PATH... --model NAME --build BUILD``: drop one build of a model.

Each chosen namespace (``<model>[@salt]#<build>``) directory is renamed in one step to
``ns/.forgotten-...``, then emptied, never through a link.  Safe while servers run: a store
notices the directory gone within a second (``store/namespaces.py``).  The emptied directory
stays for ``FORGOTTEN_KEEP_S`` (no inode reuse); a later ``forget`` removes it.
"""

from __future__ import annotations

import argparse
from typing import Any

from ..disk.layout import split_build
from .cache import CacheRoot, Dropped, namespace_row, require_namespace
from .common import (
    CLIError,
    add_namespace_option,
    add_output_options,
    cache_dir_command,
    human_bytes,
    print_json,
)

PROBLEMS = ("PATH is not a cache directory, no such model, build or namespace, an ambiguous "
            "build, or a directory not emptied in full")
NO_BUILD = "-"  # the build of a namespace bound to none, as inspect shows it
MODEL_HELP = "the model as LMCache names it, every salt (NAME@SALT: one salt); with --build"
BUILD_HELP = f"the build to drop: a unique prefix will do, '{NO_BUILD}' is no build"


def add_parser(sub: Any) -> argparse.ArgumentParser:
    p = cache_dir_command(
        sub, "forget", "drop one build of a model from a cache directory",
        description="Drop one build of a model (or whole namespaces): each namespace "
                    "directory is renamed away in one step, then emptied. Safe while servers "
                    "use the directory: within about a second they stop serving it, without "
                    "a restart (in shared mode every member).",
        epilog=f"exit status: 0 success, 1 {PROBLEMS}, 2 usage error (--model without --build)")
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--model", metavar="NAME", help=MODEL_HELP)
    add_namespace_option(which, "drop this namespace")
    p.add_argument("--build", metavar="BUILD", help=BUILD_HELP)
    add_output_options(p, dry_run="dropped")
    p.set_defaults(func=run)
    return p


def model_of(name: str, with_salt: bool) -> str:
    """The model of a namespace name (with its salt when ``with_salt``)."""
    base = split_build(name)[0]
    return base if with_salt else base.split("@", 1)[0]


def builds_text(names: dict[str, str]) -> str:
    """Each build of ``names`` (id -> name) with its namespaces, for a message."""
    by_build: dict[str, list[str]] = {}
    for name in sorted(names.values()):
        base, build = split_build(name)
        by_build.setdefault(build or NO_BUILD, []).append(base)
    return "; ".join(f"{build} ({', '.join(bases)})" for build, bases in sorted(by_build.items()))


def select_build(names: dict[str, str], model: str, build: str | None, where: str
                 ) -> dict[str, str]:
    """The namespaces (id -> name) of ``model`` with ``build`` (a unique prefix will do)."""
    with_salt = "@" in model
    mine = {i: n for i, n in names.items() if n and model_of(n, with_salt) == model}
    if not mine:
        models = sorted({model_of(n, False) for n in names.values() if n}) or ["none"]
        raise CLIError(f"no namespace of model '{model}' in {where}; models here: "
                       f"{', '.join(models)}")
    if build is None:
        raise CLIError(f"give --build: forget drops one build of a model at a time. Builds of "
                       f"'{model}' here: {builds_text(mine)}", status=2)
    builds = {split_build(n)[1] or NO_BUILD for n in mine.values()}
    if build not in builds:
        matches = sorted(b for b in builds if b != NO_BUILD and b.startswith(build))
        if len(matches) != 1:
            what = (f"build '{build}' of model '{model}' is ambiguous" if matches else
                    f"model '{model}' has no build '{build}'")
            raise CLIError(f"{what} in {where}; its builds: {builds_text(mine)}")
        build = matches[0]
    return {i: n for i, n in mine.items() if (split_build(n)[1] or NO_BUILD) == build}


def targets(roots: list[CacheRoot], args: argparse.Namespace) -> dict[str, str]:
    """The namespaces to drop, id -> readable name ("" where its NAMESPACE file is not
    readable), checked before anything changes."""
    names: dict[str, str] = {}
    for root in roots:
        for ns_id, name in root.layout.namespace_names().items():
            names[ns_id] = names.get(ns_id) or name
    if args.model is not None:
        where = ", ".join(str(r.path) for r in roots)
        return select_build(names, args.model, args.build, where)
    if args.build is not None:
        args.parser.error("--build goes with --model")
    chosen: dict[str, str] = {}
    for name in args.namespace:
        require_namespace(roots, name)
        for root in roots:
            try:
                ns_id = root.resolve_namespace(name)
            except CLIError:  # present on another path only
                continue
            chosen[ns_id] = names.get(ns_id, "")
    return chosen


def forget_root(root: CacheRoot, chosen: dict[str, str], dry_run: bool) -> dict[str, Any]:
    report: dict[str, Any] = {"path": str(root.path), "dry_run": dry_run, "namespaces": []}
    here = root.layout.namespace_names()
    if not dry_run:
        report["leftovers"] = root.remove_forgotten().to_json()
    for ns_id, name in sorted(chosen.items(), key=lambda item: (item[1], item[0])):
        if ns_id not in here:
            continue
        if dry_run:
            files = root.scan(ns_id)
            dropped = Dropped(len(files), sum(f.size for f in files))
        else:
            dropped = root.drop_namespace(ns_id)
        report["namespaces"].append({**namespace_row(ns_id, name), **dropped.to_json()})
    return report


def print_report(rep: dict[str, Any]) -> None:
    verb = "would drop" if rep["dry_run"] else "dropped"
    print(f"{rep['path']}:{' (dry run)' if rep['dry_run'] else ''}")
    left = rep.get("leftovers")
    if left and (left["chunks"] or not left["complete"]):
        print(f"  finished an earlier forget: {left['chunks']} chunk files "
              f"({human_bytes(left['bytes'])})")
    if not rep["namespaces"]:
        print("  none of them here")
    for ns in rep["namespaces"]:
        print(f"  {verb} {ns['name'] or '?'} ({ns['id']}): {ns['chunks']} chunk files "
              f"({human_bytes(ns['bytes'])})")
    for item in [*rep["namespaces"], left or {}]:
        if item.get("left"):
            print(f"  could not delete everything in {item['left']}: see what is left there "
                  "(the next forget tries again once this one has ended)")


def run(args: argparse.Namespace) -> int:
    roots = [CacheRoot(p) for p in args.paths]
    chosen = targets(roots, args)
    reports = [forget_root(r, chosen, args.dry_run) for r in roots]
    dropped = [n for rep in reports for n in rep["namespaces"]]
    complete = all(item.get("complete", True) for rep in reports
                   for item in [*rep["namespaces"], rep.get("leftovers") or {}])
    if args.json:
        print_json({"command": "forget", "dry_run": args.dry_run,
                    "namespaces": [namespace_row(i, n) for i, n in sorted(chosen.items())],
                    "roots": reports, "total": {"chunks": sum(n["chunks"] for n in dropped),
                                                "bytes": sum(n["bytes"] for n in dropped)}})
    else:
        for rep in reports:
            print_report(rep)
    return 0 if complete else 1
