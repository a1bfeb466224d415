"""Elastic resume (issues 15, 26): what a change of topology costs at resume time, how that grows
with the old run's size, and what the packers' save points cost per step.

The embedded stdlib corpus as two sources (``code`` and ``prose``, mixed 60/40 by tokens),
``bestfit``, T=1024, B=8, buffer_size=1000, an endless stream, the shipped tokenizer.

Resume latency. Old runs of ``S`` shards (``S/2`` ranks x 2 workers, S = ``--shards``, default
2, 16, 64, 256) take ``--steps`` batches on every rank (ranks simulated one after another in this
process: an endless stream needs no rank sync; ``prefetch_factor=2``) and every rank saves
``loader.state_dict()``. Then, per scenario and new rank, a fresh 2 x 2 loader is built and timed
over ``load_state_dict`` plus its first batch:

- ``cold``: no state at all: the floor, worker startup and the first rows of every shard;
- ``same``: 2 x 2 -> 2 x 2, each rank its own state (the exact resume, which re-reads each of its
  own shards' best-fit windows);
- ``same_list``: the same topology, each rank given the list of both states;
- ``S->2x2``: elastic, both new ranks given the list of all ``S/2`` old ranks' states.

A scenario's latency is its slowest rank's (the step waits for every rank); each scenario runs
``--repeats`` times, interleaved, and the best is kept (other jobs on a shared machine only ever
add time). Ratios to ``same`` are what to compare. Also per ``S``: the JSON bytes of the old states
per old shard (what every new rank reads), and ``load_state_dict`` alone.

Per step (``state_cost``): a worker calls its graph's ``state_dict()`` with every batch it sends.
One shard's graph runs in this process for ``--state-steps`` batches per packing mode (bestfit,
bestfit-crop, flat; buffer 1000), timing each ``state_dict()`` call and the JSON size of the
state, with the save point's part (the packer's ``elastic`` key) on its own. Run the same on
the commit before the save points for the before figures (``--only state``).

    python benchmarks/elastic.py                  # ~6 minutes on 2 cores (the old runs of 256 shards: 1)
    python benchmarks/elastic.py --quick          # shards 2 16, 8 steps, 1 repeat
    python benchmarks/elastic.py --only state     # the per-step cost only
Prints JSON; writes benchmarks/elastic.json and benchmarks/elastic.png (``--results-md``:
also the ``## elastic`` section of benchmarks/RESULTS.md).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
import warnings
from typing import Any, Dict, List, Optional, Tuple

import torch

from tokenloom.recipes import pretrain
from tokenloom.sample_data import build_demo_corpus, default_tokenizer_path

from results_md import DEMO, write_section  # noqa: E402 - benchmarks/ is on sys.path when run as a script

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
NEW = (2, 2)
OLD_WORKERS = 2


def corpus() -> Dict[str, List[str]]:
    return build_demo_corpus(os.path.join(ROOT, "out", "bench", "corpus"))


def make(sources, args, rank: int, world_size: int, num_workers: int, packing: str = "bestfit", **kw):
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*DataLoader will create.*")
        return pretrain(sources, tokenizer=default_tokenizer_path(), seq_len=args.seq_len, batch_size=args.batch_size,
                        weights={"code": 0.6, "prose": 0.4}, packing=packing, buffer_size=args.buffer_size,
                        num_workers=num_workers, rank=rank, world_size=world_size, seed=0, **kw)


def state_bytes(state: Dict[str, str]) -> int:
    (text,) = state.values()
    return len(text.encode("utf-8"))


def old_states(sources, args, world: int, workers: int) -> List[Dict[str, str]]:
    states = []
    for r in range(world):
        loader = make(sources, args, r, world, workers, prefetch_factor=2 if workers else None)
        it = iter(loader)
        for _ in range(args.steps):
            next(it)
        states.append(loader.state_dict())
        del it, loader
    return states


def scenarios(shards: List[int]) -> Dict[str, Tuple[Optional[int], Tuple[int, int]]]:
    """{name: (old shard count or None, old topology)}."""
    out: Dict[str, Tuple[Optional[int], Tuple[int, int]]] = {"cold": (None, NEW), "same": (None, NEW),
                                                            "same_list": (None, NEW)}
    for s in shards:
        out[f"{s}->2x2"] = (s, (max(s // OLD_WORKERS, 1), OLD_WORKERS))
    return out


def resume_rank(sources, args, name: str, rank: int, states: List[Dict[str, str]]) -> Dict[str, Any]:
    """Time one new rank: build, load, first batch; then its state's size."""
    loader = make(sources, args, rank, *NEW)
    t0 = time.perf_counter()
    if name == "same":
        loader.load_state_dict(states[rank])
    elif name != "cold":
        loader.load_state_dict(list(states))
    t1 = time.perf_counter()
    it = iter(loader)
    next(it)
    t2 = time.perf_counter()
    out = {"rank": rank, "load_s": t1 - t0, "first_batch_s": t2 - t1, "total_s": t2 - t0,
           "state_bytes_after_first": state_bytes(loader.state_dict())}
    del it, loader
    return out


