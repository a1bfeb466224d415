"""Many sources at the cost of one: speed, memory and state of ``pretrain`` as the number of named sources grows.

Issue 46: users mix 50-1024 named sources. Targets, each against the same code with 1 source: 256
sources deliver >= 0.8x the batches/s; each worker's RSS and the training process's RSS stay <= 1.5x;
1024 sources run (and resume, tests/test_many_sources.py); the state per step a small fraction of what
it was (54 KB at 64 sources and 201 KB at 256 when the issue was filed, 2.9 KB at 1).

Corpus (held out from every tokenizer here): 20 parquet files of 100-row row groups, built once from
this machine's files with a fixed seed and kept in ``~/.cache/tokenloom-bench/sources-v1`` (or
``$TOKENLOOM_BENCH_CACHE``): files 0-7 English man pages (troff source, /usr/share/man), 8-15 Python
sources (/usr/lib/python3*), 16-19 Debian documentation (/usr/share/doc); 400 documents a file (250 for
the Python ones). Source ``i`` of ``n`` reads file ``i % 20``, all weighted equally (the single source
is passed as a path, as a user with one source writes it). Sources reading the same file warn once per
pair; the runs silence warnings.

Method: ``pretrain`` bestfit, T=2048, B=8, the real cl100k ``tokenizer.json`` (tests/real_tokenizers.py,
the engine chosen automatically), ``--workers`` loader workers (default 2). Every configuration runs in
a fresh interpreter (its RSS is its own; imports untimed), configurations interleaved round by round,
medians reported; one untimed run first warms the tokenizer cache. In each run:

- batches/s in steady state: after a warm-up of ``--warmup`` batches and at least ``--warmup-s``
  seconds from the build (the engine's ramp to full speed and the best-fit buffer's first fill are
  left out), a window of at least ``--batches`` batches and ``--window-s`` seconds is timed (a short
  window at 400 batches/s is a fraction of a second: the workers' ready batches swing it);
- RSS after the timed window: each worker's (the max over workers; current and peak, VmRSS and VmHWM
  from /proc) and the training process's (current and peak);
- the loader's state: bytes of ``pickle.dumps(loader.state_dict())`` ({key: JSON text}, what a trainer
  saves), after the timed window;
- resume: the state taken after the window loaded into a new loader (its workers started, each
  packer's window re-read), the time to its first batch, checked equal to the batch the run gave next;
- the state a worker sends with every batch (StatefulDataLoader ships it with each one): not
  observable from outside a worker, so measured on the same sources in the same process, after the
  above, on a ``num_workers=0`` loader (one shard's graph, as a worker holds; with 2 workers each
  worker's graph has the same sources and keys): the median over ``STEP_STATE_BATCHES`` batches of the
  pickled patch of ``loader.dataset.state_dict()`` against the one before (pipes/state_delta.py, what
  a worker sends), or of the whole state for code before the patches (``step_whole_bytes`` in the
  JSON gives the whole state with this code too).

Pass/fail per row against the 1-source row of the same code and worker count: batches/s >= 0.8x
(checked at 256 sources and beyond), worker RSS and training-process RSS (end of the window, as the
issue measured them) <= 1.5x; the peaks are reported beside them.

    python benchmarks/sources.py                       # 1,16,64,256,1024 sources, 3 rounds
    python benchmarks/sources.py --quick               # 1 round, shorter windows
    python benchmarks/sources.py --sources 1,256 --workers 0,2
    python benchmarks/sources.py --before ../old/.venv/bin/python   # and another checkout's code, interleaved
    python benchmarks/sources.py --snapshot-every 1,1000   # and the same code taking states only around every 1000th step
    python benchmarks/sources.py --read-budget default,256M   # and the same code holding 4x the decoded text
Prints JSON; writes benchmarks/sources.json, benchmarks/sources.png and the ``## sources`` section of
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
import shutil
import statistics
import subprocess
import sys
import tempfile
from typing import Any, Dict, Iterator, List, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))
from results_md import real, write_section  # noqa: E402
from tokenloom.recipes.settings import byte_size  # noqa: E402

SOURCES = (1, 16, 64, 256, 1024)
FILES = 20
#: The issue's targets, each a ratio to the 1-source run of the same code and worker count.
TARGETS = {"bps": 0.8, "worker_rss": 1.5, "main_rss": 1.5}
#: Sources from which the throughput target applies (the issue states it at 256).
BPS_FROM = 256
STEP_STATE_BATCHES = 9
#: The configuration "one source over all 20 files" (its ``sources`` field): the same text the runs of
#: 20 or more sources read. The issue's baseline (one source, file 0: man pages, tokenized faster than
#: the Python and Debian files) reads other text, so its ratio mixes the cost of the text with the cost of
#: the sources; this one isolates the sources'. Both ratios are reported.
SAME_TEXT = -1
#: Bump when the corpus recipe changes: the cache folder is keyed by it.
CORPUS_VERSION = "v1"

CHILD = r"""
import json, os, pickle, sys, time, warnings
warnings.filterwarnings("ignore")  # sources reading the same file warn once per pair
import torch, pyarrow.parquet, numpy  # noqa: F401 - imports are not timed
import tokenloom.recipes, tokenloom.pipes  # noqa: F401
for m in ("fastokens", "tiktoken", "tokenizers"):
    try:
        __import__(m)
    except ImportError:
        pass
