"""The token-level oracle: what a training loop received, checked against the documents.

It shares none of the loader's assumptions. The corpus gives every word occurrence a
token id of its own (a `tokenizers` WordLevel vocabulary: ``w<n>`` is id ``FIRST_WORD +
n``, BOS is id 0, EOS id 1), so a delivered token names its document and offset. Batches
are read exactly as a training loop gets them, with every rule on: inputs where
``segment_ids != 0``, targets where ``labels != -100``. Per row:

- pieces are the runs of one segment id among the inputs; ``position_ids`` restart at 0 at
  each, ``segment_ids`` count 1, 2, ... and ``cu_seqlens``/``max_seqlen``/``num_seqs``
  agree with them (padding runs are sequences of their own);
- inside a piece a label is the next input; after a piece that ends its document the
  label is the end label (BOS or -100) and after one that does not, the piece must run
  to the row's end and its document's next token is the row's last label (a token
  delivered as a target only);
- a piece is consecutive tokens of one document; a BOS only at its start, an EOS only
  after the document's last word.

Across rows, ranks and resumes a piece either starts a document (with its BOS) or
continues one exactly where its last piece ended (no second BOS). At the end of a round
every document was delivered ``epochs`` times, each time whole (``flat``, ``bestfit``);
in ``bestfit-crop`` at most ``epochs`` times and only prefixes. Errors name the hop,
rank, step and row.
"""

from __future__ import annotations

import collections
import gzip
import json
import os
import random
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

BOS, EOS = 0, 1
SPECIALS = ["<|bos|>", "<|eos|>"]
FIRST_WORD = 8
IGNORE = -100
KINDS = ("parquet", "jsonl", "json_array", "jsonl_gz", "hf", "cache")


# --- the corpus ---------------------------------------------------------------------------

@dataclass
class OracleCorpus:
    """Sources on disk and, per token id, where the token lives."""

    root: str
    tokenizer: str
    sources: Dict[str, Any]  # name -> spec for pretrain (path/glob)
    kinds: Dict[str, str]
    doc_of: np.ndarray  # word id -> document index
    off_of: np.ndarray  # word id -> offset in its document (BOS is offset 0)
    doc_len: List[int]  # words per document
    doc_source: List[str]
    cache: Optional[Dict[str, str]] = None  # {source: token cache} for the sources of kind 'cache'

    def __post_init__(self):
        # word id of each document's first word (a document's words are consecutive ids)
        self.doc_first = np.cumsum([0] + self.doc_len[:-1]) + FIRST_WORD

    def describe(self) -> str:
        return ", ".join(f"{n}: {self.kinds[n]} ({sum(1 for s in self.doc_source if s == n)} docs)"
                         for n in self.sources)


