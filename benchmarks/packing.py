"""Packing waste and packer speed, all modes side by side in one run.

Document lengths come from a real corpus built on this machine: every module and
docstring of the Python standard library, tokenized with the shipped BPE
tokenizer (heavy tailed: median 35 tokens for docstrings, 2,257 for source files,
max ~186k). A stream of documents is drawn from those lengths in a seeded
random order, long enough for the buffer to reach steady state.

Measured per mode and buffer size (100, 1000, 4000) at T = 2048 (rows of 2049):
- padding: share of row slots that are padding, in steady state (rows after the
  first 2 * buffer_size documents; the final flush of the stream excluded);
- discarded: share of input tokens thrown away (crop modes);
- the crop floor: tokens beyond 2049 of documents longer than a row, which any
  packer that only crops must lose.
nanochat's BOS-aligned best-fit-crop is re-implemented from its published
algorithm (largest that fits; when nothing fits, crop the shortest document;
long documents never fit) as the baseline.

Speed: placements (segments placed) per second of packer time on a single core,
with documents pre-tokenized in memory (no reading, no tokenizing).

    python benchmarks/packing.py            # full run, ~2 minutes
    python benchmarks/packing.py --quick    # smaller streams
Prints JSON; writes benchmarks/packing.json and benchmarks/packing.png.
"""

from __future__ import annotations

import argparse
import bisect
import json
import os
import platform
import sys
import time

import numpy as np

from tokenloom.pipes import BestFitPack, FlatPack, TokenDoc, load_encoder
from tokenloom.pipes.pack import core as pack_core
from tokenloom.pipes.sources.memory import FromList
from tokenloom.sample_data import default_tokenizer_path, stdlib_documents

HERE = os.path.dirname(os.path.abspath(__file__))
T = 2048
C = T + 1


def _lengths(texts) -> np.ndarray:
    enc = load_encoder(default_tokenizer_path())
    return np.asarray([len(ids) + 1 for ids in enc.encode_batch(texts)], np.int64)  # + BOS


def stdlib_lengths() -> np.ndarray:
    return _lengths([d["text"] for kind in ("code", "prose") for d in stdlib_documents(kind)])


def markdown_lengths(limit: int) -> np.ndarray:
    """Every .md/.rst file on this machine (package READMEs, docs, changelogs): the closest
    thing to web text that every machine has. Sorted, capped at `limit` files."""
    import subprocess

    out = subprocess.run(["find", "/", "-xdev", "(", "-name", "*.md", "-o", "-name", "*.rst", ")", "-type", "f"],
                         capture_output=True, text=True).stdout.split("\n")
    texts = []
    # /tmp and /work hold other jobs' scratch files: left out so the corpus is the same every run
    skip = ("/proc", "/tmp", "/work", "/root/.cache")
    for p in sorted(x for x in out if x and not x.startswith(skip))[:limit]:
        try:
            with open(p, encoding="utf-8") as f:
                t = f.read()
        except (OSError, UnicodeDecodeError):
            continue
        if t.strip():
            texts.append(t)
    return _lengths(texts)


def stream(lengths: np.ndarray, n_docs: int, seed: int = 0) -> list:
    rng = np.random.default_rng(seed)
    picks = lengths[rng.integers(0, len(lengths), n_docs)]
    # token values are irrelevant to waste; one shared buffer keeps memory flat
    pool = np.arange(int(picks.max()), dtype=np.int32)
    return [TokenDoc(pool[:n], "s") for n in picks.tolist()]


def run_packer(packer, warm_docs: int, n_docs: int):
    """Pack a whole stream; steady-state padding counted over rows made after `warm_docs`
    documents were pulled and before the stream was exhausted (the final flush excluded)."""
    packer.reset(None)
    slots = pad = rows = segs = 0
    t0 = time.perf_counter()
    for row in packer:
        segs += len(row.seg_lens)
        st = packer.stats()
        steady = warm_docs < st["documents"] < n_docs
        if steady:
            filled = int(row.seg_lens.sum())
            slots += C
            pad += C - filled
            rows += 1
    elapsed = time.perf_counter() - t0
    st = packer.stats()
    return {
        "padding": pad / max(slots, 1),
        "discarded": st["discarded"] / st["tokens_in"],
        "rows": st["rows"],
        "steady_rows": rows,
        "segments": segs,
        "seconds": elapsed,
        "placements_per_s": segs / elapsed,
        "chunked_docs": st["chunked"],
    }


def nanochat_bestfit_crop(docs: list, buffer_size: int, warm_docs: int):
    """nanochat's tokenizing_distributed_data_loader_bos_bestfit packing, on lengths:
    per row, take the largest document that fits; when none fits, crop the shortest
    to fill the row and drop its rest. The buffer is refilled before every placement."""
    it = iter(docs)
    buf: list = []  # sorted (length, id)
    nid = 0
    tokens_in = discarded = 0
    rows = 0
    pulled = 0

    def refill():
        nonlocal nid, tokens_in, pulled
        while len(buf) < buffer_size:
            try:
                d = next(it)
            except StopIteration:
                return False
            n = len(d.ids)
            tokens_in += n
            pulled += 1
            bisect.insort(buf, (n, nid))
            nid += 1
        return True

    t0 = time.perf_counter()
    while True:
        refill()
        if not buf:
            break
        col = 0
        while col < C:
            if not refill() and not buf:
                break
            space = C - col
            i = bisect.bisect_right(buf, (space, float("inf"))) - 1
            if i >= 0:
                n, _ = buf.pop(i)
                col += n
            else:
                n, _ = buf.pop(0)  # shortest; it does not fit
                discarded += n - space
                col = C
        if col == C:
            rows += 1
        else:
            break  # the stream ended mid-row: nanochat would wait for more data
    return {"padding": 0.0, "discarded": discarded / tokens_in, "rows": rows,
            "seconds": time.perf_counter() - t0}


