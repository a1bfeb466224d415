"""Tokens per second of the two engines on the same documents: `tokenizers` and tiktoken.

The corpus is the embedded stdlib corpus (`tokenloom.sample_data`: 8,893 non-empty documents,
14.5 M characters). Byte-level BPEs of ``--vocab`` ids (32,768 by default) are trained
on it here, GPT-2 style (ByteLevel's own regex) and Llama-3 style (a Split regex, then
ByteLevel), plus the shipped 4,096-id demo tokenizer; for each, tiktoken's Encoding is
the one `tokenloom.pipes.tiktoken_bpe` builds (and the ids are checked identical on the
whole corpus before anything is timed). Every figure is one fresh Python process that
encodes the corpus once untimed (the `tokenizers` word cache warms up, as in a long
run) and once timed, batches of 256 documents:

- ``tokenizers_1``: ``encode_batch_fast`` with ``TOKENIZERS_PARALLELISM=false`` (one thread)
- ``tokenizers_all``: ``encode_batch_fast`` on its Rayon pool (all cores)
- ``tiktoken_1`` / ``tiktoken_all``: ``encode_ordinary_batch(num_threads=1 | cores)``
- ``loader_tokenizers`` / ``loader_tiktoken``: `Encoder.encode_batch` as a loader worker
  calls it (64 documents a call, one thread, int32 arrays out), each engine.
- ``pretrain_tokenizers`` / ``pretrain_tiktoken``: ``pretrain`` (bestfit, T=2048, B=8,
  buffer 1000, 2 workers), tokens in rows per second over 1,000 batches after the first.

Runs are interleaved over ``--repeats`` rounds (this machine's speed drifts); the
table gives medians, and tiktoken's speed-up as the median of the rounds' ratios.

    python benchmarks/tokenizer_speed.py               # ~4 minutes on 2 cores
    python benchmarks/tokenizer_speed.py --repeats 1 --vocab 8192   # a quick look
Prints JSON; writes benchmarks/tokenizer_speed.json and the ``## tokenizer speed``
section of benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from typing import Any, Dict, List

from results_md import DEMO, write_section  # noqa: E402 - benchmarks/ is on sys.path when run as a script

HERE = os.path.abspath(os.path.dirname(__file__))
ROOT = os.path.dirname(HERE)
OUT = os.path.join(ROOT, "out", "bench", "tokenizer_speed")
#: What RESULTS.md says these figures were measured with.
TOKENIZERS = ("byte-level BPEs trained here on the stdlib corpus, GPT-2 style and Llama-3 style (their vocabularies in "
              f"the table), and {DEMO}")
BATCH = 256
LOADER_BATCH = 64  # pipes/tokenize.py's batch_docs
LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                  r"|\s*[\r\n]+|\s+(?!\S)|\s+")
RUNS = ("tokenizers_1", "tokenizers_all", "tiktoken_1", "tiktoken_all", "loader_tokenizers", "loader_tiktoken",
        "pretrain_tokenizers", "pretrain_tiktoken")
PRETRAIN = dict(seq_len=2048, batch_size=8, buffer_size=1000, num_workers=2)
PRETRAIN_BATCHES = 1000  # after the first; long, because the workers may hold up to 128 ready batches by then


def texts() -> List[str]:
    import pyarrow.parquet as pq

    from tokenloom.sample_data import build_demo_corpus

    corpus = build_demo_corpus(os.path.join(ROOT, "out", "bench", "corpus"))
    files = corpus["code"] + corpus["prose"]
    return [t for f in files for t in pq.read_table(f, columns=["text"]).column("text").to_pylist() if t]


def train(docs: List[str], pattern: Any, vocab: int, path: str) -> None:
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    if pattern is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, min_frequency=2, special_tokens=["<|endoftext|>", "<|bos|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(docs, trainer=trainer)
    tok.save(path)


def prepare(vocab: int) -> Dict[str, Any]:
    """Train the tokenizers, check the engines agree on every document, return facts."""
    import numpy as np

    from tokenloom.pipes import tiktoken_bpe
    from tokenloom.pipes.tokenizer import load_encoder
    from tokenloom.sample_data import default_tokenizer_path

    os.makedirs(OUT, exist_ok=True)
    docs = texts()
    paths = {"demo_4096": default_tokenizer_path()}
    facts: Dict[str, Any] = {}
    for style, pattern in (("gpt2", None), ("llama3", LLAMA3_PATTERN)):
        name = f"{style}_{vocab}"
        paths[name] = os.path.join(OUT, f"{name}.json")
        t0 = time.perf_counter()
        train(docs, pattern, vocab, paths[name])
        facts[f"train_seconds_{name}"] = round(time.perf_counter() - t0, 2)
    for name, path in paths.items():
        t0 = time.perf_counter()
        enc = load_encoder(path)
        choose_s = time.perf_counter() - t0
        if enc.engine != "tiktoken":
            raise SystemExit(f"{name}: tiktoken not chosen: {enc.engine_note}")
        fast = tiktoken_bpe.encode_batch(tiktoken_bpe.encoding(enc._payload), docs)
        ref = [e.ids for e in enc.tok.encode_batch_fast(docs, add_special_tokens=False)]
        bad = sum(1 for a, b in zip(fast, ref) if not np.array_equal(a, b))
        if bad:
            raise SystemExit(f"{name}: {bad} documents encode differently")
        facts[name] = {"path": path, "vocab": enc.vocab_size, "tokens": int(sum(len(r) for r in ref)),
                       "load_and_choose_s": round(choose_s, 3), "note": enc.engine_note}
    facts["documents"] = len(docs)
    facts["characters"] = sum(map(len, docs))
    return facts


def pretrain_rate(path: str) -> Dict[str, float]:
    import glob

    from tokenloom.recipes import pretrain

    texts()  # builds the corpus if missing
    files = sorted(glob.glob(os.path.join(ROOT, "out", "bench", "corpus", "*", "*.parquet")))
    loader = pretrain(files, tokenizer=path, bos="<|bos|>", **PRETRAIN)
    it = iter(loader)
    next(it)
    t0 = time.perf_counter()
    for _ in range(PRETRAIN_BATCHES):
        next(it)
    wall = time.perf_counter() - t0
    tokens = PRETRAIN_BATCHES * PRETRAIN["batch_size"] * PRETRAIN["seq_len"]
    return {"tokens": tokens, "seconds": wall, "tokens_per_s": tokens / wall, "tokens_per_cpu_s": None,
            "engine": loader.dataset.factory.encoder.engine}


def one(run: str, path: str) -> Dict[str, float]:
    """Child process: warm pass, timed pass; tokens per second and CPU seconds."""
    if run.startswith("pretrain_"):
        if run == "pretrain_tokenizers":
            os.environ["TOKENLOOM_TIKTOKEN"] = "0"
        out = pretrain_rate(path)
        assert out["engine"] == run.split("_")[1], out
        return out
    if run in ("tokenizers_1", "loader_tokenizers", "loader_tiktoken"):
        os.environ["TOKENIZERS_PARALLELISM"] = "false"  # as a loader worker sets it
    else:
        os.environ["TOKENIZERS_PARALLELISM"] = "true"
    from tokenloom.pipes import tiktoken_bpe
    from tokenloom.pipes.tokenizer import load_encoder

    docs = texts()
    if run == "loader_tokenizers":
        os.environ[tiktoken_bpe.ENV_SWITCH] = "0"
    enc = load_encoder(path)
    cores = os.cpu_count() or 1
    if run.startswith("loader_"):
        assert enc.engine == run.split("_")[1], (run, enc.engine, enc.engine_note)
        step, call = LOADER_BATCH, enc.encode_batch
    elif run.startswith("tokenizers"):
        step, call = BATCH, (lambda b: enc.tok.encode_batch_fast(b, add_special_tokens=False))
    else:
        fast = tiktoken_bpe.encoding(enc._payload)
        threads = 1 if run == "tiktoken_1" else cores
        step, call = BATCH, (lambda b: fast.encode_ordinary_batch(b, num_threads=threads))

    def count(out) -> int:
        return sum(len(x.ids) if hasattr(x, "ids") else len(x) for x in out)

    for i in range(0, len(docs), step):  # warm
        call(docs[i:i + step])
    c0, t0 = time.process_time(), time.perf_counter()
    tokens = sum(count(call(docs[i:i + step])) for i in range(0, len(docs), step))
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    return {"tokens": tokens, "seconds": wall, "tokens_per_s": tokens / wall, "tokens_per_cpu_s": tokens / cpu}


def child(run: str, path: str) -> Dict[str, float]:
    out = subprocess.run([sys.executable, __file__, "--one", run, "--path", path], capture_output=True, text=True,
                         cwd=HERE, check=False)
    if out.returncode:
        raise SystemExit(f"{run} {path} failed:\n{out.stderr}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def markdown(result: Dict[str, Any], command: str) -> str:
    facts, runs = result["facts"], result["runs"]
    lines = [f"One run, {result['cpus']} CPUs (load average {result['load_start']} at start, {result['load_end']} at "
             f"end; other jobs shared the machine), {result['repeats']} interleaved rounds. Corpus: the embedded "
             f"stdlib corpus ({facts['documents']:,} documents, {facts['characters'] / 1e6:.1f} M characters), "
             f"encoded whole after an untimed warm pass; batches of {BATCH} documents (the loader's own calls: "
             f"{LOADER_BATCH} documents, one thread). Tokenizers: byte-level BPEs trained on the same corpus here "
             "(GPT-2 style: ByteLevel's regex; Llama-3 style: a Split regex then ByteLevel) and the shipped demo "
             "tokenizer; tiktoken's Encoding is the one `tokenloom.pipes.tiktoken_bpe` builds, and both engines "
             "gave the same ids on every document before timing. tiktoken 1 thread / all threads is "
             "`encode_ordinary_batch(num_threads=1 | cores)`; tokenizers 1 thread is `encode_batch_fast` with "
             "`TOKENIZERS_PARALLELISM=false`, all threads its Rayon pool.",
             "", f"Command: `{command}`", "",
             "| tokenizer | ids | M tokens | load + choose s | tokenizers 1 thread | tokenizers all | tiktoken 1 thread "
             "| tiktoken all | tiktoken / tokenizers, 1 thread | all threads | loader worker call, tokenizers "
             "| tiktoken | ratio | pretrain, 2 workers, tokenizers | tiktoken | ratio |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, per in runs.items():
        f = facts[name]
        med = {r: statistics.median(x["tokens_per_s"] for x in per[r]) / 1e6 for r in RUNS}

        def ratio(a: str, b: str) -> float:
            return statistics.median(x["tokens_per_s"] / y["tokens_per_s"] for x, y in zip(per[a], per[b]))

        lines.append(f"| {name} | {f['vocab']:,} | {f['tokens'] / 1e6:.2f} | {f['load_and_choose_s']:.2f} | "
                     f"{med['tokenizers_1']:.2f} | {med['tokenizers_all']:.2f} | {med['tiktoken_1']:.2f} | "
                     f"{med['tiktoken_all']:.2f} | {ratio('tiktoken_1', 'tokenizers_1'):.2f}x | "
                     f"{ratio('tiktoken_all', 'tokenizers_all'):.2f}x | {med['loader_tokenizers']:.2f} | "
                     f"{med['loader_tiktoken']:.2f} | {ratio('loader_tiktoken', 'loader_tokenizers'):.2f}x | "
                     f"{med['pretrain_tokenizers']:.2f} | {med['pretrain_tiktoken']:.2f} | "
                     f"{ratio('pretrain_tiktoken', 'pretrain_tokenizers'):.2f}x |")
    lines += ["", "M tokens/s, medians of the rounds; ratios are medians of each round's ratio. *Loader worker "
              "call*: `Encoder.encode_batch` on one thread, as a worker calls it. *pretrain*: tokens in rows per "
              f"second over {PRETRAIN_BATCHES:,} batches after the first (bestfit, T=2048, B=8, buffer 1000, 2 "
              "workers tokenizing on one thread each); the workers may hold up to 128 ready batches when the "
              "window opens, which flatters both engines by up to ~13%. Per CPU-second "
              "(medians, M tokens): " + "; ".join(
                  f"{name} " + ", ".join(f"{r} {statistics.median(x['tokens_per_cpu_s'] for x in per[r]) / 1e6:.2f}"
                                         for r in ("tokenizers_all", "tiktoken_all"))
                  for name, per in runs.items()) + "."]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--from-json", metavar="FILE", help="only rewrite RESULTS.md from a saved result")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--one", help=argparse.SUPPRESS)
    parser.add_argument("--path", help=argparse.SUPPRESS)
    parser.add_argument("--no-write", action="store_true", help="print JSON only")
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one(args.one, args.path)))
        return
    if args.from_json:
        with open(args.from_json, encoding="utf-8") as f:
            saved = json.load(f)
        command = "python benchmarks/tokenizer_speed.py" + (f" --repeats {saved['repeats']}" if saved["repeats"] != 3 else "")
        write_section(os.path.join(HERE, "RESULTS.md"), "tokenizer speed", markdown(saved, command),
                      tokenizer=TOKENIZERS)
        return
    load_start = [round(x, 2) for x in os.getloadavg()]
    facts = prepare(args.vocab)
    names = [n for n in facts if isinstance(facts[n], dict)]
    runs: Dict[str, Dict[str, List[Dict[str, float]]]] = {n: {r: [] for r in RUNS} for n in names}
    for _ in range(args.repeats):
        for name in names:
            for run in RUNS:
                runs[name][run].append(child(run, facts[name]["path"]))
    result = {"cpus": os.cpu_count(), "platform": platform.platform(), "repeats": args.repeats,
              "load_start": load_start, "load_end": [round(x, 2) for x in os.getloadavg()], "facts": facts,
              "runs": runs}
    print(json.dumps(result, indent=1))
    if not args.no_write:
        with open(os.path.join(HERE, "tokenizer_speed.json"), "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1)
        command = "python benchmarks/tokenizer_speed.py" + "".join(
            f" --{k} {v}" for k, v in (("repeats", args.repeats), ("vocab", args.vocab))
            if v != parser.get_default(k))
        write_section(os.path.join(HERE, "RESULTS.md"), "tokenizer speed", markdown(result, command),
                      tokenizer=TOKENIZERS)


if __name__ == "__main__":
    main()
