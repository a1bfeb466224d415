"""``tokenloom verify``: check, on your own sources and settings, that the loader resumes exactly.

It takes the sources and flags of ``tokenloom run`` (or ``--config run.toml``), builds the loader
again and again, resumes it at several steps and compares every batch with an uninterrupted run
(tokenloom/verify.py); it prints one line per check and the first difference of each that failed,
and exits 1 when one did. ``--quick``: a short reference (20 batches) and one drawn save point.
"""

from __future__ import annotations

import argparse
from typing import Any

from .cli_config import add_loader_arguments, build_loader, describe, merged_settings
from .verify import verify

#: Batches of the reference run, unless --steps says otherwise.
STEPS, QUICK_STEPS = 60, 20


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("verify", parents=[common], help="check that your loader resumes exactly, on your data",
                       description=__doc__.split("\n\n")[0])
    add_loader_arguments(p)
    p.add_argument("--quick", action="store_true", help=f"{QUICK_STEPS} batches and one drawn save point")
    p.add_argument("--points", type=int, default=None, help="save points drawn beside steps 0, 1 and the last "
                                                             "(default 3; --quick: 1)")
    p.add_argument("--check-seed", type=int, default=0, help="the seed that draws the save points")
    p.add_argument("--quiet", action="store_true", help="no line per check as it starts")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    settings = merged_settings(args)
    args.recipe_built = settings.get("recipe")  # names the recipe's flags in an error
    steps = settings.get("steps") or (QUICK_STEPS if args.quick else STEPS)
    points = args.points if args.points is not None else (1 if args.quick else 3)
    recipe, loader = build_loader(settings)
    print(describe(recipe, loader))
    del loader
    report = verify(lambda: build_loader(settings)[1], steps=steps, points=points, seed=args.check_seed,
                    progress=None if args.quiet else (lambda line: print(f"  {line}", flush=True)))
    print(report)
    return 0 if report.ok else 1
