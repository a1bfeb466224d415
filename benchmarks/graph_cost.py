"""What the graph's own bookkeeping costs per row as the number of sources grows (issue 46).

`benchmarks/sources.py` measures the whole loader: reading, tokenizing, the graph and the
workers, whose speed on this 2-core machine swings by 15-20% between runs. This isolates the
part that grows with the number of sources and that no reading or tokenizing hides: the
best-fit packer (its checkpoints, overdue scan and pieces), the mixer's choice and the pieces
node, over in-memory sources that hand out ready token ids, in one process, no workers.

Graph, as `pretrain` builds it with several sources (reader and tokenizer left out): ``n``
synthetic sources, each behind a `Pieces` node (``piece = T + 1``), an interleave `Mix` with
equal weights and a `StepClock`, `BestFitPack` (T=2048, buffer 1000); one source is the packer
over the source alone, as the recipe builds one. Each source's documents have seeded lognormal
lengths (median 665 tokens, 2 to 60,000; most tokens in documents longer than a row, as in
the man pages and Python files of sources.py's corpus).

Measured per configuration, in a fresh interpreter with the garbage collector set as in a loader
worker (pipes/loader/worker_gc.py), after ``WARMUP_ROWS`` rows, in CPU time (the process's, so that
another process taking the core does not count):

- ``row_us``: microseconds per row, no state taken (what a worker does between snapshots with
  ``snapshot_every_n_steps``);
- ``state_us``: microseconds per row with the packer's state taken every 8 rows (a batch of 8
  rows, as a worker takes it with every batch by default), the state itself included;
- ``digest``: a hash of the rows and of a state every 97 rows: codes compared with ``--before``
  must give the same.

Configurations are interleaved round by round; medians. Ratios are to the 1-source row of the
same code.

    python benchmarks/graph_cost.py                          # 1,16,64,256,1024 sources, 3 rounds
    python benchmarks/graph_cost.py --before /tmp/py_before  # and another code (a python that imports it)
Prints JSON; writes benchmarks/graph_cost.json, benchmarks/graph_cost.png and the ``## graph cost``
section of benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from typing import Any, Dict, List

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from results_md import NO_TOKENIZER, write_section  # noqa: E402

SOURCES = (1, 16, 64, 256, 1024)
WARMUP_ROWS = 3000
ROWS = 30000
STATE_EVERY = 8

CHILD = r"""
import hashlib, json, sys, time
import numpy as np
from tokenloom.pipes.base import Node
from tokenloom.pipes.items import TokenDoc
from tokenloom.pipes.mix import Mix
from tokenloom.pipes.pack.bestfit import BestFitPack
from tokenloom.pipes.pieces import Pieces
from tokenloom.pipes.schedule import StepClock

n, warmup, rows, every = (int(x) for x in sys.argv[1:5])
T = 2048
try:  # the collector as a loader worker sets it (these graphs run in workers)
    from tokenloom.pipes.loader.worker_gc import settle_worker_gc
    settle_worker_gc()
except ImportError:
    pass


