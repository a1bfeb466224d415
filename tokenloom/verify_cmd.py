"""``tokenloom verify``: check, on your own sources and settings, that the loader resumes exactly.

It takes the sources and flags of ``tokenloom run`` (or ``--config run.toml``), builds the loader
again and again, resumes it at several steps and compares every batch with an uninterrupted run
(tokenloom/verify.py), once in a new process (``tokenloom run --resume`` with the same sources and
flags); it prints one line per check and the first difference of each that failed,
and exits 1 when one did. ``--quick``: a short reference (20 batches) and one drawn save point.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from typing import Any, List

import torch

from .cli_config import add_loader_arguments, build_loader, describe, merged_settings
from .state_file import save
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


#: verify's own flags, with the number of values each takes: not passed on to ``tokenloom run``.
_OWN = {"--quick": 0, "--points": 1, "--check-seed": 1, "--quiet": 0, "--steps": 1}


def _run_resumed(argv: List[str], state: Any, count: int) -> List[Any]:
    """``count`` batches of ``tokenloom run`` with the same sources and flags, in a new process,
    resumed from ``state`` (``--resume``, ``--dump-batches``)."""
    rest, skip = [], 0
    words = list(argv)
    words.remove("verify")
    for word in words:
        if skip:
            skip -= 1
            continue
        flag = word.split("=", 1)[0]
        if flag in _OWN:
            skip = _OWN[flag] if "=" not in word else 0
            continue
        rest.append(word)
    with tempfile.TemporaryDirectory(prefix="tokenloom-verify-") as tmp:
        saved, dumped = os.path.join(tmp, "state.pt"), os.path.join(tmp, "batches.pt")
        save(saved, state)
        cmd = [sys.executable, "-m", "tokenloom", "run", *rest, "--resume", saved, "--steps", str(count),
               "--dump-batches", dumped, "--quiet"]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"tokenloom run --resume in a new process failed ({done.returncode}): "
                               f"{done.stderr.strip().splitlines()[-1] if done.stderr.strip() else ''}")
        return torch.load(dumped, weights_only=True)


def run(args: argparse.Namespace) -> int:
    settings = merged_settings(args)
    args.recipe_built = settings.get("recipe")  # names the recipe's flags in an error
    steps = settings.get("steps") or (QUICK_STEPS if args.quick else STEPS)
    points = args.points if args.points is not None else (1 if args.quick else 3)
    recipe, loader = build_loader(settings)
    print(describe(recipe, loader))
    del loader
    report = verify(lambda: build_loader(settings)[1], steps=steps, points=points, seed=args.check_seed,
                    progress=None if args.quiet else (lambda line: print(f"  {line}", flush=True)),
                    fresh_process=lambda state, count: _run_resumed(args.argv, state, count))
    print(report)
    return 0 if report.ok else 1
