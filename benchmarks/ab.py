"""This code against the code before a change, in one run: the loader's speed and its batches.

A refactoring must not change what the loader gives nor how fast. Both code trees (git worktrees,
``--code`` and ``--before``, each with its compiled packer) run the same workloads, interleaved
round by round, each run in a fresh interpreter that imports tokenloom from its tree:

- ``fly``: `pretrain` on the fly, the demo corpus as two sources mixed 70/30, bestfit, T=2048, B=8,
  2 workers, the demo tokenizer: tokens/s over ``--batches`` batches after ``WARMUP`` (past the
  batches the workers hold ready at the start);
- ``cache``: the same from a token cache (built once by this code), where the loader's own work
  is most of the cost;
- ``resume``: build + ``load_state_dict`` (saved after 40 batches) to the first batch, in seconds;
- ``manpages``: `pretrain` on the fly as `held_out.py` runs it (8,000 English man pages, its 100k-id
  byte-level BPE, buffer 1,000, the fastest engine installed), where the tokenizer costs least and
  the rest of the pipeline most (issue 37).

Each run also hashes every batch it yields: the two trees must give the same hashes. Figures are
the best run of each tree (other jobs only slow a run down), and the median of the per-round
ratios. Writes benchmarks/ab.json, benchmarks/ab.png and the "This code against the code before"
section of RESULTS.md.

    git worktree add /tmp/wt_before <rev>; git worktree add /tmp/wt_after HEAD
    python benchmarks/ab.py --code /tmp/wt_after --before /tmp/wt_before --rounds 5
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from results_md import DEMO, STAND_IN, write_section  # noqa: E402

WORKLOADS = ("fly", "cache", "resume", "manpages")
MAN_PAGES = 8000
T, B, WORKERS, WEIGHTS = 2048, 8, 2, {"code": 0.7, "prose": 0.3}
WARMUP = 150


def overlay(tree: str, into: str) -> str:
    """A folder whose ``tokenloom`` package is ``tree``'s (pipes/ and recipes/ mapped in, as
    pyproject.toml maps them), to put first on PYTHONPATH."""
    pkg = os.path.join(into, "tokenloom")
    os.makedirs(pkg)
    for name in os.listdir(os.path.join(tree, "tokenloom")):
        os.symlink(os.path.join(tree, "tokenloom", name), os.path.join(pkg, name))
    for name in ("pipes", "recipes"):
        os.symlink(os.path.join(tree, name), os.path.join(pkg, name))
    return into


def _loader(root: str, cache: bool):
    from tokenloom.recipes import pretrain

    if root == "manpages":
        import held_out

        return pretrain(held_out.corpus_dir(MAN_PAGES), tokenizer=held_out.tokenizer_path(), bos=held_out.BOS,
                        seq_len=T, batch_size=B, buffer_size=held_out.BUFFER, num_workers=WORKERS)

    sources = {"code": os.path.join(root, "corpus", "code"), "prose": os.path.join(root, "corpus", "prose")}
    return pretrain(sources, tokenizer="demo", seq_len=T, batch_size=B, num_workers=WORKERS, weights=WEIGHTS,
                    cache=os.path.join(root, "cache") if cache else None)


def _digest(batch: Dict[str, Any], h: Any) -> None:
    for key in sorted(batch):
        value = batch[key]
        if hasattr(value, "numpy"):
            h.update(key.encode())
            h.update(value.numpy().tobytes())


def task(workload: str, root: str, batches: int) -> Dict[str, Any]:
    """One run, in this interpreter (the tree is whatever ``import tokenloom`` finds)."""
    import torch

    h = hashlib.sha256()
    if workload == "resume":
        loader = _loader(root, cache=False)
        it = iter(loader)
        for _ in range(40):
            next(it)
        state = loader.state_dict()
        del it, loader
        t0 = time.perf_counter()
        loader = _loader(root, cache=False)
        loader.load_state_dict(state)
        _digest(next(iter(loader)), h)
        return {"seconds": time.perf_counter() - t0, "hash": h.hexdigest()}
    loader = _loader("manpages" if workload == "manpages" else root, cache=workload == "cache")
    it = iter(loader)
    for _ in range(WARMUP):
        _digest(next(it), h)
    tokens, t0 = 0, time.perf_counter()
    for _ in range(batches):
        batch = next(it)
        tokens += int((batch["segment_ids"] != 0).sum()) if isinstance(batch["segment_ids"], torch.Tensor) else 0
        _digest(batch, h)
    return {"tokens_per_s": tokens / (time.perf_counter() - t0), "hash": h.hexdigest()}


def run(tree_path: str, workload: str, root: str, batches: int) -> Dict[str, Any]:
    env = dict(os.environ, PYTHONPATH=tree_path)
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--task", workload, "--root", root,
                          "--batches", str(batches)], env=env, capture_output=True, text=True, timeout=1800)
    if out.returncode != 0:
        raise RuntimeError(f"{workload} under {tree_path}: {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def prepare(root: str) -> None:
    """The demo corpus and its token cache, by the code this script is run with."""
    from tokenloom.sample_data import build_demo_corpus

    build_demo_corpus(os.path.join(root, "corpus"))
    subprocess.run([sys.executable, "-m", "tokenloom", "tokenize", f"code={os.path.join(root, 'corpus', 'code')}",
                    f"prose={os.path.join(root, 'corpus', 'prose')}", "--tokenizer", "demo", "--out",
                    os.path.join(root, "cache")], check=True, capture_output=True)


def summarize(runs: Dict[str, Dict[str, List[Dict[str, Any]]]]) -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    for workload in runs["after"]:
        key = "seconds" if workload == "resume" else "tokens_per_s"
        a, b = runs["after"][workload], runs["before"][workload]
        best = (min if key == "seconds" else max)
        ratios = [x[key] / y[key] for x, y in zip(a, b)]
        out[workload] = {"metric": key, "after_best": best(x[key] for x in a), "before_best": best(y[key] for y in b),
                         "median_ratio": statistics.median(ratios), "ratios": ratios,
                         "same_batches": {x["hash"] for x in a} == {y["hash"] for y in b} and len({x["hash"] for x in a}) == 1}
        out[workload]["best_ratio"] = out[workload]["after_best"] / out[workload]["before_best"]
    return out


def plot(summary: Dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3))
    names = list(summary)
    ax.bar(names, [summary[n]["best_ratio"] for n in names], color="#4a7")
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_ylabel("this code / code before\n(seconds for resume)")
    ax.set_ylim(0, max(1.3, max(summary[n]["best_ratio"] for n in names) * 1.1))
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--code", help="worktree of this code (default: this repository)")
    ap.add_argument("--before", help="worktree of the code before")
    ap.add_argument("--label", default="the code before", help="what --before is, for RESULTS.md")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--batches", type=int, default=600)
    ap.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated, of " + ", ".join(WORKLOADS))
    ap.add_argument("--no-write", dest="write", action="store_false")
    ap.add_argument("--task", help=argparse.SUPPRESS)
    ap.add_argument("--root", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.task:
        print(json.dumps(task(args.task, args.root, args.batches)))
        return 0
    if not args.before:
        ap.error("--before WORKTREE is required")
    code = args.code or os.path.dirname(HERE)
    work = tempfile.mkdtemp(prefix="tokenloom-ab-")
    try:
        trees = {"after": overlay(code, os.path.join(work, "after")),
                 "before": overlay(args.before, os.path.join(work, "before"))}
        root = os.path.join(work, "data")
        prepare(root)
        if "manpages" in args.workloads.split(","):
            import held_out

            held_out.prepare(MAN_PAGES)
        load = os.getloadavg()
        workloads = [w for w in args.workloads.split(",") if w]
        unknown = sorted(set(workloads) - set(WORKLOADS))
        if unknown:
            ap.error(f"--workloads {unknown}: not among {WORKLOADS}")
        runs: Dict[str, Dict[str, List[Dict[str, Any]]]] = {k: {w: [] for w in workloads} for k in trees}
        for r in range(args.rounds):
            for workload in workloads:
                order = ("after", "before") if r % 2 == 0 else ("before", "after")
                for which in order:
                    runs[which][workload].append(run(trees[which], workload, root, args.batches))
        summary = summarize(runs)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    command = (f"python benchmarks/ab.py --code WT_AFTER --before WT_BEFORE --label '{args.label}' "
               f"--rounds {args.rounds} --batches {args.batches}")
    result = {"benchmark": "ab", "command": command, "cpus": os.cpu_count(), "load_at_start": list(load),
              "python": platform.python_version(), "label": args.label, "summary": summary, "runs": runs}
    print(json.dumps(result, indent=1))
    if args.write:
        with open(os.path.join(HERE, "ab.json"), "w") as f:
            json.dump(result, f, indent=1)
        plot(summary, os.path.join(HERE, "ab.png"))
        rows = "\n".join(
            f"| {w} | {'s to first batch' if s['metric'] == 'seconds' else 'tokens/s'} | "
            f"{s['after_best']:,.3g} | {s['before_best']:,.3g} | {s['best_ratio']:.2f}x | {s['median_ratio']:.2f}x | "
            f"{'yes' if s['same_batches'] else 'NO'} |" for w, s in summary.items())
        write_section(os.path.join(HERE, "RESULTS.md"), "This code against the code before", tokenizer=f"{DEMO} (fly, cache, resume); {STAND_IN} (manpages)", body=f"""
Command: `{command}` (writes `benchmarks/ab.json`, `benchmarks/ab.png`); {os.cpu_count()} CPUs, load average
{[round(x, 2) for x in load]} at start. Before: {args.label}. `pretrain` of the demo corpus as two sources mixed
70/30, bestfit, T={T}, B={B}, {WORKERS} workers, demo tokenizer; *fly* tokenizes on the fly, *cache* reads a token
cache (tokens/s over {args.batches} batches after {WARMUP}), *resume* is build + `load_state_dict` (saved after 40 batches) to the first batch;
*manpages* is `pretrain` on the fly as `held_out.py` runs it ({MAN_PAGES:,} English man pages, its 100k-id BPE, buffer
1,000, the fastest engine installed). {args.rounds}
interleaved rounds, each run in a fresh interpreter; *best*: each tree's best run; *median*: the median of the
per-round ratios. *Same batches*: every run of both trees hashed the same batches.

| workload | metric | this code (best) | before (best) | ratio (best) | ratio (median) | same batches |
|---|---|---|---|---|---|---|
{rows}
""")
    return 0


if __name__ == "__main__":
    sys.exit(main())
