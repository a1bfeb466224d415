"""Does the training loop wait for data? The share of step time spent blocked in ``next()``.

A simulated training step consumes batches from ``pretrain(...)`` (bestfit,
seq_len 2048, batch 8, the embedded stdlib corpus and the shipped tokenizer).
Every run builds a fresh loader from the start of the stream. Before each
paced run, the bare loader (no prefetcher) with as many workers and no step is
timed from its second batch to its 401st (and twice before the row's first);
the step is a multiple of the fastest such data time ``t_data`` seen so far in
the row. The machine's speed drifts by up to 1.7x within minutes: a data time
taken once per row turned a 1.1x step into anything from ~0.8x to ~1.4x by the
time it ran, and a slow measurement must not lengthen the step. The timing starts before any worker can run ahead
and is long next to the workers' ready batches (pretrain keeps ~1M tokens, 64
batches, per worker): a data time measured on a short stretch after a warm-up is
mostly batches made during the warm-up (4.6 ms a batch instead of ~12).

Steps are 0.8, 1.0, 1.1, 1.5 and 2 x ``t_data``. A paced run starts in the
steady state its pace leads to. It takes 100 batches as fast as they come (the
loop is data-bound, so the workers hold no lead: a loop slower than its data
ends there); for steps longer than ``t_data`` it then pauses 3 s, and the
workers fill their ready batches (where a loop faster than its data ends, as
after a checkpoint or an eval). Then 100 batches at the step's pace, untimed,
and the share of the loop's wall time spent blocked in ``next()`` over batches
202-401, inside the stretch ``t_data`` was measured on (the corpus alternates
long source files and short docstrings, so the loader's rate varies several-fold
along the stream: 2-35 ms a batch over stretches of 50 with 2 workers). Started
as the stream comes instead, the workers' ready batches (2 x 64) filled in a
fast stretch early on and fed the whole timed window at every pace: 0.8x
measured as little waiting as 2x. Started data-bound at every pace, a 1.1x loop
had ~9 batches of lead after 100 steps, and the stream's slow stretches drained
them: 1.4-2% waiting, which a real run at that pace only sees after a stall.
Every point is run twice, interleaved, and the better kept (with the step never
longer than the fastest data time, other jobs on a shared machine only ever add
waiting):

- ``sleep`` steps leave the host idle, like a GPU step whose kernels are queued;
- ``matmul`` steps keep one core busy (single-threaded CPU matmuls), like a
  host-heavy step; on a 2-core machine they compete with the loader workers.

Also (2 workers, sleep steps) through `tokenloom.pipes.loader.prefetch.DevicePrefetcher`,
whose background thread receives batches from the workers while the step runs
(on a machine without CUDA it makes no copies: this measures the thread and its
bookkeeping), with ``--depth`` batches ready (default 2 and 4), and with 1
worker and the deepest prefetcher (a core left for the training process); and, with
``--prefetch-factor N``, the bare loader with N ready batches per worker
(pretrain's default is ~1M tokens: 64 batches here).

Target (issue 6): no waiting once a step takes 1.1 x the data time; "no waiting"
here means a wait share under 1%.

    python benchmarks/stall.py            # ~20 minutes on 2 cores
    python benchmarks/stall.py --quick    # ~3 minutes: 160 batches a run, 2 workers, sleep steps
Prints JSON; writes benchmarks/stall.json, benchmarks/stall.png and the
``## stall`` section of benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import torch

from tokenloom.pipes.loader.prefetch import DevicePrefetcher
from tokenloom.recipes import pretrain
from tokenloom.sample_data import build_demo_corpus, default_tokenizer_path

from results_md import DEMO, write_section  # noqa: E402 - benchmarks/ is on sys.path when run as a script

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
FACTORS = (0.8, 1.0, 1.1, 1.5, 2.0)
NO_WAIT = 0.01  # a wait share under this counts as "no waiting"


def corpus_files() -> list:
    corpus = build_demo_corpus(os.path.join(ROOT, "out", "bench", "corpus"))
    return corpus["code"] + corpus["prose"]


class Step:
    """A step of a chosen duration: ``sleep`` (host idle) or ``matmul`` (one core busy)."""

    def __init__(self, kind: str):
        self.kind = kind
        if kind == "matmul":
            torch.set_num_threads(1)
            self.a = torch.randn(192, 192)
            for _ in range(20):
                self.a @ self.a
            t0 = time.perf_counter()
            for _ in range(200):
                self.a @ self.a
            self.t_mm = (time.perf_counter() - t0) / 200

    def __call__(self, seconds: float) -> None:
        if self.kind == "sleep":
            time.sleep(seconds)
            return
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:  # the step's duration, whatever the load
            self.a @ self.a


def run(files, args, cfg: dict, seconds: float, fill: bool = False) -> dict:
    """A fresh loader from the start of the stream: ``warmup`` batches as fast as they come
    (start-up), ``drain`` more as fast as they come (the loop is data-bound, so no ready batches
    pile up), with ``fill`` a pause of ``args.fill_s`` (the workers fill their ready batches),
    ``paced`` batches with the step, untimed, then ``batches`` timed. With no step the whole
    stretch after the warm-up is timed: the data time."""
    loader = pretrain(files, tokenizer=default_tokenizer_path(), seq_len=args.seq_len, batch_size=args.batch_size,
                      num_workers=cfg["workers"], seed=0, **cfg["loader_kwargs"])
    source = DevicePrefetcher(loader, depth=cfg["prefetcher"]) if cfg["prefetcher"] else loader
    it = iter(source)
    step = Step(cfg["step"])
    for _ in range(args.warmup):
        next(it)
    drain, paced = (args.drain, args.paced) if seconds else (0, 0)
    for _ in range(drain):
        next(it)
    if fill:
        time.sleep(args.fill_s)
    for _ in range(paced):
        next(it)
        step(seconds)
    timed = args.drain + args.paced + args.batches - drain - paced
    waited = 0.0
    t_start = time.perf_counter()
    for _ in range(timed):
        t0 = time.perf_counter()
        next(it)
        waited += time.perf_counter() - t0
        if seconds:
            step(seconds)
    total = time.perf_counter() - t_start
    if cfg["prefetcher"]:
        source.close()
    del it, source, loader
    return {"wait_share": waited / total, "wait_ms_per_step": 1e3 * waited / timed,
            "loop_ms_per_step": 1e3 * total / timed}


def measure(files, args, cfg: dict) -> dict:
    """Wait shares over the same stretch of the stream, for steps that are multiples of the bare
    loader's data time with as many workers. The data time is measured again before each paced
    run, and the step uses the fastest seen so far in the row: this machine's speed drifts by up
    to 1.7x within minutes (a data time taken once per row turned a 1.1x step into anything from
    ~0.8x to ~1.4x), and a slow measurement must not lengthen the step. Each point
    ``args.repeats`` times, interleaved, keeping the best (with the step never longer than the
    fastest data time, other jobs on the machine only ever add waiting). Below the data time a
    run starts data-bound (no lead: its steady state); above it, with the workers' ready batches
    filled (theirs). Also this configuration's own time per batch with no step."""
    bare = dict(cfg, step="sleep", prefetcher=0, loader_kwargs={})
    alone = [run(files, args, cfg, 0.0)["loop_ms_per_step"] / 1e3 for _ in range(args.repeats)]
    own = min(alone)
    # Seeded before the first paced run: a first step taken from one slow measurement was up to 1.4x too long.
    seen = list(alone) if cfg == bare else [run(files, args, bare, 0.0)["loop_ms_per_step"] / 1e3
                                            for _ in range(args.repeats)]
    tries: dict = {f: [] for f in FACTORS}
    for _ in range(args.repeats):
        for f in FACTORS:
            seen.append(run(files, args, bare, 0.0)["loop_ms_per_step"] / 1e3)
            t_data = min(seen)
            tries[f].append(dict(run(files, args, cfg, f * t_data, fill=f > 1.0), data_ms_per_batch=1e3 * t_data))
    rows = []
    for f in FACTORS:
        best = dict(min(tries[f], key=lambda r: r["wait_share"]), factor=f)
        best["all_wait_shares"] = [r["wait_share"] for r in tries[f]]
        best["all_data_ms_per_batch"] = [r["data_ms_per_batch"] for r in tries[f]]
        rows.append(best)
    target = [r for r in rows if r["factor"] >= 1.1]
    return {**cfg, "data_ms_per_batch": 1e3 * min(seen), "data_ms_range": [1e3 * min(seen), 1e3 * max(seen)],
            "own_ms_per_batch": 1e3 * own, "tokens_per_batch": args.seq_len * args.batch_size,
            "factors": rows, "no_wait_from_1_1x": all(r["wait_share"] < NO_WAIT for r in target)}