from tokenloom.recipes import pretrain

folder, tok, n, workers, warmup, warmup_s, timed, timed_s, step_batches, SAME_TEXT, snapshot = sys.argv[1:12]
budget = sys.argv[12] if len(sys.argv) > 12 else "default"  # read_budget: bytes, "none", or "default" (not passed)
SAME_TEXT, snapshot = int(SAME_TEXT), int(snapshot)
n, workers, warmup, warmup_s = int(n), int(workers), int(warmup), float(warmup_s)
timed, timed_s, step_batches = int(timed), float(timed_s), int(step_batches)
files = sorted(os.path.join(folder, f) for f in os.listdir(folder) if f.endswith(".parquet"))
names = {f"s{i:04d}": files[i % len(files)] for i in range(n)}


def build(num_workers):
    # a worker setting; 1 (torchdata's default) is not passed, so that every code runs the same
    kw = {"snapshot_every_n_steps": snapshot} if num_workers and snapshot != 1 else {}
    if budget != "default":
        kw["read_budget"] = None if budget == "none" else int(budget)
    if n == 1:  # one source, as a user with one writes it
        return pretrain(files[0], tokenizer=tok, seq_len=2048, batch_size=8, num_workers=num_workers, **kw)
    if n == SAME_TEXT:  # one source over all the files: the text the many-source runs read
        return pretrain(files, tokenizer=tok, seq_len=2048, batch_size=8, num_workers=num_workers, **kw)
    return pretrain(names, tokenizer=tok, seq_len=2048, batch_size=8, num_workers=num_workers,
                    weights={k: 1.0 for k in names}, **kw)


def status(pid):
    # VmRSS (now) and VmHWM (peak), bytes
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                out[line[:5]] = int(line.split()[1]) * 1024
    return out["VmRSS"], out["VmHWM"]


def children(pid):
    # every descendant (the loader's workers, and any process they start)
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            for t in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{t}/children") as f:
                    kids = [int(c) for c in f.read().split()]
                out += kids
                todo += kids
        except OSError:
            continue
    return out


t0 = time.perf_counter()
loader = build(workers)
it = iter(loader)
next(it)
first = time.perf_counter() - t0
done = 0
while done < warmup or time.perf_counter() - t0 < warmup_s:
    next(it)
    done += 1
t1 = time.perf_counter()
count = 0
while count < timed or time.perf_counter() - t1 < timed_s:
    next(it)
    count += 1
bps = count / (time.perf_counter() - t1)
kids = []
for pid in children(os.getpid()):
    try:
        kids.append(status(pid))
    except OSError:
        pass
