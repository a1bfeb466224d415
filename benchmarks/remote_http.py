"""HTTP(S) and Hugging Face Hub sources behind a slow link (issue 43), against the same server fast.

The store is tests/http_server.py in a process of its own: plain files with range requests
(``https://`` sources are lists of URLs) and the Hub's API as ``huggingface_hub`` calls it (``hf://``
sources, ``HF_ENDPOINT`` pointed at it). Two servers run side by side: one answering at once, one
after ``--latency`` (default 100 ms) per request with each answer's body paced at ``--bandwidth``
(default 20 MB/s) per connection. The corpus is benchmarks/remote.py's (the demo corpus as two
sources, ``code`` and ``prose``, mixed 60/40 by tokens), bestfit, T=2048, B=8, 2 workers, the shipped
tokenizer, an endless stream; the same files read from local disk too.

Requests of a job: 8 ranks x 4 workers built one after the other on this host (the host cache,
host_cache.py, fresh), the requests until every rank has its first batch.

Per run, in a fresh interpreter (imports untimed): ``first`` (``pretrain(...)`` to the first batch
in hand), tokens/s over ``--batches`` batches after ``--warmup``, and the requests the server
counted: to the first batch and per GB sent. Variants interleaved round by round; each variant's
best run is reported (this machine's speed drifts; other jobs only slow a run), with the ratio to
the same store without latency and to local disk. Every run's batches are hashed: all variants
must give the same stream.

Targets (issue 43): at 100 ms + 20 MB/s, >= 0.95x the tokens/s of the same store without latency,
judged on the median over rounds of the two runs of one round (best run against best run is given
beside it: one fast outlier decides that one);
the first batch within local disk's + 6 round trips.

    python benchmarks/remote_http.py             # 3 rounds
    python benchmarks/remote_http.py --quick     # 1 round, 150 batches a run
Prints JSON; writes benchmarks/remote_http.json, benchmarks/remote_http.png and the
``## remote_http`` section of benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import subprocess
import sys
import time
import urllib.request
from typing import Any, Dict, List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from results_md import DEMO, write_section  # noqa: E402

SEQ_LEN, BATCH, WORKERS = 2048, 8, 2
WEIGHTS = {"code": 0.6, "prose": 0.4}
REPO = "bench/demo"
TARGET_RATIO, TARGET_RTTS = 0.95, 6


def corpus_root() -> str:
    """The demo corpus (benchmarks/remote.py's), built once; its folder holds code/ and prose/."""
    from tokenloom.sample_data import build_demo_corpus

    built = build_demo_corpus(os.path.join(ROOT, "out", "bench", "corpus"))
    dirs = {os.path.dirname(sorted(built[k])[0]) for k in WEIGHTS}
    root = os.path.commonpath(sorted(dirs))
    return root


def sources(kind: str, url: Optional[str]) -> Dict[str, Any]:
    root = corpus_root()
    rel = {k: os.path.relpath(os.path.dirname(sorted(_files(root, k))[0]), root) for k in WEIGHTS}
    if kind == "local":
        return {k: os.path.join(root, rel[k], "*.parquet") for k in WEIGHTS}
    if kind == "http":
        return {k: [f"{url}/files/{rel[k]}/{os.path.basename(p)}" for p in sorted(_files(root, k))] for k in WEIGHTS}
    return {k: f"hf://datasets/{REPO}/{rel[k]}/*.parquet" for k in WEIGHTS}


def _files(root: str, kind: str) -> List[str]:
    from tokenloom.sample_data import build_demo_corpus
    return build_demo_corpus(os.path.join(ROOT, "out", "bench", "corpus"))[kind]


def _stats(url: Optional[str]) -> Dict[str, int]:
    if url is None:
        return {"requests": 0, "sent": 0}
    with urllib.request.urlopen(f"{url}/_stats") as r:
        return json.loads(r.read())


def task_run(kind: str, url: Optional[str], warmup: int, batches: int) -> dict:
    import tokenloom.recipes  # noqa: F401 - imports are not the loader's time
    from tokenloom.recipes import pretrain
    from tokenloom.sample_data import default_tokenizer_path

    srcs = sources(kind, url)
    h = hashlib.sha256()
    s0 = _stats(url)
    t0 = time.perf_counter()
    loader = pretrain(srcs, tokenizer=default_tokenizer_path(), seq_len=SEQ_LEN, batch_size=BATCH, weights=WEIGHTS,
                      num_workers=WORKERS, seed=0)
    it = iter(loader)
    b = next(it)
    first = time.perf_counter() - t0
    s1 = _stats(url)
    h.update(b["input_ids"].numpy().tobytes())
    for _ in range(warmup - 1):
        h.update(next(it)["input_ids"].numpy().tobytes())
    tokens, t1 = 0, time.perf_counter()
    for _ in range(batches):
        b = next(it)
        tokens += int((b["segment_ids"] != 0).sum())
        h.update(b["input_ids"].numpy().tobytes())
    seconds = time.perf_counter() - t1
    s2 = _stats(url)
    sent = s2["sent"] - s0["sent"]
    return {"first_s": first, "tokens_per_s": tokens / seconds, "digest": h.hexdigest()[:16],
            "requests_first": s1["requests"] - s0["requests"], "requests": s2["requests"] - s0["requests"],
            "sent": sent, "requests_per_gb": (s2["requests"] - s0["requests"]) / max(sent, 1) * 1e9}


def task_ranks(kind: str, url: str, ranks: int, workers: int) -> dict:
    """Requests the server counts while each of ``ranks`` ranks (``workers`` workers each), built one
    after the other in this process as a job's ranks on one host would be, reaches its first batch."""
    from tokenloom.recipes import pretrain
    from tokenloom.sample_data import default_tokenizer_path

    srcs = sources(kind, url)
    per_rank = []
    for rank in range(ranks):
        s0 = _stats(url)
        loader = pretrain(srcs, tokenizer=default_tokenizer_path(), seq_len=SEQ_LEN, batch_size=BATCH,
                          weights=WEIGHTS, num_workers=workers, seed=0, rank=rank, world_size=ranks)
        it = iter(loader)
        next(it)
        per_rank.append(_stats(url)["requests"] - s0["requests"])
        del it, loader
    return {"per_rank": per_rank, "total": sum(per_rank)}


def start_server(root: str, latency: float, bandwidth: float) -> tuple:
    proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "tests", "http_server.py"), root, REPO, str(latency),
                             str(bandwidth)], stdout=subprocess.PIPE, text=True)
    url = proc.stdout.readline().strip()
    return proc, url


