"""Delivered per-source token shares early in a run (issues 16 and 27), 70/30 by tokens.

What the training loop sees is what the packer emits, not what the mixer fed it: a
best-fit buffer that holds many documents lags the mix it was fed by what it holds, and
a long document handed out whole drains as rows of its source alone. Corpora:

- ``long``: the embedded stdlib corpus's .py files split into two sources ``a`` and ``b``
  (long documents both), 0 workers;
- ``mixed``: the demo corpus, ``code`` (long files) against ``prose`` (short docstrings and
  paragraphs), 0 workers;
- ``held_out``: held_out.py's 8,000 man pages against the machine's /usr/share/doc text files
  (changelogs, READMEs, copyright files: long, some of 100k tokens), held_out.py's 100k-id BPE,
  2 workers.

pretrain, bestfit, T=2048, B=8, default buffer. Each corpus runs twice in this process: as
the recipe builds it (long documents reach the mixer in pieces of a row, pipes/pieces.py)
and, as the control, with whole documents (the Pieces node replaced by its parent, as
before issue 27). Reported: the first source's share after 10 ... 400 batches and the
largest distance from the target at every batch from 50 and from 100 on. The shares do
not depend on timing: the figures are the same run after run.

    python benchmarks/shares.py          # ~2 minutes on 2 cores
Prints JSON; writes benchmarks/shares.json, benchmarks/shares.png and the ``## shares``
section of benchmarks/RESULTS.md.
"""

from __future__ import annotations

import glob
import gzip
import json
import os
import random
import sys

import pyarrow as pa
import pyarrow.parquet as pq

from tokenloom.recipes import pretrain
from tokenloom.sample_data import build_demo_corpus, default_tokenizer_path

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(os.path.dirname(HERE), "out", "bench", "shares")
CHECKPOINTS = (10, 25, 50, 100, 200, 400)
TARGET = 0.7


HELD_OUT = os.path.join(os.path.dirname(OUT), "held_out")
DOC_SUFFIXES = ("", ".gz", ".txt", ".md", ".rst", ".Debian")


def debian_docs() -> str:
    """The machine's /usr/share/doc text files (changelogs, READMEs, copyright files; .gz read),
    in 4 parquet files: long documents, some of 100k tokens."""
    out = os.path.join(HELD_OUT, "debian_docs")
    if glob.glob(os.path.join(out, "*.parquet")):
        return out
    paths = []
    for root, _, files in os.walk("/usr/share/doc"):
        paths += [os.path.join(root, f) for f in files if os.path.splitext(f)[1] in DOC_SUFFIXES
                  and not os.path.islink(os.path.join(root, f))]
    texts = []
    for path in sorted(paths):
        try:
            raw = gzip.open(path).read() if path.endswith(".gz") else open(path, "rb").read()
            text = raw.decode("utf-8")
        except (OSError, UnicodeDecodeError, EOFError):
            continue
        if text.strip() and "\0" not in text:
            texts.append(text)
    if len(texts) < 500:
        raise SystemExit(f"only {len(texts)} text files under /usr/share/doc: the held-out mix needs them")
    random.Random(0).shuffle(texts)
    tmp = out + ".tmp"
    os.makedirs(tmp, exist_ok=True)
    for i in range(4):
        pq.write_table(pa.table({"text": texts[i::4]}), os.path.join(tmp, f"doc_{i}.parquet"), row_group_size=64)
    os.replace(tmp, out)
    return out


def corpora() -> dict:
    files = build_demo_corpus(os.path.join(OUT, "corpus"))
    texts = [t for f in files["code"] for t in pq.read_table(f)["text"].to_pylist()]
    for name, part in (("a", texts[0::2]), ("b", texts[1::2])):
        os.makedirs(os.path.join(OUT, "long", name), exist_ok=True)
        pq.write_table(pa.table({"text": part}), os.path.join(OUT, "long", name, "p.parquet"), row_group_size=64)
    return {"long": {n: os.path.join(OUT, "long", n) for n in ("a", "b")},
            "mixed": {"code": files["code"], "prose": files["prose"]}}


def run(sources: dict, *, workers: int = 0, tokenizer: str = None, batches: int = max(CHECKPOINTS)) -> dict:
    """Share of the first source after every batch, as the loop sees it (``loader.stats()``)."""
    names = list(sources)
    loader = pretrain(sources, tokenizer=tokenizer or default_tokenizer_path(), seq_len=2048, batch_size=8,
                      weights={names[0]: TARGET, names[1]: 1 - TARGET}, num_workers=workers)
    it = iter(loader)
    shares, every = {}, []
    for k in range(1, batches + 1):
        next(it)
        share = loader.stats()["sources"][names[0]]["share"]
        every.append(share)
        if k in CHECKPOINTS:
            shares[k] = share
    worst = {f"worst_from_{k}": max(abs(x - TARGET) for x in every[k - 1:]) for k in (50, 100) if k <= batches}
    return {"first": names[0], "workers": workers, "share_of_first": shares, "every": every, **worst}


