"""JSON arrays and compressed JSON lines: listing, first batch, resume at the middle, a read epoch.

    .venv/bin/python benchmarks/json_sources.py [--mb 100] [--out benchmarks/json_sources.json]

Builds ~MB megabytes of stories (the standard library's sources cut into ~900-byte pieces, so
they compress like text, ~5x with gzip) as JSON lines, one JSON array, and JSON lines through
pyarrow's gzip, zstd and bz2; then, for each file:

- ``listing_s``: `list_jsonl_units` (the one scan at build time), and MB/s of decompressed data;
- ``first_batch_s``: `pretrain(...)` to its first batch (listing included; 0 workers, B=8, T=2048);
- ``resume_mid_s``: a fresh reader restored at a row of the unit that holds the middle of the file
  (by byte offset) to its first document: what a resume costs there;
- ``epoch_read_s``: every document of the file read and parsed once, units in the shuffled order
  of an epoch (for compressed files: decompressing from the start for each unit behind the stream).

Prints one JSON object and writes it to --out.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import tempfile
import time

import pyarrow as pa

from tokenloom.pipes import ShardUnits, resolve_files
from tokenloom.pipes.sources.jsonl import ReadJsonl, list_jsonl_units
from tokenloom.recipes import pretrain
from tokenloom.sample_data import default_tokenizer_path


def stories(target: int) -> list:
    texts = []
    for p in sorted(glob.glob(os.path.join(os.path.dirname(os.__file__), "**/*.py"), recursive=True)):
        try:
            s = open(p, encoding="utf-8").read()
        except (UnicodeDecodeError, OSError):
            continue
        texts += [s[i:i + 900] for i in range(0, len(s), 900)]
    out, size, k = [], 0, 0
    while size < target:
        t = texts[k % len(texts)] + (f" #{k}" if k >= len(texts) else "")
        out.append({"story": t, "id": k})
        size += len(json.dumps(out[-1], ensure_ascii=False).encode()) + 1
        k += 1
    return out


def write(root: str, docs: list) -> dict:
    lines = "".join(json.dumps(d, ensure_ascii=False) + "\n" for d in docs).encode()
    paths = {"jsonl": os.path.join(root, "s.jsonl"), "json array": os.path.join(root, "s.json")}
    with open(paths["jsonl"], "wb") as f:
        f.write(lines)
    with open(paths["json array"], "w", encoding="utf-8") as f:
        json.dump(docs, f, ensure_ascii=False)
    for codec, ext in (("gzip", "gz"), ("zstd", "zst"), ("bz2", "bz2")):
        paths[f"jsonl.{ext}"] = os.path.join(root, f"s.jsonl.{ext}")
        with pa.output_stream(paths[f"jsonl.{ext}"], compression=codec) as out:
            out.write(lines)
    return paths


def resume_mid(units) -> float:
    """Seconds from a fresh reader restored inside the middle unit to its first document."""
    mid_byte = int(units.end[-1]) // 2
    mid = int(next(u for u in range(len(units.rows)) if units.end[u] > mid_byte))
    sharder = ShardUnits(units.rows, shard=0, num_shards=1, seed=0, shuffle=False)
    sharder.reset(None)
    while True:
        state = sharder.state_dict()
        if next(sharder).unit == mid:
            break
    t = time.perf_counter()
    node = ReadJsonl(ShardUnits(units.rows, shard=0, num_shards=1, seed=0, shuffle=False), units, field="story")
    node.reset({ReadJsonl.PARENT: state, ReadJsonl.ROW: int(units.rows[mid]) // 2, ReadJsonl.SKIPPED: 0})
    next(node)
    return time.perf_counter() - t


def epoch_read(units) -> float:
    node = ReadJsonl(ShardUnits(units.rows, shard=0, num_shards=1, seed=0, epochs=1), units, field="story")
    t = time.perf_counter()
    node.reset(None)
    n = sum(1 for _ in node)
    assert n == units.total_rows
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=float, default=100)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "json_sources.json"))
    args = ap.parse_args()
    tok = default_tokenizer_path()
    results = {}
    with tempfile.TemporaryDirectory() as root:
        docs = stories(int(args.mb * 1e6))
        for name, path in write(root, docs).items():
            t = time.perf_counter()
            units = list_jsonl_units(resolve_files(path, "jsonl"), field="story")
            listing = time.perf_counter() - t
            decompressed = int(units.end[-1])
            t = time.perf_counter()
            next(iter(pretrain(path, tokenizer=tok, text_column="story", seq_len=2048, batch_size=8)))
            first = time.perf_counter() - t
            results[name] = {
                "file_mb": round(os.path.getsize(path) / 1e6, 1), "data_mb": round(decompressed / 1e6, 1),
                "documents": units.total_rows, "units": len(units.rows),
                "listing_s": round(listing, 3), "listing_mb_per_s": round(decompressed / 1e6 / listing),
                "first_batch_s": round(first, 2), "resume_mid_s": round(resume_mid(units), 3),
                "epoch_read_s": round(epoch_read(units), 2),
            }
            print(name, results[name], flush=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