def measure(sources, args, runs: Dict[str, Tuple[Optional[int], Tuple[int, int]]],
            states: Dict[Any, List[Dict[str, str]]]) -> Dict[str, Any]:
    best: Dict[str, Dict[str, Any]] = {}
    for rep in range(args.repeats):
        for name, (s, _) in runs.items():
            given = states[s if s is not None else "same"]
            ranks = [resume_rank(sources, args, name, r, given) for r in range(NEW[0])]
            slowest = max(x["total_s"] for x in ranks)
            per_rank = ", ".join(f"{x['load_s']:.2f}+{x['first_batch_s']:.2f}" for x in ranks)
            print(f"# repeat {rep} {name}: slowest rank {slowest:.2f} s (load+first batch: {per_rank})",
                  file=sys.stderr)
            if name not in best or slowest < best[name]["latency_s"]:
                best[name] = {"old_shards": s, "latency_s": slowest, "load_s": max(x["load_s"] for x in ranks),
                              "ranks": ranks}
    for r in best.values():
        r["vs_same"] = r["latency_s"] / best["same"]["latency_s"]
    return best


def breakdown(sources, args, states: List[Dict[str, str]], repeats: int = 3) -> Dict[str, float]:
    """Where a new rank's ``load_state_dict`` goes, for one list of old states (best of ``repeats``):
    decoding the states (JSON and digest), reading the old shards' save points, planning."""
    from tokenloom.pipes.loader.bridge import decode_state
    from tokenloom.pipes.loader.elastic import plan_shards

    loader = make(sources, args, 0, *NEW)
    best: Dict[str, float] = {}
    for _ in range(repeats):
        t0 = time.perf_counter()
        decoded = sorted((decode_state(s) for s in states), key=lambda d: int(d["tokenloom"]["config"]["rank"]))
        t1 = time.perf_counter()
        meta = decoded[0]["tokenloom"]
        old = loader._old_shards(decoded, int(meta["round"]), int(meta["config"]["world_size"]),
                                 int(meta["config"]["num_workers"]))
        t2 = time.perf_counter()
        plan_shards(old, loader.dataset.factory.source_names(), new_shards=range(0, NEW[1]),
                    num_new=NEW[0] * NEW[1], step=int(meta["steps"]), round_=int(meta["round"]), last_epoch=None)
        t3 = time.perf_counter()
        for k, v in (("decode_s", t1 - t0), ("read_save_points_s", t2 - t1), ("plan_s", t3 - t2)):
            best[k] = min(best.get(k, v), v)
    return best


