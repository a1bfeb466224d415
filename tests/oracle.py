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
in ``bestfit-crop`` as often, each time a prefix that begins with its BOS as an input
(issue 42: crop cut none to its BOS alone in a row's label slot). Errors name the hop,
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
#: Special tokens: the chat markers are the demo template's (``<|bos|> (<|role|> content <|end|>)*``).
SPECIALS = ["<|bos|>", "<|eos|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
ROLE_ID = {"system": 2, "user": 3, "assistant": 4}
END = 5
FIRST_WORD = 8
IGNORE = -100
KINDS = ("parquet", "jsonl", "json_array", "jsonl_gz", "hf", "cache")
CHAT_KINDS = ("parquet", "jsonl")


# --- the corpus ---------------------------------------------------------------------------

@dataclass
class OracleCorpus:
    """Sources on disk and, per document, its words (token ids; every word id is unique).
    A conversation is a list of messages ``(role, word ids)``."""

    root: str
    tokenizer: str
    sources: Dict[str, Any]  # name -> spec for pretrain/sft (path)
    kinds: Dict[str, str]
    doc_source: List[str]
    words: List[np.ndarray]  # per document: its word ids in order (a conversation: all its messages')
    chats: Optional[List[List[Tuple[str, np.ndarray]]]] = None
    cache: Optional[Dict[str, str]] = None  # {source: token cache} for the sources of kind 'cache'

    def describe(self) -> str:
        what = "conversations" if self.chats else "docs"
        return ", ".join(f"{n}: {self.kinds[n]} ({sum(1 for s in self.doc_source if s == n)} {what})"
                         for n in self.sources)

    def sequences(self, eos: bool) -> Tuple[List[np.ndarray], List[np.ndarray]]:
        """Per document the tokens a loader must deliver and which of them are targets: pretrain
        ``BOS words [EOS]``, all targets; a conversation ``BOS (<|role|> words <|end|>)*`` with the
        assistant's words and end marker as targets (written from the template's definition, not
        by calling it)."""
        seqs, masks = [], []
        if self.chats is None:
            for w in self.words:
                seqs.append(np.concatenate([[BOS], w, [EOS] if eos else []]).astype(np.int64))
                masks.append(np.ones(len(seqs[-1]), bool))
            return seqs, masks
        for conv in self.chats:
            toks, mask = [BOS], [False]
            for role, w in conv:
                trained = role == "assistant"
                toks += [ROLE_ID[role], *w.tolist(), END]
                mask += [False] + [trained] * len(w) + [trained]
            seqs.append(np.asarray(toks, np.int64))
            masks.append(np.asarray(mask, bool))
        return seqs, masks


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


def _write(kind: str, path: str, records: List[Dict[str, Any]], rng: random.Random) -> str:
    """Write ``records`` as a source of ``kind`` under ``path``; returns the spec."""
    os.makedirs(path, exist_ok=True)
    if kind in ("parquet", "cache"):
        files = rng.randint(1, 3)
        per = -(-len(records) // files)
        for f in range(files):
            part = records[f * per:(f + 1) * per]
            if part:
                pq.write_table(pa.Table.from_pylist(part), os.path.join(path, f"part-{f}.parquet"),
                               row_group_size=rng.choice([4, 7, 16]))
        return path
    if kind == "jsonl":
        with open(os.path.join(path, "docs.jsonl"), "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in records)
        return path
    if kind == "json_array":
        with open(os.path.join(path, "docs.json"), "w") as f:
            json.dump(records, f)
        return path
    if kind == "jsonl_gz":
        with gzip.open(os.path.join(path, "docs.jsonl.gz"), "wt") as f:
            f.writelines(json.dumps(r) + "\n" for r in records)
        return path
    if kind == "hf":
        import datasets

        datasets.disable_progress_bars()
        out = os.path.join(path, "ds")
        datasets.Dataset.from_list(records).save_to_disk(out, max_shard_size="20KB")
        return out
    raise ValueError(f"{kind=} is not one of {KINDS}")


def make_corpus(root: str, spec: Dict[str, Tuple[Any, ...]], *, row: int, seed: int = 0,
                chat: bool = False) -> OracleCorpus:
    """``spec``: {source name: (kind, documents)} or (kind, documents, most words a document has). Every
    word of every document is its own token.
    ``chat``: conversations of 1-4 messages (user first) under ``messages`` instead of text."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    rng = random.Random(seed)
    words: List[np.ndarray] = []
    chats: List[List[Tuple[str, np.ndarray]]] = []
    doc_source: List[str] = []
    records: Dict[str, List[Dict[str, Any]]] = {n: [] for n in spec}
    w = FIRST_WORD

    def take(n: int) -> np.ndarray:
        nonlocal w
        ids = np.arange(w, w + n, dtype=np.int64)
        w += n
        return ids

    def text(ids: np.ndarray) -> str:
        return " ".join(f"w{i - FIRST_WORD}" for i in ids)

    for name, (_, n, *most) in spec.items():
        for length in doc_lengths(rng, n, row):
            # capped after the draw, so a spec without a cap draws what it always drew
            length = min(length, most[0]) if most else length
            if chat:
                # messages of random lengths: conversations rarely share their markers' offsets, so a
                # piece of markers alone (no word to name it) rarely fits two open conversations
                k = rng.randint(1, 4)
                cuts = sorted(rng.sample(range(1, length), k - 1)) if length > k else []
                parts = [b - a for a, b in zip([0] + cuts, cuts + [length])] if cuts else [max(1, length)]
                conv = [("user" if j % 2 == 0 else "assistant", take(m)) for j, m in enumerate(parts)]
                if len(conv) == 1:
                    conv.append(("assistant", take(rng.randint(1, 8))))
                chats.append(conv)
                words.append(np.concatenate([ids for _, ids in conv]))
                records[name].append({"messages": [{"role": r, "content": text(ids)} for r, ids in conv]})
            else:
                words.append(take(length))
                records[name].append({"text": text(words[-1])})
            doc_source.append(name)
    vocab = {t: i for i, t in enumerate(SPECIALS)}
    vocab.update({f"<|r{i}|>": i for i in range(len(SPECIALS), FIRST_WORD)})
    vocab.update({f"w{i - FIRST_WORD}": i for i in range(FIRST_WORD, w)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<|r6|>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(SPECIALS)
    os.makedirs(root, exist_ok=True)
    tok_path = os.path.join(root, "tokenizer.json")
    tok.save(tok_path)
    sources, kinds = {}, {}
    for name, (kind, *_) in spec.items():
        if chat and kind not in CHAT_KINDS:
            raise ValueError(f"conversations are written as {CHAT_KINDS}, not {kind=}")
        sources[name] = _write(kind, os.path.join(root, name), records[name], rng)
        kinds[name] = kind
    corpus = OracleCorpus(root, tok_path, sources, kinds, doc_source, words, chats if chat else None)
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
    stream: Any = None  # where its last piece came from


@dataclass
class Oracle:
    """Feed it every batch the training loops received, in order (`feed`), then `finish`."""

    corpus: OracleCorpus
    epochs: Optional[int]  # None: an endless stream, cut off (no completeness check)
    mode: str  # flat | bestfit | bestfit-crop
    end_label: int  # BOS (predict_bos=True) or -100 (also sft)
    eos: bool = False
    cycling: bool = False  # exhausted sources cycle on (a document may come more than epochs times)
    names: Optional[Sequence[str]] = None  # the sources the loader reads (default: all)
    dropped: frozenset = frozenset()  # documents a node of the graph filters out: delivered 0 times
    errors: List[str] = field(default_factory=list)
    chains: Dict[int, List[_Chain]] = field(default_factory=lambda: collections.defaultdict(list))
    done: collections.Counter = field(default_factory=collections.Counter)
    delivered: int = 0  # document tokens delivered (inputs and target-only tokens)
    began: collections.Counter = field(default_factory=collections.Counter)  # per source: documents begun as inputs
    rows: int = 0
    label_slots: int = 0  # rows whose inputs end a whole document: the label slot holds the end label
    # Special-only starts not yet placed: (tokens, where, whether the label slot after them went unseen,
    # the stream they came in). Every conversation starts alike, so a continuation takes one of its own
    # stream (hop, rank) first: within a hop a document goes on where it started.
    floating: List[Tuple[np.ndarray, str, bool, Any]] = field(default_factory=list)
    # Marker-only pieces that fit several open conversations: (tokens, labels, at the row's end, where).
    pending: List[Tuple[np.ndarray, np.ndarray, bool, str]] = field(default_factory=list)
    # Continuations with no open piece, to be matched with the floating starts at the end: (doc, start, where).
    orphans: List[Tuple[int, int, str]] = field(default_factory=list)
    stream: Any = None
    # Rows of nothing but padding, per rank (hop, rank): where a batch of nothing but padding came (the
    # rank's data has ended), and how many batches ended in padding rows (a worker's data ended).
    rank_drained: Dict[Any, str] = field(default_factory=dict)
    worker_ends: collections.Counter = field(default_factory=collections.Counter)

    def __post_init__(self):
        self.seq, self.mask = self.corpus.sequences(self.eos)
        size = max(int(w.max()) for w in self.corpus.words if len(w)) + 1
        self.doc_of = np.full(size, -1, np.int64)
        self.off_of = np.full(size, -1, np.int64)
        for d, toks in enumerate(self.seq):
            at = np.flatnonzero(toks >= FIRST_WORD)
            self.doc_of[toks[at]], self.off_of[toks[at]] = d, at

    def _err(self, where: str, msg: str) -> None:
        if len(self.errors) < 50:
            self.errors.append(f"{where}: {msg}")

    def feed(self, batch: Dict[str, torch.Tensor], where: str, stream: Any = None, workers: int = 0) -> None:
        """``stream``: what the batch came from (a hop and rank), to place pieces that name no document;
        ``workers``: the loader workers of that rank, each of which may end its data once."""
        self.stream = stream
        inp, lab = batch["input_ids"].numpy(), batch["labels"].numpy()
        seg, pos = batch["segment_ids"].numpy(), batch["position_ids"].numpy()
        B, T = inp.shape
        self._padding_rows((seg != 0).any(axis=1), where, stream[:2] if isinstance(stream, tuple) else stream,
                           workers)
        starts: List[int] = []
        longest = 0
        for b in range(B):
            runs = self._row(inp[b], lab[b], seg[b], pos[b], f"{where} row {b}")
            for s, e in runs:
                starts.append(b * T + s)
                longest = max(longest, e - s + 1)
        self._check_varlen(batch, starts, longest, B * T, where)

    def _padding_rows(self, data: np.ndarray, where: str, rank: Any, workers: int) -> None:
        """A row of nothing but padding trains on nothing: it may only fill out the batch in which a
        worker's data ends (after that batch's rows with data, once per worker), or make up a padding
        batch after a rank's data ended (then no data follows on that rank)."""
        if rank in self.rank_drained:
            if data.any():
                self._err(where, f"data after a batch of nothing but padding ({self.rank_drained[rank]})")
            return
        if data.all():
            return
        if not data.any():
            self.rank_drained[rank] = where
            return
        first = int(np.flatnonzero(~data)[0])
        if data[first:].any():
            self._err(where, f"row {first} is nothing but padding, before rows with data "
                             f"(rows with data: {np.flatnonzero(data).tolist()})")
        self.worker_ends[rank] += 1
        if self.worker_ends[rank] > max(1, workers):
            self._err(where, f"{self.worker_ends[rank]} batches end in rows of nothing but padding on this rank, "
                             f"which has {workers} workers: a worker's data ends once")

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

    def _attribute(self, tokens: np.ndarray) -> Tuple[int, int, Optional[str]]:
        """(document, offset of the first token) of a piece holding a word; an error text if its
        tokens are not consecutive tokens of one document."""
        words = tokens >= FIRST_WORD
        if (tokens >= len(self.doc_of)).any():
            return -1, 0, f"token ids beyond the corpus: {tokens[tokens >= len(self.doc_of)][:4].tolist()}"
        k = int(np.argmax(words))
        doc = int(self.doc_of[tokens[k]])
        base = int(self.off_of[tokens[k]]) - k
        seq = self.seq[doc]
        if base < 0 or base + len(tokens) > len(seq) or not np.array_equal(seq[base:base + len(tokens)], tokens):
            others = sorted(set(self.doc_of[tokens[words]].tolist()))
            return doc, base, (f"tokens {tokens[:6].tolist()}... are not consecutive tokens of one document "
                               f"(documents {others[:4]}, offsets from {base})")
        return doc, base, None

    def _fits(self, doc: int, base: int, tokens: np.ndarray, labels: np.ndarray, at_row_end: bool) -> bool:
        """Whether a piece can be document ``doc`` from offset ``base``: its tokens, its labels, and
        where it ends (a document is cut only at a row's end)."""
        seq, mask = self.seq[doc], self.mask[doc]
        end = base + len(tokens)
        if end > len(seq) or not np.array_equal(seq[base:end], tokens):
            return False
        if not np.array_equal(labels[:-1], np.where(mask[base + 1:end], tokens[1:], IGNORE)):
            return False
        if end == len(seq):
            return int(labels[-1]) == self.end_label
        return at_row_end and int(labels[-1]) in (int(seq[end]) if mask[end] else IGNORE,)

    def _special_only(self, tokens: np.ndarray, labels: np.ndarray, where: str, at_row_end: bool) -> Tuple[int, int]:
        """A piece without a word: it continues the one open chain it fits (tokens, labels, where it
        ends), or it starts a document (its BOS first; placed when its continuation arrives); where
        several chains fit (conversations share markers), it waits in `pending` until a later piece
        of one of them needs it to bridge a gap, or the end closes a chain with it."""
        if tokens[0] == BOS:
            self.floating.append((tokens, where, at_row_end and int(labels[-1]) == IGNORE, self.stream))
            return -1, 0
        fits = [c for chains in self.chains.values() for c in chains
                if self._fits(c.doc, c.next, tokens, labels, at_row_end)]
        if len(fits) == 1 and not self._after_a_floating_start(tokens, labels, at_row_end):
            return fits[0].doc, fits[0].next
        self.pending.append((tokens, labels, at_row_end, where))
        return -1, 0

    def _start_ends(self, floating: Tuple[np.ndarray, str, bool, Any], doc: int) -> List[int]:
        """Where document ``doc`` goes on after a floating start piece, if that piece can be its start."""
        toks, _, slot, _ = floating
        seq, mask = self.seq[doc], self.mask[doc]
        n = len(toks)
        if not np.array_equal(seq[:n], toks):
            return []
        return [n] + ([n + 1] if slot and n < len(seq) and not mask[n] else [])

    def _after_a_floating_start(self, tokens, labels, at_row_end) -> bool:
        """Whether the piece could come right after a start not yet placed (so its document has no
        open chain yet, and a lone fitting chain may not be its own)."""
        return any(self._fits(d, n0, tokens, labels, at_row_end)
                   for f in self.floating for d in range(len(self.seq)) for n0 in self._start_ends(f, d))

    def _span(self, doc: int, base: int, n: int, last_label: int, at_row_end: bool) -> int:
        """The offset after a piece of ``n`` inputs from ``base``: one more where the row's label
        slot held the document's next token (a target, or for a conversation an untrained token)."""
        seq, mask = self.seq[doc], self.mask[doc]
        end = base + n
        if end < len(seq) and at_row_end and last_label == (int(seq[end]) if mask[end] else IGNORE) \
                and (mask[end] or self.corpus.chats is not None):
            end += 1
        return end

    def _bridge(self, chain: "_Chain", to: Optional[int]) -> bool:
        """Advance ``chain`` with one waiting marker piece that fits at its offset and ends at ``to``
        (None: at the document's end)."""
        seq = self.seq[chain.doc]
        for i, (tokens, labels, at_row_end, _) in enumerate(self.pending):
            if not self._fits(chain.doc, chain.next, tokens, labels, at_row_end):
                continue
            end = self._span(chain.doc, chain.next, len(tokens), int(labels[-1]), at_row_end)
            if end == (len(seq) if to is None else to):
                del self.pending[i]
                self.delivered += end - chain.next
                chain.next, chain.pieces = end, chain.pieces + 1
                return True
        return False

    def _piece(self, inp, lab, s: int, e: int, where: str) -> None:
        T = len(inp)
        where = f"{where} at {s}..{e}"
        tokens = inp[s:e + 1]
        last_label = int(lab[e])
        if (tokens >= FIRST_WORD).any():
            doc, base, problem = self._attribute(tokens)
        elif e == T - 1 and last_label >= FIRST_WORD:
            doc, base, problem = self._attribute(np.append(tokens, last_label))
        else:
            doc, base = self._special_only(tokens, lab[s:e + 1], where, e == T - 1)
            problem = None
            if doc < 0:
                return
        if problem is not None:
            self._err(where, problem)
            return
        seq, mask = self.seq[doc], self.mask[doc]
        end = base + len(tokens)  # the offset after the piece's last input
        want = np.where(mask[base + 1:end], tokens[1:], IGNORE)
        if not np.array_equal(lab[s:e], want):
            k = int(np.argmax(lab[s:e] != want))
            self._err(where, f"label at {s + k} is {lab[s + k]}, want {want[k]} (the next token, or -100 where it "
                             "is not a target)")
        if end < len(seq):  # the document goes on after the piece's inputs
            nxt = int(seq[end])
            if e < T - 1:
                self._err(where, f"document {doc} is cut at offset {end} inside a row (label {last_label})")
            elif last_label == (nxt if mask[end] else IGNORE) and (mask[end] or self.corpus.chats is not None):
                end += 1  # its next token is the row's label slot: a target only (or, not trained, no one's)
            else:
                self._err(where, f"the row's last label {last_label} is not document {doc}'s next token {nxt} "
                                 f"(offset {end}): a token lost or a wrong target")
        elif last_label != self.end_label:
            self._err(where, f"document {doc} ends at {e} with label {last_label}, the end label is {self.end_label}")
        elif e == T - 1:
            self.label_slots += 1
        self._deliver(doc, base, end, where)

    def _deliver(self, doc: int, start: int, end: int, where: str) -> None:
        self.delivered += end - start
        n_tok = len(self.seq[doc])
        crop = self.mode == "bestfit-crop"
        if start == 0:
            self.began[self.corpus.doc_source[doc]] += 1
            chain = _Chain(doc, end, 1, self.stream)
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
                chain = next((c for c in open_ if c.next < start and self._bridge(c, start)), None)
            if chain is None:
                began = start if any(self._starts(f, doc, start) for f in self.floating) else None
                if began is None:  # a start, then a waiting marker piece, then this one
                    for n0 in sorted({n for f in self.floating for n in self._start_ends(f, doc)}):
                        if n0 < start and self._bridge(_Chain(doc, n0), start):
                            began = n0
                            break
                if began is not None:
                    # It began with a piece of markers only; which one is settled at the end (`finish`):
                    # every conversation starts alike.
                    self.orphans.append((doc, began, where))
                    chain = _Chain(doc, start, 1, self.stream)
                    self.chains[doc].append(chain)
                elif not open_:
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
            chain.next, chain.pieces, chain.stream = end, chain.pieces + 1, self.stream
        if chain.next >= n_tok:
            self.chains[doc].remove(chain)
            self._close(doc, where)

    def _starts(self, floating: Tuple[np.ndarray, str, bool, Any], doc: int, start: int) -> bool:
        """Whether a floating start piece can be document ``doc``'s first piece, its next at ``start``
        (where the row's label slot went unseen, that slot held the document's next token, untrained)."""
        toks, _, slot, _ = floating
        seq, mask = self.seq[doc], self.mask[doc]
        n = len(toks)
        return (np.array_equal(seq[:n], toks)
                and (start == n or slot and start == n + 1 and n < len(seq) and not mask[n]))

    def _match_starts(self, complete: bool) -> None:
        """Pair every continuation that had no open piece with a floating start (a bipartite matching)."""
        fits = [[j for j, f in enumerate(self.floating) if self._starts(f, doc, start)]
                for doc, start, _ in self.orphans]
        owner: Dict[int, int] = {}

        def place(i: int) -> bool:
            """An augmenting path from continuation ``i`` (Kuhn's), with an explicit stack: thousands of
            one-token starts (sft at T=2) made the recursive form exceed Python's recursion limit."""
            seen: set = set()
            stack = [(i, iter(fits[i]))]
            via: List[int] = []  # the start each level took
            while stack:
                k, options = stack[-1]
                for j in options:
                    if j in seen:
                        continue
                    seen.add(j)
                    if j not in owner:
                        for (level, _), start in zip(stack, via + [j]):  # flip the path
                            owner[start] = level
                        return True
                    via.append(j)
                    stack.append((owner[j], iter(fits[owner[j]])))
                    break
                else:
                    stack.pop()
                    if via:
                        via.pop()
            return False

        for i, (doc, start, where) in enumerate(self.orphans):
            if not place(i):
                self._err(where, f"document {doc} continues at offset {start}, and no start piece is left for it")
        if complete:
            for j, (toks, where, _, _) in enumerate(self.floating):
                if j not in owner:
                    self._err(where, f"a segment {toks.tolist()} starts a document whose rest never came")

    def _close(self, doc: int, where: str) -> None:
        self.done[doc] += 1
        if self.epochs is not None and not self.cycling and self.done[doc] > self.epochs:
            self._err(where, f"document {doc} delivered {self.done[doc]} times in a round of {self.epochs} epochs")

    def check_documents(self, reported: Dict[str, int], where: str, began: Optional[Dict[str, int]] = None) -> None:
        """``loader.stats()``'s documents per source (``reported``) against the documents whose first
        token was an input in the batches fed (``began``: those counted over several oracles, default this
        one's): a statistic counts what the batches hold (issue 42: crop counted a document whose BOS
        was only a row's last label). Pretrain only: a conversation may begin with a piece of markers."""
        began = self.began if began is None else began
        wrong = {n: (reported[n], began.get(n, 0)) for n in reported if reported[n] != began.get(n, 0)}
        if wrong:
            self._err(where, f"loader.stats() counts documents the batches do not begin (source: (reported, "
                             f"begun as inputs)) {wrong}")

    def finish(self, *, complete: bool = True) -> None:
        """Raise AssertionError listing what went wrong. ``complete``: the round ran to its end."""
        self._match_starts(complete and self.epochs is not None)
        for chains in list(self.chains.values()):
            for c in list(chains):
                if self._bridge(c, None):  # a waiting marker piece was its last
                    chains.remove(c)
                    self._close(c.doc, "end")
        if complete and self.epochs is not None:
            for tokens, _, _, where in self.pending:
                self._err(where, f"a segment of chat markers {tokens.tolist()} that continues no document")
        if complete and self.epochs is not None:
            names = set(self.names or self.corpus.sources)
            crop = self.mode == "bestfit-crop"
            open_ = {d: [c.next for c in cs] for d, cs in self.chains.items() if cs}
            if open_:
                self._err("end", f"{len(open_)} documents left unfinished (doc: offsets reached) "
                                 f"{dict(list(open_.items())[:5])}")
            want = {d: 0 if d in self.dropped else self.epochs for d in range(len(self.corpus.doc_source))}
            # Crop too: every document begins (its BOS an input) as often as the others are delivered; a
            # one-token gap is a label slot (the end label), never a document cut to its BOS (issue 42).
            wrong = [(d, self.done[d]) for d, s in enumerate(self.corpus.doc_source)
                     if s in names and self.done[d] != want[d]]
            if wrong:
                lost = " (crop: begun fewer times: lost, its BOS in a label slot?)" if crop and any(
                    n < want[d] for d, n in wrong) else ""
                self._err("end", f"{len(wrong)} documents delivered another number of times than epochs={self.epochs}"
                                 f"{lost} (doc, times): {wrong[:8]}")
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
              single_dict: bool = True, limit: Optional[float] = None) -> List[Dict[str, str]]:
    """Run ``build(rank, world, workers, sync)`` loaders hop after hop, each hop loading the
    list of every state the previous hop saved (a dict, each rank its own, when the topology
    stays and ``single_dict``), and feed every batch to ``oracle`` in step order. A hop of 0
    steps saves right after loading, without iterating. ``limit``: seconds the chain may take (a
    rank still stepping then fails with `TimeoutError`: an epoch that never ends). Returns the last
    hop's states."""
    import time

    from tokenloom.pipes.loader.rank_sync import ThreadSync

    from .test_elastic import run_ranks

    states: Optional[List[Dict[str, str]]] = None
    prev: Optional[Hop] = None
    rng = random.Random(seed)
    start = time.monotonic()
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
            runs = run_ranks(loaders, sync or ThreadSync(1), steps=hop.steps,
                             deadline=None if limit is None else start + limit)
            for k in range(len(runs[0].batches)):
                for r, run in enumerate(runs):
                    oracle.feed(run.batches[k], f"hop {h} ({hop}) rank {r} step {k}", (h, r, k % max(hop.workers, 1)),
                                hop.workers)
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