def doc_lengths(rng: random.Random, n: int, row: int) -> List[int]:
    """Heavy-tailed lengths around a row: many short ones, some of several rows."""
    out = []
    for _ in range(n):
        r = rng.random()
        if r < 0.5:
            out.append(rng.randint(1, max(1, row // 4)))
        elif r < 0.85:
            out.append(rng.randint(row // 4 + 1, row + 2))
        else:
            out.append(int(row * (1 + rng.paretovariate(1.2))) % (6 * row) + 1)
    return out


def _write(kind: str, path: str, texts: List[str], rng: random.Random) -> str:
    """Write ``texts`` as a source of ``kind`` under ``path``; returns the spec."""
    os.makedirs(path, exist_ok=True)
    if kind in ("parquet", "cache"):
        files = rng.randint(1, 3)
        per = -(-len(texts) // files)
        for f in range(files):
            part = texts[f * per:(f + 1) * per]
            if part:
                pq.write_table(pa.table({"text": part}), os.path.join(path, f"part-{f}.parquet"),
                               row_group_size=rng.choice([4, 7, 16]))
        return path
    if kind == "jsonl":
        with open(os.path.join(path, "docs.jsonl"), "w") as f:
            f.writelines(json.dumps({"text": t}) + "\n" for t in texts)
        return path
    if kind == "json_array":
        with open(os.path.join(path, "docs.json"), "w") as f:
            json.dump([{"text": t} for t in texts], f)
        return path
    if kind == "jsonl_gz":
        with gzip.open(os.path.join(path, "docs.jsonl.gz"), "wt") as f:
            f.writelines(json.dumps({"text": t}) + "\n" for t in texts)
        return path
    if kind == "hf":
        import datasets

        out = os.path.join(path, "ds")
        datasets.Dataset.from_dict({"text": texts}).save_to_disk(out, max_shard_size="20KB")
        return out
    raise ValueError(f"{kind=} is not one of {KINDS}")


def make_corpus(root: str, spec: Dict[str, Tuple[str, int]], *, row: int, seed: int = 0) -> OracleCorpus:
    """``spec``: {source name: (kind, documents)}. Every word of every document is its own token."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    rng = random.Random(seed)
    lengths = {name: doc_lengths(rng, n, row) for name, (_, n) in spec.items()}
    total = sum(sum(v) for v in lengths.values())
    doc_of = np.full(FIRST_WORD + total, -1, np.int64)
    off_of = np.full(FIRST_WORD + total, -1, np.int64)
    doc_len, doc_source, texts = [], [], {n: [] for n in spec}
    w = 0
    for name in spec:
        for n in lengths[name]:
            d = len(doc_len)
            ids = np.arange(FIRST_WORD + w, FIRST_WORD + w + n)
            doc_of[ids], off_of[ids] = d, np.arange(1, n + 1)
            texts[name].append(" ".join(f"w{i - FIRST_WORD}" for i in ids))
            doc_len.append(n)
            doc_source.append(name)
            w += n
    vocab = {t: i for i, t in enumerate(SPECIALS)}
    vocab.update({f"<|r{i}|>": i for i in range(len(SPECIALS), FIRST_WORD)})
    vocab.update({f"w{i}": FIRST_WORD + i for i in range(total)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<|r2|>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(SPECIALS)
    os.makedirs(root, exist_ok=True)
    tok_path = os.path.join(root, "tokenizer.json")
    tok.save(tok_path)
    sources, kinds = {}, {}
    for name, (kind, _) in spec.items():
        sources[name] = _write(kind, os.path.join(root, name), texts[name], rng)
        kinds[name] = kind
    corpus = OracleCorpus(root, tok_path, sources, kinds, doc_of, off_of, doc_len, doc_source)
    cached = {n: s for n, s in sources.items() if kinds[n] == "cache"}
    if cached:
        from tokenloom.pipes.sources.cache_build import build_cache

        out = os.path.join(root, "_cache")
        build_cache(cached, tok_path, out, processes=1)
        corpus.cache = {n: out for n in cached}
    return corpus


# --- the checker ---------------------------------------------------------------------------

@dataclass
class _Chain:
    doc: int
    next: int  # the offset the next piece must start at
    pieces: int = 0


@dataclass
class Oracle:
    """Feed it every batch the training loops received, in order (`feed`), then `finish`."""

    corpus: OracleCorpus
    epochs: Optional[int]  # None: an endless stream, cut off (no completeness check)
    mode: str  # flat | bestfit | bestfit-crop
    end_label: int  # BOS (predict_bos=True) or -100
    eos: bool = False
    cycling: bool = False  # exhausted sources cycle on (a document may come more than epochs times)
    names: Optional[Sequence[str]] = None  # the sources the loader reads (default: all)
    errors: List[str] = field(default_factory=list)
    chains: Dict[int, List[_Chain]] = field(default_factory=lambda: collections.defaultdict(list))
    done: collections.Counter = field(default_factory=collections.Counter)
    delivered: int = 0  # document tokens delivered (inputs and target-only tokens)
    rows: int = 0
    label_slots: int = 0  # rows whose inputs end a whole document: crop fills the slot with a document's BOS

    def _err(self, where: str, msg: str) -> None:
        if len(self.errors) < 50:
            self.errors.append(f"{where}: {msg}")

    def _length(self, doc: int) -> int:
        """Tokens of a document: BOS, its words, EOS if any."""
        return 1 + self.corpus.doc_len[doc] + (1 if self.eos else 0)

    def feed(self, batch: Dict[str, torch.Tensor], where: str) -> None:
        inp, lab = batch["input_ids"].numpy(), batch["labels"].numpy()
        seg, pos = batch["segment_ids"].numpy(), batch["position_ids"].numpy()
        B, T = inp.shape
        starts: List[int] = []
        longest = 0
        for b in range(B):
            runs = self._row(inp[b], lab[b], seg[b], pos[b], f"{where} row {b}")
            for s, e in runs:
                starts.append(b * T + s)
                longest = max(longest, e - s + 1)
        self._check_varlen(batch, starts, longest, B * T, where)

    def _check_varlen(self, batch, starts: List[int], longest: int, total: int, where: str) -> None:
        if "cu_seqlens" not in batch:
            return
        cu = batch["cu_seqlens"].numpy()
        n = int(batch["num_seqs"])
        want = np.asarray(starts + [total])
        if n != len(starts) or not np.array_equal(cu[:n + 1], want) or (cu[n:] != total).any():
            self._err(where, f"cu_seqlens/num_seqs disagree with the segments: num_seqs={n}, want {len(starts)}")
        if int(batch["max_seqlen"]) != longest:
            self._err(where, f"max_seqlen={int(batch['max_seqlen'])}, the longest sequence is {longest}")

    def _row(self, inp, lab, seg, pos, where: str) -> List[Tuple[int, int]]:
        """Check one row; returns its sequences (segments and padding runs) as (start, end)."""
        self.rows += 1
        T = len(inp)
        runs: List[Tuple[int, int]] = []
        t = 0
        expect_id = 1
        while t < T:
            e = t
            while e + 1 < T and seg[e + 1] == seg[t]:
                e += 1
            runs.append((t, e))
            if not np.array_equal(pos[t:e + 1], np.arange(e - t + 1)):
                self._err(where, f"position_ids {pos[t:e + 1][:8].tolist()}... do not restart at 0 at position {t}")
            if seg[t] == 0:
                if (lab[t:e + 1] != IGNORE).any():
                    self._err(where, f"padding at {t}..{e} has labels that are not -100")
            else:
                if seg[t] != expect_id:
                    self._err(where, f"segment ids run {seg[t]} at {t}, expected {expect_id}")
                expect_id = int(seg[t]) + 1
                self._piece(inp, lab, t, e, where)
            t = e + 1
        return runs

    def _attribute(self, tokens: np.ndarray) -> Tuple[int, np.ndarray, Optional[str]]:
        """(document, offsets) of a piece's tokens; an error text if they are not consecutive
        tokens of one document."""
        words = tokens >= FIRST_WORD
        if not words.any():
            return -1, np.zeros(0, np.int64), None
        if (tokens >= len(self.corpus.doc_of)).any():
            return -1, np.zeros(0, np.int64), f"token ids beyond the vocabulary: {tokens[tokens >= len(self.corpus.doc_of)][:4]}"
        docs = self.corpus.doc_of[tokens[words]]
        doc = int(docs[0])
        if (docs != doc).any():
            return doc, np.zeros(0, np.int64), f"a segment mixes documents {sorted(set(docs.tolist()))[:4]}"
        first_word = int(np.argmax(words))
        base = int(self.corpus.off_of[tokens[first_word]]) - first_word
        offs = base + np.arange(len(tokens))
        n = self.corpus.doc_len[doc]
        want = np.where(offs == 0, BOS, np.where(offs == n + 1, EOS, -1))
        ok_words = (self.corpus.off_of[np.where(words, tokens, FIRST_WORD)] == offs) | ~words
        ok_special = (want == tokens) | words
        if base < 0 or offs[-1] > n + (1 if self.eos else 0) or not ok_words.all() or not ok_special.all():
            return doc, offs, (f"tokens {tokens[:6].tolist()}... are not consecutive tokens of document {doc} "
                               f"(offsets from {base})")
        return doc, offs, None

    def _piece(self, inp, lab, s: int, e: int, where: str) -> None:
        T = len(inp)
        where = f"{where} at {s}..{e}"
        inside = lab[s:e] != inp[s + 1:e + 1]
        if inside.any():
            k = s + int(np.argmax(inside))
            self._err(where, f"label at {k} is {lab[k]}, the next input is {inp[k + 1]}")
        tokens = inp[s:e + 1]
        last_label = int(lab[e])
        doc, offs, problem = self._attribute(tokens)
        if doc < 0 and problem is None:
            # No word among the inputs: a lone BOS or EOS; the row's last label may name the document.
            if e == T - 1 and last_label >= FIRST_WORD:
                doc, offs, problem = self._attribute(np.append(tokens, last_label))
                offs = offs[:-1] if problem is None else offs
            elif tokens.tolist() == [EOS] * len(tokens) and len(tokens) == 1:
                doc, offs = self._eos_only(where)
                if doc < 0:
                    return
            else:
                self._err(where, f"a segment of special tokens only {tokens.tolist()} (no document to continue)")
                return
        if problem is not None:
            self._err(where, problem)
            return
        n_tok = self._length(doc)
        end = int(offs[-1]) + 1  # the offset after the last input of the piece
        if end < n_tok:  # the document goes on after the piece's inputs
            if e < T - 1:
                self._err(where, f"document {doc} is cut at offset {end} inside a row (label {last_label})")
            elif last_label == self._token_at(doc, end):
                end += 1  # its next token is the row's last label: delivered as a target only
            elif last_label != IGNORE or self.end_label != IGNORE:
                self._err(where, f"the row's last label {last_label} is neither the end label nor document {doc}'s "
                                 f"next token {self._token_at(doc, end)} (offset {end}): a token lost or a wrong target")
        elif last_label != self.end_label:
            self._err(where, f"document {doc} ends at {e} with label {last_label}, the end label is {self.end_label}")
        elif e == T - 1:
            self.label_slots += 1
        self._deliver(doc, int(offs[0]), end, where)

    def _token_at(self, doc: int, off: int) -> int:
        n = self.corpus.doc_len[doc]
        if off == 0:
            return BOS
        if off == n + 1:
            return EOS
        return int(self.corpus.doc_first[doc]) + off - 1

    def _eos_only(self, where: str) -> Tuple[int, np.ndarray]:
        for doc, chains in self.chains.items():
            for c in chains:
                if c.next == self._length(doc) - 1:
                    return doc, np.asarray([c.next])
        self._err(where, "an EOS that continues no document")
        return -1, np.zeros(0, np.int64)

    def _deliver(self, doc: int, start: int, end: int, where: str) -> None:
        self.delivered += end - start
        n_tok = self._length(doc)
        crop = self.mode == "bestfit-crop"
        if start == 0:
            chain = _Chain(doc, end, 1)
            if crop:
                self._close(doc, where)
                return
            self.chains[doc].append(chain)
        else:
            if crop:
                self._err(where, f"document {doc} continues at offset {start} in bestfit-crop (its rest came back)")
                return
            open_ = self.chains.get(doc, [])
            chain = next((c for c in open_ if c.next == start), None)
            if chain is None:
                if not open_:
                    self._err(where, f"document {doc} continues at offset {start}, but no piece of it is open "
                                     f"({'its BOS was not an input: lost in a label slot?' if start == 1 else 'a repeat or a lost start'})")
                    chain = _Chain(doc, start)
                    self.chains[doc].append(chain)
                else:
                    chain = min(open_, key=lambda c: abs(c.next - start))
                    what = "skipped" if start > chain.next else "repeated"
                    lo, hi = sorted((chain.next, start))
                    self._err(where, f"document {doc} continues at offset {start} where it stood at {chain.next}: "
                                     f"offsets {lo}..{hi - 1} {what}")
            chain.next, chain.pieces = end, chain.pieces + 1
        if chain.next >= n_tok:
            self.chains[doc].remove(chain)
            self._close(doc, where)

    def _close(self, doc: int, where: str) -> None:
        self.done[doc] += 1
        if self.epochs is not None and not self.cycling and self.done[doc] > self.epochs:
            self._err(where, f"document {doc} delivered {self.done[doc]} times in a round of {self.epochs} epochs")

    def finish(self, *, complete: bool = True) -> None:
        """Raise AssertionError listing what went wrong. ``complete``: the round ran to its end."""
        if complete and self.epochs is not None:
            names = set(self.names or self.corpus.sources)
            crop = self.mode == "bestfit-crop"
            open_ = {d: [c.next for c in cs] for d, cs in self.chains.items() if cs}
            if open_:
                self._err("end", f"{len(open_)} documents left unfinished (doc: offsets reached) "
                                 f"{dict(list(open_.items())[:5])}")
            wrong = [(d, self.done[d]) for d, s in enumerate(self.corpus.doc_source)
                     if s in names and (self.done[d] > self.epochs if crop else self.done[d] != self.epochs)]
            if wrong:
                self._err("end", f"{len(wrong)} documents delivered another number of times than epochs={self.epochs} "
                                 f"(doc, times): {wrong[:8]}")
            if crop:
                # Crop never pads but in a stream's last row, so a document goes missing (no word
                # delivered) only when its BOS filled the label slot after a row that ended a document.
                deficit = sum(self.epochs - self.done[d] for d, s in enumerate(self.corpus.doc_source) if s in names)
                if deficit > self.label_slots:
                    self._err("end", f"{deficit} document passes delivered no token, but only {self.label_slots} "
                                     "label slots could have taken a document's BOS: documents lost")
        assert not self.errors, (f"oracle ({self.mode}, {self.rows} rows, {self.delivered} tokens; corpus "
                                 f"{self.corpus.describe()}):\n  " + "\n  ".join(self.errors[:20]))


# --- the driver: a run chained over topologies ------------------------------------------------

@dataclass
class Hop:
    """One stretch of a run: ``world`` ranks x ``workers`` loader workers for ``steps`` steps
    (None: to the end of the round), then every rank saves its state."""

    world: int
    workers: int
    steps: Optional[int]

    def __str__(self) -> str:
        return f"{self.world}x{self.workers}:{'end' if self.steps is None else self.steps}"


def run_chain(build, hops: Sequence[Hop], oracle: Oracle, *, roundtrip: str = "torch", seed: int = 0,
              single_dict: bool = True) -> List[Dict[str, str]]:
    """Run ``build(rank, world, workers, sync)`` loaders hop after hop, each hop loading the
    list of every state the previous hop saved (a dict, each rank its own, when the topology
    stays and ``single_dict``), and feed every batch to ``oracle`` in step order. A hop of 0
    steps saves right after loading, without iterating. Returns the last hop's states."""
    from tokenloom.pipes.loader.rank_sync import ThreadSync

    from .test_elastic import run_ranks

    states: Optional[List[Dict[str, str]]] = None
    prev: Optional[Hop] = None
    rng = random.Random(seed)
    for h, hop in enumerate(hops):
        sync = ThreadSync(hop.world) if hop.world > 1 else None
        loaders = []
        for r in range(hop.world):
            loader = build(r, hop.world, hop.workers, sync)
            if states is not None:
                if single_dict and (prev.world, prev.workers) == (hop.world, hop.workers):
                    loader.load_state_dict(states[r])
                else:
                    order = list(states)
                    rng.shuffle(order)
                    loader.load_state_dict(order)
            loaders.append(loader)
        if hop.steps == 0:
            saved = [loader.state_dict() for loader in loaders]
        else:
            runs = run_ranks(loaders, sync or ThreadSync(1), steps=hop.steps)
            for k in range(len(runs[0].batches)):
                for r, run in enumerate(runs):
                    oracle.feed(run.batches[k], f"hop {h} ({hop}) rank {r} step {k}")
            saved = [run.final for run in runs]
        states = [_roundtrip(s, roundtrip) for s in saved]
        prev = hop
        del loaders
    return states


def _roundtrip(state: Dict[str, str], how: str) -> Dict[str, str]:
    if how == "json":
        return json.loads(json.dumps(state))
    from .resume import torch_roundtrip

    return torch_roundtrip(state)
