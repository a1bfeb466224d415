"""Delivered per-source token shares early in a run (issue 16 item 4), 70/30 by tokens.

What the training loop sees is what the packer emits, not what the mixer fed it: a
best-fit buffer that holds many documents lags the mix it was fed by what it holds.
Two corpora from the embedded stdlib corpus: ``long`` (the .py files split into two
sources ``a`` and ``b``, long documents both) and ``mixed`` (``code``: long files,
``prose``: short docstrings and paragraphs). pretrain, bestfit, T=2048, B=8, default
buffer (1000 documents, bounded in tokens as well and ramping up), 0 workers (the
shares do not depend on the worker count beyond which worker builds which batch).
Reported: each source's share of the delivered tokens after 10, 25, 50, 100, 200 and
400 batches, and the largest distance from the target from batch 100 on.

    python benchmarks/shares.py          # ~1 minute on 2 cores
Prints JSON; writes benchmarks/shares.json, benchmarks/shares.png and the ``## shares``
section of benchmarks/RESULTS.md.
"""

from __future__ import annotations

import json
import os
import sys

import pyarrow as pa
import pyarrow.parquet as pq

from tokenloom.recipes import pretrain
from tokenloom.sample_data import build_demo_corpus, default_tokenizer_path

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(os.path.dirname(HERE), "out", "bench", "shares")
CHECKPOINTS = (10, 25, 50, 100, 200, 400)
TARGET = 0.7


def corpora() -> dict:
    files = build_demo_corpus(os.path.join(OUT, "corpus"))
    texts = [t for f in files["code"] for t in pq.read_table(f)["text"].to_pylist()]
    for name, part in (("a", texts[0::2]), ("b", texts[1::2])):
        os.makedirs(os.path.join(OUT, "long", name), exist_ok=True)
        pq.write_table(pa.table({"text": part}), os.path.join(OUT, "long", name, "p.parquet"), row_group_size=64)
    return {"long": {n: os.path.join(OUT, "long", n) for n in ("a", "b")},
            "mixed": {"code": files["code"], "prose": files["prose"]}}


def run(sources: dict) -> dict:
    names = list(sources)
    loader = pretrain(sources, tokenizer=default_tokenizer_path(), seq_len=2048, batch_size=8,
                      weights={names[0]: TARGET, names[1]: 1 - TARGET})
    it = iter(loader)
    shares, worst = {}, 0.0
    for k in range(1, max(CHECKPOINTS) + 1):
        next(it)
        share = loader.stats()["sources"][names[0]]["share"]
        if k >= 100:
            worst = max(worst, abs(share - TARGET))
        if k in CHECKPOINTS:
            shares[k] = share
    return {"first": names[0], "share_of_first": shares, "worst_from_100": worst}


def main() -> int:
    out = {"target": TARGET, "corpora": {name: run(src) for name, src in corpora().items()}}
    print(json.dumps(out, indent=1))
    if "--no-write" in sys.argv:
        return 0
    with open(os.path.join(HERE, "shares.json"), "w") as f:
        json.dump(out, f, indent=1)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 3.5))
        for name, r in out["corpora"].items():
            ks = sorted(r["share_of_first"], key=int)
            ax.plot(ks, [100 * r["share_of_first"][k] for k in ks], marker="o", label=f"{name}: {r['first']}")
        ax.axhline(100 * TARGET, color="grey", lw=0.8)
        ax.axhspan(100 * TARGET - 2, 100 * TARGET + 2, color="grey", alpha=0.15, label="target +-2 points")
        ax.set_xscale("log")
        ax.set_xlabel("batches (8 x 2048)")
        ax.set_ylabel("delivered token share, %")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(os.path.join(HERE, "shares.png"), dpi=110)
    except ImportError:
        pass
    from results_md import write_section

    rows = ["| corpus | source | " + " | ".join(f"{k}" for k in CHECKPOINTS) + " | worst from 100 |",
            "|---|---|" + "---|" * len(CHECKPOINTS) + "---|"]
    for name, r in out["corpora"].items():
        rows.append(f"| {name} | {r['first']} | " + " | ".join(f"{100 * r['share_of_first'][k]:.1f}%"
                                                         for k in CHECKPOINTS) + f" | {100 * r['worst_from_100']:.1f} points |")
    write_section(os.path.join(HERE, "RESULTS.md"), "shares",
                  "Command: `python benchmarks/shares.py` (writes `benchmarks/shares.json`, `benchmarks/shares.png`).\n\n"
                  f"Delivered token share of the first source (target {100 * TARGET:.0f}%) after N batches:\n\n"
                  + "\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
