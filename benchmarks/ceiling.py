"""The tokenizer ceiling: the most tokens per second this machine's cores get out of a tokenizer, nothing else running.

A loader cannot tokenize faster than its tokenizer alone on the same cores, so loaders are reported as
a fraction of this. It is the best of four configurations, because which wins depends on the tokenizer
and the machine (issue 16 measured cl100k on 2 cores: one process on the `tokenizers` thread pool
1.4-1.8 M tokens/s, two single-threaded processes 1.0-1.2 M, as two copies of a 100k vocabulary compete
for the caches):

- ``threads``: one process on the engine's own threads, batches of 256 documents (`tokenizers`:
  ``encode_batch_fast`` on its Rayon pool; tiktoken: ``encode_ordinary_batch(num_threads=cores)``;
  fastokens: ``encode_batch_flat`` on its own threads);
- ``procs``: one single-threaded process per core (forked once the texts are in memory, each given a
  share of about equal characters), batches of 64;

each for every engine that runs the tokenizer with `tokenizers`' ids (pipes/engines.py: the loader
picks the fastest by itself). Two passes over the texts are timed: the first (``cold_*``: the
engine's word caches start empty, as a loader's do on a corpus it reads once) and the second (the
plain ``seconds``/``tokens``: warm, every word seen before, as a loader's caches are on a corpus it
cycles through). The texts are in memory: no reading, no packing.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from typing import Any, Callable, List

#: The tokenizer's own best configuration: its thread pool on batches of this many documents.
THREADS_BATCH = 256
#: What one single-threaded process encodes per call (the loader's own batch).
PROC_BATCH = 64
ENGINES = ("tokenizers", "tiktoken", "fastokens")
MODES = ("threads", "procs")


def engines_for(tokenizer_path: str) -> List[str]:
    """The engines that run this tokenizer with the loader's ids: `tokenizers` always, tiktoken and
    fastokens where their verdicts say so (pipes/engines.py)."""
    from tokenloom.pipes.tokenizer import load_encoder

    verdicts = load_encoder(tokenizer_path).verdicts
    return ["tokenizers"] + [e for e in ("tiktoken", "fastokens") if verdicts.get(e, (False,))[0]]


def _encoder(engine: str, tokenizer_path: str, threads: int) -> Callable[[List[str]], int]:
    """A function: a batch of texts -> the number of ids, on ``threads`` threads."""
    if engine == "tokenizers":
        if threads == 1:
            os.environ["RAYON_NUM_THREADS"] = "1"  # read when the pool starts, at the first encode
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(tokenizer_path)
        return lambda batch: sum(len(e.ids) for e in tok.encode_batch_fast(batch, add_special_tokens=False))
    if engine == "fastokens":
        from tokenloom.pipes import fastokens_engine

        if threads == 1:
            fastokens_engine.single_thread()  # read at each batch (tests/test_engines.py)
        with open(tokenizer_path, encoding="utf-8") as f:
            fast = fastokens_engine.build(f.read())
        return lambda batch: sum(map(len, fastokens_engine.encode_batch(fast, batch)))
    from tokenloom.pipes import tiktoken_bpe
    from tokenloom.pipes.tokenizer import load_encoder

    enc = tiktoken_bpe.encoding(load_encoder(tokenizer_path)._payload)
    if threads == 1:
        core = enc._core_bpe
        return lambda batch: sum(len(core.encode_ordinary(t)) for t in batch)
    return lambda batch: sum(map(len, enc.encode_ordinary_batch(batch, num_threads=threads)))


def _encode_all(encode: Callable[[List[str]], int], texts: List[str], batch: int) -> int:
    return sum(encode(texts[i:i + batch]) for i in range(0, len(texts), batch))


def _balanced_shares(texts: List[str], k: int) -> List[List[str]]:
    """``k`` shares of about equal characters (longest first, each to the lightest share)."""
    shares: List[List[str]] = [[] for _ in range(k)]
    load = [0] * k
    for t in sorted(texts, key=len, reverse=True):
        i = load.index(min(load))
        shares[i].append(t)
        load[i] += len(t)
    return shares


def _encode_share(engine, tokenizer_path, share, ready, go, results) -> None:
    encode = _encoder(engine, tokenizer_path, 1)
    encode(["x"])  # starts what the engine starts lazily, without warming its caches on the texts
    for k in range(2):
        ready.wait()
        go[k].wait()
        cpu0 = time.process_time()
        n = _encode_all(encode, share, PROC_BATCH)
        results.put((n, time.process_time() - cpu0))


def measure(engine: str, mode: str, tokenizer_path: str, texts: List[str]) -> dict:
    """Two passes of ``texts`` through ``engine`` in ``mode`` (module docstring): wall seconds, tokens
    (one BOS per document included, as a loader adds) and CPU seconds of each; the second pass's
    under ``seconds``, ``tokens``, ``cpu_s``, the first's under ``cold_`` keys. Call in a fresh
    process: a `tokenizers` pool, once started, keeps its size, and fastokens' caches are per process."""
    if engine not in ENGINES or mode not in MODES:
        raise ValueError(f"{engine=} must be one of {ENGINES} and {mode=} one of {MODES}")
    ncpu = os.cpu_count() or 1
    passes = []
    if mode == "threads":
        encode = _encoder(engine, tokenizer_path, ncpu)
        encode(["x"])  # starts what the engine starts lazily (its pool), without warming its caches on the texts
        for _ in range(2):
            cpu0, t0 = time.process_time(), time.perf_counter()
            n = _encode_all(encode, texts, THREADS_BATCH)
            passes.append((time.perf_counter() - t0, n, time.process_time() - cpu0))
    else:
        ctx = mp.get_context("fork")  # the processes inherit the texts and the synchronisation objects
        ready, go, results = ctx.Barrier(ncpu + 1), [ctx.Event(), ctx.Event()], ctx.SimpleQueue()
        procs = [ctx.Process(target=_encode_share, args=(engine, tokenizer_path, share, ready, go, results))
                 for share in _balanced_shares(texts, ncpu)]
        for p in procs:
            p.start()
        for k in range(2):
            ready.wait(timeout=600)  # every process has its encoder (for the second pass: its first pass done)
            t0 = time.perf_counter()
            go[k].set()
            done = [results.get() for _ in procs]  # (tokens, CPU seconds of the pass) per process
            passes.append((time.perf_counter() - t0, sum(d[0] for d in done), sum(d[1] for d in done)))
        for p in procs:
            p.join()
    (cold_s, cold_n, cold_cpu), (dt, n, cpu) = passes
    return {"engine": engine, "mode": mode, "seconds": dt, "tokens": n + len(texts), "documents": len(texts),
            "cpu_s": cpu, "cold_seconds": cold_s, "cold_tokens": cold_n + len(texts), "cold_cpu_s": cold_cpu}


def rate(run: Any, cold: bool = False) -> float:
    """Tokens per second of the second pass (warm), or of the first (``cold``)."""
    return run["cold_tokens"] / run["cold_seconds"] if cold else run["tokens"] / run["seconds"]
