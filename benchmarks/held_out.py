"""Issues 16 and 37's held-out throughput run, offline: man pages, a cl100k-sized BPE, 2 workers on 2 cores.

Issue 16's check: ``pretrain`` (T=2048, B=8, buffer 1000, 2 workers) on the English man pages with
cl100k's tokenizer.json gives >= 0.85x the tokenizer's own best (one process on its thread pool,
batches of 256) and >= 2x nanochat's loader on the same files. Issue 37's: on the fast engine, >= 2.5x
``pretrain`` on tiktoken and >= 0.5x fastokens' own all-core rate; the Llama-2-style tokenizer >= 5x
the `tokenizers` engine. cl100k cannot be downloaded here, so
its stand-in is trained on this machine: a byte-level BPE with cl100k's split regex and 100,000 ids,
trained on text that is *not* the benchmark's (the stdlib corpus and the machine's .md/.rst files,
45 MB, ~7 s), saved as a tokenizer.json. The corpus is a seeded sample of the English man pages
(troff source, /usr/share/man/man*/) written as parquet.

Runs, each in a fresh interpreter, interleaved over ``--repeats`` rounds (this machine's speed drifts
by up to 1.7x within minutes, so every ratio is taken within a round and the median reported):

- the ceilings of `ceiling.py` (`tokenizers`, tiktoken and fastokens, each on its own threads with
  batches of 256 and as one single-threaded process per core);
- ``pretrain``: the recipe at its defaults (it picks the fastest engine that gives `tokenizers`' ids
  by itself: fastokens where installed), and the same on tiktoken and on `tokenizers`
  (``TOKENLOOM_ENGINE``);
- ``llama``: ``pretrain`` with a Llama-2-style tokenizer.json (byte fallback, ``▁`` for spaces,
  32,000 ids, trained here on the stdlib corpus), at its defaults and on `tokenizers`;
- ``nanochat``: nanochat's BOS-aligned best-fit-crop loader re-implemented from its published
  algorithm (row groups read in turn, 128 documents a tokenizer call on 4 tiktoken threads with the
  BOS prepended, a pool of tokens, for each row the largest buffered document that fits, else the
  shortest cropped to fill), in the training process as nanochat runs it.

Loaders are timed over ``--batches`` batches after the first (start-up left out) and, for
``pretrain``, after the batches its workers hold ready by then (``prefetch_factor`` a worker: work done
before the window would flatter the fastest engine); rates are rows' tokens (B x (T+1) a batch) per second, and tokens tokenized per second (crop discards a third of
what nanochat tokenizes).

    python benchmarks/held_out.py               # ~12 minutes on 2 cores
    python benchmarks/held_out.py --quick       # ~4 minutes: 1 round, 300 batches, 3,000 pages
Prints JSON; writes benchmarks/held_out.json, benchmarks/held_out.png and the ``## held-out``
section of benchmarks/RESULTS.md.
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
import time
from typing import Any, Dict, List

import ceiling  # noqa: E402 - benchmarks/ is on sys.path when run as a script
from results_md import STAND_IN, write_section  # noqa: E402

HERE = os.path.abspath(os.path.dirname(__file__))
ROOT = os.path.dirname(HERE)
OUT = os.path.join(ROOT, "out", "bench", "held_out")
SEQ_LEN, BATCH, BUFFER = 2048, 8, 1000
VOCAB = 100_000
CL100K_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                  r"|\s*[\r\n]+|\s+(?!\S)|\s+")
BOS = "<|bos|>"
ROWS_PER_GROUP = 256
FILES = 8
TARGETS = {"pretrain_vs_tokenizer_best": 0.85, "pretrain_vs_nanochat": 2.0,
           # issue 37: the fast engine's gain passed on
           "pretrain_vs_tiktoken_engine": 2.5, "pretrain_vs_fastokens_ceiling": 0.5, "llama_vs_tokenizers": 5.0}
LLAMA_VOCAB = 32_000


# --- inputs --------------------------------------------------------------------------------

def tokenizer_path() -> str:
    return os.path.join(OUT, f"bpe_{VOCAB}.json")


def llama_path() -> str:
    """A Llama-2-style tokenizer.json: BPE with byte fallback, spaces as ``▁`` (normalizer), 32,000 ids."""
    return os.path.join(OUT, f"llama_like_{LLAMA_VOCAB}.json")


def train_llama_like(docs: List[str], path: str) -> None:
    from tokenizers import Tokenizer, decoders, models, normalizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    specials = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)]
    tok.train_from_iterator(docs, trainer=trainers.BpeTrainer(vocab_size=LLAMA_VOCAB, special_tokens=specials,
                                                               limit_alphabet=1000))
    tok.save(path)


def corpus_dir(pages: int) -> str:
    return os.path.join(OUT, f"man_{pages}")


def corpus_files(pages: int) -> List[str]:
    return sorted(glob.glob(os.path.join(corpus_dir(pages), "*.parquet")))


def prepare(pages: int) -> Dict[str, Any]:
    """The tokenizer (trained once) and the corpus (written once); facts about both."""
    os.makedirs(OUT, exist_ok=True)
    facts: Dict[str, Any] = {}
    if not os.path.exists(tokenizer_path()):
        sys.path.insert(0, HERE)
        from tokenizer_speed import texts as stdlib_texts, train

        from packing import markdown_texts

        docs = stdlib_texts() + markdown_texts(10 ** 6)
        t0 = time.perf_counter()
        train(docs, CL100K_PATTERN, VOCAB, tokenizer_path())
        facts["train_s"] = round(time.perf_counter() - t0, 1)
        facts["train_characters"] = sum(map(len, docs))
    if not os.path.exists(llama_path()):
        sys.path.insert(0, HERE)
        from tokenizer_speed import texts as stdlib_texts

        train_llama_like(stdlib_texts(), llama_path())
    write_corpus(pages)
    texts = all_texts(pages)
    facts.update(pages=len(texts), characters=sum(map(len, texts)), engines=ceiling.engines_for(tokenizer_path()),
                 llama_engines=ceiling.engines_for(llama_path()))
    return facts


def write_corpus(pages: int) -> List[str]:
    """The corpus's files, written once: a seeded sample of ``pages`` English man pages (all of them
    where there are fewer) in `FILES` parquet files of `ROWS_PER_GROUP`-row row groups."""
    if not corpus_files(pages):
        import pyarrow as pa
        import pyarrow.parquet as pq

        paths = sorted(glob.glob("/usr/share/man/man*/*.gz"))
        texts = []
        for path in random.Random(0).sample(paths, min(len(paths), pages * 2)):
            try:
                texts.append(gzip.open(path).read().decode("utf-8"))
            except (OSError, UnicodeDecodeError):
                continue
            if len(texts) == pages:
                break
        if len(texts) < 1000:
            raise SystemExit(f"only {len(texts)} English man pages under /usr/share/man: this benchmark needs them")
        os.makedirs(OUT, exist_ok=True)
        tmp = corpus_dir(pages) + ".tmp"
        os.makedirs(tmp, exist_ok=True)
        for i in range(FILES):
            pq.write_table(pa.table({"text": texts[i::FILES]}), os.path.join(tmp, f"man_{i:02d}.parquet"),
                           row_group_size=ROWS_PER_GROUP)
        os.replace(tmp, corpus_dir(pages))
    return corpus_files(pages)


def all_texts(pages: int) -> List[str]:
    import pyarrow.parquet as pq

    return [t for f in corpus_files(pages) for t in pq.read_table(f, columns=["text"]).column("text").to_pylist()]


# --- child tasks ----------------------------------------------------------------------------

def task_ceiling(engine: str, mode: str, pages: int) -> dict:
    return ceiling.measure(engine, mode, tokenizer_path(), all_texts(pages))


def _window(it, batches: int, count, skip: int = 1) -> dict:
    """``batches`` timed after ``skip`` untimed ones (start-up, and the batches workers hold ready)."""
    for _ in range(skip):
        next(it)
    c0, t0 = count(), time.perf_counter()
    for _ in range(batches):
        next(it)
    return {"seconds": time.perf_counter() - t0, "rows_tokens": batches * BATCH * (SEQ_LEN + 1),
            "tokens_tokenized": count() - c0}


def task_pretrain(batches: int, pages: int, llama: bool = False) -> dict:
    """`pretrain` on the engine the loader picks ($TOKENLOOM_ENGINE forces one); ``llama``: with the
    Llama-2-style tokenizer (its BOS is ``<s>``)."""
    from tokenloom.recipes import pretrain

    loader = pretrain(corpus_files(pages), tokenizer=llama_path() if llama else tokenizer_path(),
                      bos="<s>" if llama else BOS, seq_len=SEQ_LEN, batch_size=BATCH, buffer_size=BUFFER,
                      num_workers=2)
    # The batches the workers hold ready at the start are left out: they would count work done before the window.
    r = _window(iter(loader), batches, lambda: loader.stats()["tokens_in"], skip=1 + 2 * loader.prefetch_factor)
    r["engine"] = loader.dataset.factory.encoder.engine
    return r


def nanochat_batches(files: List[str], encode, bos: int, threads: int = 4, per_call: int = 128,
                     buffer_size: int = BUFFER, counter: List[int] = None, position: Dict[str, int] = None,
                     resume: Dict[str, int] = None):
    """nanochat's BOS-aligned best-fit-crop loader, its algorithm re-implemented (one rank, CPU).

    Its state, as nanochat yields it: ``position`` (a dict, updated in place) holds {pq_idx, rg_idx, epoch}
    of the row group the last refill read. ``resume`` (such a dict) starts where nanochat's resume
    starts: at the row group after it, with an empty buffer (its resume is approximate by design)."""
    import pyarrow.parquet as pq
    import torch

    def documents():
        epoch = resume["epoch"] if resume else 1
        skip = (resume["pq_idx"], resume["rg_idx"]) if resume else None
        while True:  # endless, epochs in turn
            for f, path in enumerate(files):
                if skip and f < skip[0]:
                    continue
                pf = pq.ParquetFile(path)
                start = skip[1] + 1 if skip and f == skip[0] else 0
                skip = None
                for g in range(start, pf.num_row_groups):
                    texts = pf.read_row_group(g).column("text").to_pylist()
                    for i in range(0, len(texts), per_call):
                        if position is not None:
                            position.update(pq_idx=f, rg_idx=g, epoch=epoch)
                        yield texts[i:i + per_call]
            epoch += 1

    source = documents()
    width = SEQ_LEN + 1
    pool = torch.empty(buffer_size * 512, dtype=torch.long)
    end = 0
    docs: List[tuple] = []  # (start, length) in the pool

    def refill():
        nonlocal pool, end
        lists = [[bos] + ids for ids in encode(next(source), threads)]
        total = sum(map(len, lists))
        if counter is not None:
            counter[0] += total
        if end + total > pool.numel():  # compact, then grow
            w = 0
            for i, (s, n) in enumerate(docs):
                if s != w:
                    pool[w:w + n] = pool[s:s + n].clone()
                docs[i] = (w, n)
                w += n
            end = w
            if end + total > pool.numel():
                bigger = torch.empty(max(2 * pool.numel(), end + total), dtype=torch.long)
                bigger[:end] = pool[:end]
                pool = bigger
        for ids in lists:
            pool[end:end + len(ids)] = torch.tensor(ids, dtype=torch.long)
            docs.append((end, len(ids)))
            end += len(ids)

    rows = torch.empty((BATCH, width), dtype=torch.long)
    inputs = torch.empty((BATCH, SEQ_LEN), dtype=torch.long)
    targets = torch.empty((BATCH, SEQ_LEN), dtype=torch.long)
    while True:
        for r in range(BATCH):
            col = 0
            while col < width:
                while len(docs) < buffer_size:
                    refill()
                room = width - col
                best, best_len = -1, 0
                for i, (_, n) in enumerate(docs):
                    if best_len < n <= room:
                        best, best_len = i, n
                if best >= 0:
                    s, n = docs.pop(best)
                    rows[r, col:col + n] = pool[s:s + n]
                    col += n
                else:
                    i = min(range(len(docs)), key=lambda j: docs[j][1])
                    s, _ = docs.pop(i)
                    rows[r, col:col + room] = pool[s:s + room]
                    col += room
        inputs.copy_(rows[:, :-1])
        targets.copy_(rows[:, 1:])
        yield inputs, targets


def task_nanochat(batches: int, pages: int) -> dict:
    from tokenloom.pipes import tiktoken_bpe
    from tokenloom.pipes.tokenizer import load_encoder

    enc = load_encoder(tokenizer_path())
    tt = tiktoken_bpe.encoding(enc._payload)  # nanochat's tokenizer is a tiktoken Encoding
    bos = enc.token_id(BOS)
    counter = [0]
    it = nanochat_batches(corpus_files(pages), lambda texts, n: tt.encode_ordinary_batch(texts, num_threads=n),
                          bos, counter=counter)
    return _window(it, batches, lambda: counter[0])


TASKS = {"ceiling": task_ceiling, "pretrain": task_pretrain, "nanochat": task_nanochat}


def spawn(task: str, env: Dict[str, str] = None, **params) -> dict:
    """One task in a fresh interpreter; its last stdout line is the JSON result."""
    cmd = [sys.executable, os.path.abspath(__file__), "--task", task, "--params", json.dumps(params)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, **(env or {})), timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"task {task} {params} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    print(f"# {task} {params} {env or ''}: {json.dumps(result)[:200]}", file=sys.stderr)
    return result


# --- the run --------------------------------------------------------------------------------

def run(args) -> Dict[str, Any]:
    facts = prepare(args.pages)
    engines = facts["engines"]
    loaders = {"pretrain": ("pretrain", {}), "pretrain_tiktoken": ("pretrain", {"TOKENLOOM_ENGINE": "tiktoken"}),
               "pretrain_tokenizers": ("pretrain", {"TOKENLOOM_ENGINE": "tokenizers"}),
               "llama": ("pretrain", {}), "llama_tokenizers": ("pretrain", {"TOKENLOOM_ENGINE": "tokenizers"}),
               "nanochat": ("nanochat", {})}
    if "tiktoken" not in engines:
        del loaders["pretrain_tiktoken"]
    ceilings = [f"{e}_{m}" for e in engines for m in ceiling.MODES]
    rounds: List[Dict[str, dict]] = []
    load0 = os.getloadavg()
    for _ in range(args.repeats):
        got: Dict[str, dict] = {}
        for name in ceilings:  # ceilings, loaders, ceilings again: each loader sits between two measurements
            e, m = name.rsplit("_", 1)
            got[name] = spawn("ceiling", engine=e, mode=m, pages=args.pages)
        for name, (task, env) in loaders.items():
            extra = {"llama": True} if name.startswith("llama") else {}
            got[name] = spawn(task, env, batches=args.batches, pages=args.pages, **extra)
        for name in ceilings:
            e, m = name.rsplit("_", 1)
            got[name + "_after"] = spawn("ceiling", engine=e, mode=m, pages=args.pages)
        rounds.append(got)

    def rate(r, key="rows_tokens"):
        return r[key] / r["seconds"]

    per_round = []
    for got in rounds:
        ceil = {n: (ceiling.rate(got[n]) + ceiling.rate(got[n + "_after"])) / 2 for n in ceilings}
        best = max(ceil.values())
        hf_best = ceil["tokenizers_threads"]
        row = {"ceilings": ceil, "best": best, "best_is": max(ceil, key=ceil.get)}
        for name in loaders:
            r = got[name]
            row[name] = {"rows_per_s": rate(r), "tokenized_per_s": rate(r, "tokens_tokenized"),
                         "vs_best": rate(r) / best, "vs_tokenizers_threads": rate(r) / hf_best,
                         "tokenized_vs_best": rate(r, "tokens_tokenized") / best}
        row["pretrain_vs_nanochat"] = rate(got["pretrain"]) / rate(got["nanochat"])
        if "pretrain_tiktoken" in got:
            row["pretrain_vs_tiktoken_engine"] = rate(got["pretrain"]) / rate(got["pretrain_tiktoken"])
        fast = [ceil[n] for n in ceilings if n.startswith("fastokens_")]
        row["pretrain_vs_fastokens_ceiling"] = rate(got["pretrain"]) / max(fast) if fast else None
        row["llama_vs_tokenizers"] = rate(got["llama"]) / rate(got["llama_tokenizers"])
        row["pretrain_tokenizers_vs_nanochat"] = rate(got["pretrain_tokenizers"]) / rate(got["nanochat"])
        per_round.append(row)

    med = statistics.median
    summary = {
        "ceilings_M": {n: med(r["ceilings"][n] for r in per_round) / 1e6 for n in ceilings},
        "loaders": {name: {k: med(r[name][k] for r in per_round)
                           for k in ("rows_per_s", "tokenized_per_s", "vs_best", "vs_tokenizers_threads",
                                     "tokenized_vs_best")} for name in loaders},
        "pretrain_vs_nanochat": med(r["pretrain_vs_nanochat"] for r in per_round),
        "pretrain_tokenizers_vs_nanochat": med(r["pretrain_tokenizers_vs_nanochat"] for r in per_round),
        "best_is": [r["best_is"] for r in per_round],
        "engines_used": {name: rounds[0][name].get("engine") for name in loaders if name != "nanochat"},
    }
    for key in ("pretrain_vs_tiktoken_engine", "pretrain_vs_fastokens_ceiling", "llama_vs_tokenizers"):
        values = [r[key] for r in per_round if r.get(key) is not None]
        summary[key] = med(values) if values else None
    p = summary["loaders"]["pretrain"]
    summary["targets"] = {
        "pretrain_vs_tokenizer_best": {"value": p["vs_tokenizers_threads"], "target": ">= 0.85",
                                       "met": p["vs_tokenizers_threads"] >= TARGETS["pretrain_vs_tokenizer_best"]},
        "pretrain_vs_machine_best": {"value": p["vs_best"], "target": ">= 0.85 (ours: the best of all four)",
                                     "met": p["vs_best"] >= TARGETS["pretrain_vs_tokenizer_best"]},
        "pretrain_vs_nanochat": {"value": summary["pretrain_vs_nanochat"], "target": ">= 2",
                                 "met": summary["pretrain_vs_nanochat"] >= TARGETS["pretrain_vs_nanochat"]},
    }
    for key, target in (("pretrain_vs_tiktoken_engine", ">= 2.5 (issue 37)"),
                        ("pretrain_vs_fastokens_ceiling", ">= 0.5 (issue 37)"),
                        ("llama_vs_tokenizers", ">= 5 (issue 37)")):
        if summary[key] is not None:
            summary["targets"][key] = {"value": summary[key], "target": target, "met": summary[key] >= TARGETS[key]}
    return {"facts": facts, "summary": summary, "per_round": per_round, "runs": rounds,
            "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                        "load_start": [round(x, 2) for x in load0],
                        "load_end": [round(x, 2) for x in os.getloadavg()]},
            "settings": {"pages": args.pages, "batches": args.batches, "repeats": args.repeats, "T": SEQ_LEN,
                         "B": BATCH, "buffer": BUFFER, "vocab": VOCAB}}


def markdown(res: Dict[str, Any], command: str) -> str:
    f, s, m = res["facts"], res["summary"], res["machine"]
    lines = [f"Command: `{command}` (writes `benchmarks/held_out.json`, `benchmarks/held_out.png`); "
             f"{m['cpus']} CPUs, CPython {m['python']}, load average {m['load_start']} at start, {m['load_end']} at end "
             f"(shared with other jobs). {res['settings']['repeats']} interleaved rounds.", "",
             f"Corpus: {f['pages']:,} English man pages (troff, {f['characters'] / 1e6:.0f} M characters) in "
             f"{FILES} parquet files. Tokenizer: a byte-level BPE with cl100k's split regex and {VOCAB:,} ids "
             "trained here on other text (the stdlib corpus and the machine's .md/.rst files), the stand-in for "
             f"cl100k's tokenizer.json (engines that run it with the same ids: {', '.join(f['engines'])}). "
             f"`pretrain` and nanochat: T={SEQ_LEN}, B={BATCH}, buffer {BUFFER}, {res['settings']['batches']} "
             "batches after the first (`pretrain`: after the batches its workers hold ready); rates are rows' "
             "tokens per second.", "",
             "| ceiling (M tokens/s, median over rounds) | value |", "|---|---|"]
    for n, v in s["ceilings_M"].items():
        lines.append(f"| {n.replace('_', ', ')} | {v:.2f} |")
    lines += ["", f"The best configuration per round: {', '.join(s['best_is'])}.", "",
              "| loader | M tokens/s into rows | tokenized M/s | / best ceiling | / tokenizers' own threads |",
              "|---|---|---|---|---|"]
    for n, v in s["loaders"].items():
        lines.append(f"| {n} | {v['rows_per_s'] / 1e6:.2f} | {v['tokenized_per_s'] / 1e6:.2f} | {v['vs_best']:.2f}x | "
                     f"{v['vs_tokenizers_threads']:.2f}x |")
    lines += ["", "Engines the loaders ran on: " + ", ".join(f"{n}: {e}" for n, e in s["engines_used"].items())
              + f". `llama`: the same corpus with a Llama-2-style tokenizer.json (BPE with byte fallback, spaces as "
              f"▁, {LLAMA_VOCAB:,} ids, trained here; engines that give its ids: {', '.join(f['llama_engines'])}).",
              "", "| target | value | met |", "|---|---|---|"]
    for n, t in s["targets"].items():
        lines.append(f"| {n} {t['target']} | {t['value']:.2f}x | {'yes' if t['met'] else 'no'} |")
    lines += ["", f"`pretrain` on the `tokenizers` engine vs nanochat: {s['pretrain_tokenizers_vs_nanochat']:.2f}x.",
              "", "![held-out](held_out.png)"]
    return "\n".join(lines)


def plot(res: Dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = res["summary"]
    names = list(s["ceilings_M"]) + list(s["loaders"])
    vals = list(s["ceilings_M"].values()) + [v["rows_per_s"] / 1e6 for v in s["loaders"].values()]
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.barh(names, vals, color=["#999"] * len(s["ceilings_M"]) + ["#2a6"] * len(s["loaders"]))
    ax.set_xlabel("M tokens/s (median of rounds)")
    ax.set_title("man pages, 100k BPE, 2 cores: ceilings (grey) and loaders")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--task")
    ap.add_argument("--params", default="{}")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batches", type=int, default=600)
    ap.add_argument("--pages", type=int, default=8000)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--results", default=os.path.join(HERE, "RESULTS.md"))
    args = ap.parse_args()
    if args.task:
        print(json.dumps(TASKS[args.task](**json.loads(args.params))))
        return
    if args.quick:
        args.repeats, args.batches, args.pages = 1, 300, 3000
    res = run(args)
    print(json.dumps(res["summary"], indent=1))
    with open(os.path.join(HERE, "held_out.json"), "w") as f:
        json.dump(res, f, indent=1)
    plot(res, os.path.join(HERE, "held_out.png"))
    command = "python benchmarks/held_out.py" + (" --quick" if args.quick else "")
    write_section(args.results, "held-out", markdown(res, command),
                  tokenizer=f"{STAND_IN}; the `llama` rows: a Llama-2-style tokenizer.json of {LLAMA_VOCAB:,} ids trained here")


if __name__ == "__main__":
    main()
