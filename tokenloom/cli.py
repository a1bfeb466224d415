"""The ``tokenloom`` command.

``tokenloom demo`` runs the main job on an embedded default: the Python
standard library's own sources and docstrings (on every machine, nothing
downloaded) and the small BPE tokenizer shipped in the package. It packs
batches, checkpoints half way, resumes in a fresh loader and checks that the
resumed batches are bitwise identical to the uninterrupted run, then prints a
summary.

Errors are one line on stderr (exit code 2) unless ``--debug`` is given.
"""

from __future__ import annotations

import argparse
import io
import os
import sys
import time
from typing import List, Optional

import torch


def _progress(i: int, n: int, t0: float, tokens: int) -> None:
    width = 30
    done = int(width * i / n)
    rate = tokens / max(time.perf_counter() - t0, 1e-9)
    sys.stderr.write(f"\r  [{'#' * done}{'.' * (width - done)}] {i}/{n} batches  {rate / 1e3:8.1f}k tok/s")
    sys.stderr.flush()
    if i == n:
        sys.stderr.write("\n")


def _take(it, n: int, t0: float, counted: List[int], show: bool):
    out = []
    for i in range(n):
        b = next(it)
        out.append(b)
        counted[0] += int((b["labels"] != -100).sum())
        if show and (i % 5 == 4 or i == n - 1):
            _progress(i + 1, n, t0, counted[0])
    return out


def demo(args: argparse.Namespace) -> int:
    from tokenloom.recipes import pretrain
    from tokenloom.sample_data import build_demo_corpus, default_tokenizer_path

    out = args.out
    os.makedirs(out, exist_ok=True)
    print(f"tokenloom demo: building the embedded corpus (Python standard library) in {out}/corpus ...")
    corpus = build_demo_corpus(os.path.join(out, "corpus"))
    files = corpus["code"] + corpus["prose"]

    def build():
        return pretrain(files, tokenizer=default_tokenizer_path(), seq_len=args.seq_len, batch_size=args.batch_size,
                        num_workers=args.workers, seed=0, packing="bestfit", buffer_size=1000)

    n, half = args.steps, args.steps // 2
    print(f"pretrain: {len(files)} parquet files, seq_len={args.seq_len}, batch_size={args.batch_size}, "
          f"workers={args.workers}, packing=bestfit")
    loader = build()
    it = iter(loader)
    counted = [0]
    t0 = time.perf_counter()
    first = _take(it, half, t0, counted, False)
    state = loader.state_dict()
    rest = _take(it, n - half, t0, counted, False)
    elapsed = time.perf_counter() - t0
    _progress(n, n, t0 - 0, counted[0])
    stats = loader.stats()
    del it, loader

    buf = io.BytesIO()
    torch.save(state, buf)
    state_bytes = buf.tell()
    buf.seek(0)
    resumed = build()
    resumed.load_state_dict(torch.load(buf, weights_only=True))
    t1 = time.perf_counter()
    again = _take(iter(resumed), n - half, time.perf_counter(), [0], False)
    resume_s = time.perf_counter() - t1
    exact = all(all(torch.equal(a[k], b[k]) for k in a) for a, b in zip(rest, again))

    tokens = counted[0]
    pad = stats["padding"] / max(stats["tokens_out"] + stats["padding"], 1)
    print("summary")
    print(f"  batches           {n} ({len(first)} before the checkpoint, {len(rest)} after)")
    print(f"  throughput        {tokens / elapsed / 1e3:.1f}k target tokens/s ({elapsed:.1f}s)")
    print(f"  packing           {stats['documents']} documents, {stats['chunked']} cut into chunks, "
          f"padding {100 * pad:.3f}%, discarded {stats['discarded']}")
    print(f"  loader state      {state_bytes / 1024:.1f} KiB (torch.save), plain data")
    print(f"  resume            {'EXACT: the resumed batches are bitwise identical' if exact else 'MISMATCH'} "
          f"({resume_s:.1f}s for {n - half} batches)")
    return 0 if exact else 1


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="tokenloom", description=__doc__.split("\n\n")[0])
    parser.add_argument("--debug", action="store_true", help="show full tracebacks")
    sub = parser.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help="run pretrain on the embedded stdlib corpus, checkpoint, resume, summarize")
    d.add_argument("--steps", type=int, default=200)
    d.add_argument("--seq-len", type=int, default=1024)
    d.add_argument("--batch-size", type=int, default=8)
    d.add_argument("--workers", type=int, default=min(2, os.cpu_count() or 1))
    d.add_argument("--out", default="out/demo")
    d.set_defaults(run=demo)
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except KeyboardInterrupt:
        return 130
    except Exception as e:  # one clear line for people, full traceback with --debug
        if args.debug:
            raise
        print(f"tokenloom: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
