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
long documents never fit) as the baseline, and beside it the "simple" streaming
rule issue 16 states: a document longer than a row starts a row of its own when
one is buffered; otherwise the largest buffered document that fits; when none
fits, crop the shortest. Neither bounds how long a document waits (the simple
rule keeps some short documents for the whole stream, which a resume would have
to re-read); bestfit-crop does.

Distributions: stdlib and markdown (most tokens in documents longer than a row),
and a prose corpus where documents between half a row and a row are common: the
English man pages on this machine (/usr/share/man/man*/, troff source; 45% of
them in (C/2, C] with the shipped tokenizer), and the same lengths scaled by 0.7,
which puts the crop floor (33%) near the 32.4% issue 16 measured with cl100k
(a tokenizer with 25x the vocabulary makes fewer tokens of the same text).
Without man pages, a seeded log-normal stand-in with the same median and spread.

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

from results_md import DEMO, write_section  # noqa: E402 - benchmarks/ is on sys.path when run as a script
from tokenloom.pipes import BestFitPack, FlatPack, TokenDoc, load_encoder
from tokenloom.pipes.pack import core as pack_core
from tokenloom.pipes.sources.memory import FromList
from tokenloom.sample_data import default_tokenizer_path, stdlib_documents

HERE = os.path.dirname(os.path.abspath(__file__))
T = 2048
C = T + 1


def _lengths(texts, tokenizer=None) -> np.ndarray:
    enc = load_encoder(tokenizer or default_tokenizer_path())
    return np.asarray([len(ids) + 1 for ids in enc.encode_batch(texts)], np.int64)  # + BOS


def stdlib_lengths() -> np.ndarray:
    return _lengths([d["text"] for kind in ("code", "prose") for d in stdlib_documents(kind)])


def markdown_lengths(limit: int) -> np.ndarray:
    return _lengths(markdown_texts(limit))


def markdown_texts(limit: int) -> list:
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
    return texts


def man_lengths(tokenizer=None) -> np.ndarray:
    """Every English man page on this machine (troff source, gzip), tokenized (with ``tokenizer``,
    default the shipped one); a seeded log-normal stand-in (median 1,438 tokens, sigma 0.9, as
    measured on a Debian image) where there are none."""
    import glob
    import gzip

    texts = []
    for path in sorted(glob.glob("/usr/share/man/man*/*.gz")):
        try:
            texts.append(gzip.open(path).read().decode("utf-8"))
        except (OSError, UnicodeDecodeError):
            continue
    if len(texts) >= 1000:
        return _lengths(texts, tokenizer)
    print("no man pages here: using a log-normal stand-in", file=sys.stderr)
    return np.maximum(np.random.default_rng(0).lognormal(np.log(1438), 0.9, 20_000).astype(np.int64), 2)


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
    slots = pad = rows = segs = wait = 0
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
            oldest = getattr(packer, "_oldest", lambda: None)()
            if oldest is not None:
                wait = max(wait, packer._pulled - oldest)
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
        "max_wait_pulls": wait,  # the oldest buffered document's age: what a restore re-reads
    }


def _fit_or_crop(buf: list, space: int):
    """One placement of the reference rules below, in ``space`` tokens left in the row: the largest
    buffered document that fits, else the shortest cropped to fill the row. ``buf`` is sorted
    (length, id); returns (id, tokens placed, tokens dropped)."""
    i = bisect.bisect_right(buf, (space, float("inf"))) - 1
    if i >= 0:
        n, d = buf.pop(i)
        return d, n, 0
    n, d = buf.pop(0)  # the shortest; it does not fit
    return d, space, n - space


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
    wait = 0

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
            d, used, cut = _fit_or_crop(buf, C - col)
            col += used
            discarded += cut
            if d >= warm_docs:
                wait = max(wait, nid - d)
        if col == C:
            rows += 1
        else:
            break  # the stream ended mid-row: nanochat would wait for more data
    # documents still buffered count too: nanochat never places one longer than a row
    wait = max([wait] + [nid - d for _, d in buf if d >= warm_docs])
    return {"padding": 0.0, "discarded": discarded / tokens_in, "rows": rows,
            "seconds": time.perf_counter() - t0, "max_wait_pulls": wait}


