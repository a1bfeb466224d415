"""Elastic resume (issue 15): what a change of topology costs at resume time, and the state's size.

The embedded stdlib corpus as two sources (``code`` and ``prose``, mixed 60/40 by
tokens), ``bestfit``, T=1024, B=8, buffer_size=1000, an endless stream, the shipped
tokenizer. An old run of 2 ranks x 2 workers takes ``--steps`` batches on every rank
(ranks are simulated one after another in this process: an endless stream needs no rank
sync), and every rank saves ``loader.state_dict()``. Then, per scenario and rank, a
fresh loader is built and timed over ``load_state_dict`` plus its first batch:

- ``cold``: no state at all (a fresh start on 2 x 2): the floor, worker startup and
  the first rows of every shard;
- ``same``: the same topology (2 x 2), each rank its own state (the exact resume,
  which re-reads each shard's best-fit window);
- ``same_list``: the same topology, each rank given the list of both states;
- ``2x2->3x1`` and ``2x2->1x2``: elastic, every new rank given the list of all old states.

A scenario's latency is its slowest rank's (the step waits for every rank); each
scenario runs ``--repeats`` times, interleaved, and the best is kept (other jobs on a
shared machine only ever add time). Ratios to ``same`` are what to compare.

State size: the JSON text of each rank's state (``len`` of the one ``tokenloom_rank_<r>``
entry, in bytes) on the old ranks at the save, on the new ranks right after their first
batch, and ``--steps`` batches later.

    python benchmarks/elastic.py            # ~3 minutes on 2 cores
    python benchmarks/elastic.py --quick    # 10 steps, 1 repeat
Prints JSON; writes benchmarks/elastic.json and benchmarks/elastic.png (``--results-md``:
also the ``## elastic`` section of benchmarks/RESULTS.md).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
import warnings
from typing import Any, Dict, List, Optional

import torch

from tokenloom.recipes import pretrain
from tokenloom.sample_data import build_demo_corpus, default_tokenizer_path

from results_md import write_section  # noqa: E402 - benchmarks/ is on sys.path when run as a script

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
OLD = (2, 2)
SCENARIOS = {"cold": OLD, "same": OLD, "same_list": OLD, "2x2->3x1": (3, 1), "2x2->1x2": (1, 2)}


def corpus() -> Dict[str, List[str]]:
    return build_demo_corpus(os.path.join(ROOT, "out", "bench", "corpus"))


def make(sources, args, rank: int, world_size: int, num_workers: int):
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*DataLoader will create.*")
        return pretrain(sources, tokenizer=default_tokenizer_path(), seq_len=args.seq_len, batch_size=args.batch_size,
                        weights={"code": 0.6, "prose": 0.4}, packing="bestfit", buffer_size=args.buffer_size,
                        num_workers=num_workers, rank=rank, world_size=world_size, seed=0)


def state_bytes(state: Dict[str, str]) -> int:
    (text,) = state.values()
    return len(text.encode("utf-8"))


def old_states(sources, args) -> List[Dict[str, str]]:
    states = []
    for r in range(OLD[0]):
        loader = make(sources, args, r, *OLD)
        it = iter(loader)
        for _ in range(args.steps):
            next(it)
        states.append(loader.state_dict())
        del it, loader
    return states


def resume_rank(sources, args, scenario: str, rank: int, states: List[Dict[str, str]]) -> Dict[str, Any]:
    """Time one new rank: build, load, first batch; then its state's size, now and ``steps`` later."""
    world_size, num_workers = SCENARIOS[scenario]
    loader = make(sources, args, rank, world_size, num_workers)
    t0 = time.perf_counter()
    if scenario == "same":
        loader.load_state_dict(states[rank])
    elif scenario != "cold":
        loader.load_state_dict(list(states))
    t1 = time.perf_counter()
    it = iter(loader)
    next(it)
    t2 = time.perf_counter()
    out = {"rank": rank, "load_s": t1 - t0, "first_batch_s": t2 - t1, "total_s": t2 - t0,
           "state_bytes_after_first": state_bytes(loader.state_dict())}
    for _ in range(args.steps):
        next(it)
    out["state_bytes_later"] = state_bytes(loader.state_dict())
    del it, loader
    return out


def measure(sources, args, states) -> Dict[str, Any]:
    best: Dict[str, Dict[str, Any]] = {}
    for rep in range(args.repeats):
        for scenario in SCENARIOS:
            ranks = [resume_rank(sources, args, scenario, r, states) for r in range(SCENARIOS[scenario][0])]
            slowest = max(x["total_s"] for x in ranks)
            per_rank = ", ".join(f"{x['load_s']:.2f}+{x['first_batch_s']:.2f}" for x in ranks)
            print(f"# repeat {rep} {scenario}: slowest rank {slowest:.2f} s (load+first batch: {per_rank})",
                  file=sys.stderr)
            if scenario not in best or slowest < best[scenario]["latency_s"]:
                best[scenario] = {"topology": "x".join(map(str, SCENARIOS[scenario])), "latency_s": slowest,
                                  "ranks": ranks}
    for scenario, r in best.items():
        r["vs_same"] = r["latency_s"] / best["same"]["latency_s"]
    return best