main_rss, main_peak = status(os.getpid())
saved = loader.state_dict()
state = len(pickle.dumps(saved))
want = next(it)
del it, loader
# resume: a new loader (its workers too) from the state, to its first batch, which must be the one that followed
t2 = time.perf_counter()
again = build(workers)
again.load_state_dict(saved)
got = next(iter(again))
resume_s = time.perf_counter() - t2
resume_exact = all(torch.equal(want[k], got[k]) for k in want if isinstance(want[k], torch.Tensor))
del again
one = build(0)
it0 = iter(one)
try:  # what a worker sends with a batch: a patch of its state before (pipes/state_delta.py), or all of it
    from tokenloom.pipes.state_delta import diff
except ImportError:
    diff = None
prev = one.dataset.state_dict()
sent, whole = [], []
for _ in range(step_batches):
    next(it0)
    now = one.dataset.state_dict()
    whole.append(len(pickle.dumps(now)))
    sent.append(len(pickle.dumps(diff(prev, now))) if diff is not None else whole[-1])
    prev = now
step_state, step_whole = sorted(sent)[len(sent) // 2], sorted(whole)[len(whole) // 2]
print(json.dumps({"first_s": first, "warmup_batches": done, "bps": bps, "timed_batches": count, "workers_seen": len(kids),
                  "worker_rss": max((r for r, _ in kids), default=0), "worker_peak": max((p for _, p in kids), default=0),
                  "main_rss": main_rss, "main_peak": main_peak, "state_bytes": state, "step_state_bytes": step_state,
                  "step_whole_bytes": step_whole, "resume_s": resume_s, "resume_exact": resume_exact}))
"""


# --- the corpus ----------------------------------------------------------------------------------

def _man(rng: random.Random) -> Iterator[str]:
    paths = sorted(glob.glob("/usr/share/man/man*/*.gz"))
    rng.shuffle(paths)
    for p in paths:
        try:
            yield gzip.open(p).read().decode("utf-8")
        except (OSError, UnicodeDecodeError, EOFError):
            continue


def _python(rng: random.Random) -> Iterator[str]:
    paths = sorted(glob.glob("/usr/lib/python3*/**/*.py", recursive=True))
    rng.shuffle(paths)
    for p in paths:
        try:
            text = open(p, encoding="utf-8").read()
        except (OSError, UnicodeDecodeError):
            continue
        if text.strip() and len(text) < 200_000:
            yield text


def _docs(rng: random.Random) -> Iterator[str]:
    paths = sorted(glob.glob("/usr/share/doc/**/*", recursive=True))
    rng.shuffle(paths)
    for p in paths:
        if os.path.isdir(p):
            continue
        try:
            raw = gzip.open(p).read() if p.endswith(".gz") else open(p, "rb").read()
            text = raw.decode("utf-8")
        except (OSError, UnicodeDecodeError, EOFError):
            continue
        if text.strip() and len(text) < 200_000:
            yield text


def cache_root() -> str:
    return os.environ.get("TOKENLOOM_BENCH_CACHE") or os.path.join(os.path.expanduser("~"), ".cache",
                                                                    "tokenloom-bench")


def corpus() -> Tuple[str, Dict[str, Any]]:
    """The 20 held-out parquet files (built on first use, then reused): (folder, manifest).

    One seeded generator per kind, shared by the files of that kind (file 1 continues where file 0
    stopped), so no document is in two files. Built in a temporary folder beside the cache and
    renamed into place, so an interrupted build leaves nothing half-written to reuse."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder = os.path.join(cache_root(), f"sources-{CORPUS_VERSION}")
    manifest = os.path.join(folder, "manifest.json")
    if os.path.exists(manifest):
        return folder, json.load(open(manifest))
    os.makedirs(cache_root(), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix="sources-", dir=cache_root())
    rng = random.Random(46)
    man, py, doc = _man(rng), _python(rng), _docs(rng)
    kinds = [("man", man)] * 8 + [("python", py)] * 8 + [("doc", doc)] * 4
    files = []
    for i, (kind, gen) in enumerate(kinds):
        want = 250 if kind == "python" else 400
        texts = [t for _, t in zip(range(want), gen)]
        if len(texts) < 100:
            shutil.rmtree(tmp, ignore_errors=True)
            raise SystemExit(f"only {len(texts)} {kind} documents for file {i}: this benchmark needs /usr/share/man, "
                             "/usr/lib/python3* and /usr/share/doc")
        pq.write_table(pa.table({"text": texts}), os.path.join(tmp, f"f{i:02d}.parquet"), row_group_size=100)
        files.append({"file": f"f{i:02d}.parquet", "kind": kind, "documents": len(texts),
                      "chars": sum(map(len, texts))})
    info = {"version": CORPUS_VERSION, "files": files}
    with open(os.path.join(tmp, "manifest.json"), "w") as f:
        json.dump(info, f, indent=1)
    try:
        os.replace(tmp, folder)
    except OSError:  # built meanwhile by another run: use that one
        shutil.rmtree(tmp, ignore_errors=True)
    return folder, json.load(open(manifest))


# --- runs ----------------------------------------------------------------------------------------

def run_child(python: str, folder: str, tok: str, n: int, workers: int, warmup: int, warmup_s: float,
              timed: int, timed_s: float, env: Dict[str, str], snapshot: int = 1,
              budget: str = "default") -> Dict[str, Any]:
    """One configuration in a fresh interpreter of ``python``: the CHILD script's figures."""
    args = [python, "-c", CHILD, folder, tok, str(n), str(workers), str(warmup), str(warmup_s), str(timed),
            str(timed_s), str(STEP_STATE_BATCHES), str(SAME_TEXT), str(snapshot)] + (
                [budget] if budget != "default" else [])
    out = subprocess.run(args, capture_output=True, text=True, env=env, timeout=900)
    if out.returncode:
        raise SystemExit(f"child failed ({python}, {n} sources, {workers} workers):\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


FIELDS = ("bps", "first_s", "worker_rss", "worker_peak", "main_rss", "main_peak", "state_bytes", "step_state_bytes",
          "resume_s")


def summarize(runs: Dict[str, List[Dict[str, Any]]], configs: List[Tuple[str, int, int]]) -> List[Dict[str, Any]]:
    """Medians per configuration, ratios to the 1-source row of the same code and workers, pass/fail."""
    # resume_s: absent from runs of code before it was measured
    med = {key: {f: statistics.median(r.get(f, float("nan")) for r in runs[key]) for f in FIELDS} for key in runs}
    rows = []
    for label, workers, n in configs:
        key = f"{label}|{workers}|{n}"
        base = med.get(f"{label}|{workers}|1")
        row: Dict[str, Any] = {"code": label, "workers": workers, "sources": n, **med[key], "rounds": len(runs[key]),
                               "resume_exact": all(r.get("resume_exact", True) for r in runs[key])}
        same = med.get(f"{label}|{workers}|{SAME_TEXT}")
        if same is not None and n > 1:
            row["bps_same_text_ratio"] = row["bps"] / same["bps"]
        if base is not None and n != SAME_TEXT:
            row["bps_ratio"] = row["bps"] / base["bps"]
            row["main_rss_ratio"] = row["main_rss"] / base["main_rss"]
            row["main_peak_ratio"] = row["main_peak"] / base["main_peak"]
            row["state_ratio"] = row["state_bytes"] / base["state_bytes"]
            row["step_state_ratio"] = row["step_state_bytes"] / base["step_state_bytes"]
            checks = {"main_rss": row["main_rss_ratio"] <= TARGETS["main_rss"]}
            if workers:
                row["worker_rss_ratio"] = row["worker_rss"] / base["worker_rss"]
                row["worker_peak_ratio"] = row["worker_peak"] / base["worker_peak"]
                checks["worker_rss"] = row["worker_rss_ratio"] <= TARGETS["worker_rss"]
            if n >= BPS_FROM:
                checks["bps"] = row["bps_ratio"] >= TARGETS["bps"]
            checks["resume"] = row["resume_exact"]
            row["checks"] = checks
            row["pass"] = all(checks.values())
        rows.append(row)
    # this code against the code before (--before), configuration by configuration
    for row in rows:
        other = med.get(f"before|{row['workers']}|{row['sources']}")
        if row["code"] == "this" and other is not None:
            row["vs_before"] = {f: row[f] / other[f] for f in FIELDS if other[f] and other[f] == other[f]}
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="1 round, 40 warm-up batches (4 s), 150 timed (3 s)")
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--sources", default=",".join(map(str, SOURCES)), help="comma-separated source counts")
    ap.add_argument("--workers", default="2", help="comma-separated num_workers values (e.g. 0,2)")
    ap.add_argument("--warmup", type=int, default=None, help="warm-up batches before the timed window")
    ap.add_argument("--warmup-s", type=float, default=None, help="and at least this many seconds from the build")
    ap.add_argument("--batches", type=int, default=None, help="batches in the timed window, at least")
    ap.add_argument("--window-s", type=float, default=None, help="and at least this many seconds")
    ap.add_argument("--tokenizer", default="cl100k", help="cl100k or o200k (tests/real_tokenizers.py)")
    ap.add_argument("--snapshot-every", default="1",
                    help="comma-separated snapshot_every_n_steps values; each but 1 is a code of its own "
                         "('this, state every N'), its ratios against its own 1-source run")
    ap.add_argument("--read-budget", default="default",
                    help="comma-separated read_budget values (64M, 256M, none; default: the recipe's own); each "
                         "but 'default' is a code of its own ('this, read_budget B'), its ratios against its own "
                         "1-source run")
    ap.add_argument("--before", default=None, help="the python of another checkout's venv: its runs interleave "
                                                   "with this code's, as 'before'")
    args = ap.parse_args()
    rounds = args.rounds or (1 if args.quick else 3)
    warmup = args.warmup if args.warmup is not None else (40 if args.quick else 150)
    warmup_s = args.warmup_s if args.warmup_s is not None else (4.0 if args.quick else 10.0)
    timed = args.batches or (150 if args.quick else 500)
    timed_s = args.window_s if args.window_s is not None else (3.0 if args.quick else 8.0)
    # 1 source: the baseline of every ratio; the same text in one source: the baseline of the second
    counts = sorted({int(x) for x in args.sources.split(",")} | {1, SAME_TEXT})
    workers = [int(x) for x in args.workers.split(",")]
    from tests.real_tokenizers import real_tokenizer

    tok = real_tokenizer(args.tokenizer)
    folder, manifest = corpus()
    env = dict(os.environ, TOKENLOOM_CACHE=os.path.join(cache_root(), "tokenizer-cache"), PYTHONWARNINGS="ignore")
    env.pop("TOKENLOOM_ENGINE", None)
    snapshots = [int(x) for x in args.snapshot_every.split(",")]
    budgets = [x.strip() for x in args.read_budget.split(",")]
    budget_bytes = {b: b if b == "default" else ("none" if byte_size(b) is None else str(byte_size(b)))
                    for b in budgets}
    codes = [("this", sys.executable)] + ([("before", args.before)] if args.before else [])
    # each snapshot interval but 1 and each read_budget but the default as a code of its own: its rows' ratios
    # against its own 1-source run
    variants = [(label + ("" if k == 1 else f", state every {k}") + ("" if b == "default" else f", read_budget {b}"),
                 python, k, budget_bytes[b]) for label, python in codes for k in snapshots for b in budgets]
    configs = [(label, w, n) for label, _, _, _ in variants for w in workers for n in counts]
    python_of = {label: python for label, python, _, _ in variants}
    snapshot_of = {label: k for label, _, k, _ in variants}
    budget_of = {label: b for label, _, _, b in variants}
    for label, python in codes:  # warm: the tokenizer cache holds the file's verdicts
        run_child(python, folder, tok, 1, 0, 1, 0.0, 1, 0.0, env)
    runs: Dict[str, List[Dict[str, Any]]] = {f"{label}|{w}|{n}": [] for label, w, n in configs}
    for r in range(rounds):
        for label, w, n in configs:
            res = run_child(python_of[label], folder, tok, n, w, warmup, warmup_s, timed, timed_s, env,
                            snapshot_of[label], budget_of[label])
            runs[f"{label}|{w}|{n}"].append(res)
            print(f"round {r}: {label}, {w} workers, {n} sources: {res['bps']:.1f} batches/s, worker RSS "
                  f"{res['worker_rss'] / 2**30:.2f} GiB, main {res['main_rss'] / 2**30:.2f} GiB, state "
                  f"{res['state_bytes']} B, per step {res['step_state_bytes']} B, resume {res.get('resume_s', 0):.2f} s",
                  file=sys.stderr, flush=True)
    rows = summarize(runs, configs)
    result = {"tokenizer": args.tokenizer, "rounds": rounds, "warmup": warmup, "warmup_s": warmup_s, "timed": timed,
              "timed_s": timed_s, "targets": TARGETS, "bps_target_from": BPS_FROM, "corpus": manifest, "rows": rows, "runs": runs,
              "codes": python_of, "snapshots": snapshot_of, "read_budgets": budget_of,
              "machine": f"{platform.machine()}, {os.cpu_count()} cores"}
    print(json.dumps(result, indent=1))
    with open(os.path.join(HERE, "sources.json"), "w") as f:
        json.dump(result, f, indent=1)
    plot(result)
    write_section(os.path.join(HERE, "RESULTS.md"), "sources", markdown(result, args), tokenizer=real(args.tokenizer))


def markdown(result: Dict[str, Any], args: argparse.Namespace) -> str:
    gib = 2 ** 30

    def ratio(row: Dict[str, Any], key: str, fmt: str = "{:.2f}x") -> str:
        return fmt.format(row[key]) if key in row else "-"

    lines = []
    for row in result["rows"]:
        verdict = "-" if "pass" not in row else ("pass" if row["pass"] else
                                                  "FAIL (" + ", ".join(k for k, ok in row["checks"].items() if not ok) + ")")
        workers = (f"{row['worker_rss'] / gib:.2f} ({ratio(row, 'worker_rss_ratio')}) | "
                   f"{row['worker_peak'] / gib:.2f} ({ratio(row, 'worker_peak_ratio')})") if row["workers"] else "- | -"
        shown = "1 (all 20 files)" if row["sources"] == SAME_TEXT else row["sources"]
        lines.append(
            f"| {row['code']} | {row['workers']} | {shown} | {row['bps']:.1f} ({ratio(row, 'bps_ratio')}; "
            f"{ratio(row, 'bps_same_text_ratio')}) | "
            f"{workers} | {row['main_rss'] / gib:.2f} ({ratio(row, 'main_rss_ratio')}) | "
            f"{row['main_peak'] / gib:.2f} ({ratio(row, 'main_peak_ratio')}) | "
            f"{row['state_bytes'] / 1024:.1f} | {row['step_state_bytes'] / 1024:.1f} | {row['first_s']:.1f} | "
            f"{row['resume_s']:.1f}{'' if row['resume_exact'] else ' (NOT EXACT)'} | {verdict} |")
    against = [f"| {row['workers']} | {row['sources']} | " + " | ".join(
        f"{row['vs_before'][f]:.2f}x" if f in row["vs_before"] else "-"
        for f in ("bps", "worker_rss", "main_rss", "state_bytes", "step_state_bytes")) + " |"
        for row in result["rows"] if "vs_before" in row]
    if against:
        lines += ["", "This code against the code before, same configuration (medians' ratios):", "",
                  "| workers | sources | batches/s | worker RSS | main RSS | state | per step |",
                  "|---|---|---|---|---|---|---|", *against]
    cmd = "python benchmarks/sources.py" + (" --quick" if args.quick else "") + (
        f" --sources {args.sources}" if args.sources != ",".join(map(str, SOURCES)) else "") + (
        f" --workers {args.workers}" if args.workers != "2" else "") + (
        f" --snapshot-every {args.snapshot_every}" if args.snapshot_every != "1" else "") + (
        f" --read-budget {args.read_budget}" if args.read_budget != "default" else "") + (
        " --before PYTHON" if args.before else "")
    codes = "; ".join(f"{label}: `{python}`" for label, python in result["codes"].items())
    sparse = sorted({k for k in result.get("snapshots", {}).values() if k != 1})
    if sparse:
        codes += (". `state every N`: the same code with `snapshot_every_n_steps=N`, so that a worker takes and "
                  "sends its state only with the batches torchdata may need for a snapshot (workers x (prefetch_factor + 1) "
                  "+ 1 of every N batches, those before each N-th step: 131 with 2 workers of 64 ready batches each) "
                  "instead of with every batch; a state_dict() at the N-th steps is exact and resumes elastically, "
                  "one between them replays up to N-1 batches on the same topology")
    if any(b != "default" for b in result.get("read_budgets", {}).values()):
        codes += (". `read_budget B`: the same code with `read_budget=B` (bytes of decoded text a worker's readers "
                  "hold, shared by the sources; default 64 MiB): a row group larger than B / sources is read in "
                  "windows of that many bytes, each window a new decode of its row group's pages up to it (and of "
                  "the whole group where one dictionary page holds it, as here); `none` reads whole row groups")
    return f"""
`{cmd}` ({result['machine']}; {result['rounds']} round(s), configurations interleaved, each run a fresh
interpreter with its imports untimed; medians). `pretrain` bestfit, T=2048, B=8, the real {result['tokenizer']}
tokenizer.json, equal weights; source i reads held-out file i % 20 (man pages, Python sources, Debian docs; 100-row
row groups). Batches/s over >= {result['timed']} batches and >= {result['timed_s']:g} s after >= {result['warmup']} batches
and >= {result['warmup_s']:g} s of warm-up. RSS in GiB after the timed window (worker: the max over workers; peak: VmHWM). State: KiB of
`pickle.dumps(loader.state_dict())`; per step: KiB a worker ships with every batch, measured on a `num_workers=0`
loader on the same sources (one shard's graph): the pickled patch of its state against the one before
(pipes/state_delta.py), or the whole state for code before the patches (median of {STEP_STATE_BATCHES} batches).
Resume: a new loader built from the state taken after the window, to its first batch (workers started, the
restore's re-reading included), checked equal to the batch the run gave next.
Ratios against 1 source of the same code and workers (file 0); batches/s also against one source over all 20
files (the second ratio: the same text as 20 or more sources, so only the sources' cost). Targets (issue 46): batches/s >= {TARGETS['bps']}x from
{BPS_FROM} sources, worker and training-process RSS (end) <= {TARGETS['worker_rss']}x. Code: {codes}.

| code | workers | sources | batches/s | worker RSS | worker peak | main RSS | main peak | state KiB | per step KiB | build + first (s) | resume (s) | targets |
|---|---|---|---|---|---|---|---|---|---|---|---|---|
{chr(10).join(lines)}

![sources](sources.png)
"""


def plot(result: Dict[str, Any]) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.4))
    series: Dict[Tuple[str, int], List[Dict[str, Any]]] = {}
    for row in result["rows"]:
        if row["sources"] != SAME_TEXT:
            series.setdefault((row["code"], row["workers"]), []).append(row)
    for (code, workers), rows in series.items():
        xs = [r["sources"] for r in rows]
        label = f"{code}, {workers} workers"
        axes[0].plot(xs, [r["bps"] for r in rows], marker="o", label=label)
        axes[1].plot(xs, [(r["worker_rss"] if workers else r["main_rss"]) / 2**30 for r in rows], marker="o",
                     label=label + (" (worker)" if workers else " (main)"))
        axes[2].plot(xs, [r["step_state_bytes"] / 1024 for r in rows], marker="o", label=label + " per step")
        axes[2].plot(xs, [r["state_bytes"] / 1024 for r in rows], marker="x", linestyle="--",
                     label=label + " state_dict()")
        base = next((r for r in rows if r["sources"] == 1), None)
        if base is not None:
            axes[0].axhline(base["bps"] * TARGETS["bps"], color="grey", linestyle=":", linewidth=1)
            ref = base["worker_rss"] if workers else base["main_rss"]
            axes[1].axhline(ref * TARGETS["worker_rss"] / 2**30, color="grey", linestyle=":", linewidth=1)
    for ax, title in zip(axes, ("batches/s (dotted: 0.8x 1 source)", "RSS GiB (dotted: 1.5x 1 source)",
                                "state KiB")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sources")
        ax.set_title(title, fontsize=9)
        ax.legend(fontsize=6)
    axes[2].set_yscale("log")
    fig.suptitle(f"many sources: pretrain bestfit T=2048 B=8, {result['tokenizer']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(os.path.join(HERE, "sources.png"), dpi=110)


if __name__ == "__main__":
    main()