def _label(r: dict) -> str:
    parts = ([r["step"] + " step"] + ([f"DevicePrefetcher depth={r['prefetcher']}"] if r["prefetcher"] else []) +
             [f"{k}={v}" for k, v in r["loader_kwargs"].items()])
    return ", ".join(parts)


def plot(results: list, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for r in results:
        xs = [x["factor"] for x in r["factors"]]
        ys = [100 * x["wait_share"] for x in r["factors"]]
        label = f"{r['workers']} worker{'s' if r['workers'] != 1 else ''}, {_label(r)}"
        ax.plot(xs, ys, marker="o", label=label)
    ax.axvline(1.1, color="grey", ls="--", lw=1)
    ax.axhline(100 * NO_WAIT, color="grey", ls=":", lw=1)
    ax.text(1.12, ax.get_ylim()[1] * 0.9, "target: no wait from 1.1x", fontsize=8, color="grey")
    ax.set_xlabel("step time / loader's data time per batch")
    ax.set_ylabel("share of step time waiting for data (%)")
    ax.set_title("pretrain (bestfit, T=2048, B=8), stdlib corpus")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def results_markdown(out: dict, command: str) -> str:
    lines = [
        "Share of the training loop's time blocked in `next()`, for a simulated step of 0.8-2x the loader's own "
        "data time per batch (`pretrain`, bestfit, T=2048, B=8, stdlib corpus). `sleep` steps leave the host idle "
        "(a GPU step); `matmul` steps keep one core busy. Each run: {drain_batches} batches as fast as they come (no "
        "lead piled up), above 1x a {fill_s:.0f} s pause (ready batches filled), {paced_batches} at the step's pace, "
        "then {timed_batches} timed. Target: no waiting (< 1%) "
        "from 1.1x. Best of ".format(**out["config"]) +
        f"{out['config']['repeats']} interleaved runs per point. "
        f"Machine: {out['machine']['cpus']} CPUs, load average {out['machine']['loadavg_start']} at start.",
        "",
        f"Command: `{command}`",
        "",
        "| workers | run | data ms/batch (range) | alone ms/batch | " +
        " | ".join(f"{f}x" for f in FACTORS) + " | wait ms/step at 2x | target met |",
        "|---|---|---|---|" + "---|" * len(FACTORS) + "---|---|",
    ]
    for r in out["runs"]:
        shares = " | ".join(f"{100 * x['wait_share']:.1f}%" for x in r["factors"])
        lo, hi = r["data_ms_range"]
        lines.append(f"| {r['workers']} | {_label(r)} | {r['data_ms_per_batch']:.1f} ({lo:.1f}-{hi:.1f}) | "
                     f"{r['own_ms_per_batch']:.1f} | {shares} | {r['factors'][-1]['wait_ms_per_step']:.2f} | "
                     f"{'yes' if r['no_wait_from_1_1x'] else '**no**'} |")
    lines += ["", "`data ms/batch`: the bare loader's time per batch with as many workers and no step, measured "
              "before each paced run; steps are multiples of the fastest seen so far in the row (the prefetcher "
              "rows too), and the range shows how much this machine's speed moved. `alone`: this row's own "
              "configuration with no step. `wait ms/step at 2x`: time spent in `next()` per step when the loader is far ahead of the "
              "loop; for the bare loader with workers it is what receiving one batch from a worker process costs "
              "the training thread; through the prefetcher that work happens in its thread during the step.", "",
              "![stall](stall.png)"]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer batches; 2 workers, sleep steps, with and without "
                    "the prefetcher")
    ap.add_argument("--workers", type=int, nargs="+", default=None)
    ap.add_argument("--steps", nargs="+", default=["sleep", "matmul"], choices=["sleep", "matmul"])
    ap.add_argument("--depth", type=int, nargs="*", default=[2, 4],
                    help="DevicePrefetcher runs with these depths (none: no prefetcher runs)")
    ap.add_argument("--repeats", type=int, default=None, help="runs per point, interleaved; the best is kept")
    ap.add_argument("--prefetch-factor", type=int, nargs="*", default=[],
                    help="extra runs with these prefetch_factor values (pretrain's default here: 64)")
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--no-write", dest="write", action="store_false", help="print JSON only")
    args = ap.parse_args(argv)
    args.workers = args.workers or ([2] if args.quick else [2, 1])
    if args.quick:
        args.steps = ["sleep"]
    args.warmup, args.drain, args.paced, args.batches = (1, 40, 40, 80) if args.quick else (1, 100, 100, 200)
    args.fill_s = 3.0  # 64 ready batches per worker take ~1.7 s at B=8, T=2048 on this machine
    args.repeats = args.repeats or (1 if args.quick else 2)

    files = corpus_files()
    out = {"benchmark": "stall", "quick": args.quick,
           "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
                       "cuda": torch.cuda.is_available(), "loadavg_start": [round(x, 2) for x in os.getloadavg()]},
           "config": {"seq_len": args.seq_len, "batch_size": args.batch_size, "factors": FACTORS,
                      "warmup_batches": args.warmup, "drain_batches": args.drain, "fill_s": args.fill_s, "paced_batches": args.paced,
                      "timed_batches": args.batches,
                      "repeats": args.repeats},
           "runs": []}
    def cfg(workers, step, prefetcher=0, **loader_kwargs):
        return {"workers": workers, "step": step, "prefetcher": prefetcher, "loader_kwargs": loader_kwargs}

    first = args.workers[0]
    # (1 worker: only through the prefetcher; every paced run is calibrated on the bare loader anyway)
    plan = [cfg(w, k) for w in args.workers for k in args.steps if w != 1]
    plan += [cfg(first, "sleep", prefetcher=d) for d in args.depth]
    if args.depth and first > 1 and 1 in args.workers:
        # fewer workers than cores: is the waiting left through the prefetcher the cores' doing?
        plan.append(cfg(1, "sleep", prefetcher=max(args.depth)))
    plan += [cfg(first, "sleep", prefetch_factor=pf) for pf in args.prefetch_factor]
    for c in plan:
        r = measure(files, args, c)
        out["runs"].append(r)
        lo, hi = r["data_ms_range"]
        print(f"# {c['workers']} workers, {_label(r)}: data {r['data_ms_per_batch']:.1f} ms/batch "
              f"({lo:.1f}-{hi:.1f}; alone {r['own_ms_per_batch']:.1f}); wait " +
              ", ".join(f"{x['factor']}x {100 * x['wait_share']:.1f}%" for x in r["factors"]), file=sys.stderr)
    out["machine"]["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    print(json.dumps(out, indent=2))
    if args.write:
        with open(os.path.join(HERE, "stall.json"), "w") as f:
            json.dump(out, f, indent=2)
        plot(out["runs"], os.path.join(HERE, "stall.png"))
        command = "python benchmarks/stall.py" + (" --quick" if args.quick else "")
        write_section(os.path.join(HERE, "RESULTS.md"), "stall", results_markdown(out, command), tokenizer=DEMO)
    return 0


if __name__ == "__main__":
    sys.exit(main())
