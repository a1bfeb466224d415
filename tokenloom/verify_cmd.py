"""``tokenloom verify``: check, on your own sources and settings, that the loader resumes exactly.

It takes the sources and flags of ``tokenloom run`` (or ``--config run.toml``), builds the loader
again and again, resumes it at several steps and compares every batch with an uninterrupted run
(tokenloom/verify.py), once in a new process (``tokenloom run --resume`` with the same sources and
flags); it prints one line per check and the first difference of each that failed,
and exits 1 when one did. ``--quick``: a short reference (20 batches) and one drawn save point.

With ``--epochs``, the reference is the whole stream (unless ``--steps`` bounds it), and when every
document is delivered a fixed number of times (one source, or ``--no-cycle-exhausted``; packing
``flat`` or ``bestfit``) states saved on other topologies are resumed too (`ELASTIC`; ``--quick``:
the first): every token of the epoch exactly once. Otherwise the report says why they were not run.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from typing import Any, Dict, List, Optional, Tuple

import torch

from .cli_config import add_loader_arguments, build_loader, describe, merged_settings
from .progress import Progress
from .state_file import save
from .verify import verify

#: Batches of the reference run, unless --steps says otherwise (with --epochs: the whole stream).
STEPS, QUICK_STEPS = 60, 20
WHOLE = 10**9


def elastic_pairs(workers: int, quick: bool) -> List[Tuple[Tuple[int, int], Tuple[int, int]]]:
    """The (world size, workers) pairs a state is saved on and resumed on: one rank with your workers
    to two ranks with one fewer (at least one), and two ranks to one with one more (at most 3, and no
    more than the machine's cores)."""
    more = max(min(workers + 1, 3, os.cpu_count() or 1), 1)
    pairs = [((1, workers), (2, max(workers - 1, 1))), ((2, workers), (1, more))]
    return pairs[:1] if quick else pairs


def why_not_elastic(settings: Dict[str, Any], sources: int) -> str:
    """Why another topology cannot be checked on these settings ("" when it can)."""
    if not settings.get("epochs"):
        return "needs a finite stream: add --epochs 1 (a small set of files is enough)"
    if settings.get("recipe") == "multiplex":
        return "multiplex's streams are not counted by this check"
    if (settings.get("packing") or "bestfit") == "bestfit-crop":
        return "bestfit-crop discards tokens where rows happen to fall, so what it keeps depends on the topology"
    cycle = settings.get("cycle_exhausted")
    if sources > 1 and (cycle is None or cycle is True):
        return ("with several sources a source that ran out starts its next pass while others go on, so how much "
                "of it is delivered depends on the topology: add --no-cycle-exhausted")
    return ""


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


class Bars:
    """A progress bar per check on stderr (tokenloom/progress.py): ``line`` starts a check (its line
    printed on stdout as before), ``tick`` moves its bar."""

    def __init__(self, enabled: bool):
        self.enabled, self.bar = enabled, None

    def line(self, text: str) -> None:
        self.close()
        print(f"  {text}", flush=True)
        self.bar = Progress(f"    {text[:40]}", None, enabled=self.enabled)

    def tick(self, done: int, tokens: int, total: Optional[int]) -> None:
        if self.bar is not None:
            self.bar.total = total
            self.bar.update(done, tokens)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def run(args: argparse.Namespace) -> int:
    from tokenloom.pipes import load_encoder

    settings = merged_settings(args)
    args.recipe_built = settings.get("recipe")  # names the recipe's flags in an error
    finite = bool(settings.get("epochs"))
    steps = settings.get("steps") or (WHOLE if finite else QUICK_STEPS if args.quick else STEPS)
    points = args.points if args.points is not None else (1 if args.quick else 3)
    recipe, loader = build_loader(settings)
    print(describe(recipe, loader))
    workers, sources = loader.config["num_workers"], len(loader.config["sources"])
    tokenizer = getattr(getattr(loader.settings, "data", None), "tokenizer", None)
    del loader
    why = why_not_elastic({**settings, "recipe": recipe}, sources)
    pairs = [] if why else elastic_pairs(workers, args.quick)
    decode = load_encoder(tokenizer).decode if isinstance(tokenizer, str) else None
    # A bar per check on a terminal; in a log, the line per check is enough (a bar's deciles would be ten more)
    bars = Bars(enabled=not args.quiet and sys.stderr.isatty())
    try:
        report = verify(lambda **topology: build_loader(settings, **topology)[1], steps=steps, points=points,
                        seed=args.check_seed, progress=None if args.quiet else bars.line,
                        fresh_process=lambda state, count: _run_resumed(args.argv, state, count),
                        elastic=pairs, decode=decode, tick=bars.tick if bars.enabled else None)
    finally:
        bars.close()
    print(report)
    if why:
        print(f"other topologies (ranks, workers): not checked: {why}")
    return 0 if report.ok else 1
