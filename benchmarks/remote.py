"""Remote storage (issue 26): pretrain from a slow S3 against the same corpus on local disk.

The store is moto's S3 server on loopback, in a process of its own, behind a small
HTTP proxy that makes it slow the way a far object store is: every request is answered
after ``latency`` (the proxy sleeps, then forwards it to moto) and every response body
is paced at ``bandwidth`` per connection (chunks of 16 KiB, each sent when the
connection's clock allows it), so parallel requests get more bandwidth in total, as
on S3. Settings: 100 ms and 20 MB/s, 50 ms and 100 MB/s.

The corpus is the demo corpus (``tokenloom.sample_data``) as two sources, ``code``
(4 files, 6-8 row groups each, 110-290 KB a row group) and ``prose`` (5 files, 1-8 row
groups, ~25 KB), mixed 60/40 by tokens; bestfit, T=2048, B=8, 2 workers, the shipped
tokenizer, an endless stream. The same files are read from local disk and from the
bucket. Per run, in a fresh interpreter (tokenloom imported before the clock starts):

- ``first``: ``pretrain(...)`` called to the first batch in hand (listing the footers,
  worker start, reading, tokenizing, packing);
- ``tokens/s``: tokens (``segment_ids != 0``) over ``--batches`` batches after
  ``--warmup`` batches, the loop taking batches as fast as they come;
- ``resumed``: a fresh loader, ``load_state_dict`` of a state saved after
  ``SAVE_AT`` batches (on local disk: a corpus moved to a bucket resumes), to the first
  batch in hand.

Variants: local disk (read-ahead ``auto``: off for local files), local disk with read-ahead
forced on (``TOKENLOOM_READAHEAD=all``), and per setting S3 with read-ahead off
(``TOKENLOOM_READAHEAD=0``: the reader before issue 26) and on (the default). One round
runs every variant once; rounds are interleaved and every ratio is taken within its round
against that round's local run (this 2-core machine is shared and its speed drifts); the
best round of ``--rounds`` is reported, with the median. Every run's batches are hashed:
all variants must yield the same stream, bit for bit.

Target (issue 26): at 100 ms + 20 MB/s, >= 0.95x the tokens/s of local disk and the first
batch within 1.5x of local; local disk no slower than before.

    python benchmarks/remote.py            # ~10 minutes on 2 cores
    python benchmarks/remote.py --quick    # 1 round, fewer batches
Prints JSON; writes benchmarks/remote.json, benchmarks/remote.png and the ``## remote``
section of benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import hashlib
import http.client
import http.server
import json
import os
import platform
import socket
import socketserver
import statistics
import subprocess
import sys
import threading
import time
from typing import Any, Dict, List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SEQ_LEN, BATCH, WORKERS = 2048, 8, 2
WEIGHTS = {"code": 0.6, "prose": 0.4}
BUCKET = "bench"
SETTINGS = {"100ms-20MBps": (0.100, 20e6), "50ms-100MBps": (0.050, 100e6)}
SAVE_AT = 40
TARGET_TOKENS, TARGET_FIRST = 0.95, 1.5
CHUNK = 16 << 10
TRACE = bool(os.environ.get("REMOTE_TRACE"))  # print every proxied request to the store's stderr
HOP = {"connection", "keep-alive", "proxy-connection", "transfer-encoding", "te", "trailer", "upgrade"}


# --- the slow store: moto behind a latency and bandwidth proxy (run in its own process) -----

class _Server(socketserver.ThreadingMixIn, http.server.HTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 128

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # a client that went away (a run ended) is not news


def slow_proxy(port: int, upstream: int, latency: float, bandwidth: float) -> _Server:
    """A threaded HTTP/1.1 proxy on 127.0.0.1:``port`` in front of 127.0.0.1:``upstream``: each
    request waits ``latency`` s, then its response body goes out at ``bandwidth`` bytes/s on its
    connection. Headers (Host included, so S3 signatures hold) pass through unchanged."""

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: Any) -> None:
            pass

        def _forward(self) -> None:
            t0, arrived = time.perf_counter(), time.time()
            time.sleep(latency)
            conn = getattr(self, "_upstream", None)
            if conn is None:
                conn = self._upstream = http.client.HTTPConnection("127.0.0.1", upstream, timeout=60)
            n = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(n) if n else None
            headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP}
            try:
                conn.request(self.command, self.path, body=body, headers=headers)
                resp = conn.getresponse()
                data = resp.read()
            except (OSError, http.client.HTTPException):
                conn.close()
                self._upstream = None
                raise
            self.send_response(resp.status, resp.reason)
            for k, v in resp.getheaders():
                if k.lower() not in HOP and k.lower() != "content-length":
                    self.send_header(k, v)
            if self.command == "HEAD":
                self.send_header("Content-Length", resp.getheader("Content-Length", "0"))
                self.end_headers()
                data = b""
            else:
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
            t1 = time.perf_counter()
            for i in range(0, len(data), CHUNK):
                due = t1 + i / bandwidth
                wait = due - time.perf_counter()
                if wait > 0:
                    time.sleep(wait)
                self.wfile.write(data[i:i + CHUNK])
            self.wfile.flush()
            if TRACE:
                print(f"{arrived:.3f} {time.perf_counter() - t0:.3f}s {self.command} {self.path[:90]} "
                      f"{self.headers.get('Range', '')} {len(data)}", file=sys.stderr, flush=True)

        do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = _forward

    server = _Server(("127.0.0.1", port), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve() -> None:
    """Start moto and one proxy per setting; print their ports as JSON; run until stdin closes."""
    import moto.server as moto_server

    port = _free_port()
    moto = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    moto.start()
    proxies = {}
    for name, (latency, bandwidth) in SETTINGS.items():
        p = _free_port()
        slow_proxy(p, port, latency, bandwidth)
        proxies[name] = p
    print(json.dumps({"moto": port, "proxies": proxies}), flush=True)
    sys.stdin.read()
    moto.stop()


def start_store(files: Dict[str, List[str]]) -> tuple:
    """The store process, with ``files`` uploaded to the bucket (straight to moto, not through a proxy)."""
    import boto3

    proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--serve"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=None if TRACE else subprocess.DEVNULL, text=True, env=_env())
    ports = json.loads(proc.stdout.readline())
    client = boto3.client("s3", endpoint_url=f"http://127.0.0.1:{ports['moto']}", region_name="us-east-1",
                          aws_access_key_id="bench", aws_secret_access_key="bench")
    client.create_bucket(Bucket=BUCKET)
    for kind, paths in files.items():
        for p in paths:
            with open(p, "rb") as f:
                client.put_object(Bucket=BUCKET, Key=f"{kind}/{os.path.basename(p)}", Body=f.read())
    return proc, ports


def _env(**extra: str) -> Dict[str, str]:
    env = dict(os.environ, AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench", AWS_EC2_METADATA_DISABLED="true",
               PYTHONHASHSEED="0")
    env.update(extra)
    return env


# --- one run, in a fresh interpreter ---------------------------------------------------------

def corpus() -> Dict[str, List[str]]:
    from tokenloom.sample_data import build_demo_corpus

    built = build_demo_corpus(os.path.join(ROOT, "out", "bench", "corpus"))
    return {k: sorted(built[k]) for k in WEIGHTS}


def sources(where: Any) -> Dict[str, str]:
    """Local paths (``where`` None) or the bucket behind proxy port ``where``."""
    if where is None:
        return {k: os.path.join(os.path.dirname(v[0]), "*.parquet") for k, v in corpus().items()}
    return {k: f"s3://{BUCKET}/{k}/*.parquet?endpoint_override=127.0.0.1:{where}&scheme=http&region=us-east-1"
            for k in WEIGHTS}


def build(where: Any):
    from tokenloom.recipes import pretrain
    from tokenloom.sample_data import default_tokenizer_path

    return pretrain(sources(where), tokenizer=default_tokenizer_path(), seq_len=SEQ_LEN, batch_size=BATCH,
                    weights=WEIGHTS, num_workers=WORKERS, seed=0)


def task_run(where: Any, warmup: int, batches: int) -> dict:
    import tokenloom.recipes  # noqa: F401 - imports are not the loader's time

    corpus()  # built (or found) before the clock starts
    h = hashlib.sha256()
    t0 = time.perf_counter()
    loader = build(where)
    it = iter(loader)
    b = next(it)
    first = time.perf_counter() - t0
    h.update(b["input_ids"].numpy().tobytes())
    for _ in range(warmup - 1):
        h.update(next(it)["input_ids"].numpy().tobytes())
    tokens = 0
    t1 = time.perf_counter()
    for _ in range(batches):
        b = next(it)
        tokens += int((b["segment_ids"] != 0).sum())
        h.update(b["input_ids"].numpy().tobytes())
    seconds = time.perf_counter() - t1
    return {"first_s": first, "tokens_per_s": tokens / seconds, "tokens": tokens, "seconds": seconds,
            "digest": h.hexdigest()[:16]}


def task_save(path: str) -> dict:
    import torch

    loader = build(None)
    it = iter(loader)
    for _ in range(SAVE_AT):
        next(it)
    torch.save(loader.state_dict(), path)
    want = hashlib.sha256(next(it)["input_ids"].numpy().tobytes()).hexdigest()[:16]
    return {"next_digest": want}


def task_resume(where: Any, state: str) -> dict:
    import torch

    import tokenloom.recipes  # noqa: F401

    corpus()
    saved = torch.load(state, weights_only=True)
    t0 = time.perf_counter()
    loader = build(where)
    loader.load_state_dict(saved)
    b = next(iter(loader))
    return {"resumed_s": time.perf_counter() - t0,
            "next_digest": hashlib.sha256(b["input_ids"].numpy().tobytes()).hexdigest()[:16]}


TASKS = {"run": task_run, "save": task_save, "resume": task_resume}


def child(task: str, env: Dict[str, str], **params: Any) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--task", task, "--params", json.dumps(params)]
    out = subprocess.run(cmd, capture_output=True, text=True, env=_env(**env), timeout=900)
    if out.returncode != 0:
        raise RuntimeError(f"{task} {params} {env} failed:\n{out.stderr[-3000:]}")
    result = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"# {task} {env} {json.dumps(params)[:80]}: {json.dumps(result)}", file=sys.stderr)
    return result


# --- the benchmark -----------------------------------------------------------------------------

def variants() -> List[dict]:
    out = [{"name": "local", "where": None, "env": {}},
           {"name": "local, read-ahead forced on", "where": "local", "env": {"TOKENLOOM_READAHEAD": "all"}}]
    for s in SETTINGS:
        out.append({"name": f"s3 {s}, read-ahead off", "where": s, "env": {"TOKENLOOM_READAHEAD": "0"}})
        out.append({"name": f"s3 {s}, read-ahead on", "where": s, "env": {}})
    return out


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--batches", type=int, default=None)
    ap.add_argument("--results-md", default=os.path.join(HERE, "RESULTS.md"))
    ap.add_argument("--no-write", action="store_true", help="print only")
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--task", help=argparse.SUPPRESS)
    ap.add_argument("--params", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.serve:
        serve()
        return 0
    if args.task:
        print(json.dumps(TASKS[args.task](**json.loads(args.params))))
        return 0
    rounds = args.rounds or (1 if args.quick else 3)
    batches = args.batches or (120 if args.quick else 300)
    files = corpus()
    proc, ports = start_store(files)
    port_of = lambda v: None if v["where"] in (None, "local") else ports["proxies"][v["where"]]  # noqa: E731
    load = os.getloadavg()
    runs: List[Dict[str, Any]] = []
    try:
        state = os.path.join(ROOT, "out", "bench", "remote_state.pt")
        saved = child("save", {}, path=state)
        for r in range(rounds):
            for v in variants():
                res = child("run", v["env"], where=port_of(v), warmup=args.warmup, batches=batches)
                res.update(child("resume", v["env"], where=port_of(v), state=state))
                runs.append({"round": r, "variant": v["name"], **res})
    finally:
        proc.stdin.close()
        proc.wait(timeout=30)
    out = summarize(runs, saved, rounds, batches, args, load)
    print(json.dumps(out, indent=2))
    if not args.no_write:
        with open(os.path.join(HERE, "remote.json"), "w") as f:
            json.dump(out, f, indent=2)
        plot(out, os.path.join(HERE, "remote.png"))
        from results_md import write_section  # benchmarks/ is on sys.path when run as a script

        command = "python benchmarks/remote.py" + (" --quick" if args.quick else "")
        write_section(args.results_md, "remote", markdown(out, command))
    return 0


def summarize(runs: List[dict], saved: dict, rounds: int, batches: int, args: Any, load: tuple) -> dict:
    names = [v["name"] for v in variants()]
    local = {r["round"]: r for r in runs if r["variant"] == "local"}
    digests = {r["digest"] for r in runs}
    resumed = {r["next_digest"] for r in runs} | {saved["next_digest"]}
    table = {}
    for name in names:
        mine = [r for r in runs if r["variant"] == name]
        ratios = {
            "tokens": [r["tokens_per_s"] / local[r["round"]]["tokens_per_s"] for r in mine],
            "first": [r["first_s"] / local[r["round"]]["first_s"] for r in mine],
            "resumed": [r["resumed_s"] / local[r["round"]]["resumed_s"] for r in mine],
        }
        table[name] = {
            "tokens_per_s": [round(r["tokens_per_s"]) for r in mine],
            "first_s": [round(r["first_s"], 3) for r in mine],
            "resumed_s": [round(r["resumed_s"], 3) for r in mine],
            "tokens_ratio_best": round(max(ratios["tokens"]), 3),
            "tokens_ratio_median": round(statistics.median(ratios["tokens"]), 3),
            "first_ratio_best": round(min(ratios["first"]), 3),
            "first_ratio_median": round(statistics.median(ratios["first"]), 3),
            "resumed_ratio_best": round(min(ratios["resumed"]), 3),
            "resumed_ratio_median": round(statistics.median(ratios["resumed"]), 3),
        }
    return {
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "load_at_start": list(load)},
        "setup": {"seq_len": SEQ_LEN, "batch_size": BATCH, "workers": WORKERS, "weights": WEIGHTS,
                  "settings": {k: {"latency_s": a, "bandwidth_Bps": b} for k, (a, b) in SETTINGS.items()},
                  "rounds": rounds, "warmup": args.warmup, "batches": batches, "save_at": SAVE_AT},
        "same_stream": len(digests) == 1, "same_resumed_batch": len(resumed) == 1,
        "variants": table,
    }


def markdown(out: dict, command: str) -> str:
    s = out["setup"]
    lines = [
        f"Command: `{command}` (writes `benchmarks/remote.json`, `benchmarks/remote.png`); {out['machine']['cpus']} CPUs, "
        f"load average {out['machine']['load_at_start']} at start, shared with other jobs. `pretrain` of the demo "
        f"corpus as two sources (code, prose; 9 parquet files, 1-8 row groups each) mixed 60/40, bestfit, "
        f"T={s['seq_len']}, B={s['batch_size']}, {s['workers']} workers; moto's S3 server on loopback behind a proxy "
        "that answers every request after the latency and paces each response at the bandwidth per connection. "
        f"{s['rounds']} interleaved rounds, each run in a fresh interpreter; ratios against the same round's local "
        f"run, best round (median). *tokens/s* over {s['batches']} batches after {s['warmup']}; *first*: "
        f"`pretrain(...)` to the first batch; *resumed*: build + `load_state_dict` (saved after {s['save_at']} batches) "
        f"to the first batch. Every run yielded the same batches: {'yes' if out['same_stream'] else '**no**'} "
        f"(resumed: {'yes' if out['same_resumed_batch'] else '**no**'}).",
        "",
        "| variant | tokens/s | tokens/s vs local | first s | first vs local | resumed s | resumed vs local |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, v in out["variants"].items():
        lines.append(
            f"| {name} | {max(v['tokens_per_s']):,} | {v['tokens_ratio_best']:.2f}x ({v['tokens_ratio_median']:.2f}x) "
            f"| {min(v['first_s']):.2f} | {v['first_ratio_best']:.2f}x ({v['first_ratio_median']:.2f}x) "
            f"| {min(v['resumed_s']):.2f} | {v['resumed_ratio_best']:.2f}x ({v['resumed_ratio_median']:.2f}x) |")
    lines += ["", "![remote](remote.png)"]
    return "\n".join(lines)


def plot(out: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(out["variants"])
    v = out["variants"]
    fig, axes = plt.subplots(1, 3, figsize=(14, 4.2), sharey=True)
    for ax, key, title, target in ((axes[0], "tokens", "tokens/s vs local (higher is better)", TARGET_TOKENS),
                                   (axes[1], "first", "first batch vs local (lower is better)", TARGET_FIRST),
                                   (axes[2], "resumed", "resumed first batch vs local", TARGET_FIRST)):
        best = [v[n][f"{key}_ratio_best"] for n in names]
        med = [v[n][f"{key}_ratio_median"] for n in names]
        colors = ["#888888" if "local" in n else ("#d62728" if "off" in n else "#2ca02c") for n in names]
        y = range(len(names))
        ax.barh(list(y), best, color=colors)
        ax.scatter(med, list(y), color="black", s=12, zorder=3, label="median")
        ax.axvline(target, color="black", linestyle="--", linewidth=1)
        ax.axvline(1.0, color="#bbbbbb", linewidth=1)
        ax.set_title(title, fontsize=10)
        for yi, b in zip(y, best):
            ax.text(b, yi, f" {b:.2f}x", va="center", fontsize=8)
    axes[0].set_yticks(list(range(len(names))))
    axes[0].set_yticklabels(names, fontsize=8)
    axes[0].invert_yaxis()
    axes[1].legend(fontsize=8, loc="lower right")
    fig.suptitle("pretrain from S3 behind latency + bandwidth per connection, vs local disk (best round; dashed: target)",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