def simple_crop(docs: list, buffer_size: int, warm_docs: int):
    """The simple streaming rule of issue 16, on lengths: a document longer than a row starts a row
    of its own when one is buffered; otherwise the largest buffered document that fits; when none
    fits, crop the shortest. The buffer is refilled before every placement."""
    it = iter(docs)
    buf: list = []  # sorted (length, id) of documents that fit a row
    longs: list = []  # (length, id) of documents longer than a row, oldest first
    nid = tokens_in = discarded = rows = wait = 0
    stale: list = []  # sampled: share of the buffer waiting longer than buffer_size pulls

    def placed(d):
        nonlocal wait
        if d >= warm_docs:
            wait = max(wait, nid - d)

    def refill():
        nonlocal nid, tokens_in
        while len(buf) + len(longs) < buffer_size:
            try:
                n = len(next(it).ids)
            except StopIteration:
                return
            tokens_in += n
            if n > C:
                longs.append((n, nid))
            else:
                bisect.insort(buf, (n, nid))
            nid += 1

    t0 = time.perf_counter()
    while True:
        refill()
        if longs:
            n, d = longs.pop(0)
            placed(d)
            discarded += n - C
            rows += 1
            continue
        if not buf:
            break
        if rows % 50 == 0 and nid > warm_docs:
            stale.append(sum(nid - d > buffer_size for _, d in buf) / len(buf))
        col = 0
        while col < C:
            refill()
            if not buf:
                break  # the stream ended mid-row
            d, used, cut = _fit_or_crop(buf, C - col)
            col += used
            discarded += cut
            placed(d)
        rows += col == C
    return {"padding": 0.0, "discarded": discarded / tokens_in, "rows": rows, "seconds": time.perf_counter() - t0,
            "max_wait_pulls": wait, "stale_share": float(np.median(stale)) if stale else 0.0}


def measure(name: str, lengths: np.ndarray, n_docs: int) -> dict:
    docs = stream(lengths, n_docs)
    doc_lens = np.array([len(d.ids) for d in docs])
    out = {
        "corpus_documents": int(len(lengths)), "median_tokens": float(np.median(lengths)),
        "p90_tokens": float(np.percentile(lengths, 90)), "p99_tokens": float(np.percentile(lengths, 99)),
        "max_tokens": int(lengths.max()), "docs_longer_than_a_row": float((lengths > C).mean()),
        "docs_between_half_and_a_row": float(((lengths > C / 2) & (lengths <= C)).mean()),
        "stream_documents": n_docs,
        "crop_floor": float(np.maximum(doc_lens - C, 0).sum() / doc_lens.sum()),
        "modes": {},
    }
    out["ramp_cost"] = ramp_cost(docs)
    for buffer_size in (100, 1000, 4000):
        warm = 2 * buffer_size
        runs = {
            "flat": run_packer(FlatPack(FromList(docs), seq_len=T), warm, n_docs),
            "bestfit": run_packer(BestFitPack(FromList(docs), seq_len=T, buffer_size=buffer_size), warm, n_docs),
            "bestfit-crop": run_packer(BestFitPack(FromList(docs), seq_len=T, buffer_size=buffer_size, mode="crop"),
                                       warm, n_docs),
            "nanochat-crop": nanochat_bestfit_crop(docs, buffer_size, warm),
            "simple-crop": simple_crop(docs, buffer_size, warm),
        }
        if buffer_size == 1000:
            # what the delay bound costs: bestfit-crop allowed to wait 16x longer (and a token bound to match)
            out["crop_wait16"] = run_packer(BestFitPack(FromList(docs), seq_len=T, buffer_size=buffer_size, mode="crop",
                                                        max_wait=16 * buffer_size, buffer_tokens=1 << 40), warm, n_docs)
        for mode, r in runs.items():
            out["modes"].setdefault(mode, {})[str(buffer_size)] = r
        print(f"{name} buffer {buffer_size}: " + ", ".join(
            f"{m} pad {100 * r['padding']:.3f}% disc {100 * r['discarded']:.2f}%" for m, r in runs.items())
            + f" (crop floor {100 * out['crop_floor']:.2f}%)", file=sys.stderr)
    return out


def ramp_cost(docs: list, rows: int = 512, buffer_size: int = 1000) -> dict:
    """bestfit's padding in the first rows of a stream, with the ramp and with a full buffer from the start."""
    out = {}
    for name, ramp in (("ramp", True), ("no_ramp", False)):
        packer = BestFitPack(FromList(docs), seq_len=T, buffer_size=buffer_size, ramp=ramp)
        packer.reset(None)
        pads = np.asarray([C - int(next(packer).seg_lens.sum()) for _ in range(rows)])
        out[name] = {f"first_{n}": float(pads[:n].sum() / (n * C)) for n in (64, rows)}
    return out


