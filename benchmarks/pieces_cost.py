"""What mixing long documents in pieces costs in throughput (issue 27; pipes/pieces.py).

With several sources and ``bestfit`` the recipes put a Pieces node between each tokenizer and
the mixer: one parent state taken before each document pulled, a piece object per row of a
long document, and the packer appending pieces to their slot. This runs the same loader with
pieces (the recipe as built) and with whole documents (the Pieces node replaced by its
parent, as before), each run in a fresh interpreter, variants interleaved in rounds; the ratio
is taken within a round (this 2-core machine's speed drifts within minutes).

Corpora: ``demo`` (the demo corpus's code and prose, 60/40; the shipped tokenizer) and
``held_out`` (shares.py's man pages against /usr/share/doc, 70/30; the 100k-id BPE, where
most tokens are in documents longer than a row). pretrain, bestfit, T=2048, B=8, 2 workers,
tokens (``segment_ids != 0``) per second over ``--batches`` batches after 20.

    python benchmarks/pieces_cost.py            # ~2 minutes on 2 cores
Prints JSON; writes benchmarks/pieces_cost.json, benchmarks/pieces_cost.png and the
``## pieces cost`` section of benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
WARMUP = 20
NOTE = ("What pieces cost: a mixer pick, a piece and an append to the packer's slot per row of a long document "
        "(the tokenizer's state is asked only for long documents, `Tokenize.state_before_last`); the more of the "
        "tokens are in long documents, the more it shows. What they buy: the shares hold from the first batches "
        "(`shares`: 1.6 points off at worst from batch 50 on the held-out mix, 7.4 with whole documents). The ratios "
        "swing by +-10% within rounds on this shared 2-core machine.")


def sources(corpus: str) -> dict:
    import shares

    if corpus == "demo":
        from tokenloom.sample_data import build_demo_corpus, default_tokenizer_path

        files = build_demo_corpus(os.path.join(os.path.dirname(HERE), "out", "bench", "corpus"))
        return {"sources": {"code": files["code"], "prose": files["prose"]}, "weights": {"code": 0.6, "prose": 0.4},
                "tokenizer": default_tokenizer_path()}
    h = shares.held_out()
    return {"sources": h["sources"], "weights": {"man": 0.7, "doc": 0.3}, "tokenizer": h["tokenizer"]}


def task(corpus: str, variant: str, batches: int) -> dict:
    import shares
    from tokenloom.recipes import pretrain

    c = sources(corpus)
    if variant == "whole":
        shares.whole_documents()
    loader = pretrain(c["sources"], tokenizer=c["tokenizer"], weights=c["weights"], seq_len=2048, batch_size=8,
                      num_workers=2)
    it = iter(loader)
    for _ in range(WARMUP):
        next(it)
    tokens, t0 = 0, time.perf_counter()
    for _ in range(batches):
        tokens += int((next(it)["segment_ids"] != 0).sum())
    return {"tokens_per_s": tokens / (time.perf_counter() - t0)}


def child(corpus: str, variant: str, batches: int) -> dict:
    out = subprocess.run([sys.executable, __file__, "--task", json.dumps([corpus, variant, batches])],
                         capture_output=True, text=True, timeout=900)
    if out.returncode != 0:
        raise RuntimeError(f"{corpus} {variant} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--batches", type=int, default=600)
    ap.add_argument("--task")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    if args.task:
        print(json.dumps(task(*json.loads(args.task))))
        return 0
    load = os.getloadavg()
    out = {"rounds": args.rounds, "batches": args.batches, "load_at_start": [round(x, 2) for x in load], "corpora": {}}
    for corpus in ("demo", "held_out"):
        sources(corpus)  # built once, outside the clock
        runs = {"pieces": [], "whole": []}
        for _ in range(args.rounds):
            for variant in ("pieces", "whole"):
                runs[variant].append(child(corpus, variant, args.batches)["tokens_per_s"])
        ratios = [p / w for p, w in zip(runs["pieces"], runs["whole"])]
        out["corpora"][corpus] = {"pieces_M": [round(x / 1e6, 2) for x in runs["pieces"]],
                                  "whole_M": [round(x / 1e6, 2) for x in runs["whole"]],
                                  "ratio_in_round": [round(x, 3) for x in ratios],
                                  "ratio_median": round(statistics.median(ratios), 3)}
    out["load_at_end"] = [round(x, 2) for x in os.getloadavg()]
    print(json.dumps(out, indent=1))
    if args.no_write:
        return 0
    with open(os.path.join(HERE, "pieces_cost.json"), "w") as f:
        json.dump(out, f, indent=1)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(5, 3))
        names = list(out["corpora"])
        ax.bar(names, [out["corpora"][n]["ratio_median"] for n in names])
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_ylabel("tokens/s, pieces / whole")
        fig.tight_layout()
        fig.savefig(os.path.join(HERE, "pieces_cost.png"), dpi=110)
    except ImportError:
        pass
    from results_md import DEMO, STAND_IN, write_section

    rows = ["| corpus | in pieces, M tokens/s | whole, M tokens/s | ratio within rounds | median |", "|---|---|---|---|---|"]
    for n, r in out["corpora"].items():
        rows.append(f"| {n} | {', '.join(map(str, r['pieces_M']))} | {', '.join(map(str, r['whole_M']))} | "
                    f"{', '.join(f'{x:.2f}' for x in r['ratio_in_round'])} | {r['ratio_median']:.2f}x |")
    write_section(os.path.join(HERE, "RESULTS.md"), "pieces cost",
                  tokenizer=f"{DEMO} (demo); {STAND_IN} (held_out)", body=f"Command: `python benchmarks/pieces_cost.py` (writes `benchmarks/pieces_cost.json`, "
                  f"`benchmarks/pieces_cost.png`); 2 CPUs, load average {out['load_at_start']} at start, "
                  f"{out['load_at_end']} at end. pretrain, bestfit, T=2048, B=8, 2 workers, tokens/s over "
                  f"{args.batches} batches after {WARMUP}, each run in a fresh interpreter, {args.rounds} interleaved "
                  "rounds: long documents mixed in pieces (the recipe's default with several sources) against whole "
                  "documents. Corpora in the script's docstring.\n\n" + "\n".join(rows) + "\n\n" + NOTE
                  + "\n\n![pieces cost](pieces_cost.png)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
