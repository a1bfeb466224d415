"""``tokenloom run``: a recipe on your own data for N steps, with a progress bar and a summary.

What it is for: trying settings (seq_len, packing, weights, workers) on real
files before a training job, and checking what a checkpoint would hold.
``--save-state`` writes ``loader.state_dict()`` after the last step and
``--resume`` loads one before the first, so two short runs give exactly the
batches of one long run; ``--dump-batches`` saves the batches themselves
(a list of dicts of tensors) to compare runs. ``--resume`` with every old
rank's state file (``--resume r0.pt r1.pt``, or ``--resume`` repeated), or one
file and ``--elastic``, continues a run saved with other ranks or ``--workers``
(an elastic resume: ``load_state_dict([state, ...])``; every document of the
interrupted epoch once, in other batches).
"""

from __future__ import annotations

import argparse
import os
from typing import Any, Dict, List

from tokenloom.pipes.loader.bridge import decode_state

from tokenloom.pipes.sources.files import FORMAT_SUFFIXES

from .cli_config import _NAMED, _URI, add_loader_arguments, build_loader, describe, merged_settings, steps_to_take
from .progress import Progress
from .state_file import load_state, save
from .summary import Trace, encoder_of, state_bytes, summary_lines, take


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("run", parents=[common], help="run pretrain or sft on your data for N steps, then summarize",
                       description=__doc__.split("\n\n")[0])
    add_loader_arguments(p)
    p.add_argument("--save-state", metavar="FILE", help="torch.save(loader.state_dict()) here after the last step")
    p.add_argument("--resume", metavar="FILE", action=StateFiles, default=None,
                   help="load a state saved by --save-state before the first step; several files (every old rank's, "
                        "or --resume repeated): an elastic resume, for other ranks or --workers than they were saved with")
    p.add_argument("--elastic", action="store_true",
                   help="with --resume: an elastic resume from one file too (a 1-rank run saved with other --workers)")
    p.add_argument("--allow-weight-change", action="store_true",
                   help="with --resume: accept --weights other than the saved ones (the new mixture starts here)")
    p.add_argument("--dump-batches", metavar="FILE", help="torch.save the batches produced (a list of dicts)")
    p.add_argument("--plot", metavar="PNG", help="also draw the summary figures to this PNG (needs matplotlib)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(run=run)


_SOURCE_ENDINGS = tuple(e for endings in FORMAT_SUFFIXES.values() for e in endings)


class StateFiles(argparse.Action):
    """``--resume FILE [FILE ...]``, repeatable. The words after the first that look like sources
    (``name=path``, a directory, a glob, a URI, a parquet/jsonl/txt file) go back to the sources,
    as ``--text-column`` hands them back, so ``--resume state.pt data/`` still reads ``data/``."""

    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest, nargs="+", **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        take, rest = list(values[:1]), []
        for v in values[1:]:
            (rest if _source_like(v) else take).append(v)
        setattr(namespace, self.dest, list(getattr(namespace, self.dest, None) or []) + take)
        if rest:
            namespace.sources = list(getattr(namespace, "sources", None) or []) + rest


def _source_like(word: str) -> bool:
    return (_NAMED.match(word) is not None or _URI.match(word) is not None or "*" in word or os.path.isdir(word)
            or word.split("?", 1)[0].lower().endswith(_SOURCE_ENDINGS))


def resume(loader: Any, files: List[str], states: List[Dict[str, Any]], *, elastic: bool,
           allow_weight_change: bool) -> str:
    """Load the states (one: exactly; several, or ``elastic``: the list, an elastic resume) and say what was loaded."""
    if not elastic:
        loader.load_state_dict(states[0], allow_weight_change=allow_weight_change)
        meta = decode_state(states[0])["tokenloom"]
        return f"resumed from {files[0]}: round {meta['round']}, {meta['steps']} batches already taken"
    loader.load_state_dict(states, allow_weight_change=allow_weight_change)
    meta = decode_state(states[0])["tokenloom"]
    saved = meta["config"]
    return (f"resumed from {', '.join(files)} (elastic resume; saved by {saved.get('world_size', 1)} rank(s) with "
            f"{saved.get('num_workers', 0)} workers): round {meta['round']}, {meta['steps']} batches already taken")


def run(args: argparse.Namespace) -> int:
    settings = merged_settings(args)
    args.recipe_built = settings.get("recipe")  # names the recipe's flags in an error
    for flag, given in (("--allow-weight-change", args.allow_weight_change), ("--elastic", args.elastic)):
        if given and not args.resume:
            raise ValueError(f"{flag} applies to a resumed run: add --resume FILE, or leave it out")
    steps = steps_to_take(settings)
    # Read the states before building: a wrong path should not cost a corpus listing first.
    files = args.resume or []
    states = [load_state(f, "--resume") for f in files]
    recipe, loader = build_loader(settings)
    print(describe(recipe, loader))
    if states:
        print(resume(loader, files, states, elastic=args.elastic or len(files) > 1,
                     allow_weight_change=args.allow_weight_change))

    dumped: List[Dict[str, Any]] = []
    keep = (lambda i, batch: dumped.append(batch)) if args.dump_batches else None
    trace = Trace()
    # To the end of --epochs: the bar's total is the loader's estimate of the batches left.
    left = (lambda: loader.stats().get("progress", {}).get("batches_left")) if steps is None else None
    with Progress(recipe, steps, enabled=not args.quiet, left=left) as progress:
        got = take(iter(loader), steps, trace, progress, on_batch=keep)
    if steps is not None and got < steps:
        print(f"the stream ended after {got} of {steps} batches (epochs={loader.config['epochs']})")

    final = loader.state_dict()
    size = state_bytes(final)
    stats = loader.stats()
    if args.save_state:
        save(args.save_state, final)
    if args.dump_batches:
        save(args.dump_batches, dumped)
    print("\n".join(summary_lines(trace, stats, size, encoder=encoder_of(loader))))
    if args.save_state:
        print(f"  {'saved state':<15}{args.save_state}")
    if args.dump_batches:
        print(f"  {'dumped':<15}{len(dumped)} batches to {args.dump_batches}")
    if args.plot:
        from .summary_plot import plot_summary

        print(plot_summary(args.plot, trace, stats, title=describe(recipe, loader).split(";")[0], state_size=size))
    return 0