def child(env: Dict[str, str], **params: Any) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--task", json.dumps(params)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    if out.returncode != 0:
        raise RuntimeError(f"{params}: exit {out.returncode}\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--batches", type=int, default=None)
    ap.add_argument("--latency", type=float, default=0.1)
    ap.add_argument("--bandwidth", type=float, default=20e6)
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--render", action="store_true", help="summarize benchmarks/remote_http.json again and write")
    ap.add_argument("--task", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.task:
        params = json.loads(args.task)
        task = task_ranks if "ranks" in params else task_run
        print(json.dumps(task(**params)))
        return 0
    if args.render:
        with open(os.path.join(HERE, "remote_http.json")) as f:
            saved = json.load(f)
        runs = {k: v["runs"] for k, v in saved["variants"].items()}
        write(summarize(runs, saved["ranks_8x4"], saved["rounds"], saved["batches"], saved["latency_s"],
                        saved["bandwidth"]), quick=saved["rounds"] == 1)
        return 0
    rounds = args.rounds or (1 if args.quick else 3)
    batches = args.batches or (150 if args.quick else 400)
    root = corpus_root()
    fast, fast_url = start_server(root, 0.0, 0.0)
    slow, slow_url = start_server(root, args.latency, args.bandwidth)
    variants = [("local", "local", None), ("http fast", "http", fast_url), ("http slow", "http", slow_url),
                ("hf fast", "hf", fast_url), ("hf slow", "hf", slow_url)]
    runs: Dict[str, List[dict]] = {v[0]: [] for v in variants}
    try:
        for r in range(rounds):
            for name, kind, url in variants:
                env = dict(os.environ, PYTHONHASHSEED="0", HF_ENDPOINT=url or "", HF_HUB_DISABLE_TELEMETRY="1")
                got = child(env, kind=kind, url=url, warmup=args.warmup, batches=batches)
                runs[name].append(got)
                print(f"round {r}: {name}: {got['tokens_per_s'] / 1e6:.2f} M tokens/s, first {got['first_s']:.2f} s, "
                      f"{got['requests_first']} requests to the first batch", file=sys.stderr, flush=True)
        # a job of 8 ranks x 4 workers on one host, each host cache fresh (host_cache.py)
        import tempfile
        ranks = {}
        for kind in ("http", "hf"):
            with tempfile.TemporaryDirectory() as cache:
                env = dict(os.environ, PYTHONHASHSEED="0", HF_ENDPOINT=fast_url, HF_HUB_DISABLE_TELEMETRY="1",
                           TOKENLOOM_CACHE=cache)
                ranks[kind] = child(env, kind=kind, url=fast_url, ranks=8, workers=4)
            print(f"8 ranks x 4 workers, {kind}: {ranks[kind]['total']} requests to every rank's first batch "
                  f"{ranks[kind]['per_rank']}", file=sys.stderr, flush=True)
    finally:
        for p in (fast, slow):
            p.terminate()
    out = summarize(runs, ranks, rounds, batches, args.latency, args.bandwidth)
    print(json.dumps({k: v for k, v in out.items() if k != "variants"} | {
        "variants": {k: {kk: vv for kk, vv in v.items() if kk != "runs"} for k, v in out["variants"].items()}}, indent=1))
    if not args.no_write:
        write(out, args.quick)
    return 0 if out["same_batches"] else 1


def write(out: dict, quick: bool) -> None:
    with open(os.path.join(HERE, "remote_http.json"), "w") as f:
        json.dump(out, f, indent=1)
    plot(out, os.path.join(HERE, "remote_http.png"))
    cmd = "python benchmarks/remote_http.py" + (" --quick" if quick else "")
    write_section(os.path.join(HERE, "RESULTS.md"), "remote_http", markdown(out, cmd), tokenizer=DEMO)


def summarize(runs: Dict[str, List[dict]], ranks: dict, rounds: int, batches: int, latency: float,
              bandwidth: float) -> dict:
    """Best run per variant, and per store the slow server against the fast one: best against best,
    and the median over rounds of the two runs of one round (the machine drifts between rounds)."""
    import statistics
    digests = {r["digest"] for v in runs.values() for r in v}
    best = {k: max(v, key=lambda r: r["tokens_per_s"]) for k, v in runs.items()}
    first = {k: min(r["first_s"] for r in v) for k, v in runs.items()}
    out = {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores", "rounds": rounds, "batches": batches,
        "latency_s": latency, "bandwidth": bandwidth, "same_batches": len(digests) == 1,
        "ranks_8x4": ranks,
        "variants": {k: {"tokens_per_s": best[k]["tokens_per_s"], "first_s": first[k],
                         "requests_first": best[k]["requests_first"], "requests_per_gb": best[k]["requests_per_gb"],
                         "runs": runs[k]} for k in runs},
    }
    local = out["variants"]["local"]
    for store in ("http", "hf"):
        slow_v, fast_v = out["variants"][f"{store} slow"], out["variants"][f"{store} fast"]
        ratio = slow_v["tokens_per_s"] / fast_v["tokens_per_s"]
        within = statistics.median(s["tokens_per_s"] / f["tokens_per_s"]
                                   for s, f in zip(runs[f"{store} slow"], runs[f"{store} fast"]))
        budget = local["first_s"] + TARGET_RTTS * latency
        out[store] = {"slow_vs_fast": ratio, "slow_vs_fast_within_rounds": within,
                      "slow_vs_local": slow_v["tokens_per_s"] / local["tokens_per_s"], "first_budget_s": budget,
                      "pass": bool(within >= TARGET_RATIO and slow_v["first_s"] <= budget)}
    return out


def markdown(out: dict, command: str) -> str:
    lines = [f"`{command}` ({out['machine']}; {out['rounds']} round(s), variants interleaved, each run a fresh "
             f"interpreter, best run per variant). Store: tests/http_server.py, fast (no latency) and slow "
             f"({out['latency_s'] * 1e3:.0f} ms a request, {out['bandwidth'] / 1e6:.0f} MB/s per connection); the demo "
             "corpus as two sources (code 60%, prose 40%), bestfit, T=2048, B=8, 2 workers, the shipped tokenizer. "
             f"Same batches in every run: {out['same_batches']}.", "",
             "| variant | M tokens/s | first batch (s) | requests to the first batch | requests per GB |",
             "|---|---|---|---|---|"]
    for k, v in out["variants"].items():
        lines.append(f"| {k} | {v['tokens_per_s'] / 1e6:.2f} | {v['first_s']:.2f} | {v['requests_first']} | "
                     f"{v['requests_per_gb']:.0f} |")
    lines += ["", "| store | slow / fast tokens/s (best runs) | within rounds (median) | slow / local | "
              "first-batch budget (local + 6 RTT) | targets |", "|---|---|---|---|---|---|"]
    for store in ("http", "hf"):
        s = out[store]
        lines.append(f"| {store} | {s['slow_vs_fast']:.2f}x | {s['slow_vs_fast_within_rounds']:.2f}x | "
                     f"{s['slow_vs_local']:.2f}x | {s['first_budget_s']:.2f} s | {'pass' if s['pass'] else 'FAIL'} |")
    lines += ["", "A job of 8 ranks x 4 workers on one host (ranks built one after the other, the host cache fresh): "
              "requests the server counted until every rank had its first batch: "
              + ", ".join(f"{k} {v['total']} ({v['per_rank'][0]} for the first rank, then "
                          f"{min(v['per_rank'][1:])}-{max(v['per_rank'][1:])} each)" for k, v in out["ranks_8x4"].items())
              + ".", "", "![remote_http](remote_http.png)"]
    return "\n".join(lines)


def plot(out: dict, path: str) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    names = list(out["variants"])
    fig, ax = plt.subplots(1, 2, figsize=(10, 3.5))
    ax[0].bar(names, [out["variants"][n]["tokens_per_s"] / 1e6 for n in names], color="#4c72b0")
    ax[0].set_ylabel("M tokens/s")
    ax[1].bar(names, [out["variants"][n]["first_s"] for n in names], color="#dd8452")
    ax[1].set_ylabel("first batch (s)")
    for a in ax:
        a.tick_params(axis="x", rotation=30)
    fig.suptitle(f"HTTP and Hub sources, {out['latency_s'] * 1e3:.0f} ms / {out['bandwidth'] / 1e6:.0f} MB/s vs fast")
    fig.tight_layout()
    fig.savefig(path, dpi=90)


if __name__ == "__main__":
    sys.exit(main())