class TimedCore:
    """Forwards to a packing core and adds up the time spent inside it."""

    def __init__(self, core):
        self.core, self.seconds = core, 0.0

    def insert_many(self, *a):
        t = time.perf_counter()
        self.core.insert_many(*a)
        self.seconds += time.perf_counter() - t

    def insert(self, *a):
        self.core.insert(*a)

    def build_row(self, *a):
        t = time.perf_counter()
        out = self.core.build_row(*a)
        self.seconds += time.perf_counter() - t
        return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=os.path.join(HERE, "packing.json"))
    ap.add_argument("--results", default=os.path.join(HERE, "RESULTS.md"), help="the RESULTS.md to update")
    args = ap.parse_args()
    n_docs = 20_000 if args.quick else 80_000
    stdlib = stdlib_lengths()
    man = man_lengths()
    result = {
        "T": T, "core": pack_core.IMPLEMENTATION,
        "machine": {"python": platform.python_version(), "cpus": os.cpu_count()},
        "distributions": {
            "stdlib": measure("stdlib", stdlib, n_docs),
            "markdown": measure("markdown", markdown_lengths(3000 if args.quick else 20_000), n_docs),
            "man": measure("man", man, n_docs),
            "man-x0.7": measure("man-x0.7", np.maximum((man * 0.7).astype(np.int64), 1), n_docs),
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
    plot(result, os.path.splitext(args.out)[0] + ".png")
    command = "python benchmarks/packing.py" + (" --quick" if args.quick else "")
    write_section(args.results, "packing", markdown(result, command), tokenizer=DEMO)


MODES = ("flat", "bestfit", "bestfit-crop", "nanochat-crop", "simple-crop")
CROP_MARGIN = 0.005  # issue 16: bestfit-crop discards no more than the simple rule + 0.5 point


def markdown(result: dict, command: str) -> str:
    m = result["machine"]
    lines = [f"Command: `{command}` (writes `benchmarks/packing.json`, `benchmarks/packing.png`), "
             f"{time.strftime('%Y-%m-%d')}, {m['cpus']} CPUs (CPython {m['python']}, {result['core']} core), "
             "shared with other jobs.", "",
             f"T = {result['T']} (rows of {result['T'] + 1} tokens). Document lengths are real: every stdlib module "
             "and docstring, `.md`/`.rst` files on the machine (outside /tmp and /work), and the English man pages "
             "(troff source), tokenized with the shipped BPE tokenizer; `man-x0.7` is the man pages with every "
             "length scaled by 0.7, which puts the crop floor near the 32.4% issue 16 measured with cl100k. Each "
             f"stream draws {next(iter(result['distributions'].values()))['stream_documents']:,} documents in a seeded order. Padding is the steady state "
             "(after the first 2 x buffer documents, before the stream ends); \"disc\" is the share of input tokens "
             "discarded; for the cropping packers \"waits\" is the longest a buffered document waited, in documents "
             "pulled (what a restore re-reads; nanochat and the simple rule do not bound it). Packers at their "
             "defaults (bestfit: `buffer_tokens` 16 rows' worth, crop half a row per document, both ramping up). "
             "nanochat-crop is "
             "nanochat's BOS-aligned best-fit-crop re-implemented from its published algorithm; simple-crop is the "
             "rule issue 16 states (a document longer than a row starts a row of its own; else the largest that "
             "fits; when none fits, crop the shortest)."]
    buffers = ["100", "1000", "4000"]
    for name, d in result["distributions"].items():
        lines += ["", f"**{name}** ({d['corpus_documents']:,} documents; median {d['median_tokens']:,.0f} tokens, "
                      f"p90 {d['p90_tokens']:,.0f}, p99 {d['p99_tokens']:,.0f}, max {d['max_tokens']:,}; "
                      f"{100 * d['docs_longer_than_a_row']:.1f}% longer than a row, "
                      f"{100 * d['docs_between_half_and_a_row']:.1f}% between half a row and a row; "
                      f"crop floor {100 * d['crop_floor']:.2f}%)", "",
                  "| mode | buffer 100 | buffer 1000 | buffer 4000 |", "|---|---|---|---|"]
        for mode in MODES:
            cells = []
            for b in buffers:
                r = d["modes"][mode][b]
                if mode.endswith("crop"):
                    cells.append(f"disc {100 * r['discarded']:.2f}%, waits {r['max_wait_pulls']:,}")
                else:
                    cells.append(f"pad {100 * r['padding']:.4f}%, disc {100 * r['discarded']:.2f}%")
            lines.append(f"| {mode} | " + " | ".join(cells) + " |")
    lines += ["", "bestfit's padding in the first rows of a stream (buffer 1000), with the ramp and with a full buffer "
                  "from the first row (the padding cost of the ramp; later rows are the same):", "",
              "| distribution | ramp: first 64 rows | first 512 | full buffer: first 64 | first 512 |",
              "|---|---|---|---|---|"]
    for name, d in result["distributions"].items():
        rc = d["ramp_cost"]
        lines.append(f"| {name} | {100 * rc['ramp']['first_64']:.3f}% | {100 * rc['ramp']['first_512']:.3f}% | "
                     f"{100 * rc['no_ramp']['first_64']:.3f}% | {100 * rc['no_ramp']['first_512']:.3f}% |")
    lines += ["", "Against the targets at buffer 1000:"]
    for name, d in result["distributions"].items():
        mo = d["modes"]
        crop, simple, nano = (mo[k]["1000"]["discarded"] for k in ("bestfit-crop", "simple-crop", "nanochat-crop"))
        met = crop <= simple + CROP_MARGIN and crop < nano
        lines.append(f"- {name}: bestfit pads {100 * mo['bestfit']['1000']['padding']:.4f}%; bestfit-crop discards "
                     f"{100 * crop:.2f}% (floor + {100 * (crop - d['crop_floor']):.2f}), simple rule "
                     f"{100 * simple:.2f}%, nanochat {100 * nano:.2f}%: {100 * (crop - simple):+.2f} points against "
                     f"the simple rule, {'met' if met else '**not met**'} (<= +0.5 and below nanochat).")
    sp = result["speed_short_docs"]
    lines.append(f"- Speed, one short (prose) document per placement: the C core "
                 f"{sp['c']['core_placements_per_s'] / 1e6:.2f}M placements/s, the whole packer node "
                 f"{sp['c']['node_placements_per_s'] / 1e6:.2f}M/s ({100 * sp['c']['core_share_of_node_time']:.0f}% "
                 f"of its time in the core); the pure-Python core {sp['python']['core_placements_per_s'] / 1e6:.2f}M/s."
                 if "c" in sp else "- Speed: the C core was not built.")
    lines += ["", "Reading the crop rows. bestfit-crop bounds how long a document waits (`max_wait` = `buffer_size` "
                  "pulls, `buffer_tokens` tokens), so a restore re-reads a bounded window; nanochat's rule and the simple "
                  "rule do not. Where documents of nearly a row are common and short ones scarce, the simple rule keeps "
                  "a standing reservoir of short documents for the small gaps next to them (share of its buffer waiting "
                  "longer than 1000 pulls, buffer 1000: " + ", ".join(
                      f"{n} {100 * d['modes']['simple-crop']['1000']['stale_share']:.0f}%"
                      for n, d in result["distributions"].items()) + "; its longest wait: " + ", ".join(
                      f"{n} {d['modes']['simple-crop']['1000']['max_wait_pulls']:,}"
                      for n, d in result["distributions"].items()) + " pulls). A packer whose restore re-reads a window "
                  "cannot keep such a reservoir. Letting bestfit-crop wait 16x longer (`max_wait=16 * buffer_size`, no "
                  "token bound) shows the trade at buffer 1000: discards " + ", ".join(
                      f"{n} {100 * d['crop_wait16']['discarded']:.2f}% (waits {d['crop_wait16']['max_wait_pulls']:,})"
                      for n, d in result["distributions"].items()) + "."]
    lines += ["", "![packing](packing.png)"]
    return "\n".join(lines)


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    buffers = ["100", "1000", "4000"]
    dists = result["distributions"]
    fig, axes = plt.subplots(len(dists), 2, figsize=(11, 4 * len(dists)), squeeze=False)
    for row, (name, d) in enumerate(dists.items()):
        for mode, color in (("flat", "tab:gray"), ("bestfit", "tab:blue"), ("bestfit-crop", "tab:green"),
                            ("nanochat-crop", "tab:red"), ("simple-crop", "tab:orange")):
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
