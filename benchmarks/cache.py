"""Token cache vs tokenizing on the fly, side by side in one run (issue 18).

Corpus: the embedded stdlib corpus (`tokenloom.sample_data`, all of it) as two sources,
``code`` and ``prose``, mixed 0.7/0.3 by tokens; the shipped demo tokenizer. Loader:
``pretrain`` bestfit, T=2048, B=8, buffer 1000, 2 workers, endless, timed over a window
of ``--batches`` batches after ``--warmup`` batches (300, the same for both loaders): the
steady rate a training run sees, not its start, which first_batch.py measures. (On the
cache, 1000-batch windows right after the first batch ran 8-13% slower: the workers
start, fill the packer's buffer, and fault in their rings' pages on the first lap.) Each
loader runs in a fresh Python process (no run inherits another's threads or page cache
warmth beyond the files), and the runs are interleaved over ``--rounds`` rounds (this
machine is shared and drifts): per round the ratio cache/on-the-fly, reported as the
median over rounds.

The demo tokenizer runs on tiktoken (tiktoken_bpe.py: same ids, ~3x faster than
tokenizers); tokenizer.json files tiktoken cannot run (SentencePiece-style, for one)
encode on tokenizers, so each comparison is made on both engines (``--engines``; the
child processes of ``tokenizers`` run with ``TOKENLOOM_TIKTOKEN=0``): the same ids and
fingerprint, so the same cache serves both.

Per run: tokens placed in rows per second (``stats()["tokens_out"]``, what the loop
receives); the training process's own CPU per batch (getrusage of the process, over
the window) and the workers' CPU per batch (/proc of the child processes). And the
work a batch costs in one process (``num_workers=0``, CPU per batch over 500 batches):
what is left when tokenizing is gone (mixing, packing, collation).

Breakdown: with one worker, where a cached batch's CPU goes: the worker's main thread timed in
parts from inside it (the nodes, the parquet reads, the ring, the state and torchdata's delta,
the rest of the loop), its other threads from /proc (the queue's feeder thread, idle unless a pipe fills), and the
training process.

Build cost: ``build_cache(processes=2)`` of both sources (wall, including listing and
writing) against one epoch on the fly (``epochs=1``, ``cycle_exhausted=False``: every
document once, 2 workers, from building the loader to its last batch). Disk: cache
bytes per token, with the demo tokenizer (4,096 ids) and with a 32,768-id byte-level BPE
trained on the corpus (`sample_data.train_tokenizer`): both store uint16 ids.

    python benchmarks/cache.py            # ~5 minutes on 2 cores
    python benchmarks/cache.py --quick    # 1 round, 300-batch windows, demo engine only
Prints JSON; writes benchmarks/cache.json and the ``## cache`` section of benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List

from results_md import DEMO, write_section  # noqa: E402 - benchmarks/ is on sys.path when run as a script

HERE = os.path.abspath(os.path.dirname(__file__))
T, B, WORKERS, WEIGHTS = 2048, 8, 2, {"code": 0.7, "prose": 0.3}


def _sources(root: str) -> Dict[str, str]:
    from tokenloom.sample_data import build_demo_corpus

    build_demo_corpus(os.path.join(root, "corpus"))
    return {k: os.path.join(root, "corpus", k) for k in ("code", "prose")}


def _encoder(engine: str):
    from tokenloom.pipes import load_encoder
    from tokenloom.sample_data import default_tokenizer_path

    enc = load_encoder(default_tokenizer_path())
    if enc.engine != engine:
        raise RuntimeError(f"asked for {engine}, the tokenizer runs on {enc.engine} ({enc.engine_note})")
    return enc


def _children_cpu() -> float:
    """CPU seconds (user + system) of this process's live children, from /proc."""
    me, tick, total = os.getpid(), os.sysconf("SC_CLK_TCK"), 0.0
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == me:
            total += (int(fields[11]) + int(fields[12])) / tick
    return total


