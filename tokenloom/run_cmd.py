"""``tokenloom run``: a recipe on your own data for N steps, with a progress bar and a summary.

What it is for: trying settings (seq_len, packing, weights, workers) on real
files before a training job, and checking what a checkpoint would hold.
``--save-state`` writes ``loader.state_dict()`` after the last step and
``--resume`` loads one before the first, so two short runs give exactly the
batches of one long run; ``--dump-batches`` saves the batches themselves
(a list of dicts of tensors) to compare runs.
"""

from __future__ import annotations

import argparse
from typing import Any, Dict, List

from tokenloom.pipes.loader.bridge import decode_state

from .cli_config import add_loader_arguments, build_loader, describe, merged_settings, steps_to_take
from .progress import Progress
from .state_file import load_state, save
from .summary import Trace, encoder_of, state_bytes, summary_lines, take


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("run", parents=[common], help="run pretrain or sft on your data for N steps, then summarize",
                       description=__doc__.split("\n\n")[0])
    add_loader_arguments(p)
    p.add_argument("--save-state", metavar="FILE", help="torch.save(loader.state_dict()) here after the last step")
    p.add_argument("--resume", metavar="FILE", help="load a state saved by --save-state before the first step")
    p.add_argument("--allow-weight-change", action="store_true",
                   help="with --resume: accept --weights other than the saved ones (the new mixture starts here)")
    p.add_argument("--dump-batches", metavar="FILE", help="torch.save the batches produced (a list of dicts)")
    p.add_argument("--plot", metavar="PNG", help="also draw the summary figures to this PNG (needs matplotlib)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    settings = merged_settings(args)
    args.recipe_built = settings.get("recipe")  # names the recipe's flags in an error
    if args.allow_weight_change and not args.resume:
        raise ValueError("--allow-weight-change applies to a resumed run: add --resume FILE, or leave it out")
    steps = steps_to_take(settings)
    # Read the state before building: a wrong path should not cost a corpus listing first.
    state = load_state(args.resume, "--resume") if args.resume else None
    recipe, loader = build_loader(settings)
    print(describe(recipe, loader))
    if state is not None:
        loader.load_state_dict(state, allow_weight_change=args.allow_weight_change)
        meta = decode_state(state)["tokenloom"]
        print(f"resumed from {args.resume}: round {meta['round']}, {meta['steps']} batches already taken")

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
