"""Remote storage beside the peers (issue 26): the same loaders as peers.py, reading from a slow S3.

Issue 26 asks for a first batch from object storage within 1.5x of local disk's. Local disk's
first batch is ~0.1-0.3 s here, and one request to a store 100 ms away costs 0.1 s before its
first byte, so that target is below one round trip for any loader. This benchmark asks what the
loaders users would pick instead do in the same place, and what a round trip costs each of them:

- the store: moto's S3 on loopback behind remote.py's proxy, every request answered after
  100 ms and paced at 20 MB/s per connection (remote.py's ``100ms-20MBps``);
- the corpus and the loaders of peers.py (8,000 man pages in 8 parquet files, rows of 2049
  tokens, B=8, 2 workers): tokenloom's ``pretrain`` tokenizing on the fly, tokenloom's
  ``pretrain`` on its token cache, LitData's ``TokensLoader`` and Mosaic Streaming's MDS, each
  built once (locally, as peers.py builds them) and uploaded to the bucket as it is;
- each loader run from local disk and from the bucket, in a fresh interpreter (the library
  imported before the clock starts); LitData and Mosaic download into a local cache directory,
  emptied before every run, as on a fresh node;
- measured: first batch (build + ``iter`` + ``next``) and tokens/s over ``--batches`` batches
  after it (5x as many for the pre-tokenized, as peers.py), ratios against the same loader from
  local disk within the round; and the store's own floor: the seconds to list the bucket and read
  one byte range with pyarrow, i.e. the round trips any loader pays before its first batch.

    python benchmarks/remote_peers.py             # ~10 minutes on 2 cores (3 rounds)
    python benchmarks/remote_peers.py --quick     # 1 round, 100 batches
Needs the peers and moto (``make remote-peers`` runs it in ``.venv-peers``). Prints JSON; writes
benchmarks/remote_peers.json, benchmarks/remote_peers.png and ``## remote-peers`` in RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List

HERE = os.path.abspath(os.path.dirname(__file__))
sys.path.insert(0, HERE)

import peers  # noqa: E402 - benchmarks/ is on sys.path
import remote  # noqa: E402
from results_md import STAND_IN, real, write_section  # noqa: E402

SETTING = remote.FIRST_SETTING  # 100 ms, 20 MB/s per connection
PREFIX = {"text": "text", "tokenloom_cache": "tokenloom_cache", "litdata": "litdata", "mosaic": "mds"}
NAMES = ["tokenloom", "tokenloom_cache", "litdata", "mosaic"]


# --- where each loader reads from --------------------------------------------------------------

def _uri(port: int, key: str) -> str:
    return f"s3://{remote.BUCKET}/{key}?endpoint_override=127.0.0.1:{port}&scheme=http&region=us-east-1"


def _remote_ctx(ctx: Dict[str, Any], port: int) -> Dict[str, Any]:
    return dict(ctx, files=_uri(port, f"{PREFIX['text']}/*.parquet"), cache_dir=_uri(port, PREFIX["tokenloom_cache"]),
                litdata_dir=f"s3://{remote.BUCKET}/{PREFIX['litdata']}", mds_dir=f"s3://{remote.BUCKET}/{PREFIX['mosaic']}",
                endpoint=f"http://127.0.0.1:{port}", scratch=tempfile.mkdtemp(prefix="remote_peers_"))


class RemoteLitData(peers.LitData):
    def build(self):
        from litdata import StreamingDataLoader, StreamingDataset, TokensLoader
        from litdata.streaming import downloader

        # LitData fetches chunks with obstore, which refuses a plain-http endpoint (the bench's store on loopback)
        # unless told; a real bucket is https and needs no such option. Its workers fork with this module state.
        downloader._OBSTORE_CLIENT_OPTIONS = dict(downloader._OBSTORE_CLIENT_OPTIONS, allow_http="true")
        ds = StreamingDataset(self.ctx["litdata_dir"], item_loader=TokensLoader(block_size=peers.ROW), shuffle=True,
                              drop_last=True, seed=0, cache_dir=self.ctx["scratch"],
                              storage_options={"endpoint_url": self.ctx["endpoint"]})
        self.loader = StreamingDataLoader(ds, batch_size=peers.B, num_workers=peers.WORKERS, drop_last=True)


class RemoteMosaic(peers.Mosaic):
    def build(self):
        streaming = peers._import_streaming()
        from streaming.base.util import clean_stale_shared_memory

        clean_stale_shared_memory()
        os.environ["S3_ENDPOINT_URL"] = self.ctx["endpoint"]  # Mosaic's way to name an S3-compatible endpoint
        ds = streaming.StreamingDataset(remote=self.ctx["mds_dir"], local=self.ctx["scratch"], shuffle=True,
                                        shuffle_seed=0, batch_size=peers.B)
        self.loader = streaming.StreamingDataLoader(ds, batch_size=peers.B, num_workers=peers.WORKERS, drop_last=True)


REMOTE = {"tokenloom": peers.TokenloomLoader, "tokenloom_cache": peers.TokenloomCache, "litdata": RemoteLitData,
          "mosaic": RemoteMosaic}


# --- child tasks ---------------------------------------------------------------------------------

def task_run(name: str, corpus: Dict[str, Any], batches: int, port: Any, store: int) -> Dict[str, Any]:
    peers._import_for(name)
    ctx = peers._ctx(corpus)
    cls = peers.LOADERS[name]["cls"]
    if port is not None:
        ctx, cls = _remote_ctx(ctx, port), REMOTE[name]
    try:  # the store's CPU (moto and the proxy, on the same cores) counts with the loader's
        r = peers.timed(cls(ctx), batches, lambda: remote.cpu_seconds(store))
    finally:
        if "scratch" in ctx:
            shutil.rmtree(ctx["scratch"], ignore_errors=True)
    return {"first_s": r["first_batch_s"], "tokens_per_s": r["tokens_per_s"], "tokens": r["tokens"],
            "seconds": r["seconds"], "cpu_s_per_m_tokens": r["cpu_s_per_m_tokens"], "store_cpu_s": r["cpu_elsewhere_s"]}


def task_floor(port: int, key: str) -> Dict[str, Any]:
    """The store's own cost before any first batch: list the text files, then read 1 MiB of one (pyarrow,
    as tokenloom reads; a loader needs at least the listing or an index, then its first bytes)."""
    import pyarrow.fs as pafs

    fs = pafs.S3FileSystem(endpoint_override=f"127.0.0.1:{port}", scheme="http", region="us-east-1")
    t0 = time.perf_counter()
    infos = fs.get_file_info(pafs.FileSelector(f"{remote.BUCKET}/{key}"))
    listed = time.perf_counter() - t0
    with fs.open_input_file(infos[0].path) as f:
        f.read_at(1 << 20, 0)
    return {"list_s": listed, "list_open_read_s": time.perf_counter() - t0}


TASKS = {"run": task_run, "floor": task_floor}


def spawn(task: str, **params: Any) -> Dict[str, Any]:
    cmd = [sys.executable, os.path.abspath(__file__), "--task", task, "--params", json.dumps(params)]
    env = remote._env(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"{task} {params.get('name')} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    print(f"# {task} {params.get('name', '')} port={params.get('port')}: "
          f"{json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in result.items()})}", file=sys.stderr)
    return result


# --- the run ---------------------------------------------------------------------------------------

def _upload(ports: Dict[str, Any], corpus: Dict[str, Any]) -> None:
    """The text files and every build, straight to moto (not through the slow proxy)."""
    import boto3

    client = boto3.client("s3", endpoint_url=f"http://127.0.0.1:{ports['moto']}", region_name="us-east-1",
                          aws_access_key_id="bench", aws_secret_access_key="bench")
    client.create_bucket(Bucket=remote.BUCKET)
    trees = {PREFIX["text"]: os.path.dirname(corpus["files"][0])}
    trees.update({PREFIX[n]: peers._build_dir(n) for n in ("tokenloom_cache", "litdata", "mosaic")})
    for prefix, root in trees.items():
        for d, _, files in os.walk(root):
            for f in files:
                if prefix == PREFIX["text"] and not f.endswith(".parquet"):
                    continue
                rel = os.path.relpath(os.path.join(d, f), root)
                client.upload_file(os.path.join(d, f), remote.BUCKET, f"{prefix}/{rel}")


def run(args) -> Dict[str, Any]:
    load0 = os.getloadavg()
    corpus = peers.prepare(args.pages, args.tokenizer)
    builds = {n: spawn("build_peer", name=n, corpus=corpus) for n in ("tokenloom_cache", "litdata", "mosaic")}
    proc, ports = remote.start_store({})
    port = ports["proxies"][SETTING]
    rounds: List[Dict[str, Any]] = []
    floors: List[Dict[str, Any]] = []
    try:
        _upload(ports, corpus)
        for r in range(args.rounds):
            floors.append(spawn("floor", port=port, key=PREFIX["text"]))
            runs: Dict[str, Any] = {}
            order = NAMES[r % len(NAMES):] + NAMES[:r % len(NAMES)]
            for n in order:
                window = args.batches * (peers.PRE_WINDOW if peers.LOADERS[n]["group"] == "pre" else 1)
                runs[n] = {w: spawn("run", name=n, corpus=corpus, batches=window, port=p, store=proc.pid)
                           for w, p in (("local", None), ("s3", port))}
            rounds.append(runs)
    finally:
        proc.stdin.close()
        proc.wait(timeout=30)
    return {"summary": summarize(rounds, floors), "rounds": rounds, "floors": floors, "builds": builds,
            "corpus": {"kind": corpus["kind"], "pages": corpus["pages"], "characters": corpus["characters"],
                       "files": len(corpus["files"])},
            "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                        "load_start": [round(x, 2) for x in load0], "load_end": [round(x, 2) for x in os.getloadavg()]},
            "settings": {"store": SETTING, "rounds": args.rounds, "batches": args.batches, "pages": args.pages,
                         "T": peers.T, "B": peers.B, "workers": peers.WORKERS, "pre_window": peers.PRE_WINDOW,
                         "tokenizer": args.tokenizer},
            "versions": {p: _version(p) for p in ("litdata", "mosaicml-streaming", "pyarrow", "boto3")}}


def _version(p: str) -> Any:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(p)
    except PackageNotFoundError:
        return None


def summarize(rounds: List[Dict[str, Any]], floors: List[Dict[str, Any]]) -> Dict[str, Any]:
    """Per loader: best first batch and tokens/s from each place, and the medians over rounds of the
    within-round ratios s3 / local (first batch, tokens/s) and of s3 first batch minus local."""
    out: Dict[str, Any] = {"floor_s": min(f["list_open_read_s"] for f in floors),
                           "list_s": min(f["list_s"] for f in floors)}
    for n in NAMES:
        per = [r[n] for r in rounds]
        out[n] = {
            "label": peers.LOADERS[n]["label"],
            "first_local_s": min(p["local"]["first_s"] for p in per),
            "first_s3_s": min(p["s3"]["first_s"] for p in per),
            "first_ratio": statistics.median(p["s3"]["first_s"] / p["local"]["first_s"] for p in per),
            "first_added_s": statistics.median(p["s3"]["first_s"] - p["local"]["first_s"] for p in per),
            "tokens_local": max(p["local"]["tokens_per_s"] for p in per),
            "tokens_s3": max(p["s3"]["tokens_per_s"] for p in per),
            "tokens_ratio": statistics.median(p["s3"]["tokens_per_s"] / p["local"]["tokens_per_s"] for p in per),
            "cpu_local": statistics.median(p["local"]["cpu_s_per_m_tokens"] for p in per),
            "cpu_s3": statistics.median(p["s3"]["cpu_s_per_m_tokens"] for p in per),
            "store_share": statistics.median(p["s3"]["store_cpu_s"] / p["s3"]["seconds"] / 2 for p in per),
        }
    return out


def markdown(res: Dict[str, Any], command: str) -> str:
    s, st, m = res["summary"], res["settings"], res["machine"]
    latency, bandwidth = remote.SETTINGS[st["store"]]
    lines = [
        f"Command: `{command}` (in `.venv-peers`: `make remote-peers`; writes `benchmarks/remote_peers.json`, "
        f"`benchmarks/remote_peers.png`); {m['cpus']} CPUs, CPython {m['python']}, load average {m['load_start']} at "
        f"start, {m['load_end']} at end. {st['rounds']} interleaved rounds; in each, every loader runs from local disk "
        f"and from the bucket, each run in a fresh interpreter. Versions: "
        + ", ".join(f"{k} {v}" for k, v in res["versions"].items()) + ".",
        "",
        f"Store: moto's S3 behind remote.py's proxy, {latency * 1000:.0f} ms before every answer and "
        f"{bandwidth / 1e6:.0f} MB/s per connection. Corpus and loaders: peers.py's ({res['corpus']['pages']:,} "
        f"man pages in {res['corpus']['files']} parquet files; rows of {peers.ROW} tokens, B={st['B']}, "
        f"{st['workers']} workers), every build made once locally and uploaded as it is. LitData and Mosaic "
        "download into a local directory emptied before each run (a fresh node).",
        "",
        f"The store's floor, pyarrow alone: listing the text files {s['list_s']:.2f} s, then opening one and "
        f"reading 1 MiB {s['floor_s']:.2f} s in all (best of {len(res['floors'])}).",
        "",
        "| loader | first batch local s | first batch S3 s | S3 / local | S3 minus local s | tokens/s local M | "
        "tokens/s S3 M | S3 / local | CPU s per M tokens local | S3 (store's share of the cores) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for n in NAMES:
        v = s[n]
        lines.append(f"| {v['label']} | {v['first_local_s']:.2f} | {v['first_s3_s']:.2f} | {v['first_ratio']:.1f}x | "
                     f"{v['first_added_s']:.2f} | {v['tokens_local'] / 1e6:.2f} | {v['tokens_s3'] / 1e6:.2f} | "
                     f"{v['tokens_ratio']:.2f}x | {v['cpu_local']:.3f} | {v['cpu_s3']:.3f} ({v['store_share']:.0%}) |")
    lines += [
        "",
        "*first batch*: build + `iter` + `next`, best run; *S3 / local* and *S3 minus local*: within a round, "
        "median over rounds. *tokens/s*: best run, over "
        f"{st['batches']} batches after the first ({st['batches'] * st['pre_window']} for the pre-tokenized, whose "
        "window includes their downloads of the rest of the corpus). *CPU s per M tokens*: the loader's processes "
        "and, from the bucket, the store's (moto and the proxy, one process on the same 2 cores), median over "
        "rounds; in brackets the share of the 2 cores the store took during the window.",
        "",
        "What is not like for like. *The first batch waits for what a loader fetches whole*: tokenloom fetches "
        "row groups (here ~0.3 MB of ids or ~0.5 MB of text each) in parallel range reads; LitData and Mosaic download a "
        "whole chunk or shard file before its first sample, at their builds' defaults here (LitData: 2 chunks of "
        "24-26 MB, one per build worker, fetched in parallel range reads; Mosaic: one 51 MB shard in one stream), "
        "so a build with smaller chunks or shards starts sooner, and reads more files. *Later epochs*: LitData and "
        "Mosaic keep what they downloaded on local disk and read the next epochs from there; tokenloom keeps "
        "nothing on disk and fetches a row group again each epoch. The pre-tokenized window is ~3.9 passes over "
        "this 12.7 M-token corpus, so tokenloom's cache fetched the corpus ~4 times in it (the store took 1-2% of the "
        "cores for it); a pretraining corpus is read about once. *The floor* "
        "is pyarrow's own cost to list the bucket and read 1 MiB of one file (list, size lookup, read: 3 round "
        "trips); tokenloom's first batch from the store is local disk's plus ~4 round trips and the transfer.",
        "",
        "![remote peers](remote_peers.png)",
    ]
    return "\n".join(lines)


def plot(res: Dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = res["summary"]
    labels = [s[n]["label"].replace("tokenloom pretrain", "tokenloom") for n in NAMES]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    x = range(len(NAMES))
    axes[0].bar([i - 0.2 for i in x], [s[n]["first_local_s"] for n in NAMES], 0.4, label="local disk")
    axes[0].bar([i + 0.2 for i in x], [s[n]["first_s3_s"] for n in NAMES], 0.4, label="S3, 100 ms, 20 MB/s")
    axes[0].axhline(s["floor_s"], color="grey", ls="--", label="list + open + read 1 MiB (pyarrow)")
    axes[0].set_ylabel("first batch, s (lower is better)")
    axes[1].bar(list(x), [s[n]["tokens_ratio"] for n in NAMES], 0.5)
    axes[1].axhline(1.0, color="grey", ls="--")
    axes[1].set_ylabel("tokens/s, S3 / local (higher is better)")
    for ax in axes:
        ax.set_xticks(list(x))
        ax.set_xticklabels(labels, rotation=15, fontsize=8)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--batches", type=int, default=None)
    ap.add_argument("--pages", type=int, default=8000)
    ap.add_argument("--tokenizer", default="cl100k", help="cl100k or o200k (tests/real_tokenizers.py)")
    ap.add_argument("--render", action="store_true", help="the plot and RESULTS.md section from remote_peers.json")
    ap.add_argument("--task", help=argparse.SUPPRESS)
    ap.add_argument("--params", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.task:
        params = json.loads(args.params)
        if args.task == "build_peer":
            print(json.dumps(peers.task_build(params["name"], params["corpus"])))
        else:
            print(json.dumps(TASKS[args.task](**params)))
        return
    jpath = os.path.join(HERE, "remote_peers.json")
    if args.render:
        with open(jpath) as f:
            res = json.load(f)
    else:
        args.rounds = args.rounds or (1 if args.quick else 3)
        args.batches = args.batches or (100 if args.quick else 600)
        res = run(args)
        res["command"] = "python benchmarks/remote_peers.py" + (" --quick" if args.quick else "") + \
            (f" --rounds {args.rounds}" if args.rounds != 3 and not args.quick else "")
        with open(jpath, "w") as f:
            json.dump(res, f, indent=2)
    print(json.dumps(res["summary"], indent=2))
    plot(res, os.path.join(HERE, "remote_peers.png"))
    write_section(os.path.join(HERE, "RESULTS.md"), "remote-peers", markdown(res, res["command"]),
                  # a remote_peers.json without the key predates the real tokenizers here
                  tokenizer=real(res["settings"]["tokenizer"]) if "tokenizer" in res["settings"] else STAND_IN)


if __name__ == "__main__":
    main()