def measure(name: str, lengths: np.ndarray, n_docs: int) -> dict:
    docs = stream(lengths, n_docs)
    doc_lens = np.array([len(d.ids) for d in docs])
    out = {
        "corpus_documents": int(len(lengths)), "median_tokens": float(np.median(lengths)),
        "p90_tokens": float(np.percentile(lengths, 90)), "p99_tokens": float(np.percentile(lengths, 99)),
        "max_tokens": int(lengths.max()), "docs_longer_than_a_row": float((lengths > C).mean()),
        "stream_documents": n_docs,
        "crop_floor": float(np.maximum(doc_lens - C, 0).sum() / doc_lens.sum()),
        "modes": {},
    }
    for buffer_size in (100, 1000, 4000):
        warm = 2 * buffer_size
        runs = {
            "flat": run_packer(FlatPack(FromList(docs), seq_len=T), warm, n_docs),
            "bestfit": run_packer(BestFitPack(FromList(docs), seq_len=T, buffer_size=buffer_size), warm, n_docs),
            "bestfit-crop": run_packer(BestFitPack(FromList(docs), seq_len=T, buffer_size=buffer_size, mode="crop"),
                                       warm, n_docs),
            "nanochat-crop": nanochat_bestfit_crop(docs, buffer_size, warm),
        }
        for mode, r in runs.items():
            out["modes"].setdefault(mode, {})[str(buffer_size)] = r
        print(f"{name} buffer {buffer_size}: " + ", ".join(
            f"{m} pad {100 * r['padding']:.3f}% disc {100 * r['discarded']:.2f}%" for m, r in runs.items())
            + f" (crop floor {100 * out['crop_floor']:.2f}%)", file=sys.stderr)
    return out


class TimedCore:
    """Forwards to a packing core and adds up the time spent inside it."""

    def __init__(self, core):
        self.core, self.seconds = core, 0.0

    def insert_many(self, *a):
        t = time.perf_counter()
        self.core.insert_many(*a)
        self.seconds += time.perf_counter() - t

    def build_row(self, *a):
        t = time.perf_counter()
        out = self.core.build_row(*a)
        self.seconds += time.perf_counter() - t
        return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=os.path.join(HERE, "packing.json"))
    args = ap.parse_args()
    n_docs = 20_000 if args.quick else 80_000
    stdlib = stdlib_lengths()
    result = {
        "T": T, "core": pack_core.IMPLEMENTATION,
        "machine": {"python": platform.python_version(), "cpus": os.cpu_count()},
        "distributions": {
            "stdlib": measure("stdlib", stdlib, n_docs),
            "markdown": measure("markdown", markdown_lengths(3000 if args.quick else 20_000), n_docs),
        },
    }
    lengths = stdlib
    # Speed on prose-sized documents (one placement per document, the hardest case for
    # per-document overhead): the whole packer node, and the time inside the core alone.
    short = stream(lengths[lengths < 200], 20_000 if args.quick else 100_000, seed=1)
    from tokenloom.pipes.pack import _packcore_py

    speed = {}
    for name, core in (("c", pack_core._core), ("python", _packcore_py)):
        if name == "c" and pack_core.IMPLEMENTATION != "c":
            continue
        docs = short if name == "c" else short[:10_000]
        timer = TimedCore(core)
        packer = BestFitPack(FromList(docs), seq_len=T, buffer_size=1000)
        packer.reset(None)
        packer._slots.core = timer
        segs, t0 = 0, time.perf_counter()
        for row in packer:
            segs += len(row.seg_lens)
        node_s = time.perf_counter() - t0
        speed[name] = {"node_placements_per_s": segs / node_s, "core_placements_per_s": segs / timer.seconds,
                       "core_share_of_node_time": timer.seconds / node_s}
    result["speed_short_docs"] = speed
    print(json.dumps(result, indent=2))
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    plot(result, os.path.join(HERE, "packing.png"))


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    buffers = ["100", "1000", "4000"]
    dists = result["distributions"]
    fig, axes = plt.subplots(len(dists), 2, figsize=(11, 4 * len(dists)), squeeze=False)
    for row, (name, d) in enumerate(dists.items()):
        for mode, color in (("flat", "tab:gray"), ("bestfit", "tab:blue"), ("bestfit-crop", "tab:green"),
                            ("nanochat-crop", "tab:red")):
            r = d["modes"][mode]
            axes[row, 0].plot(buffers, [100 * r[b]["padding"] for b in buffers], "o-", color=color, label=mode)
            axes[row, 1].plot(buffers, [100 * r[b]["discarded"] for b in buffers], "o-", color=color, label=mode)
        axes[row, 1].axhline(100 * d["crop_floor"], color="k", ls="--", lw=1, label="crop floor")
        axes[row, 0].set(title=f"{name}: padding, steady state (T={result['T']})", xlabel="buffer (documents)",
                         ylabel="% of row slots")
        axes[row, 1].set(title=f"{name}: discarded tokens", xlabel="buffer (documents)", ylabel="% of input tokens")
        for ax in axes[row]:
            ax.legend(fontsize=8)
            ax.grid(alpha=0.3)
    fig.suptitle("tokenloom packing on real token lengths from files on this machine")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
