"""``tokenloom demo``: the main job on an embedded corpus, with nothing to download.

Two named sources built from the running Python's standard library (``code``:
one document per ``.py`` file; ``prose``: docstrings and text paragraphs, see
`tokenloom.sample_data`) are mixed 70/30 by tokens with the shipped tokenizer
and packed best-fit. Half way the loader state is taken; the run goes on to the
end, then a fresh loader loads that state (through torch.save bytes, as a
checkpoint would) and its batches are compared, bitwise, with the ones the
uninterrupted run produced after that point. The summary gives throughput,
packing waste, share against target per source and the state's size, and a PNG
draws them. The defaults take about a minute on 2 cores.
"""

from __future__ import annotations

import argparse
import io
import os
from typing import Any, List

import torch

from .cli_config import describe
from .progress import Progress
from .summary import Trace, batch_digest, encoder_of, state_bytes, summary_lines, take

WEIGHTS = {"code": 0.7, "prose": 0.3}


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("demo", parents=[common], description=__doc__.split("\n\n")[0],
                       help="mix two embedded sources, checkpoint half way, resume, check it is exact, summarize")
    p.add_argument("--steps", type=int, default=1500, metavar="N",
                   help="batches in the whole run (default: %(default)s)")
    p.add_argument("--seq-len", type=int, default=1024, metavar="N", help="(default: %(default)s)")
    p.add_argument("--batch-size", type=int, default=8, metavar="N", help="(default: %(default)s)")
    p.add_argument("--workers", type=int, default=min(2, os.cpu_count() or 1), metavar="N",
                   help="loader worker processes (default: %(default)s)")
    p.add_argument("--max-docs", type=int, default=None, metavar="N",
                   help="use at most N documents per source (default: all; smaller is faster to build)")
    p.add_argument("--out", default="out/demo", metavar="DIR", help="corpus and PNG go here (default: %(default)s)")
    p.add_argument("--plot", metavar="PNG", help="where to draw the figures (default: DIR/summary.png)")
    p.set_defaults(run=demo)


def demo(args: argparse.Namespace) -> int:
    from tokenloom.recipes import pretrain
    from tokenloom.sample_data import build_demo_corpus, default_tokenizer_path

    if args.steps < 2:
        raise ValueError(f"--steps {args.steps} must be >= 2 (the checkpoint is taken half way)")
    print(f"tokenloom demo: the Python standard library as two sources, in {args.out}/corpus")
    corpus = build_demo_corpus(os.path.join(args.out, "corpus"), max_docs_per_source=args.max_docs)

    def build():
        return pretrain(corpus, tokenizer=default_tokenizer_path(), weights=WEIGHTS, seq_len=args.seq_len,
                        batch_size=args.batch_size, num_workers=args.workers, seed=0, packing="bestfit")

    loader = build()
    print(describe("pretrain", loader))
    n, half = args.steps, args.steps // 2
    after: List[str] = []
    trace = Trace()
    with Progress("pretrain", n) as progress:
        it = iter(loader)
        take(it, half, trace, progress)
        state = loader.state_dict()
        take(it, n - half, trace, progress, on_batch=lambda i, b: after.append(batch_digest(b)))
    stats = loader.stats()
    del it, loader  # stops the workers before the resumed loader starts its own

    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    resumed = build()
    resumed.load_state_dict(torch.load(buf, weights_only=True))
    again: List[str] = []
    check = Trace()
    with Progress("resume check", n - half) as progress:
        take(iter(resumed), n - half, check, progress, on_batch=lambda i, b: again.append(batch_digest(b)))

    size = state_bytes(state)
    lines = summary_lines(trace, stats, size, encoder=encoder_of(resumed))
    exact = again == after
    if exact:
        verdict = f"EXACT: the {len(again)} batches after the checkpoint are bitwise identical"
    else:
        first = next((i for i, (a, b) in enumerate(zip(after, again)) if a != b), min(len(after), len(again)))
        verdict = f"MISMATCH: batch {half + first} differs after resuming at batch {half}"
    first_s = check.seconds[0] if check.seconds else 0.0
    lines.append(f"  {'resume':<15}{verdict} ({check.elapsed:.1f}s; first batch after {first_s:.1f}s, "
                 "the restore re-reads the packer's buffer)")
    print("\n".join(lines))

    from .summary_plot import plot_summary

    png = args.plot or os.path.join(args.out, "summary.png")
    print(plot_summary(png, trace, stats, title="tokenloom demo: pretrain, code 0.7 + prose 0.3", state_size=size))
    return 0 if exact else 1
