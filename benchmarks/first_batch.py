"""Time to the first batch, cold and after a resume, for best-fit buffers of 10, 1000 and 4000 documents.

A user waits for the first batch twice: when training starts, and when it resumes
from a checkpoint. Before the packer ramped its buffer up, the first batch waited
until every worker had read and tokenized a whole buffer, and a resume re-read the
same window, so buffer 1000 took several times buffer 10 (seconds on long documents,
where the buffer was larger than a worker's shard and the whole shard was tokenized
before batch 1). Now the buffer ramps up (its allowed fill in tokens grows with the
rows emitted) and is bounded in tokens as well as documents (``buffer_tokens``), and
so is the window a resume re-reads.

Measured, per corpus and buffer, each run in a fresh interpreter, rounds interleaved
(this machine's speed drifts; medians are reported):

- ``first``: ``pretrain(...)`` called to first batch in hand (build, worker start,
  read, tokenize, pack 8 rows), 2 workers, T=2048, B=8;
- ``resumed``: a fresh loader built, ``load_state_dict`` of a state saved after
  ``SAVE_AT`` batches (past the ramp: steady state), to first batch in hand;
- the window each worker's packer re-reads on that resume (documents and tokens),
  found by restoring each worker's graph in this process;
- ``old``: the same with the ramp and the token bound off (the packer before issue 16).

Corpora: the demo corpus (``tokenloom.sample_data``) tokenized with the shipped
tokenizer: ``prose`` (short documents: median 35 tokens) and ``code`` (long: median
2,257 tokens, mean ~4,700, p99 30,619). The padding cost of the ramp is measured
in-process on the same documents: padding in the first 64 and 512 rows and over
20,000 rows, with the ramp and without it (full buffer from the start).

    python benchmarks/first_batch.py            # ~6 minutes on 2 cores
    python benchmarks/first_batch.py --quick    # 2 rounds
Prints JSON; writes benchmarks/first_batch.json, benchmarks/first_batch.png and the
``## first batch`` section of benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List

from results_md import DEMO, write_section  # noqa: E402 - benchmarks/ is on sys.path when run as a script

HERE = os.path.abspath(os.path.dirname(__file__))
ROOT = os.path.dirname(HERE)
SEQ_LEN, BATCH, WORKERS = 2048, 8, 2
BUFFERS = (10, 1000, 4000)
CORPORA = ("prose", "code")
SAVE_AT = 40  # batches (20 per worker, 160 rows each): past the ramp at the default buffer_tokens
TARGET = 1.5


def corpus(kind: str) -> List[str]:
    from tokenloom.sample_data import build_demo_corpus

    return build_demo_corpus(os.path.join(ROOT, "out", "bench", "corpus"))[kind]


def build(kind: str, buffer: int, variant: str):
    from tokenloom.pipes.pack.bestfit import BestFitPack
    from tokenloom.recipes import pretrain
    from tokenloom.sample_data import default_tokenizer_path

    kw = {}
    if variant == "old":
        # No token bound, and a ramp that starts above it: a full buffer first (the class
        # attribute reaches the forked workers).
        kw["buffer_tokens"] = 1 << 40
        BestFitPack.RAMP_START = 1 << 30
    return pretrain(corpus(kind), default_tokenizer_path(), seq_len=SEQ_LEN, batch_size=BATCH, buffer_size=buffer,
                    num_workers=WORKERS, seed=0, **kw)


# --- child tasks (each in a fresh interpreter) --------------------------------------------

def task_first(kind: str, buffer: int, variant: str, state: str = "") -> dict:
    import torch

    import tokenloom.recipes  # noqa: F401 - imports are not the loader's time: a training script has them done

    files = corpus(kind)  # the demo corpus is built (or found) before the clock starts
    if state:
        saved = torch.load(state, weights_only=True)
    t0 = time.perf_counter()
    loader = build(kind, buffer, variant)
    if state:
        loader.load_state_dict(saved)
    next(iter(loader))
    return {"seconds": time.perf_counter() - t0}


def task_save(kind: str, buffer: int, variant: str, path: str) -> dict:
    """Run SAVE_AT batches, save the state, and measure each worker's replay window."""
    import torch

    from tokenloom.pipes.loader.bridge import ShardContext, TokenLoomLoader
    from tokenloom.pipes.loader.elastic import _nodes, worker_trees
    from tokenloom.pipes.pack.bestfit import BestFitPack

    loader = build(kind, buffer, variant)
    it = iter(loader)
    for _ in range(SAVE_AT):
        next(it)
    state = loader.state_dict()
    torch.save(state, path)
    del it
    inner = json.loads(next(iter(state.values())))[TokenLoomLoader.LOADER]
    windows = []
    for w, tree in sorted(worker_trees(inner).items()):
        root = loader.dataset.factory(ShardContext(0, 1, w, WORKERS, int(tree["round"])))
        root.reset(tree["node"])
        packer = next(n for n in _nodes(root) if isinstance(n, BestFitPack))
        st = packer.get_state()
        packer.in_flight()  # re-reads the window, as a resume does
        windows.append({"documents": st[BestFitPack.PULLED] - st[BestFitPack.BASE], "tokens": packer._tokens,
                        "buffered_documents": len(st[BestFitPack.LIVE]), "buffered_tokens": packer._held})
    return {"windows": windows}


