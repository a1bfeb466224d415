"""bestfit-crop's waiting bound as a choice: tokens discarded against the window a resume re-reads.

``bestfit-crop`` crops a document that fits no gap; it loses less the longer short documents
may wait in the buffer for the gap they fit, but a resume re-reads (and re-tokenizes) every
document pulled since the oldest one still waiting. Two settings bound that wait:
``max_wait`` (pulls; default ``buffer_size``) and ``buffer_tokens`` (tokens; default half a row
per document of ``buffer_size``). This sweeps them together on a stream of man-page lengths
(every English man page on this machine, tokenized with the shipped tokenizer; a log-normal
stand-in where there are none), T=2048, buffers 1000 and 4000, and reports per setting: tokens discarded,
the crop floor (tokens beyond one row of documents longer than a row: no rule keeps those), the
largest window a resume would re-read (documents and tokens, from the packer's state taken every
200 rows) and that window's re-read time at the tokenize rate measured here (the shipped
tokenizer on the same documents, one process). The first batch does not depend on the bound
(the buffer ramps up: first_batch.py).

    python benchmarks/crop_wait.py            # ~2 minutes on 2 cores
    python benchmarks/crop_wait.py --quick
Prints JSON; writes benchmarks/crop_wait.json and the ``## crop wait`` section of RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from packing import C, T, man_lengths, stream  # noqa: E402
from results_md import DEMO, STAND_IN, write_section  # noqa: E402
from tokenloom.pipes import BestFitPack  # noqa: E402
from tokenloom.pipes.sources.memory import FromList  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
BUFFERS = (1000, 4000)
#: (max_wait, buffer_tokens) in multiples of the defaults (buffer_size pulls, half a row per document)
FACTORS = (1, 4, 16)


def tokenize_rate(tokenizer: str, n_docs: int = 400) -> float:
    """Tokens per second of the shipped tokenizer on man pages (or synthetic text), one process."""
    import glob
    import gzip

    from tokenloom.pipes import load_encoder

    texts = []
    for path in sorted(glob.glob("/usr/share/man/man1/*.gz"))[:n_docs]:
        try:
            texts.append(gzip.open(path).read().decode("utf-8"))
        except (OSError, UnicodeDecodeError):
            continue
    if not texts:
        texts = ["word " * 1500] * 100
    enc = load_encoder(tokenizer)
    enc.encode_batch(texts[:8])
    t0 = time.perf_counter()
    n = sum(len(a) for a in enc.encode_batch(texts))
    return n / (time.perf_counter() - t0)


def run(docs: list, buffer: int, factor: int) -> dict:
    lengths = np.array([len(d.ids) for d in docs], dtype=np.int64)
    prefix = np.concatenate([[0], np.cumsum(lengths)])
    default_tokens = BestFitPack.resolve_buffer_tokens(None, T, "crop", buffer)
    packer = BestFitPack(FromList(docs), seq_len=T, buffer_size=buffer, mode="crop",
                         max_wait=factor * buffer, buffer_tokens=factor * default_tokens)
    packer.reset(None)
    window_docs = window_tokens = 0
    for k, _ in enumerate(packer):
        if k % 200 == 199:
            st = packer.get_state()
            base, pulled = int(st[BestFitPack.BASE]), int(st[BestFitPack.PULLED])
            window_docs = max(window_docs, pulled - base)
            window_tokens = max(window_tokens, int(prefix[min(pulled, len(docs))] - prefix[base]))
    stats = packer.stats()
    return {"buffer_size": buffer, "max_wait": factor * buffer, "buffer_tokens": factor * default_tokens,
            "discarded": stats["discarded"] / stats["tokens_in"],
            "window_docs": window_docs, "window_tokens": window_tokens}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=os.path.join(HERE, "crop_wait.json"))
    ap.add_argument("--results", default=os.path.join(HERE, "RESULTS.md"))
    ap.add_argument("--tokenizer", default=None, help="tokenizer.json for the lengths (default: held_out.py's "
                    "100k-id BPE if it was trained, else the shipped one)")
    args = ap.parse_args()
    if args.tokenizer is None:
        from held_out import tokenizer_path

        from tokenloom.sample_data import default_tokenizer_path
        args.tokenizer = tokenizer_path() if os.path.exists(tokenizer_path()) else default_tokenizer_path()
    lengths = man_lengths(args.tokenizer)
    docs = stream(lengths, 20_000 if args.quick else 60_000)
    doc_lens = np.array([len(d.ids) for d in docs])
    rate = tokenize_rate(args.tokenizer, 100 if args.quick else 400)
    from packing import simple_crop

    result = {"T": T, "stream_documents": len(docs), "tokenizer": os.path.basename(args.tokenizer),
              "median_tokens": float(np.median(lengths)),
              "crop_floor": float(np.maximum(doc_lens - C, 0).sum() / doc_lens.sum()),
              "tokenize_tokens_per_s": rate, "runs": [],
              "simple_rule_discarded": simple_crop(docs, 1000, 2000)["discarded"]}
    for buffer in BUFFERS:
        for factor in FACTORS:
            r = run(docs, buffer, factor)
            r["window_reread_s"] = r["window_tokens"] / rate
            result["runs"].append(r)
            print(f"buffer {buffer} x{factor}: discarded {100 * r['discarded']:.2f}%, window {r['window_docs']:,} "
                  f"docs / {r['window_tokens'] / 1e6:.2f}M tokens (~{r['window_reread_s']:.2f} s to re-read)",
                  file=sys.stderr)
    print(json.dumps(result, indent=2))
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    command = "python benchmarks/crop_wait.py" + (" --quick" if args.quick else "")
    from held_out import tokenizer_path

    from tokenloom.sample_data import default_tokenizer_path
    named = {tokenizer_path(): STAND_IN, default_tokenizer_path(): DEMO}
    write_section(args.results, "crop wait", markdown(result, command),
                  tokenizer=named.get(args.tokenizer, f"`{args.tokenizer}`"))


def markdown(res: dict, command: str) -> str:
    lines = [f"Command: `{command}` (writes `benchmarks/crop_wait.json`). `bestfit-crop`, T={res['T']}, "
             f"{res['stream_documents']:,} documents drawn from every English man page here, lengths with "
             f"`{res['tokenizer']}` (median {res['median_tokens']:,.0f} tokens); crop floor "
             f"{100 * res['crop_floor']:.2f}% (tokens beyond one row of documents longer than a row: no rule keeps "
             f"them). The window is the most a resume re-reads (largest over the stream, per worker); its time at "
             f"{res['tokenize_tokens_per_s'] / 1e6:.2f}M tokens/s (this tokenizer here, one process). For "
             f"reference, a rule that never forces a document out (packing.py's simple rule, buffer 1000, no bound "
             f"on the window) discards {100 * res['simple_rule_discarded']:.2f}%.", "",
             "| buffer_size | max_wait | buffer_tokens | discarded | above the floor | resume window (docs / M tokens) "
             "| re-read |",
             "|---|---|---|---|---|---|---|"]
    for r in res["runs"]:
        lines.append(f"| {r['buffer_size']:,} | {r['max_wait']:,} | {r['buffer_tokens']:,} | "
                     f"{100 * r['discarded']:.2f}% | {100 * (r['discarded'] - res['crop_floor']):+.2f} | "
                     f"{r['window_docs']:,} / {r['window_tokens'] / 1e6:.2f} | {r['window_reread_s']:.2f} s |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