def state_cost(sources, args) -> Dict[str, Any]:
    """Per packing mode: the time of each ``state_dict()`` of one shard's graph (what a worker pays
    per batch) and its JSON size, over ``--state-steps`` batches after a warm-up."""
    from tokenloom.pipes.loader.bridge import ShardContext
    from tokenloom.pipes.loader.elastic import _kind, _nodes

    out = {}
    for packing in ("bestfit", "bestfit-crop", "flat"):
        loader = make(sources, args, 0, *NEW, packing=packing)
        root = loader.dataset.factory(ShardContext(0, NEW[0], 0, NEW[1]))
        root.reset(None)
        packer = next(n for n in _nodes(root) if _kind(n) == "packer")
        times, sizes, elastic = [], [], []
        for step in range(args.state_steps + 10):
            next(root)
            t0 = time.perf_counter()
            state = root.state_dict()
            dt = time.perf_counter() - t0
            if step >= 10:  # warm-up: the buffer fills over the first rows (its ramp)
                times.append(dt)
                sizes.append(len(json.dumps(state, separators=(",", ":"))))
                summary = packer.get_state().get("elastic")
                if summary is not None:
                    elastic.append(len(json.dumps(summary, separators=(",", ":"))))
        out[packing] = {"state_dict_us_median": 1e6 * statistics.median(times),
                        "state_dict_us_p90": 1e6 * sorted(times)[int(0.9 * len(times))],
                        "state_bytes_median": statistics.median(sizes),
                        "elastic_bytes_median": statistics.median(elastic) if elastic else None,
                        "buffered_documents": len(getattr(packer, "_slot_of", ())) }
        print(f"# state_dict {packing}: {out[packing]}", file=sys.stderr)
    return out