class Synthetic(Node):
    # a source of ready token ids: document k has length lens[k % 4096] (seeded per source)
    STATE_KEYS = ("k",)

    def __init__(self, name, seed):
        super().__init__()
        self.name = name
        rng = np.random.default_rng(seed)
        self.lens = np.clip(rng.lognormal(6.5, 1.3, 4096).astype(np.int64), 2, 60000).tolist()
        self.ids = np.arange(60000, dtype=np.int32)
        self.k = 0

    def reset(self, initial_state=None):
        self.k = 0 if initial_state is None else int(initial_state["k"])

    def next(self):
        k = self.k
        self.k = k + 1
        return TokenDoc(self.ids[:self.lens[k % 4096]], self.name, None, 0, k // 4096, k % 4096, 0, False)

    def get_state(self):
        return {"k": self.k}


def build():
    if n == 1:
        return BestFitPack(Synthetic("s0", 0), seq_len=T, buffer_size=1000)
    kids = {f"s{i:04d}": Pieces(Synthetic(f"s{i:04d}", i), piece=T + 1) for i in range(n)}
    return BestFitPack(Mix(kids, weights={k: 1.0 for k in kids}, clock=StepClock()), seq_len=T, buffer_size=1000)


def timed(state):
    p = build()
    p.reset(None)
    for _ in range(warmup):
        p.next()
    t0 = time.process_time()  # CPU time: another process taking the core does not count
    for i in range(rows):
        p.next()
        if state and i % every == 0:
            p.state_dict()
    return (time.process_time() - t0) / rows * 1e6


def digest():
    p = build()
    p.reset(None)
    h = hashlib.sha256()
    for i in range(2000):
        r = p.next()
        h.update(r.tokens.tobytes())
        h.update(r.seg_lens.tobytes())
        if i % 97 == 0:
            h.update(json.dumps(p.state_dict(), sort_keys=True, default=str).encode())
    return h.hexdigest()[:16]


print(json.dumps({"row_us": timed(False), "state_us": timed(True), "digest": digest()}))
"""


def run_child(python: str, n: int) -> Dict[str, Any]:
    out = subprocess.run([python, "-c", CHILD, str(n), str(WARMUP_ROWS), str(ROWS), str(STATE_EVERY)],
                         capture_output=True, text=True, timeout=1200, cwd=HERE)
    if out.returncode:
        raise SystemExit(f"child failed ({python}, {n} sources):\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--sources", default=",".join(map(str, SOURCES)), help="comma-separated source counts")
    ap.add_argument("--before", default=None, help="a python that imports another code's tokenloom: its runs "
                                                   "interleave with this code's, as 'before'")
    ap.add_argument("--label", default="the code before", help="what --before is, for RESULTS.md")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    counts = sorted({int(x) for x in args.sources.split(",")} | {1})
    codes = {"this": sys.executable, **({"before": args.before} if args.before else {})}
    load = [round(x, 2) for x in os.getloadavg()]
    runs: Dict[str, List[Dict[str, Any]]] = {f"{c}|{n}": [] for c in codes for n in counts}
    for r in range(args.rounds):
        for n in counts:  # the codes side by side at each count: the machine's drift hits both alike
            for c, python in codes.items():
                res = run_child(python, n)
                runs[f"{c}|{n}"].append(res)
                print(f"round {r}: {c}, {n} sources: {res['row_us']:.1f} us a row, {res['state_us']:.1f} with the "
                      f"state every {STATE_EVERY}", file=sys.stderr, flush=True)
    rows = []
    for c in codes:
        one = statistics.median(x["row_us"] for x in runs[f"{c}|1"])
        one_state = statistics.median(x["state_us"] for x in runs[f"{c}|1"])
        for n in counts:
            got = runs[f"{c}|{n}"]
            row = {"code": c, "sources": n, "row_us": statistics.median(x["row_us"] for x in got),
                   "state_us": statistics.median(x["state_us"] for x in got),
                   "digests": sorted({x["digest"] for x in got})}
            row["row_vs_1"], row["state_vs_1"] = row["row_us"] / one, row["state_us"] / one_state
            if c == "this" and "before" in codes:
                other = runs[f"before|{n}"]
                row["vs_before"] = row["row_us"] / statistics.median(x["row_us"] for x in other)
                row["state_vs_before"] = row["state_us"] / statistics.median(x["state_us"] for x in other)
                row["same_as_before"] = row["digests"] == sorted({x["digest"] for x in other})
            rows.append(row)
    result = {"rounds": args.rounds, "warmup_rows": WARMUP_ROWS, "rows_timed": ROWS, "state_every": STATE_EVERY,
              "load_at_start": load, "load_at_end": [round(x, 2) for x in os.getloadavg()], "codes": codes,
              "label": args.label if args.before else None, "rows": rows, "runs": runs}
    print(json.dumps(result, indent=1))
    if args.no_write:
        return
    with open(os.path.join(HERE, "graph_cost.json"), "w") as f:
        json.dump(result, f, indent=1)
    plot(result)
    write_section(os.path.join(HERE, "RESULTS.md"), "graph cost", markdown(result, args),
                  tokenizer=NO_TOKENIZER)


def markdown(result: Dict[str, Any], args: argparse.Namespace) -> str:
    before = result["label"]
    head = "| sources | us a row | vs 1 source | us a row, state every 8 rows | vs 1 source |"
    sep = "|---|---|---|---|---|"
    if before:
        head += " us a row, before | this / before | state, this / before | same rows and states |"
        sep += "---|---|---|---|"
    lines = [head, sep]
    by = {(r["code"], r["sources"]): r for r in result["rows"]}
    for r in (r for r in result["rows"] if r["code"] == "this"):
        line = (f"| {r['sources']} | {r['row_us']:.1f} | {r['row_vs_1']:.2f}x | {r['state_us']:.1f} | "
                f"{r['state_vs_1']:.2f}x |")
        if before:
            b = by[("before", r["sources"])]
            line += (f" {b['row_us']:.1f} | {r['vs_before']:.2f}x | {r['state_vs_before']:.2f}x | "
                     f"{'yes' if r['same_as_before'] else 'NO'} |")
        lines.append(line)
    command = "python benchmarks/graph_cost.py" + (f" --rounds {args.rounds}" if args.rounds != 3 else "") + (
        f" --sources {args.sources}" if args.sources != ",".join(map(str, SOURCES)) else "") + (
        " --before PYTHON" if before else "")
    return (f"Command: `{command}` (writes `benchmarks/graph_cost.json`, `benchmarks/graph_cost.png`); 2 CPUs, load "
            f"average {result['load_at_start']} at start, {result['load_at_end']} at end."
            + (f" Before: {before}." if before else "") +
            f" The packer, mixer and pieces nodes over in-memory sources of synthetic token ids (no reading, no "
            f"tokenizing; graph and lengths in the script's docstring), one process with a worker's collector "
            f"settings, T=2048, buffer 1000: "
            f"CPU microseconds a row after {result['warmup_rows']} rows, over {result['rows_timed']}, medians of "
            f"{result['rounds']} interleaved rounds, each run in a fresh interpreter. A batch of B=8 rows costs 8 "
            "times the figure; in sources.py's runs a worker spends 1-2 ms a batch in all.\n\n"
            + "\n".join(lines) + "\n\n![graph cost](graph_cost.png)")


def plot(result: Dict[str, Any]) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for code in result["codes"]:
        rows = [r for r in result["rows"] if r["code"] == code]
        xs = [r["sources"] for r in rows]
        ax.plot(xs, [r["row_us"] for r in rows], marker="o", label=f"{code}: no state")
        ax.plot(xs, [r["state_us"] for r in rows], marker="s", ls="--", label=f"{code}: state every 8 rows")
    ax.set_xscale("log")
    ax.set_xlabel("sources")
    ax.set_ylabel("microseconds a row")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(HERE, "graph_cost.png"), dpi=110)


if __name__ == "__main__":
    main()