def plot(out: Dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = out["scenarios"]
    names = list(runs)
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    load = [max(x["load_s"] for x in runs[n]["ranks"]) for n in names]
    first = [runs[n]["latency_s"] - l for n, l in zip(names, load)]
    axes[0].bar(names, load, color="tab:orange", label="load_state_dict (slowest rank)")
    axes[0].bar(names, first, bottom=load, color="tab:blue", label="first batch")
    for i, n in enumerate(names):
        axes[0].text(i, runs[n]["latency_s"], f"{runs[n]['latency_s']:.2f} s\n{runs[n]['vs_same']:.2f}x",
                     ha="center", va="bottom", fontsize=8)
    axes[0].set(title="resume latency: load + first batch (slowest rank)", ylabel="seconds")
    axes[0].legend(fontsize=8)
    sizes = [("old ranks at the save", [out["old_state_bytes"]])]
    for n in names:
        if n != "cold":
            sizes.append((n, [[x["state_bytes_after_first"] for x in runs[n]["ranks"]],
                              [x["state_bytes_later"] for x in runs[n]["ranks"]]]))
    labels, firsts, laters = [], [], []
    for label, values in sizes:
        labels.append(label)
        firsts.append(max(values[0]) / 1024)
        laters.append(max(values[-1]) / 1024)
    xs = range(len(labels))
    axes[1].bar([x - 0.2 for x in xs], firsts, width=0.4, label="at the save / after the first batch")
    axes[1].bar([x + 0.2 for x in xs], laters, width=0.4, label=f"{out['config']['steps']} batches later")
    axes[1].set_xticks(list(xs), labels, rotation=15, fontsize=8)
    axes[1].set(title="state per rank (JSON, largest rank)", ylabel="KB")
    axes[1].legend(fontsize=8)
    for ax in axes:
        ax.grid(alpha=0.3, axis="y")
    fig.suptitle(f"elastic resume, stdlib corpus, bestfit T={out['config']['seq_len']}, "
                 f"buffer {out['config']['buffer_size']}, old run 2 ranks x 2 workers")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def results_markdown(out: Dict[str, Any], command: str) -> str:
    lines = [f"Command: `{command}` (writes `benchmarks/elastic.json`, `benchmarks/elastic.png`), "
             f"{out['machine']['cpus']} cores.", "",
             "| resume | topology | latency (slowest rank) | vs same | state per rank after the first batch |",
             "|---|---|---|---|---|"]
    for name, r in out["scenarios"].items():
        sizes = [x["state_bytes_after_first"] for x in r["ranks"]]
        lines.append(f"| {name} | {r['topology']} | {r['latency_s']:.2f} s | {r['vs_same']:.2f}x | "
                     f"{min(sizes) / 1024:.1f}-{max(sizes) / 1024:.1f} KB |")
    old = out["old_state_bytes"]
    lines += ["", f"Old ranks' states at the save: {min(old) / 1024:.1f}-{max(old) / 1024:.1f} KB."]
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="10 steps, 1 repeat")
    ap.add_argument("--steps", type=int, default=None, help="batches per rank before the save (default 40)")
    ap.add_argument("--repeats", type=int, default=None, help="runs per scenario, interleaved; the best is kept")
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--buffer-size", type=int, default=1000)
    ap.add_argument("--no-write", dest="write", action="store_false", help="print JSON only")
    ap.add_argument("--results-md", action="store_true", help="also write the ## elastic section of RESULTS.md")
    args = ap.parse_args(argv)
    args.steps = args.steps or (10 if args.quick else 40)
    args.repeats = args.repeats or (1 if args.quick else 3)

    sources = corpus()
    out: Dict[str, Any] = {
        "benchmark": "elastic",
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
                    "loadavg_start": [round(x, 2) for x in os.getloadavg()]},
        "config": {"seq_len": args.seq_len, "batch_size": args.batch_size, "buffer_size": args.buffer_size,
                   "steps": args.steps, "repeats": args.repeats, "old": "x".join(map(str, OLD)),
                   "weights": {"code": 0.6, "prose": 0.4}},
    }
    t0 = time.perf_counter()
    states = old_states(sources, args)
    out["old_run_s"] = time.perf_counter() - t0
    out["old_state_bytes"] = [state_bytes(s) for s in states]
    out["scenarios"] = measure(sources, args, states)
    out["machine"]["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    print(json.dumps(out, indent=2))
    if args.write:
        with open(os.path.join(HERE, "elastic.json"), "w") as f:
            json.dump(out, f, indent=2)
        plot(out, os.path.join(HERE, "elastic.png"))
    if args.results_md:
        command = "python benchmarks/elastic.py" + (" --quick" if args.quick else "")
        write_section(os.path.join(HERE, "RESULTS.md"), "elastic", results_markdown(out, command))
    return 0


if __name__ == "__main__":
    sys.exit(main())