def _self_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def child_stream(root: str, mode: str, engine: str, batches: int, warmup: int) -> Dict[str, Any]:
    """One endless loader, timed over ``batches`` batches after ``warmup`` batches."""
    from tokenloom.recipes import pretrain

    loader = pretrain(_sources(root), tokenizer=_encoder(engine), seq_len=T, batch_size=B, num_workers=WORKERS,
                      weights=WEIGHTS, cache=os.path.join(root, "cache") if mode == "cache" else None)
    it = iter(loader)
    for _ in range(max(warmup, 1)):
        next(it)
    out0, main0, workers0, t0 = loader.stats()["tokens_out"], _self_cpu(), _children_cpu(), time.perf_counter()
    for _ in range(batches):
        next(it)
    wall = time.perf_counter() - t0
    main, workers = _self_cpu() - main0, _children_cpu() - workers0
    tokens = loader.stats()["tokens_out"] - out0
    return {"mode": mode, "engine": engine, "tokens_per_s": tokens / wall, "wall_ms_per_batch": 1e3 * wall / batches,
            "main_cpu_ms_per_batch": 1e3 * main / batches, "workers_cpu_ms_per_batch": 1e3 * workers / batches}


def child_inprocess(root: str, mode: str, engine: str, batches: int) -> Dict[str, Any]:
    """The whole graph in this process (no workers): CPU per batch."""
    from tokenloom.recipes import pretrain

    loader = pretrain(_sources(root), tokenizer=_encoder(engine), seq_len=T, batch_size=B, num_workers=0,
                      weights=WEIGHTS, cache=os.path.join(root, "cache") if mode == "cache" else None)
    it = iter(loader)
    for _ in range(20):
        next(it)
    c0 = time.process_time()
    for _ in range(batches):
        next(it)
    return {"mode": mode, "engine": engine, "cpu_ms_per_batch": 1e3 * (time.process_time() - c0) / batches}