def task_padding(kind: str, buffer: int, rows: int) -> dict:
    """Padding of the first rows with and without the ramp, on the corpus's documents in a seeded order."""
    import numpy as np
    import pyarrow.parquet as pq

    from tokenloom.pipes import BestFitPack, TokenDoc, load_encoder
    from tokenloom.pipes.sources.memory import FromList
    from tokenloom.sample_data import default_tokenizer_path

    texts = [t for f in corpus(kind) for t in pq.read_table(f, columns=["text"]).column("text").to_pylist() if t]
    enc = load_encoder(default_tokenizer_path())
    ids = [np.asarray([0] + x, np.int32) for x in enc.encode_batch(texts)]
    rng = np.random.default_rng(0)
    need = rows * (SEQ_LEN + 1) * 1.3
    docs, total = [], 0
    while total < need:
        for i in rng.permutation(len(ids)):
            docs.append(TokenDoc(ids[i], kind))
            total += len(ids[i])
    C = SEQ_LEN + 1
    out = {}
    for name, kw in (("ramp", {}), ("no_ramp", {"ramp": False}), ("old", {"ramp": False, "buffer_tokens": 1 << 40})):
        packer = BestFitPack(FromList(docs), seq_len=SEQ_LEN, buffer_size=buffer, **kw)
        packer.reset(None)
        pads = []
        for _ in range(rows):
            pads.append(C - int(next(packer).seg_lens.sum()))
        pads = np.asarray(pads)
        out[name] = {f"first_{n}": float(pads[:n].sum() / (n * C)) for n in (64, 512)}
        out[name]["all"] = float(pads.sum() / (rows * C))
        out[name]["buffer_tokens"] = packer.buffer_tokens
    return out


TASKS = {"first": task_first, "save": task_save, "padding": task_padding}


def spawn(task: str, **params) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--task", task, "--params", json.dumps(params)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(f"task {task} {params} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    print(f"# {task} {params}: {json.dumps(result)[:200]}", file=sys.stderr)
    return result


