"""Loader throughput against the tokenizer's own, the cost of checkpoints, state size, resume latency, memory.

Everything runs in one invocation, each measurement in a fresh Python process
(no run inherits another's threads, memory or tokenizer state: a Hugging Face
tokenizer used before a fork runs single-threaded in the child), and the
throughput runs are interleaved over ``--repeats`` rounds. This machine's speed
drifts by up to 1.7x over minutes, so each loader run is divided by the ceiling
measured in its own round and the median of those ratios is reported. Corpus:
the embedded stdlib corpus (`tokenloom.sample_data`: 8,896 documents, 4.17 M
tokens with the shipped tokenizer). Loaders are endless streams timed over a
window of 1,000 batches of 8 x 2049 tokens (~4 epochs' worth) from the first
batch on, so worker start-up, the first fill of the best-fit buffers and the
ragged end of a finite epoch are left out. A window starts before any worker
could run ahead and is long, because a worker keeps up to 64 batches ready:
shorter windows that start later (100 + 200 batches) moved the ratio by +-20%
with where they fell. Two rates: tokens placed in rows per second
(``stats()["tokens_out"]``, what the loop receives) and document tokens
tokenized per second (``tokens_in``, the ceiling's work); the target figure is
the lower of the two (they differ by the best-fit buffer's swing, ~0.5M tokens).

- ``ceiling``: the corpus's texts already in memory, through the tokenizer
  alone, on all cores, nothing else, warm: the best of the configurations of
  `ceiling.py` (each engine that runs this tokenizer with the loader's ids,
  `tokenizers` and tiktoken, on its own threads with batches of 256 and as one
  single-threaded process per core). The loader's engine per core brackets every
  loader run (this machine's speed drifts by up to 1.7x within minutes); the
  others are measured once per round.
- ``pretrain``: ``pretrain(...)`` (bestfit, T=2048, B=8, buffer 1000), 0/1/2
  workers; and 2 workers with what the defaults replaced: 8 ready batches per
  worker (the default is ~1M tokens, 64 batches here), and the tokenizer's
  thread pool in each worker (``TOKENIZERS_PARALLELISM=true`` set in a
  ``worker_init_fn``; workers turn it off by default).
- ``naive``: a plain ``torch.utils.data.DataLoader`` over a generator that reads
  the files, tokenizes (batched, per row group) and concatenates into (B, T+1)
  blocks; 0/2 workers.
- checkpointability: the pretrain loader as built (a snapshot at every step,
  kept flat until asked for; batches through the shared-memory ring) vs the
  same loader taking none (``snapshot_every_n_steps`` beyond the run), 2
  workers, in 9 back-to-back pairs of 600-batch runs (one pair swings by
  +-10% here): the median of the pairs' ratios of wall time and of CPU time
  (main + workers), and the training process's CPU per batch; plus the snapshot work itself, measured in one
  process. (Until 2026-11-23 the pair was the bare ``NodeDataset`` under
  ``StatefulDataLoader`` vs a plain ``DataLoader``: neither had the ring, and
  the stateful one rebuilt every worker's state at every step.)
- the loader state per worker (``torch.save`` bytes), resume latency (build +
  ``load_state_dict`` + first batch) vs a cold start (build + first batch), and
  worker memory (RSS from /proc) over 10,000 batches. For the RSS run the batches
  are small (T=1023, B=2: 2,048 tokens, so 10,000 batches are ~5 epochs of the
  corpus) to fit in the time budget.
- diagnostics: the cost of moving one batch from a worker to the main process
  (the batch dict as tensors, which travel through shared memory with one file
  descriptor per tensor, vs the same arrays as numpy, pickled through the pipe),
  and tiny batches (T=63, B=2) with 0 and 2 workers, snapshots every step or
  never.

Targets (issue 6): pretrain >= 0.9x the ceiling with as many workers as cores;
checkpoint cost <= 3%; state <= 16 KB per worker at buffer 1000; resume <= 1.5x
a cold start; flat worker memory (here: <= 5% growth from 20% of the run to the end).

    python benchmarks/throughput.py              # ~6 minutes on 2 cores
    python benchmarks/throughput.py --quick      # ~4 minutes: 2 rounds, 300-batch windows, 2,000 RSS batches
    python benchmarks/throughput.py --profile    # also: cProfile over 150 batches with 0 workers
Prints JSON; writes benchmarks/throughput.json, benchmarks/throughput.png and
the ``## throughput`` section of benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import re
import subprocess
import sys
import time
from typing import Any, Dict, List

import ceiling  # noqa: E402 - benchmarks/ is on sys.path when run as a script
from results_md import DEMO, write_section  # noqa: E402

HERE = os.path.abspath(os.path.dirname(__file__))
ROOT = os.path.dirname(HERE)
SEQ_LEN, BATCH, BUFFER = 2048, 8, 1000
# A window starts at the first batch (start-up and the first best-fit fill are behind it; no worker has
# run ahead yet) and is long: a worker may be up to `prefetch_factor` batches ahead at its end, work the
# window does not count, at most 64/1000 of it here.
WARMUP = 1
RSS_SEQ_LEN, RSS_BATCH = 1023, 2  # 2,048 tokens a batch: 10,000 batches are ~5 epochs of the corpus
TARGETS = {"pretrain_vs_ceiling": 0.9, "checkpoint_cost": 0.03, "state_bytes_per_worker": 16 * 1024,
           "resume_vs_cold": 1.5, "rss_growth": 0.05}


# --- helpers shared by the child tasks ------------------------------------------------

def corpus_files() -> List[str]:
    from tokenloom.sample_data import build_demo_corpus

    corpus = build_demo_corpus(os.path.join(ROOT, "out", "bench", "corpus"))
    return corpus["code"] + corpus["prose"]


def tok_path() -> str:
    from tokenloom.sample_data import default_tokenizer_path

    return default_tokenizer_path()


def texts_of(files: List[str]) -> List[str]:
    import pyarrow.parquet as pq

    return [t for f in files for t in pq.read_table(f, columns=["text"]).column("text").to_pylist() if t is not None]


def build(files, **kw):
    from tokenloom.recipes import pretrain

    args = dict(tokenizer=tok_path(), seq_len=SEQ_LEN, batch_size=BATCH, packing="bestfit", buffer_size=BUFFER,
                seed=0)
    args.update(kw)
    return pretrain(files, **args)


def _identity(x):
    return x


def children_rss_kb() -> Dict[int, int]:
    """VmRSS (kB) of this process's child processes, from /proc."""
    me, out = os.getpid(), {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            if ppid != me:
                continue
            with open(f"/proc/{pid}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        out[int(pid)] = int(line.split()[1])
        except (OSError, ValueError, IndexError):
            continue
    return out


def self_rss_kb() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def torch_bytes(obj) -> int:
    import torch

    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.tell()


# --- child tasks: each returns a JSON-able dict ---------------------------------------

def task_ceiling(engine: str, mode: str) -> dict:
    """The corpus's texts through the tokenizer alone (ceiling.py): ``engine`` in ``mode``."""
    return ceiling.measure(engine, mode, tok_path(), texts_of(corpus_files()))


def _cpu_seconds() -> float:
    """CPU time of this process and of its children that have exited (loader workers, once shut down)."""
    import resource

    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def _time_window(loader, warmup: int, n: int, tokens=None, tokenized=None) -> dict:
    """``warmup`` batches (startup, queues filled), then the time of the next ``n``; the workers are shut
    down before the CPU time is read, so it counts theirs too."""
    import gc

    cpu0 = _cpu_seconds()
    t_start = time.perf_counter()
    it = iter(loader)
    for _ in range(warmup):
        next(it)
    startup = time.perf_counter() - t_start
    tok0 = tokens() if tokens else 0
    in0 = tokenized() if tokenized else 0
    main0 = time.process_time()
    t0 = time.perf_counter()
    for _ in range(n):
        next(it)
    dt = time.perf_counter() - t0
    main_cpu = time.process_time() - main0
    tok = tokens() - tok0 if tokens else 0
    tok_in = tokenized() - in0 if tokenized else tok
    shutdown = getattr(it, "_shutdown_workers", None)  # join the workers now, so their CPU time is counted
    if shutdown is not None:
        shutdown()
    del it
    gc.collect()
    return {"seconds": dt, "tokens": tok, "tokens_tokenized": tok_in, "batches": n, "warmup_s": startup,
            "cpu_s": _cpu_seconds() - cpu0, "main_cpu_s": main_cpu}


def _tokenizer_threads_on(worker_id: int) -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "true"  # undo the worker's default (pipes/tokenizer_threads.py)


def task_pretrain(workers: int, warmup: int, n: int, prefetch: int = 0, tok_threads: bool = False) -> dict:
    kw: Dict[str, Any] = {"prefetch_factor": prefetch} if prefetch else {}
    if tok_threads:
        kw["worker_init_fn"] = _tokenizer_threads_on
    loader = build(corpus_files(), num_workers=workers, **kw)
    stats = loader.stats
    return _time_window(loader, warmup, n, tokens=lambda: stats()["tokens_out"], tokenized=lambda: stats()["tokens_in"])


def task_naive(workers: int, warmup: int, n: int) -> dict:
    import torch
    from torch.utils.data import DataLoader, IterableDataset, get_worker_info

    files = corpus_files()
    bos = 0  # the shipped tokenizer's <|bos|>

    class Naive(IterableDataset):
        def __iter__(self):
            import pyarrow.parquet as pq
            from tokenizers import Tokenizer

            info = get_worker_info()
            wid, nw = (0, 1) if info is None else (info.id, info.num_workers)
            tok = Tokenizer.from_file(tok_path())
            buf: List[int] = []
            size = BATCH * (SEQ_LEN + 1)
            while True:  # endless, like pretrain(epochs=None)
                for path in files[wid::nw]:
                    pf = pq.ParquetFile(path)
                    for g in range(pf.num_row_groups):
                        texts = pf.read_row_group(g, columns=["text"]).column("text").to_pylist()
                        for enc in tok.encode_batch_fast(texts, add_special_tokens=False):
                            buf.append(bos)
                            buf.extend(enc.ids)
                        while len(buf) >= size:
                            x = torch.tensor(buf[:size], dtype=torch.int64).view(BATCH, SEQ_LEN + 1)
                            del buf[:size]
                            yield {"input_ids": x[:, :-1], "labels": x[:, 1:]}

    loader = DataLoader(Naive(), batch_size=None, num_workers=workers, collate_fn=_identity)
    r = _time_window(loader, warmup, n)
    r["tokens"] = r["tokens_tokenized"] = n * BATCH * (SEQ_LEN + 1)
    return r


def task_checkpoint(kind: str, warmup: int, n: int, workers: int = 2) -> dict:
    # "plain": no snapshot within the run (torchdata's workers then send no state either)
    loader = build(corpus_files(), num_workers=workers, snapshot_every_n_steps=1 if kind == "stateful" else 10 ** 9)
    r = _time_window(loader, warmup, n)
    r["tokens"] = 0  # the same batches in both runs: compare their seconds
    return r


def task_snapshot_work() -> dict:
    """In one process: what a worker does per snapshot vs a batch: the node state, torchdata's
    incremental delta against the previous snapshot (what its worker loop does), pickled."""
    import pickle

    from torchdata.stateful_dataloader import incremental_state as inc  # private: a benchmark's look inside

    from tokenloom.pipes.loader.bridge import NodeDataset
    from tokenloom.pipes.compat.torchdata import WholeState

    loader = build(corpus_files(), num_workers=0)
    it = iter(loader)
    for _ in range(20):
        next(it)

    def worker_state():  # the layout torchdata's worker builds for an iterable dataset
        ds = loader.dataset.state_dict()
        ds[NodeDataset.NODE] = WholeState(ds[NodeDataset.NODE])  # as a worker hands it over (one leaf)
        return {inc._WORKER_ID: 0, inc._DATASET_STATE: None,
                inc._FETCHER_STATE: {inc._DATASET_ITER_STATE: ds, inc._FETCHER_ENDED: False}}

    deltas = inc._IncrementalWorkerState(worker_state())
    n, t_batch, t_state, size = 60, 0.0, 0.0, 0
    for _ in range(n):
        t0 = time.perf_counter()
        next(it)
        t1 = time.perf_counter()
        size = len(pickle.dumps(deltas.generate_delta(worker_state()), pickle.HIGHEST_PROTOCOL))
        t_state += time.perf_counter() - t1
        t_batch += t1 - t0
    return {"batch_ms": 1e3 * t_batch / n, "state_ms": 1e3 * t_state / n, "state_pickle_bytes": size}


def task_state(workers: int) -> dict:
    loader = build(corpus_files(), num_workers=workers)
    it = iter(loader)
    for _ in range(100):
        next(it)
    state = loader.state_dict()
    per_worker = []

    def walk(x):
        if isinstance(x, dict):
            for k, v in x.items():
                if isinstance(k, str) and re.fullmatch(r"worker_\d+", k):
                    per_worker.append(torch_bytes(v))
                else:
                    walk(v)

    from tokenloom.pipes.loader import decode_state

    walk(decode_state(state))  # the loader state is JSON text per rank: the nested dict
    total = torch_bytes(state)
    return {"workers": workers, "total_bytes": total,
            "per_worker_bytes": per_worker or [total // max(workers, 1)]}


def task_resume(workers: int, repeats: int) -> dict:
    import torch

    files = corpus_files()
    loader = build(files, num_workers=workers)
    it = iter(loader)
    for _ in range(100):
        next(it)
    blob = io.BytesIO()
    state = loader.state_dict()
    torch.save(state, blob)
    window = _replay_window(state)
    del it, loader
    cold, resume = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fresh = build(files, num_workers=workers)
        next(iter(fresh))
        cold.append(time.perf_counter() - t0)
        del fresh
        blob.seek(0)
        t0 = time.perf_counter()
        resumed = build(files, num_workers=workers)
        resumed.load_state_dict(torch.load(blob, weights_only=True))
        next(iter(resumed))
        resume.append(time.perf_counter() - t0)
        del resumed
    return {"workers": workers, "saved_at_batch": 100, "cold_s": cold, "resume_s": resume,
            "replay_window_documents": window}


def _replay_window(state) -> List[int]:
    """Documents a restore re-reads and re-tokenizes, per packer state found in ``state``
    (``pulled - base`` of the best-fit packer's position; empty if the layout differs)."""
    found = []

    def walk(x):
        if isinstance(x, dict):
            if "pulled" in x and "base" in x and isinstance(x["pulled"], int):
                found.append(x["pulled"] - x["base"])
            for v in x.values():
                walk(v)

    from tokenloom.pipes.loader import decode_state

    walk(decode_state(state))  # the loader state is JSON text per rank: the nested dict
    return found


def task_rss(batches: int) -> dict:
    loader = build(corpus_files(), num_workers=2, seq_len=RSS_SEQ_LEN, batch_size=RSS_BATCH)
    it = iter(loader)
    samples = []
    every = max(batches // 40, 1)
    t0 = time.perf_counter()
    for i in range(1, batches + 1):
        next(it)
        if i % every == 0 or i == 1:
            kids = children_rss_kb()
            samples.append({"batch": i, "workers_kb": sorted(kids.values()), "main_kb": self_rss_kb()})
    return {"batches": batches, "seconds": time.perf_counter() - t0, "tokens_per_batch": RSS_BATCH * (RSS_SEQ_LEN + 1),
            "samples": samples}


def task_ipc(batch_size: int, seq_len: int) -> dict:
    """Per-batch cost of shipping one real batch from 2 workers: tensors vs numpy arrays."""
    import numpy as np
    import torch
    from torch.utils.data import DataLoader, IterableDataset

    batch = next(iter(build(corpus_files(), num_workers=0, batch_size=batch_size, seq_len=seq_len)))
    arrays = {k: v.numpy() for k, v in batch.items()}

    class Copies(IterableDataset):
        def __init__(self, as_numpy):
            self.as_numpy = as_numpy

        def __iter__(self):
            while True:
                fresh = {k: v.copy() for k, v in arrays.items()}
                yield fresh if self.as_numpy else {k: torch.from_numpy(v) for k, v in fresh.items()}

    out = {"batch_size": batch_size, "seq_len": seq_len, "arrays": len(arrays),
           "bytes": int(sum(a.nbytes for a in arrays.values()))}
    n = 300
    for name, as_numpy in (("tensors", False), ("numpy", True)):
        it = iter(DataLoader(Copies(as_numpy), batch_size=None, num_workers=2, collate_fn=_identity))
        for _ in range(20):
            next(it)
        t0 = time.perf_counter()
        for _ in range(n):
            b = next(it)
            if as_numpy:
                b = {k: torch.from_numpy(np.asarray(v)) for k, v in b.items()}
        out[f"{name}_ms_per_batch"] = 1e3 * (time.perf_counter() - t0) / n
        del it
    return out


def task_tiny(workers: int, snapshot: int) -> dict:
    kw = {"snapshot_every_n_steps": snapshot} if workers else {}
    loader = build(corpus_files(), num_workers=workers, seq_len=63, batch_size=2, **kw)
    it = iter(loader)
    for _ in range(50):
        next(it)
    n = 800
    t0 = time.perf_counter()
    for _ in range(n):
        next(it)
    return {"ms_per_batch": 1e3 * (time.perf_counter() - t0) / n}


TASKS = {"ceiling": task_ceiling, "pretrain": task_pretrain, "naive": task_naive, "checkpoint": task_checkpoint,
         "snapshot_work": task_snapshot_work, "state": task_state, "resume": task_resume, "rss": task_rss,
         "ipc": task_ipc, "tiny": task_tiny}


def spawn(task: str, env: Dict[str, str] = None, **params) -> dict:
    """Run one task in a fresh interpreter; its last stdout line is the JSON result."""
    full_env = dict(os.environ, **(env or {}))
    cmd = [sys.executable, os.path.abspath(__file__), "--task", task, "--params", json.dumps(params)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=full_env, timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(f"task {task} {params} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    print(f"# {task} {params} {env or ''}: {json.dumps(result)[:160]}", file=sys.stderr)
    return result


# --- the run ----------------------------------------------------------------------------

def run_all(args) -> dict:
    corpus_files()  # build once, before the timed children
    window = dict(warmup=WARMUP, n=args.window)
    throughput_plan = {
        "pretrain_0": ("pretrain", {}, dict(workers=0, **window)),
        "pretrain_1": ("pretrain", {}, dict(workers=1, **window)),
        "pretrain_2": ("pretrain", {}, dict(workers=2, **window)),
        "pretrain_2_prefetch_8": ("pretrain", {}, dict(workers=2, prefetch=8, **window)),
        "pretrain_2_tok_threads": ("pretrain", {}, dict(workers=2, tok_threads=True, **window)),
        "naive_0": ("naive", {}, dict(workers=0, **window)),
        "naive_2": ("naive", {}, dict(workers=2, **window)),
    }

    def rate(r, key="tokens"):
        return r[key] / r["seconds"]

    # This machine's speed drifts by up to 1.7x within minutes (shared cores), so every loader run is
    # bracketed by two runs of one tokenizer process per core on the engine the loader uses (tiktoken where
    # it runs this tokenizer) and divided by their mean; the other configurations of ceiling.py (each
    # engine's own threads, the other engine per core) are measured once per round, and the ceiling of a
    # run is the highest of all: the best this machine does with this tokenizer.
    engines = ceiling.engines_for(tok_path())
    loader_engine = engines[-1]
    others = [(e, m) for e in engines for m in ceiling.MODES if (e, m) != (loader_engine, "procs")]
    names = [f"ceiling_{e}_{m}" for e, m in others]
    runs: Dict[str, List[dict]] = {k: [] for k in [*names, "ceiling_procs", *throughput_plan]}
    bracket: Dict[str, List[float]] = {k: [] for k in throughput_plan}
    bracket_cpu: Dict[str, List[float]] = {k: [] for k in throughput_plan}
    for _ in range(args.repeats):
        for (e, m), name in zip(others, names):
            runs[name].append(spawn("ceiling", engine=e, mode=m))
        runs["ceiling_procs"].append(spawn("ceiling", engine=loader_engine, mode="procs"))
        for name, (task, env, params) in throughput_plan.items():
            runs[name].append(spawn(task, env, **params))
            runs["ceiling_procs"].append(spawn("ceiling", engine=loader_engine, mode="procs"))
            bracket[name].append(max((rate(runs["ceiling_procs"][-2]) + rate(runs["ceiling_procs"][-1])) / 2,
                                     *(rate(runs[n][-1]) for n in names)))
            bracket_cpu[name].append(sum(r["tokens"] / r["cpu_s"] for r in runs["ceiling_procs"][-2:]) / 2)
    best = {k: min(v, key=lambda r: r["seconds"]) for k, v in runs.items()}
    procs_rates = [rate(r) for r in runs["ceiling_procs"]]
    out: Dict[str, Any] = {"ceiling": {"tokens": best["ceiling_procs"]["tokens"],
                                       "tokens_per_s": sorted(procs_rates)[len(procs_rates) // 2],
                                       "one_process_per_core_tokens_per_s_all": procs_rates,
                                       "engine": loader_engine,
                                       "others_tokens_per_s_per_round": {n: [rate(r) for r in runs[n]] for n in names}},
           "bracket_ceiling_tokens_per_s": bracket}
    loaders = [k for k in runs if not k.startswith("ceiling") and best[k]["tokens"]]

    def median(xs):
        xs = sorted(xs)
        return xs[len(xs) // 2] if len(xs) % 2 else (xs[len(xs) // 2 - 1] + xs[len(xs) // 2]) / 2

    # Into rows: tokens placed in batches per second, what the training loop gets. Tokenized: document
    # tokens read and tokenized per second, the ceiling's work. Over a window of ~4 epochs they agree to
    # a few percent; the difference is what the best-fit buffer held at the start vs the end.
    out["rows_tokens_per_s"] = {k: median([rate(r) for r in runs[k]]) for k in loaders}
    out["tokens_per_s"] = {k: median([rate(r, "tokens_tokenized") for r in runs[k]]) for k in loaders}
    out["rows_vs_ceiling"] = {k: median([rate(r) / c for r, c in zip(runs[k], bracket[k])]) for k in loaders}
    out["vs_ceiling"] = {k: median([rate(r, "tokens_tokenized") / c for r, c in zip(runs[k], bracket[k])])
                         for k in loaders}
    out["rows_vs_ceiling_per_round"] = {k: [rate(r) / c for r, c in zip(runs[k], bracket[k])] for k in loaders}
    # The work per token: tokens per CPU-second of all the run's processes (start-up included), relative to
    # the bracketing ceilings'.
    out["cpu_efficiency_vs_ceiling"] = {
        k: median([r["tokens_tokenized"] / r["cpu_s"] / c for r, c in zip(runs[k], bracket_cpu[k])]) for k in loaders}
    out["ceiling"]["tokens_per_cpu_s"] = median([r["tokens"] / r["cpu_s"] for r in runs["ceiling_procs"]])
    out["seconds"] = {k: best[k]["seconds"] for k in runs}
    out["all_runs"] = runs
    # The target figure: the lower of the two ratios (over a window they differ by the best-fit buffer's
    # swing and by how far the workers ran ahead at its start and end).
    out["target_vs_ceiling"] = {k: min(out["rows_vs_ceiling"][k], out["vs_ceiling"][k]) for k in loaders}

    # Checkpointability: a plain/stateful pair per round, back to back, and the median of the pairs'
    # ratios (one cost is ~1% of the work; the machine drifts by more than that between rounds).
    pairs = []
    for _ in range(args.ckpt_pairs):
        pairs.append({kind: spawn("checkpoint", kind=kind, warmup=WARMUP, n=args.ckpt_window)
                      for kind in ("plain", "stateful")})
    out["checkpoint"] = {
        "pairs": pairs, "window": args.ckpt_window,
        "wall_cost": median([p["stateful"]["seconds"] / p["plain"]["seconds"] - 1 for p in pairs]),
        "cpu_cost": median([p["stateful"]["cpu_s"] / p["plain"]["cpu_s"] - 1 for p in pairs]),
        "wall_costs": [p["stateful"]["seconds"] / p["plain"]["seconds"] - 1 for p in pairs],
        "main_ms_per_batch": {kind: median([1e3 * p[kind]["main_cpu_s"] / p[kind]["batches"] for p in pairs])
                              for kind in ("plain", "stateful")},
        "batch_ms": {kind: median([1e3 * p[kind]["seconds"] / p[kind]["batches"] for p in pairs])
                     for kind in ("plain", "stateful")},
    }
    out["checkpoint_cost"] = out["checkpoint"]["wall_cost"]
    out["snapshot_work"] = spawn("snapshot_work")

    states = [spawn("state", workers=w) for w in (0, 2)]
    out["state"] = {f"workers_{s['workers']}": s for s in states}
    out["state_bytes_per_worker_max"] = max(max(s["per_worker_bytes"]) for s in states)

    out["resume"] = {}
    for w in (0, 2):
        r = spawn("resume", workers=w, repeats=args.resume_repeats)
        cold, res = sorted(r["cold_s"])[len(r["cold_s"]) // 2], sorted(r["resume_s"])[len(r["resume_s"]) // 2]
        out["resume"][f"workers_{w}"] = {**r, "cold_median_s": cold, "resume_median_s": res, "ratio": res / cold}

    rss = spawn("rss", batches=args.rss_batches)
    s = rss["samples"]
    # Peak of both workers' RSS per fifth of the run: a sample at one batch swings with whatever row group
    # is loaded (a few to tens of MB), a leak raises every fifth's peak.
    totals = [sum(x["workers_kb"]) for x in s]
    k = len(totals)
    fifths = [max(totals[i * k // 5:(i + 1) * k // 5]) for i in range(5)]
    out["rss"] = {**rss, "workers_peak_kb_per_fifth": fifths, "workers_kb_at_20pct": fifths[1],
                  "workers_kb_at_end": fifths[-1], "workers_growth": fifths[-1] / fifths[1] - 1,
                  "workers_peak_kb": max(totals)}

    out["ipc"] = [spawn("ipc", batch_size=b, seq_len=t) for b, t in ((BATCH, SEQ_LEN), (2, 63))]
    out["tiny"] = {
        "workers_0": spawn("tiny", workers=0, snapshot=1),
        "workers_2_snapshot_every_step": spawn("tiny", workers=2, snapshot=1),
        "workers_2_snapshot_never": spawn("tiny", workers=2, snapshot=10 ** 9),
    }
    ncpu = os.cpu_count() or 1
    cores_key = f"pretrain_{min(ncpu, 2)}"
    out["targets"] = {
        "pretrain_vs_ceiling": {"value": out["target_vs_ceiling"][cores_key],
                                "target": f">= {TARGETS['pretrain_vs_ceiling']}",
                                "met": out["target_vs_ceiling"][cores_key] >= TARGETS["pretrain_vs_ceiling"],
                                "config": cores_key},
        "checkpoint_cost": {"value": out["checkpoint_cost"], "target": f"<= {TARGETS['checkpoint_cost']}",
                            "met": out["checkpoint_cost"] <= TARGETS["checkpoint_cost"]},
        "state_bytes_per_worker": {"value": out["state_bytes_per_worker_max"],
                                   "target": f"<= {TARGETS['state_bytes_per_worker']}",
                                   "met": out["state_bytes_per_worker_max"] <= TARGETS["state_bytes_per_worker"]},
        "resume_vs_cold": {"value": out["resume"]["workers_2"]["ratio"], "target": f"<= {TARGETS['resume_vs_cold']}",
                           "met": out["resume"]["workers_2"]["ratio"] <= TARGETS["resume_vs_cold"]},
        "worker_rss_growth": {"value": out["rss"]["workers_growth"], "target": f"<= {TARGETS['rss_growth']}",
                              "met": out["rss"]["workers_growth"] <= TARGETS["rss_growth"]},
    }
    return out


def profile(path: str) -> dict:
    """cProfile over 150 batches with 0 workers (the whole graph in this process), the top entries by
    own time written to ``path``."""
    import cProfile
    import pstats

    loader = build(corpus_files(), num_workers=0)
    it = iter(loader)
    for _ in range(20):
        next(it)
    n = 150
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(n):
        next(it)
    prof.disable()
    with open(path, "w") as f:
        pstats.Stats(prof, stream=f).strip_dirs().sort_stats("tottime").print_stats(30)
    return {"batches": n, "report": os.path.relpath(path, ROOT)}


# --- output -----------------------------------------------------------------------------

def plot(out: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5))
    ax = axes[0][0]
    names = list(out["vs_ceiling"])[::-1]
    ys = range(len(names))
    ax.barh([y + 0.2 for y in ys], [out["vs_ceiling"][k] for k in names], 0.4, color="C0", label="tokenized")
    ax.barh([y - 0.2 for y in ys], [out["rows_vs_ceiling"][k] for k in names], 0.4, color="C9", label="into rows")
    ax.set_yticks(list(ys), names)
    ax.axvline(TARGETS["pretrain_vs_ceiling"], color="C3", ls="--", lw=1, label="target 0.9x")
    ax.axvline(1.0, color="grey", lw=0.8)
    ax.set_xlabel("throughput / tokenizer ceiling (same documents)")
    ax.set_title(f"ceiling: median {out['ceiling']['tokens_per_s'] / 1e6:.2f} M tokens/s on {out['machine']['cpus']} cores")
    ax.legend(fontsize=8)
    ax.tick_params(axis="y", labelsize=8)

    ax = axes[0][1]
    s = out["rss"]["samples"]
    xs = [x["batch"] for x in s]
    nworkers = max(len(x["workers_kb"]) for x in s)
    for w in range(nworkers):
        ax.plot(xs, [x["workers_kb"][w] / 1024 if w < len(x["workers_kb"]) else float("nan") for x in s],
                label=f"worker {w}")
    ax.plot(xs, [x["main_kb"] / 1024 for x in s], label="main process", color="grey")
    ax.set_xlabel(f"batch (T={RSS_SEQ_LEN}, B={RSS_BATCH})")
    ax.set_ylabel("RSS (MB)")
    ax.set_ylim(bottom=0)
    ax.set_title(f"memory over {out['rss']['batches']:,} batches, 2 workers")
    ax.legend(fontsize=8)

    ax = axes[1][0]
    labels, cold, res = [], [], []
    for k, r in out["resume"].items():
        labels.append(k.replace("_", " "))
        cold.append(r["cold_median_s"])
        res.append(r["resume_median_s"])
    x = range(len(labels))
    ax.bar([i - 0.2 for i in x], cold, 0.4, label="cold start (build + first batch)")
    ax.bar([i + 0.2 for i in x], res, 0.4, label="resume (build + load + first batch)")
    ax.set_xticks(list(x), labels)
    ax.set_ylabel("seconds")
    ax.set_title("resume latency (target <= 1.5x cold)")
    ax.legend(fontsize=8)

    ax = axes[1][1]
    tiny = out["tiny"]
    ax.barh([k.replace("_", " ") for k in tiny][::-1], [tiny[k]["ms_per_batch"] for k in tiny][::-1], color="C1")
    for ipc in out["ipc"]:
        if ipc["seq_len"] == 63:
            ax.axvline(ipc["tensors_ms_per_batch"], color="C3", ls="--", lw=1,
                       label=f"transfer alone, tensors: {ipc['tensors_ms_per_batch']:.2f} ms")
            ax.axvline(ipc["numpy_ms_per_batch"], color="C2", ls="--", lw=1,
                       label=f"transfer alone, numpy: {ipc['numpy_ms_per_batch']:.2f} ms")
    ax.set_xlabel("ms per batch (T=63, B=2)")
    ax.set_title("tiny batches: per-batch overheads")
    ax.legend(fontsize=8)
    ax.tick_params(axis="y", labelsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _parts_cost(out: dict) -> float:
    """The checkpoint cost from its parts: the snapshot's share of a worker's time per batch, plus the
    training process's extra CPU per batch as a share of the machine's time per batch."""
    sw, ck = out["snapshot_work"], out["checkpoint"]
    main = ck["main_ms_per_batch"]["stateful"] - ck["main_ms_per_batch"]["plain"]
    return sw["state_ms"] / sw["batch_ms"] + main / (ck["batch_ms"]["plain"] * out["machine"]["cpus"])


def results_markdown(out: dict, command: str) -> str:
    t = out["targets"]
    c = out["ceiling"]
    m = out["machine"]
    ok = lambda x: "yes" if x["met"] else "**no**"  # noqa: E731
    r2 = out["resume"]["workers_2"]
    procs = c["one_process_per_core_tokens_per_s_all"]
    lines = [
        f"One run, {m['cpus']} CPUs (load average {m['loadavg_start']} at start, {m['loadavg_end']} at end; other "
        f"jobs shared the machine), {out['config']['repeats']} interleaved rounds. Corpus: the embedded "
        f"stdlib corpus ({out['ceiling']['tokens']:,} tokens). Loaders are timed over {out['config']['window']} "
        f"batches (~{out['config']['window'] * BATCH * (SEQ_LEN + 1) / out['ceiling']['tokens']:.1f} epochs' worth) "
        f"from the first batch on (start-up and the first best-fit fill left out), endless stream; pretrain = "
        f"bestfit, T={SEQ_LEN}, B={BATCH}, buffer {BUFFER}, workers keep up to 64 batches ready.",
        "",
        f"Command: `{command}`",
        "",
        "| figure | value | target | met |",
        "|---|---|---|---|",
        f"| pretrain, {t['pretrain_vs_ceiling']['config'].split('_')[1]} workers (= cores), tokens per second / "
        f"tokenizer ceiling, median of the rounds' ratios, the lower of into rows "
        f"({out['rows_vs_ceiling'][t['pretrain_vs_ceiling']['config']]:.2f}x) and tokenized "
        f"({out['vs_ceiling'][t['pretrain_vs_ceiling']['config']]:.2f}x) | "
        f"{t['pretrain_vs_ceiling']['value']:.2f}x | >= 0.9x | {ok(t['pretrain_vs_ceiling'])} |",
        f"| checkpoint cost: the pretrain loader, a snapshot every step vs none (2 workers), median of "
        f"{len(out['checkpoint']['pairs'])} back-to-back pairs | "
        f"{100 * t['checkpoint_cost']['value']:+.1f}% | <= 3% | {ok(t['checkpoint_cost'])} |",
        f"| loader state per worker (torch.save, buffer {BUFFER}) | "
        f"{t['state_bytes_per_worker']['value'] / 1024:.1f} KB | <= 16 KB | {ok(t['state_bytes_per_worker'])} |",
        f"| resume (build + load + first batch) / cold start (build + first batch), 2 workers, saved at batch "
        f"{r2['saved_at_batch']} | {r2['ratio']:.2f}x ({r2['resume_median_s']:.2f} s / {r2['cold_median_s']:.2f} s; "
        f"replay windows {r2['replay_window_documents']} documents) | <= 1.5x | {ok(t['resume_vs_cold'])} |",
        f"| worker RSS growth over {out['rss']['batches']:,} batches (T={RSS_SEQ_LEN}, B={RSS_BATCH}): peak of the "
        f"last fifth vs the second | {100 * out['rss']['workers_growth']:+.1f}% (peaks per fifth "
        f"{[round(x / 1024) for x in out['rss']['workers_peak_kb_per_fifth']]} MB, 2 workers) | flat (<= 5%) | "
        f"{ok(t['worker_rss_growth'])} |",
        "",
        f"Throughput as a ratio to the tokenizer ceiling (`benchmarks/ceiling.py`): the corpus's texts in memory "
        f"through the warm tokenizer alone, the best of one single-threaded process per core on the loader's engine "
        f"({c['engine']}; median {c['tokens_per_s'] / 1e6:.2f} M tokens/s over {len(procs)} runs, range "
        f"{min(procs) / 1e6:.2f}-{max(procs) / 1e6:.2f} M: this machine's speed drifts, so these bracket every loader "
        "run and it is divided by their mean) and, once per round, "
        + "; ".join(f"{n.replace('ceiling_', '').replace('_', ' ')} {[round(x / 1e6, 2) for x in v]} M"
                    for n, v in c["others_tokens_per_s_per_round"].items())
        + " (threads: one process on the engine's own threads, batches of 256); the median of the rounds' ratios "
        "is shown. *Into rows*: tokens placed in "
        "batches per second, what the training loop receives. *Tokenized*: document tokens read and tokenized per "
        "second (the ceiling's work); they differ by what the best-fit buffer held at the window's start and end. "
        "*Per CPU-second*: tokens tokenized per CPU-second of all the run's processes (start-up included), "
        f"relative to the bracketing ceilings' (median {c['tokens_per_cpu_s'] / 1e6:.2f} M tokens per CPU-second): "
        "the work per token.",
        "",
        "| run | M tokens/s into rows | / ceiling | M tokens/s tokenized | / ceiling | per CPU-second / ceiling's |",
        "|---|---|---|---|---|---|",
    ]
    for k, v in out["vs_ceiling"].items():
        lines.append(f"| {k} | {out['rows_tokens_per_s'][k] / 1e6:.2f} | {out['rows_vs_ceiling'][k]:.2f}x | "
                     f"{out['tokens_per_s'][k] / 1e6:.2f} | {v:.2f}x | {out['cpu_efficiency_vs_ceiling'][k]:.2f} |")
    ck = out["checkpoint"]
    lines += ["", f"Checkpointability, the pretrain loader with a snapshot every step (stateful) or none (plain), "
              f"2 workers, {ck['window']} batches per run, {len(ck['pairs'])} plain/stateful pairs back to back: per batch {ck['batch_ms']['plain']:.1f} "
              f"vs {ck['batch_ms']['stateful']:.1f} ms (medians); the pairs' wall costs "
              f"{[f'{100 * x:+.1f}%' for x in ck['wall_costs']]}, median {100 * ck['wall_cost']:+.1f}%; CPU time of "
              f"main + workers {100 * ck['cpu_cost']:+.1f}% (median); the training process's own CPU per batch "
              f"{ck['main_ms_per_batch']['plain']:.2f} vs {ck['main_ms_per_batch']['stateful']:.2f} ms."]
    sw = out["snapshot_work"]
    lines += [
        "",
        f"Snapshot work per step, measured in one process: the node state built, diffed against the previous one "
        f"(torchdata's incremental delta, as its worker loop does) and pickled in "
        f"{sw['state_ms']:.3f} ms ({sw['state_pickle_bytes'] / 1024:.1f} KB) vs {sw['batch_ms']:.1f} ms for the batch "
        f"({100 * sw['state_ms'] / sw['batch_ms']:.2f}%). Adding up the parts: that share of the workers' time, "
        f"plus the training process's extra {ck['main_ms_per_batch']['stateful'] - ck['main_ms_per_batch']['plain']:.2f}"
        f" ms per batch taken from {m['cpus']} cores that deliver a batch every {ck['batch_ms']['plain']:.1f} ms, "
        f"puts the cost of a snapshot every step at ~{100 * _parts_cost(out):.1f}%: below what two runs on this "
        "machine can tell apart, which is why the end-to-end figure swings around it.",
        "",
        "Per-batch transfer from 2 workers (a worker only copies a ready batch; the main process receives it). "
        "tokenloom's workers send numpy (`pipes/loader/wire.py`):",
        "",
        "| batch | bytes | dict of tensors (shared memory, one fd per tensor) | same arrays as numpy (pickled) |",
        "|---|---|---|---|",
    ]
    for ipc in out["ipc"]:
        lines.append(f"| B={ipc['batch_size']}, T={ipc['seq_len']}, {ipc['arrays']} arrays | {ipc['bytes']:,} | "
                     f"{ipc['tensors_ms_per_batch']:.2f} ms | {ipc['numpy_ms_per_batch']:.2f} ms |")
    lines += ["", "Resume latency (median of 3):", "",
              "| workers | cold start s | resume s | ratio | replay window (documents) |", "|---|---|---|---|---|"]
    for k, r in out["resume"].items():
        lines.append(f"| {r['workers']} | {r['cold_median_s']:.2f} | {r['resume_median_s']:.2f} | {r['ratio']:.2f}x | "
                     f"{r['replay_window_documents']} |")
    lines += ["", "Tiny batches (T=63, B=2), ms per batch:", "", "| run | ms/batch |", "|---|---|"]
    for k, v in out["tiny"].items():
        lines.append(f"| {k} | {v['ms_per_batch']:.2f} |")
    if "profile" in out:
        lines += ["", f"Profile (cProfile, {out['profile']['batches']} batches, 0 workers): "
                  f"`{out['profile']['report']}`."]
    lines += ["", "![throughput](throughput.png)"]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--repeats", type=int, default=None, help="interleaved rounds of the throughput runs")
    ap.add_argument("--profile", action="store_true", help="also profile 150 batches with 0 workers (cProfile)")
    ap.add_argument("--no-write", dest="write", action="store_false", help="print JSON only")
    ap.add_argument("--task", help=argparse.SUPPRESS)
    ap.add_argument("--params", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.task:
        print(json.dumps(TASKS[args.task](**json.loads(args.params))))
        return 0
    args.repeats = args.repeats or (2 if args.quick else 3)
    args.rss_batches = 2000 if args.quick else 10000
    args.window = 300 if args.quick else 1000
    args.ckpt_pairs = 2 if args.quick else 9
    args.ckpt_window = 200 if args.quick else 600
    args.resume_repeats = 3

    import torch

    t0 = time.perf_counter()
    out = {"benchmark": "throughput", "quick": args.quick,
           "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
                       "loadavg_start": [round(x, 2) for x in os.getloadavg()]},
           "config": {"seq_len": SEQ_LEN, "batch_size": BATCH, "buffer_size": BUFFER, "repeats": args.repeats,
                      "window": args.window, "rss_batches": args.rss_batches}}
    out.update(run_all(args))
    if args.profile:
        out["profile"] = profile(os.path.join(HERE, "throughput_profile.txt"))
    out["machine"]["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    out["wall_seconds"] = time.perf_counter() - t0
    print(json.dumps(out, indent=2))
    if args.write:
        with open(os.path.join(HERE, "throughput.json"), "w") as f:
            json.dump(out, f, indent=2)
        plot(out, os.path.join(HERE, "throughput.png"))
        command = "python benchmarks/throughput.py" + (" --quick" if args.quick else "") + \
            (" --profile" if args.profile else "")
        write_section(os.path.join(HERE, "RESULTS.md"), "throughput", results_markdown(out, command), tokenizer=DEMO)
    return 0


if __name__ == "__main__":
    sys.exit(main())