def _threads_cpu() -> Dict[str, float]:
    """CPU seconds per thread of this process's live children, ``{"pid/tid name": seconds}``, from /proc."""
    me, tick, out = os.getpid(), os.sysconf("SC_CLK_TCK"), {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                if int(f.read().rsplit(")", 1)[1].split()[1]) != me:
                    continue
            for tid in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{tid}/stat") as f:
                    st = f.read()
                g = st.rsplit(")", 1)[1].split()
                out[f"{pid}/{tid} {st.split('(', 1)[1].rsplit(')', 1)[0]}"] = (int(g[11]) + int(g[12])) / tick
        except OSError:
            continue
    return out


def child_breakdown(root: str, engine: str, batches: int) -> Dict[str, Any]:
    """Where a cached batch's CPU goes, with one worker: its main thread's parts timed inside the
    worker (thread CPU; the loader's internals are wrapped here, a benchmark's look inside), its
    other threads from /proc, and the training process's own CPU."""
    import threading

    from torchdata.stateful_dataloader import worker as td_worker
    from torchdata.stateful_dataloader.incremental_state import _IncrementalWorkerState

    from torch.utils.data import get_worker_info

    from tokenloom.pipes.loader import node_dataset, wire as wire_mod
    from tokenloom.recipes import pretrain

    import pyarrow.parquet as pq

    acc = {"graph": 0.0, "read": 0.0, "wire": 0.0, "state": 0.0, "delta": 0.0}
    count = [0]
    out_path = os.path.join(root, f"breakdown-{os.getpid()}.json")
    clock = time.thread_time

    def timed_next(self):  # NodeDataset.__next__ in a worker, in two timed parts
        t0 = clock()
        batch = next(self._root)
        t1 = clock()
        wire = wire_mod.WireBatch(batch, self.rings[get_worker_info().id] if self.rings else None)
        acc["graph"] += t1 - t0
        acc["wire"] += clock() - t1
        count[0] += 1
        if count[0] % 200 == 0:  # the latest per-batch means, for the training process to read
            with open(out_path + ".tmp", "w") as f:
                json.dump({"batches": count[0], "main_thread_s": clock(), **acc,
                           "threads": {str(t.native_id): t.name for t in threading.enumerate()}}, f)
            os.replace(out_path + ".tmp", out_path)
        return wire

    def timed(fn, key):
        def wrapped(*a, **k):
            t0 = clock()
            try:
                return fn(*a, **k)
            finally:
                acc[key] += clock() - t0
        return wrapped

    node_dataset.NodeDataset.__next__ = timed_next
    pq.ParquetFile.read_row_group = timed(pq.ParquetFile.read_row_group, "read")
    td_worker._make_state_dict = timed(td_worker._make_state_dict, "state")
    _IncrementalWorkerState.generate_delta = timed(_IncrementalWorkerState.generate_delta, "delta")
    loader = pretrain(_sources(root), tokenizer=_encoder(engine), seq_len=T, batch_size=B, num_workers=1,
                      weights=WEIGHTS, cache=os.path.join(root, "cache"))
    it = iter(loader)
    for _ in range(100):
        next(it)
    threads0, main0 = _threads_cpu(), _self_cpu()
    for _ in range(batches):
        next(it)
    threads1, main1 = _threads_cpu(), _self_cpu()
    with open(out_path) as f:
        w = json.load(f)
    n = w["batches"]
    per = {k: 1e3 * w[k] / n for k in acc}
    per["graph"] -= per["read"]  # graph: the nodes without the reading of cache files
    per["rest of the worker loop"] = 1e3 * w["main_thread_s"] / n - sum(per.values())
    others = {}
    for key, cpu in threads1.items():
        tid = key.split(" ", 1)[0].split("/")[1]
        name = w["threads"].get(tid, "not started by Python")
        if name != "MainThread" and cpu > threads0.get(key, 0.0):
            others[name] = others.get(name, 0.0) + 1e3 * (cpu - threads0.get(key, 0.0)) / batches
    return {"engine": engine, "batches": batches, "worker_main_thread_ms": per,
            "worker_other_threads_ms": others, "training_process_ms": 1e3 * (main1 - main0) / batches}


def child_build(root: str, engine: str) -> Dict[str, Any]:
    from tokenloom.pipes.sources.cache import build_cache

    out = os.path.join(root, f"build-{engine}")
    shutil.rmtree(out, ignore_errors=True)
    t0 = time.perf_counter()
    done = build_cache(_sources(root), _encoder(engine), out, processes=WORKERS)
    wall = time.perf_counter() - t0
    tokens = sum(s["tokens"] for s in done["sources"].values())
    size = sum(s["bytes"] for s in done["sources"].values())
    per = {n: s["bytes"] / s["tokens"] for n, s in done["sources"].items()}
    return {"engine": engine, "seconds": wall, "tokens": tokens, "bytes": size, "bytes_per_token": size / tokens,
            "bytes_per_token_by_source": per, "dtype": done["dtype"]}


def child_disk(root: str, vocab: int) -> Dict[str, Any]:
    """Bytes per token of the cache with a byte-level BPE of ``vocab`` ids trained on the corpus."""
    import pyarrow.parquet as pq

    from tokenloom.pipes.sources.cache import build_cache
    from tokenloom.sample_data import train_tokenizer

    sources = _sources(root)
    texts = [t for d in sources.values() for f in sorted(os.listdir(d)) if f.endswith(".parquet")
             for t in pq.read_table(os.path.join(d, f), columns=["text"]).column("text").to_pylist() if t]
    path = os.path.join(root, f"bpe{vocab}.json")
    train_tokenizer(texts, vocab_size=vocab).save(path)
    done = build_cache(sources, path, os.path.join(root, f"disk-{vocab}"), processes=WORKERS)
    tokens = sum(s["tokens"] for s in done["sources"].values())
    size = sum(s["bytes"] for s in done["sources"].values())
    return {"vocab": vocab, "tokens": tokens, "bytes_per_token": size / tokens, "dtype": done["dtype"],
            "bytes_per_token_by_source": {n: s["bytes"] / s["tokens"] for n, s in done["sources"].items()}}


def child_epoch(root: str, engine: str) -> Dict[str, Any]:
    from tokenloom.recipes import pretrain

    t0 = time.perf_counter()
    loader = pretrain(_sources(root), tokenizer=_encoder(engine), seq_len=T, batch_size=B, num_workers=WORKERS,
                      weights=WEIGHTS, epochs=1, cycle_exhausted=False)
    n = sum(1 for _ in loader)
    return {"engine": engine, "seconds": time.perf_counter() - t0, "batches": n,
            "tokens_in": loader.stats()["tokens_in"]}


def _run(root: str, *args: str) -> Dict[str, Any]:
    env = dict(os.environ, TOKENLOOM_TIKTOKEN="0" if "tokenizers" in args else "1")
    out = subprocess.run([sys.executable, __file__, "--child", root, *args], capture_output=True, text=True,
                         timeout=1800, env=env)
    if out.returncode != 0:
        raise RuntimeError(f"child {args} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--batches", type=int, default=1000)
    p.add_argument("--warmup", type=int, default=300)
    p.add_argument("--engines", nargs="+", default=["tiktoken", "tokenizers"])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--child", nargs="+")
    args = p.parse_args()
    if args.child:
        root, what, *rest = args.child
        fn = {"stream": child_stream, "inprocess": child_inprocess, "build": child_build, "epoch": child_epoch,
              "disk": child_disk, "breakdown": child_breakdown}[what]
        conv = [int(x) if x.isdigit() else x for x in rest]
        print(json.dumps(fn(root, *conv)))
        return
    if args.quick:
        args.rounds, args.batches, args.engines = 1, 300, ["tiktoken"]
    root = tempfile.mkdtemp(prefix="tokenloom-cache-bench-")
    try:
        _sources(root)
        from tokenloom.pipes.sources.cache import build_cache

        build_cache(_sources(root), _encoder("tiktoken"), os.path.join(root, "cache"), processes=WORKERS)
        result: Dict[str, Any] = {"machine": f"{os.cpu_count()} cores, {platform.python_implementation()} "
                                             f"{platform.python_version()}", "T": T, "B": B, "workers": WORKERS,
                                  "batches": args.batches, "warmup": args.warmup, "rounds": args.rounds,
                                  "engines": {}}
        for engine in args.engines:
            runs: List[Dict[str, Any]] = []
            builds, epochs = [], []
            for r in range(args.rounds):
                fly = _run(root, "stream", "fly", engine, str(args.batches), str(args.warmup))
                cache = _run(root, "stream", "cache", engine, str(args.batches), str(args.warmup))
                runs.append({"fly": fly, "cache": cache, "ratio": cache["tokens_per_s"] / fly["tokens_per_s"]})
                builds.append(_run(root, "build", engine))
                epochs.append(_run(root, "epoch", engine))
                print(f"{engine} round {r}: fly {fly['tokens_per_s'] / 1e6:.2f} M tok/s, cache "
                      f"{cache['tokens_per_s'] / 1e6:.2f} M tok/s ({runs[-1]['ratio']:.2f}x); build "
                      f"{builds[-1]['seconds']:.2f}s vs epoch {epochs[-1]['seconds']:.2f}s", file=sys.stderr)
            inproc = {m: _run(root, "inprocess", m, engine, "500") for m in ("fly", "cache")}
            med = statistics.median

            def pick(mode, key):
                return med(x[mode][key] for x in runs)

            result["engines"][engine] = {
                "ratio_median": med(x["ratio"] for x in runs),
                "ratios": [x["ratio"] for x in runs],
                "fly_tokens_per_s": pick("fly", "tokens_per_s"),
                "cache_tokens_per_s": pick("cache", "tokens_per_s"),
                "cache_wall_ms_per_batch": pick("cache", "wall_ms_per_batch"),
                "fly_main_cpu_ms_per_batch": pick("fly", "main_cpu_ms_per_batch"),
                "cache_main_cpu_ms_per_batch": pick("cache", "main_cpu_ms_per_batch"),
                "fly_workers_cpu_ms_per_batch": pick("fly", "workers_cpu_ms_per_batch"),
                "cache_workers_cpu_ms_per_batch": pick("cache", "workers_cpu_ms_per_batch"),
                "inprocess_cpu_ms_per_batch": {m: v["cpu_ms_per_batch"] for m, v in inproc.items()},
                "build_seconds": med(b["seconds"] for b in builds),
                "epoch_on_the_fly_seconds": med(e["seconds"] for e in epochs),
                "build_over_epoch": med(b["seconds"] / e["seconds"] for b, e in zip(builds, epochs)),
                "cache_bytes_per_token": builds[0]["bytes_per_token"],
                "cache_bytes_per_token_by_source": builds[0]["bytes_per_token_by_source"],
                "corpus_tokens": builds[0]["tokens"],
                "runs": runs,
            }
        result["disk_32k"] = _run(root, "disk", "32768")
        result["breakdown"] = _run(root, "breakdown", args.engines[0], str(3 * args.batches))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(json.dumps(result, indent=1))
    if not args.quick:
        with open(os.path.join(HERE, "cache.json"), "w") as f:
            json.dump(result, f, indent=1)
        write_section(os.path.join(HERE, "RESULTS.md"), "cache", _markdown(result), tokenizer=DEMO)


def _markdown(r: Dict[str, Any]) -> str:
    lines = [f"`python benchmarks/cache.py` ({r['machine']}; stdlib corpus, code/prose mixed 0.7/0.3, bestfit, "
             f"T={r['T']}, B={r['B']}, {r['workers']} workers; {r['rounds']} interleaved rounds of "
             f"{r['batches']}-batch windows after {r['warmup']} batches, medians).", "",
             "| engine | on the fly | cache | cache / on the fly | training process CPU per batch (cache) | "
             "workers' CPU per batch (fly / cache) | one process, CPU per batch (fly / cache) | build | one epoch on "
             "the fly |", "|---|---|---|---|---|---|---|---|---|"]
    for engine, e in r["engines"].items():
        ip = e["inprocess_cpu_ms_per_batch"]
        lines.append(
            f"| {engine} | {e['fly_tokens_per_s'] / 1e6:.2f} M tok/s | {e['cache_tokens_per_s'] / 1e6:.2f} M tok/s | "
            f"**{e['ratio_median']:.1f}x** ({', '.join(f'{x:.1f}' for x in e['ratios'])}) | "
            f"{e['cache_main_cpu_ms_per_batch']:.2f} ms (of {e['cache_wall_ms_per_batch']:.2f} ms wall) | "
            f"{e['fly_workers_cpu_ms_per_batch']:.1f} / {e['cache_workers_cpu_ms_per_batch']:.1f} ms | "
            f"{ip['fly']:.2f} / {ip['cache']:.2f} ms | {e['build_seconds']:.2f} s | "
            f"{e['epoch_on_the_fly_seconds']:.2f} s ({e['build_over_epoch']:.2f}x) |")
    first = next(iter(r["engines"].values()))
    per = ", ".join(f"{n} {v:.2f}" for n, v in first["cache_bytes_per_token_by_source"].items())
    for engine, e in r["engines"].items():
        ip, main_ms = e["inprocess_cpu_ms_per_batch"], e["cache_main_cpu_ms_per_batch"]
        workers_ms, wall_ms = e["cache_workers_cpu_ms_per_batch"], e["cache_wall_ms_per_batch"]
        tokens = r["T"] * r["B"]
        lines += ["", f"{engine}: the cache takes tokenizing out of a batch's work ({ip['fly']:.2f} -> "
                      f"{ip['cache']:.2f} ms of CPU in one process, {ip['fly'] / ip['cache']:.1f}x less), but not the "
                      f"rest: mixing, best-fit packing and collation (the {ip['cache']:.2f} ms), then moving the batch "
                      f"to the training process ({workers_ms - ip['cache']:.1f} ms more in the workers, "
                      f"{main_ms:.2f} ms in the training process). On 2 cores all of it shares the two, so the "
                      f"delivered rate rises {e['ratio_median']:.1f}x{', not 10x' if e['ratio_median'] < 10 else ''}. "
                      "The training process is not the "
                      f"limit here ({main_ms:.2f} of {wall_ms:.2f} ms a batch); it would be at "
                      f"~{tokens / main_ms / 1e3:.0f} M tokens/s, with "
                      f"~{workers_ms / main_ms:.0f} cache workers on cores of their own.",
                  "", f"{engine}: 10x would be {10 * e['fly_tokens_per_s'] / 1e6:.1f} M tokens/s, a batch every "
                      f"{tokens / (10 * e['fly_tokens_per_s']) * 1e3:.2f} ms: at most "
                      f"{2 * tokens / (10 * e['fly_tokens_per_s']) * 1e3:.2f} ms of CPU a batch on the 2 cores for "
                      f"everything, against {workers_ms + main_ms:.2f} ms now ({workers_ms:.2f} in the workers, "
                      f"{main_ms:.2f} in the training process)."]
    bd = r.get("breakdown")
    if bd:
        wm, wo = bd["worker_main_thread_ms"], bd["worker_other_threads_ms"]
        total = sum(wm.values()) + sum(wo.values())
        labels = {"graph": "the nodes: reader, mixer, best-fit packer, collation (minus reading)",
                  "read": "reading the cache files (parquet decode)",
                  "wire": "the batch's arrays into the shared-memory ring", "state": "the node graph's state",
                  "delta": "torchdata's incremental delta of that state",
                  "rest of the worker loop": "the rest of torchdata's worker loop (the queues: index in, "
                                             "batch message out)"}
        feeder = " (writes a message only when the pipe lacks room: pipes/compat/mp_queue.py)"
        lines += ["", f"Where a cached batch's CPU goes, one worker, {bd['batches']:,} batches (its threads' CPU "
                      "time; the parts of its main thread timed inside it):", "",
                  "| where | ms a batch | share of the worker |", "|---|---|---|"]
        lines += [f"| worker: {labels.get(k, k)} | {v:.3f} | {100 * v / total:.0f}% |" for k, v in wm.items()]
        lines += [f"| worker thread {k}{feeder if k == 'QueueFeederThread' else ''} | {v:.3f} | "
                  f"{100 * v / total:.0f}% |" for k, v in wo.items()]
        lines += [f"| training process (all of it) | {bd['training_process_ms']:.3f} | |"]
        ip = r["engines"].get(bd["engine"], {}).get("inprocess_cpu_ms_per_batch", {}).get("cache")
        if ip:
            lines += ["", f"The nodes and the reading take {wm['graph'] + wm['read']:.2f} ms a batch in the worker; "
                          f"the whole loop in one process took {ip:.2f} ms (table above). The rest of torchdata's loop "
                          "is torch's machinery for moving a batch between processes."]
    d = r["disk_32k"]
    per32 = ", ".join(f"{n} {v:.2f}" for n, v in d["bytes_per_token_by_source"].items())
    lines += ["", f"Disk (uint16 ids, zstd): {first['cache_bytes_per_token']:.2f} bytes per token with the demo "
                  f"tokenizer ({per}; {first['corpus_tokens']:,} tokens), {d['bytes_per_token']:.2f} with a "
                  f"{d['vocab']:,}-id BPE trained on the corpus ({per32}; {d['tokens']:,} tokens): "
                  f"~{first['cache_bytes_per_token']:.1f}-{d['bytes_per_token']:.1f} GB per billion tokens."]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