def held_out() -> dict:
    """Man pages (held_out.py's 8,000) against the machine's Debian documentation, 2 workers, the
    100k-id BPE: the long documents of the second source are what the mixer must not hand out whole."""
    sys.path.insert(0, HERE)
    import held_out as ho

    ho.prepare(8000)
    return {"sources": {"man": ho.corpus_dir(8000), "doc": debian_docs()}, "workers": 2,
            "tokenizer": ho.tokenizer_path()}


def whole_documents():
    """The control: recipes build no Pieces node (its parent stands in for it)."""
    import tokenloom.recipes.packed_graph as packed  # where the recipes build their graph

    saved = packed.Pieces
    packed.Pieces = lambda parent, piece: parent
    return lambda: setattr(packed, "Pieces", saved)


def main() -> int:
    runs = {name: {"sources": src} for name, src in corpora().items()}
    if "--no-held-out" not in sys.argv:
        runs["held_out"] = held_out()
    out = {"target": TARGET, "corpora": {}}
    for name, r in runs.items():
        kw = {k: v for k, v in r.items() if k != "sources"}
        out["corpora"][name] = run(r["sources"], **kw)
        undo = whole_documents()
        try:
            out["corpora"][name]["whole_documents"] = run(r["sources"], **kw)
        finally:
            undo()
    brief = lambda r: {k: (brief(v) if isinstance(v, dict) and k == "whole_documents" else v) for k, v in r.items()
                       if k != "every"}
    print(json.dumps({n: brief(r) for n, r in out["corpora"].items()}, indent=1))
    if "--no-write" in sys.argv:
        return 0
    with open(os.path.join(HERE, "shares.json"), "w") as f:
        json.dump(out, f, indent=1)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        for i, (name, r) in enumerate(out["corpora"].items()):
            for variant, style in ((r, "-"), (r["whole_documents"], ":")):
                every = variant["every"]
                ax.plot(range(1, len(every) + 1), [100 * x for x in every], style, color=f"C{i}", lw=1,
                        label=f"{name}: {r['first']}" + (" (whole documents)" if style == ":" else ""))
        ax.axhline(100 * TARGET, color="grey", lw=0.8)
        ax.axhspan(100 * TARGET - 2, 100 * TARGET + 2, color="grey", alpha=0.15, label="target +-2 points")
        ax.set_xscale("log")
        ax.set_ylim(40, 100)
        ax.set_xlabel("batches (8 x 2048)")
        ax.set_ylabel("delivered token share, %")
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(os.path.join(HERE, "shares.png"), dpi=110)
    except ImportError:
        pass
    from results_md import DEMO, STAND_IN, write_section

    rows = ["| corpus | workers | source | documents | " + " | ".join(f"{k}" for k in CHECKPOINTS)
            + " | worst from 50 | worst from 100 |",
            "|---|---|---|---|" + "---|" * len(CHECKPOINTS) + "---|---|"]
    for name, r in out["corpora"].items():
        for label, v in (("in pieces (default)", r), ("whole (control)", r["whole_documents"])):
            rows.append(f"| {name} | {r['workers']} | {r['first']} | {label} | "
                        + " | ".join(f"{100 * v['share_of_first'][k]:.1f}%" for k in CHECKPOINTS)
                        + f" | {100 * v['worst_from_50']:.1f} points | {100 * v['worst_from_100']:.1f} points |")
    write_section(os.path.join(HERE, "RESULTS.md"), "shares",
                  tokenizer=f"{DEMO} (the demo corpora); {STAND_IN} (held_out)", body="Command: `python benchmarks/shares.py` (writes `benchmarks/shares.json`, `benchmarks/shares.png`). "
                  "The shares do not depend on timing: the same figures come run after run.\n\n"
                  f"Delivered token share of the first source (target {100 * TARGET:.0f}%) after N batches, "
                  "pretrain bestfit T=2048 B=8 at its defaults; *in pieces*: as the recipe builds it, long "
                  "documents reach the mixer a row at a time (pipes/pieces.py); *whole*: the same with whole "
                  "documents, as before issue 27. *worst from N*: the largest distance from the target at any "
                  "batch from N on. Corpora in the script's docstring; `held_out` is issue 27's held-out mix "
                  "(man pages against /usr/share/doc, some documents of 100k tokens, 2 workers, 100k-id BPE).\n\n"
                  + "\n".join(rows) + "\n\n![shares](shares.png)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