def median(xs: List[float]) -> float:
    xs = sorted(xs)
    return xs[len(xs) // 2] if len(xs) % 2 else 0.5 * (xs[len(xs) // 2 - 1] + xs[len(xs) // 2])


def run_all(rounds: int, padding_rows: int) -> Dict[str, Any]:
    for kind in CORPORA:
        corpus(kind)  # built once, before the timed children
    tmp = tempfile.mkdtemp(prefix="tokenloom-first-batch-")
    configs = [(k, b, v) for k in CORPORA for b in BUFFERS for v in ("new", "old")]
    saved = {}
    for kind, buffer, variant in configs:
        path = os.path.join(tmp, f"{kind}-{buffer}-{variant}.pt")
        saved[(kind, buffer, variant)] = (path, spawn("save", kind=kind, buffer=buffer, variant=variant, path=path))
    times: Dict[tuple, Dict[str, List[float]]] = {c: {"first": [], "resumed": []} for c in configs}
    for _ in range(rounds):
        for c in configs:
            kind, buffer, variant = c
            times[c]["first"].append(spawn("first", kind=kind, buffer=buffer, variant=variant)["seconds"])
            times[c]["resumed"].append(spawn("first", kind=kind, buffer=buffer, variant=variant,
                                             state=saved[c][0])["seconds"])
    out: Dict[str, Any] = {"seq_len": SEQ_LEN, "batch_size": BATCH, "workers": WORKERS, "save_at": SAVE_AT,
                           "rounds": rounds, "machine": {"python": platform.python_version(), "cpus": os.cpu_count(),
                                                         "load_average": list(os.getloadavg())},
                           "runs": {}, "padding": {}}
    for (kind, buffer, variant), t in times.items():
        out["runs"].setdefault(kind, {}).setdefault(variant, {})[str(buffer)] = {
            "first_s": median(t["first"]), "resumed_s": median(t["resumed"]), "first_min_s": min(t["first"]),
            "resumed_min_s": min(t["resumed"]), "first_all": t["first"],
            "resumed_all": t["resumed"], "windows": saved[(kind, buffer, variant)][1]["windows"]}
    for kind in CORPORA:
        out["padding"][kind] = spawn("padding", kind=kind, buffer=1000, rows=padding_rows)
    for kind in CORPORA:
        for variant in ("new", "old"):
            r = out["runs"][kind][variant]
            for what in ("first_s", "resumed_s", "first_min_s", "resumed_min_s"):
                r[f"ratio_{what}"] = r["1000"][what] / r["10"][what]
    return out


def markdown(out: Dict[str, Any], command: str) -> str:
    lines = [f"Command: `{command}` (writes `benchmarks/first_batch.json`, `benchmarks/first_batch.png`); "
             f"{out['machine']['cpus']} CPUs, load average {[round(x, 2) for x in out['machine']['load_average']]} "
             f"at start, shared with other jobs. `pretrain`, bestfit, T={out['seq_len']}, B={out['batch_size']}, "
             f"{out['workers']} workers; each figure is the median (and the fastest) of {out['rounds']} runs, each "
             f"in a fresh interpreter with tokenloom imported, rounds interleaved (on a busy machine the fastest run "
             f"is the steadier figure). *first*: `pretrain(...)` to the first batch in hand; *resumed*: "
             f"build + `load_state_dict` (saved after {out['save_at']} batches, past the ramp) to the first batch; "
             "*window*: what each worker's packer re-reads on that resume (documents / thousand tokens). "
             "*old*: ramp and token bound off, as before issue 16. Corpora: the demo corpus, prose "
             "(median 35 tokens) and code (median 2,257).", "",
             "| corpus | packer | buffer | first s, median (fastest) | resumed s | window per worker (docs / k tokens) |",
             "|---|---|---|---|---|---|"]
    for kind, by_variant in out["runs"].items():
        for variant in ("new", "old"):
            for b in map(str, BUFFERS):
                r = by_variant[variant][b]
                win = ", ".join(f"{w['documents']} / {w['tokens'] / 1000:.0f}k" for w in r["windows"])
                lines.append(f"| {kind} | {variant} | {b} | {r['first_s']:.2f} ({r['first_min_s']:.2f}) | "
                             f"{r['resumed_s']:.2f} ({r['resumed_min_s']:.2f}) | {win} |")
    lines += ["", f"Against the target (buffer 1000 within {TARGET}x of buffer 10, same data and workers):", "",
              "| corpus | packer | first: 1000 / 10, medians (fastest) | resumed: 1000 / 10 | met (both) |",
              "|---|---|---|---|---|"]
    for kind, by_variant in out["runs"].items():
        for variant in ("new", "old"):
            r = by_variant[variant]
            ok = all(r[f"ratio_{w}"] <= TARGET for w in ("first_s", "resumed_s", "first_min_s", "resumed_min_s"))
            lines.append(f"| {kind} | {variant} | {r['ratio_first_s']:.2f}x ({r['ratio_first_min_s']:.2f}x) | "
                         f"{r['ratio_resumed_s']:.2f}x ({r['ratio_resumed_min_s']:.2f}x) | {'yes' if ok else '**no**'} |")
    lines += ["", "Padding cost of the ramp (buffer 1000, share of row slots; in-process, the corpus's documents in a "
                  "seeded order):", "",
              "| corpus | packer | first 64 rows | first 512 rows | all rows |", "|---|---|---|---|---|"]
    for kind, p in out["padding"].items():
        for name in ("ramp", "no_ramp", "old"):
            r = p[name]
            lines.append(f"| {kind} | {name.replace('_', ' ')} | {100 * r['first_64']:.3f}% | "
                         f"{100 * r['first_512']:.3f}% | {100 * r['all']:.4f}% |")
    lines += ["", "![first batch](first_batch.png)"]
    return "\n".join(lines)


def plot(out: Dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(out["runs"]), figsize=(6 * len(out["runs"]), 4), squeeze=False)
    for ax, (kind, by_variant) in zip(axes[0], out["runs"].items()):
        x = range(len(BUFFERS))
        for i, (variant, what, color) in enumerate((("old", "first_s", "tab:gray"), ("old", "resumed_s", "silver"),
                                                    ("new", "first_s", "tab:blue"),
                                                    ("new", "resumed_s", "lightskyblue"))):
            ys = [by_variant[variant][str(b)][what] for b in BUFFERS]
            ax.bar([j + (i - 1.5) * 0.2 for j in x], ys, 0.2, color=color,
                   label=f"{variant}: {what.replace('_s', '')}")
        ax.set_xticks(list(x), [str(b) for b in BUFFERS])
        ax.set(title=f"{kind}: time to the first batch ({out['workers']} workers)", xlabel="buffer_size (documents)",
               ylabel="seconds")
        ax.set_yscale("log")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--task")
    ap.add_argument("--params", default="{}")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=os.path.join(HERE, "first_batch.json"))
    ap.add_argument("--results", default=os.path.join(HERE, "RESULTS.md"), help="the RESULTS.md to update")
    args = ap.parse_args()
    if args.task:
        print(json.dumps(TASKS[args.task](**json.loads(args.params))))
        return
    out = run_all(rounds=2 if args.quick else 7, padding_rows=4000 if args.quick else 20_000)
    print(json.dumps(out, indent=2))
    with open(args.out, "w") as f:
        json.dump(out, f, indent=2)
    plot(out, os.path.splitext(args.out)[0] + ".png")
    command = "python benchmarks/first_batch.py" + (" --quick" if args.quick else "")
    write_section(args.results, "first batch", markdown(out, command), tokenizer=DEMO)


if __name__ == "__main__":
    main()