def plot(out: Dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = out["scenarios"]
    names = list(runs)
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    load = [runs[n]["load_s"] for n in names]
    first = [runs[n]["latency_s"] - l for n, l in zip(names, load)]
    axes[0].bar(names, load, color="tab:orange", label="load_state_dict (slowest rank)")
    axes[0].bar(names, first, bottom=load, color="tab:blue", label="first batch")
    for i, n in enumerate(names):
        axes[0].text(i, runs[n]["latency_s"], f"{runs[n]['latency_s']:.2f} s\n{runs[n]['vs_same']:.2f}x",
                     ha="center", va="bottom", fontsize=8)
    axes[0].set(title="resume latency of 2 x 2 new ranks: load + first batch", ylabel="seconds")
    axes[0].tick_params(axis="x", labelsize=8)
    axes[0].legend(fontsize=8)
    shards = [s for s in out["old"]]
    axes[1].plot([int(s) for s in shards], [out["old"][s]["bytes_per_shard"] / 1024 for s in shards], "o-",
                 label="old state per old shard (KB)")
    axes[1].plot([int(s) for s in shards], [1000 * runs[f"{s}->2x2"]["load_s"] / int(s) for s in shards], "s-",
                 label="load_state_dict per old shard (ms)")
    axes[1].set_xscale("log", base=2)
    axes[1].set(title="what each old shard costs a new rank", xlabel="old shards")
    axes[1].legend(fontsize=8)
    for ax in axes:
        ax.grid(alpha=0.3, axis="y")
    fig.suptitle(f"elastic resume, stdlib corpus, bestfit T={out['config']['seq_len']}, "
                 f"buffer {out['config']['buffer_size']}, old runs of S/2 ranks x 2 workers")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def results_markdown(out: Dict[str, Any], command: str) -> str:
    lines = [f"Command: `{command}` (writes `benchmarks/elastic.json`, `benchmarks/elastic.png`), "
             f"{out['machine']['cpus']} cores, load average {out['machine']['loadavg_start'][0]:.1f} at the start.", ""]
    if "scenarios" in out:
        lines += ["| resume into 2 x 2 | old shards | latency (slowest rank) | of which load_state_dict | vs same | "
                  "old state per old shard |", "|---|---|---|---|---|---|"]
        for name, r in out["scenarios"].items():
            s = r["old_shards"]
            per = f"{out['old'][str(s)]['bytes_per_shard'] / 1024:.1f} KB" if s is not None else ""
            lines.append(f"| {name} | {s or ''} | {r['latency_s']:.2f} s | {r['load_s']:.2f} s | {r['vs_same']:.2f}x | "
                         f"{per} |")
    if "state_cost" in out:
        lines += ["", "| per step, one worker | state_dict() median (p90) | worker state | of which the save point | "
                  "documents buffered |", "|---|---|---|---|---|"]
        for packing, c in out["state_cost"].items():
            el = f"{c['elastic_bytes_median'] / 1024:.2f} KB" if c["elastic_bytes_median"] is not None else "-"
            lines.append(f"| {packing} | {c['state_dict_us_median']:.0f} us ({c['state_dict_us_p90']:.0f} us) | "
                         f"{c['state_bytes_median'] / 1024:.1f} KB | {el} | {c['buffered_documents']} |")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="shards 2 16, 8 steps, 1 repeat")
    ap.add_argument("--shards", type=int, nargs="+", default=None, help="old shard counts (default 2 16 64 256)")
    ap.add_argument("--steps", type=int, default=None, help="batches per old rank before the save (default 12)")
    ap.add_argument("--repeats", type=int, default=None, help="runs per scenario, interleaved; the best is kept")
    ap.add_argument("--state-steps", type=int, default=200, help="batches timed per packing mode (state_cost)")
    ap.add_argument("--only", choices=["resume", "state"], default=None)
    ap.add_argument("--no-breakdown", dest="breakdown", action="store_false",
                    help="skip timing decode / save points / plan apart (needs the save points: state version 6)")
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--buffer-size", type=int, default=1000)
    ap.add_argument("--no-write", dest="write", action="store_false", help="print JSON only")
    ap.add_argument("--out", default=os.path.join(HERE, "elastic.json"), help="where the JSON goes")
    ap.add_argument("--results-md", action="store_true", help="also write the ## elastic section of RESULTS.md")
    args = ap.parse_args(argv)
    args.shards = args.shards or ([2, 16] if args.quick else [2, 16, 64, 256])
    args.steps = args.steps or (8 if args.quick else 12)
    args.repeats = args.repeats or (1 if args.quick else 3)

    sources = corpus()
    out: Dict[str, Any] = {
        "benchmark": "elastic",
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
                    "loadavg_start": [round(x, 2) for x in os.getloadavg()]},
        "config": {"seq_len": args.seq_len, "batch_size": args.batch_size, "buffer_size": args.buffer_size,
                   "steps": args.steps, "repeats": args.repeats, "new": "x".join(map(str, NEW)),
                   "old_workers": OLD_WORKERS, "shards": args.shards, "weights": {"code": 0.6, "prose": 0.4}},
    }
    if args.only != "state":
        runs = scenarios(args.shards)
        states: Dict[Any, List[Dict[str, str]]] = {}
        out["old"] = {}
        t0 = time.perf_counter()
        states["same"] = old_states(sources, args, *NEW)
        for s in args.shards:
            topo = scenarios([s])[f"{s}->2x2"][1]
            t1 = time.perf_counter()
            states[s] = old_states(sources, args, *topo)
            total = sum(state_bytes(x) for x in states[s])
            out["old"][str(s)] = {"topology": "x".join(map(str, topo)), "run_s": time.perf_counter() - t1,
                                  "state_bytes": total, "bytes_per_shard": total / s}
            print(f"# old run of {s} shards ({topo[0]}x{topo[1]}): {out['old'][str(s)]}", file=sys.stderr)
        out["old_runs_s"] = time.perf_counter() - t0
        out["scenarios"] = measure(sources, args, runs, states)
        if args.breakdown:
            for s in args.shards:
                out["old"][str(s)]["breakdown"] = breakdown(sources, args, states[s])
                print(f"# breakdown of {s} shards: {out['old'][str(s)]['breakdown']}", file=sys.stderr)
    if args.only != "resume":
        out["state_cost"] = state_cost(sources, args)
    out["machine"]["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    print(json.dumps(out, indent=2))
    if args.write:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=2)
        if "scenarios" in out:
            plot(out, os.path.join(HERE, "elastic.png"))
    if args.results_md:
        command = "python benchmarks/elastic.py" + (" " + " ".join(argv if argv is not None else sys.argv[1:])).rstrip()
        command = command.replace(" --results-md", "")
        write_section(os.path.join(HERE, "RESULTS.md"), "elastic", results_markdown(out, command), tokenizer=DEMO)
    return 0


if __name__ == "__main__":
    sys.exit(main())
