"""Random scenarios for the token-level oracle (tests/oracle.py): a run chained over 2-4
topologies, checked at token level.

A scenario is drawn from one seed: 1-3 sources of random kinds (parquet, jsonl, JSON
array, .jsonl.gz, a saved HF dataset, a token cache), a packing mode, row length, batch
and buffer sizes, epochs 1-3 or an endless stream, a mix strategy with its options
(weights or a schedule switching near a save, ``weights_unit``, ``stop``, cycling),
``eos=``, ``predict_bos``, and 2-4 hops of 1-4 simulated ranks x 0-3 workers, each saving
after 0 steps, after some, at the round's last batch, or after the round (then the next
hop runs the next round, checked on its own). Between hops a state goes through JSON or
``torch.save``; a hop on the same topology may load its own dict or the list; the weights
may change at a hop (``allow_weight_change``); persistent workers and a `DevicePrefetcher`
(its own state) appear at random. Drawn last, so earlier seeds keep their scenarios: buffers of 1-3
documents, rows of 2-9 tokens, sources of a few documents, and a graph composed by hand
(tests/composed.py: a filter and a torchdata Mapper, run by TokenLoomLoader) instead of the recipe,
of several sources either told to the mixer or as the README composes them (finite sharders under a
``Mix`` left to its defaults, issue 42);
then, for ``bestfit-crop`` with epochs, several sources each delivered to the round's end (issue 42);
then, one scenario in ten, many sources (issue 46: 8-64 of them, a third of 1-3 documents, some of
documents of 1-2 words, the topologies sometimes narrowed to one or two shards so a source can be a
single document; see `many_sources`); then, one in seven, workers that take their state only around
every N-th step (``snapshot_every_n_steps`` 2-8, 1-2 batches ready each; saves at multiples of N or, in
half of them, between, see `sparse_snapshots`).
Besides the oracle's checks, ``loader.stats()``'s documents per source must be the documents whose
first token came as an input (pretrain, the recipe's graph).
Each scenario runs under a time limit (``--limit``): an epoch that never ends fails with its seed.

    python -m tests.oracle_fuzz --seed 17            # one scenario, printed, then run
    python -m tests.oracle_fuzz --minutes 30         # as many as fit (make fuzz MINUTES=30)
    python -m tests.oracle_fuzz --n 200 --start 1000
    python -m tests.oracle_fuzz --many --n 30        # only scenarios with many sources (--seed N reruns one)

A failing seed prints the scenario and the command that reproduces it.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import random
import shutil
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from .composed import COMPOSABLE, composed_builder
from .oracle import BOS, CHAT_KINDS, IGNORE, KINDS, Oracle, make_corpus


#: Seconds a scenario may take (the largest take ~20 s on 2 cores): past it, a failure with its seed.
LIMIT = 180.0


@dataclass
class FuzzHop:
    world: int
    workers: int
    save: Any  # int: steps; "last": the round's last batch; "end": after the round (the next hop: next round)
    roundtrip: str = "torch"
    as_dict: bool = True  # same topology: each rank loads its own dict (else the list)
    weights: Optional[Dict[str, float]] = None  # a change of weights at this hop (allow_weight_change)
    persistent: bool = False
    prefetcher: bool = False

    def __str__(self) -> str:
        extra = "".join([" json" if self.roundtrip == "json" else "", "" if self.as_dict else " list",
                         f" weights={self.weights}" if self.weights else "", " persistent" if self.persistent else "",
                         " prefetcher" if self.prefetcher else ""])
        return f"{self.world}x{self.workers} save={self.save}{extra}"


@dataclass
class Scenario:
    seed: int
    sources: Dict[str, Tuple[Any, ...]]  # name -> (kind, documents) or (kind, documents, most words a document)
    seq_len: int
    batch_size: int
    packing: str
    buffer_size: int
    epochs: Optional[int]
    loader: Dict[str, Any]  # pretrain (sft) keyword arguments
    hops: List[FuzzHop] = field(default_factory=list)
    chat: bool = False  # conversations through sft (bestfit, long ones split)
    #: Read-ahead forced on for local files with this budget (TOKENLOOM_READAHEAD_BYTES) and line units fetched
    #: in parts of ``part_bytes`` (unit_readahead.PART_BYTES), or None: the default (local files read when needed).
    readahead: Optional[str] = None
    part_bytes: int = 0
    #: A graph composed by hand instead of the recipe (tests/composed.py), with a filter dropping source a's
    #: documents shorter than this many tokens (and a torchdata Mapper); 0: the recipe.
    composed: int = 0
    #: The composed graph of several sources as the README writes it: each sharder ``epochs``, the mixer with its
    #: defaults (it learns the rest from the graph); False: the sharders endless, the mixer told everything.
    mix_defaults: bool = False
    #: The number of sources where the scenario was drawn with many (`many_sources`), else 0.
    many: int = 0

    def complete(self) -> bool:
        """Whether a round delivers every document exactly ``epochs`` times."""
        return (self.epochs is not None and self.loader.get("stop") in (None, "all_exhausted")
                and not self.loader.get("cycle_exhausted", True))

    def __str__(self) -> str:
        hops = " -> ".join(map(str, self.hops))
        ahead = f" read-ahead {self.readahead} parts {self.part_bytes}" if self.readahead else ""
        ahead += f" composed (filter < {self.composed} tokens)" if self.composed else ""
        ahead += " finite sharders under a default Mix" if self.mix_defaults else ""
        ahead += f" {self.many} sources" if self.many else ""
        return (f"seed {self.seed}: {'sft ' if self.chat else ''}sources {self.sources}, T={self.seq_len} B={self.batch_size} {self.packing} "
                f"buffer {self.buffer_size} epochs={self.epochs} {self.loader}{ahead}; hops {hops}")


def _draw_stop(rng, mix: str, loader: dict) -> None:
    """A stop rule for a scenario with epochs (the same draws wherever it is drawn, so seeds keep their scenarios)."""
    if mix == "sequential":
        loader["stop"], loader["cycle_exhausted"] = rng.choice([("all_exhausted", False),
                                                                ("first_exhausted", True)])
    else:
        loader["stop"] = rng.choice(["all_exhausted", "all_exhausted", "first_exhausted"])
        loader["cycle_exhausted"] = loader["stop"] == "first_exhausted" or rng.random() < 0.3


def draw(seed: int) -> Scenario:
    rng = random.Random(seed)
    n_src = rng.choice([1, 1, 2, 2, 3])
    names = ["a", "b", "c"][:n_src]
    chat = rng.random() < 0.2
    kinds = list(CHAT_KINDS) if chat else [k for k in KINDS if k != "hf"] + ["hf"]
    sources = {n: (rng.choice(kinds), rng.randint(30, 120)) for n in names}
    T = rng.choice([16, 32, 64])
    packing = "bestfit" if chat else rng.choice(["flat", "bestfit", "bestfit", "bestfit-crop"])
    epochs = rng.choice([1, 1, 2, 3, None])
    loader: Dict[str, Any] = {"long_conversations": "split"} if chat else {"predict_bos": rng.random() < 0.7}
    if not chat and rng.random() < 0.25:
        loader["eos"] = "<|eos|>"
    if n_src > 1:
        mix = rng.choice(["interleave", "interleave", "random", "round_robin", "alternating", "sequential"])
        loader["mix"] = mix
        loader["weights_unit"] = rng.choice(["tokens", "documents"])
        w = {n: rng.choice([1, 2, 3]) for n in names}
        if mix == "alternating":
            loader["pattern"] = [rng.choice(names) for _ in range(rng.randint(2, 4))]
            loader["pattern"] += [n for n in names if n not in loader["pattern"]]
            loader["burst"] = rng.randint(1, 3)
        elif mix not in ("sequential", "round_robin"):
            if rng.random() < 0.3:
                switch = rng.randint(1, 8)
                loader["weights"] = [(0, w), (switch, {n: rng.choice([1, 2, 3]) for n in names})]
            else:
                loader["weights"] = w
        if epochs is not None:
            _draw_stop(rng, mix, loader)
        elif mix == "sequential":
            loader["mix"] = "interleave"
    elif epochs is not None:
        loader["cycle_exhausted"] = False
    hops = []
    for h in range(rng.randint(2, 4)):
        world = rng.choice([1, 1, 2, 3, 4])
        workers = rng.choice([0, 0, 1, 2, 3]) if world <= 2 else rng.choice([0, 0, 1])
        save: Any = rng.choice([0, rng.randint(1, 4), rng.randint(1, 12), "last", "end"])
        hop = FuzzHop(world, workers, save, roundtrip=rng.choice(["torch", "json"]), as_dict=rng.random() < 0.7,
                      persistent=workers > 0 and rng.random() < 0.3,
                      prefetcher=world == 1 and rng.random() < 0.2)
        if h and "weights" in loader and isinstance(loader["weights"], dict) and rng.random() < 0.2:
            hop.weights = {n: rng.choice([1, 2, 3]) for n in names}
        hops.append(hop)
    if epochs is None:
        for hop in hops:  # an endless stream has no round to end
            if hop.save in ("last", "end"):
                hop.save = rng.randint(1, 12)
    hops[-1].save = "end" if epochs is not None else rng.randint(4, 16)
    sc = Scenario(seed, sources, T, rng.choice([1, 2, 4]), packing, rng.choice([4, 16, 64]), epochs, loader, hops, chat)
    if rng.random() < 0.3:  # drawn last: the scenarios of earlier seeds stay what they were
        sc.readahead, sc.part_bytes = rng.choice(["1K", "8K", "64M"]), rng.choice([64, 700, 1 << 20])
    # Down to the smallest legal values (drawn after the above, for the same reason): a buffer of 1-3
    # documents, rows of 2-9 tokens, sources of 1-4 documents (at least one a shard).
    if rng.random() < 0.3:
        sc.buffer_size = rng.choice([1, 2, 3])
    if rng.random() < 0.1:
        sc.seq_len = rng.choice([1, 2, 4, 8])
        if sc.chat:
            # The oracle's blind spot, not the loader's (the same on the code before issue 34): a chunk whose
            # inputs are markers only and whose one word is its label, masked as a user's, names no
            # conversation among the open ones: [marker, word] at T=1 (seed 20324), [end, role, word] at T=2
            # (seed 31773). Between two words a conversation has at most two markers, so from T=4 every
            # chunk's inputs hold a word. Conversations are drawn down to T=4.
            sc.seq_len = max(sc.seq_len, 4)
    if rng.random() < 0.15:  # every shard needs a row: refused with a clear error otherwise (test_bad_input.py)
        shards = max(h.world * max(h.workers, 1) for h in sc.hops)
        sc.sources = {n: (kind, max(rng.randint(1, 4), shards)) for n, (kind, _) in sc.sources.items()}
    if (not sc.chat and all(kind in COMPOSABLE for kind, _ in sc.sources.values()) and rng.random() < 0.2
            and sc.loader.get("mix", "interleave") == "interleave" and not isinstance(sc.loader.get("weights"), list)):
        # A graph composed by hand, with a filter and a Mapper (tests/composed.py): the recipe's settings it has
        sc.composed = rng.randint(1, 8)
        for hop in sc.hops:
            hop.weights = None
    if sc.packing == "bestfit" and not sc.composed and rng.random() < 0.2:  # drawn last, as above
        sc.loader["min_fill"] = rng.randint(1, sc.seq_len)  # the least gap cut from a long document
    if sc.composed and len(sc.sources) > 1 and sc.epochs is not None and rng.random() < 0.5:  # drawn last, as above
        # As the README composes several sources: finite sharders under Mix(branches, weights=...); each branch
        # ends after its epochs and drops out, so the round delivers every document once per epoch, as
        # stop="all_exhausted" without cycling does (what the oracle is told).
        sc.mix_defaults = True
        sc.loader["stop"], sc.loader["cycle_exhausted"] = "all_exhausted", False
    if sc.packing == "bestfit-crop" and sc.epochs is not None and not sc.composed and rng.random() < 0.6:
        # Drawn last, as above. Issue 42: crop with several sources, each delivered to a finite round's end
        # (all_exhausted, no cycling, so the oracle checks every document), where the packer's buffer drains
        # into the last rows (it cropped them, down to BOS-only label slots, and counted them delivered).
        kinds = [k for k in KINDS if k != "hf"] + ["hf"]
        for n in ["a", "b", "c"][len(sc.sources):rng.choice([2, 3])]:
            sc.sources[n] = (rng.choice(kinds), rng.randint(30, 120))
        names = list(sc.sources)
        if sc.loader.get("mix") is None:
            sc.loader["mix"] = rng.choice(["interleave", "random", "round_robin"])
            sc.loader["weights_unit"] = rng.choice(["tokens", "documents"])
            if sc.loader["mix"] != "round_robin":
                sc.loader["weights"] = {n: rng.choice([1, 2, 3]) for n in names}
        elif sc.loader["mix"] == "alternating":
            sc.loader["pattern"] = list(sc.loader["pattern"]) + [n for n in names if n not in sc.loader["pattern"]]
        weights = sc.loader.get("weights")
        if isinstance(weights, dict):
            sc.loader["weights"] = {n: weights.get(n, rng.choice([1, 2, 3])) for n in names}
        elif isinstance(weights, list):
            sc.loader["weights"] = [(step, {n: w.get(n, rng.choice([1, 2, 3])) for n in names}) for step, w in weights]
        for hop in sc.hops:
            if hop.weights is not None:
                hop.weights = {n: hop.weights.get(n, 1) for n in names}
        sc.loader["stop"], sc.loader["cycle_exhausted"] = "all_exhausted", False
    # Drawn last, as above; in a window of the draw that none of test_oracle.SEEDS (the CI's seeds) falls in,
    # so those keep the scenarios their comments describe.
    if not sc.chat and MANY_AT <= rng.random() < MANY_AT + MANY_P:
        many_sources(rng, sc)
    # Drawn last, as above, in a window none of the CI's seeds falls in: pieces of more than a row (`piece_rows`,
    # pretrain bestfit with several sources), from 2 rows to more than any document here (whole documents).
    if (PIECES_AT <= rng.random() < PIECES_AT + PIECES_P and sc.packing == "bestfit" and not sc.chat
            and not sc.composed and len(sc.sources) > 1):
        sc.loader["piece_rows"] = rng.choice([2, 3, 8, 1000])
    # Drawn last, as above, in a window none of the CI's seeds falls in: worker states taken only around every
    # N-th step (`sparse_snapshots`).
    if SPARSE_AT <= rng.random() < SPARSE_AT + SPARSE_P and any(h.workers for h in sc.hops):
        sparse_snapshots(rng, sc)
    # Drawn last, as above, in a window none of the CI's seeds falls in: a read budget small enough that the
    # parquet row groups of 16 rows are read in windows of 8 (row_windows.py), both held compressed or the second
    # read again (held_rows.py), as the budget gives room.
    if BUDGET_AT <= rng.random() < BUDGET_AT + BUDGET_P:
        sc.loader["read_budget"] = rng.choice([1, 256, 2048, 1 << 14, 1 << 16])
    return sc


def sparse_snapshots(rng: random.Random, sc: Scenario) -> None:
    """Workers take their state only around every N-th step (``snapshot_every_n_steps``, N 2-8), with 1-2
    batches ready each (``prefetch_factor``) so that most batches carry none. Each hop saves at a multiple
    of N, as a run that checkpoints every N steps does (a save of k steps becomes the nearest multiple, and
    one at a round's last batch, ``"last"``, a step of its own, its end), or in half of the scenarios at the
    step drawn: a state between two N-th steps resumes elastically too (advance.py), but not with new
    weights (refused; test_sparse_snapshots.py)."""
    every = rng.choice([2, 3, 5, 8])
    sc.loader["snapshot_every_n_steps"], sc.loader["prefetch_factor"] = every, rng.choice([1, 2])
    drawn = [hop.save for hop in sc.hops]
    for hop in sc.hops:
        if isinstance(hop.save, int) and hop.save:
            hop.save = every * max(1, round(hop.save / every))
        elif hop.save == "last":
            hop.save = "end" if sc.epochs is not None else every
    # Drawn after the rest (the scenarios above stay as they were): in half of them, saves between two N-th
    # steps too, which an elastic resume advances to their step (pipes/loader/advance.py); not where the next
    # hop changes the weights, which refuses them.
    if rng.random() < 0.5:
        for hop, nxt, save in zip(sc.hops, sc.hops[1:], drawn):
            if isinstance(save, int) and save and not nxt.weights:
                hop.save = save


#: The share of scenarios whose long documents come in pieces of more than a row (``piece_rows``).
PIECES_P = 0.2
PIECES_AT = 0.1
#: The share of scenarios whose workers take their state only around every N-th step (`sparse_snapshots`).
SPARSE_P = 0.14
SPARSE_AT = 0.545
#: The share of scenarios with a small ``read_budget`` (row groups read in windows).
BUDGET_P = 0.095
BUDGET_AT = 0.877
#: The share of scenarios drawn with many sources (`many_sources`); ``--many`` runs only those.
MANY_P = 0.1
MANY_AT = 0.36
#: Documents in all the sources of a many-source scenario, about: as many as the others' (1-3 sources of
#: 30-120), so a many-source scenario costs what another does.
MANY_DOCS = 400


def many_sources(rng: random.Random, sc: Scenario) -> None:
    """Turn ``sc`` into a scenario of 8-64 sources (issue 46), in place, keeping its packing, rows,
    epochs, hops and the rest.

    Sources: most of a few documents (about `MANY_DOCS` in all); about a third tiny, 1-3 documents (as
    few as the hops' shards allow: every shard needs a row of every source, else the loader refuses);
    some "empty-ish", documents of 1-2 words (not of none: a document without words is a BOS alone,
    which names no document, so the oracle cannot place it; a trial with such documents delivered one
    BOS-only segment for each, and the oracle reported them all as unattributable). Kinds mostly parquet
    and jsonl, a few of the others. To reach a single document a source, the topologies are sometimes
    narrowed to one shard (1 rank, 0-1 workers) or two. The mix is drawn anew over the names: interleave (equal weights, random ones, or a
    schedule switching early), random, round_robin, alternating over a pattern naming every source,
    sequential; ``stop`` and cycling as for a few sources. Hops that changed weights get new ones over
    the new names. Graphs composed by hand are left to the few-source scenarios."""
    n = rng.choice([8, 12, 16, 24, 32, 48, 64])
    sc.many = n
    sc.composed, sc.mix_defaults = 0, False
    narrow = rng.random()
    if narrow < 0.6:  # one shard (0.35) or at most two: the tiny sources can be 1 or 2 documents
        tops = [(1, 0), (1, 1)] if narrow < 0.35 else [(1, 0), (1, 1), (1, 2), (2, 0), (2, 1)]
        for hop in sc.hops:
            hop.world, hop.workers = rng.choice(tops)
            hop.persistent = hop.persistent and hop.workers > 0
            hop.prefetcher = hop.prefetcher and hop.world == 1
    shards = max(h.world * max(h.workers, 1) for h in sc.hops)
    kinds = ["parquet"] * 4 + ["jsonl"] * 2 + ["json_array", "jsonl_gz", "cache"]
    usual = max(3, MANY_DOCS // n)
    sources: Dict[str, Tuple[Any, ...]] = {}
    for i in range(n):
        kind = "hf" if rng.random() < 0.03 else rng.choice(kinds)  # a saved HF dataset is slow to write
        r = rng.random()
        if r < 0.35:
            spec: Tuple[Any, ...] = (kind, max(rng.randint(1, 3), shards))
        elif r < 0.5:
            spec = (kind, max(rng.randint(1, 4), shards), rng.choice([1, 2]))
        else:
            spec = (kind, max(rng.randint(3, usual), shards))
        sources[f"m{i:02d}"] = spec
    sc.sources = sources
    names = list(sources)
    loader = {k: v for k, v in sc.loader.items()
              if k not in ("mix", "weights", "weights_unit", "pattern", "burst", "stop", "cycle_exhausted")}
    mix = rng.choice(["interleave", "interleave", "interleave", "random", "round_robin", "alternating", "sequential"])
    if mix == "sequential" and sc.epochs is None:
        mix = "interleave"
    loader["mix"], loader["weights_unit"] = mix, rng.choice(["tokens", "documents"])
    equal = rng.random() < 0.5
    w = {k: 1.0 if equal else rng.choice([1, 2, 3]) for k in names}
    if mix == "alternating":
        loader["pattern"] = rng.sample(names, len(names)) + [rng.choice(names) for _ in range(rng.randint(0, 3))]
        loader["burst"] = rng.randint(1, 3)
    elif mix in ("interleave", "random"):
        loader["weights"] = ([(0, w), (rng.randint(1, 8), {k: rng.choice([1, 2, 3]) for k in names})]
                             if rng.random() < 0.2 else w)
    if sc.epochs is not None:
        _draw_stop(rng, mix, loader)
    sc.loader = loader
    for hop in sc.hops:
        hop.weights = ({k: rng.choice([1, 2, 3]) for k in names}
                       if hop.weights is not None and isinstance(loader.get("weights"), dict) else None)


def _builder(sc: Scenario, corpus, weights: Optional[Dict[str, float]]):
    from tokenloom.recipes import ChatTemplate, pretrain, sft

    kw = dict(sc.loader)
    if weights is not None:
        kw["weights"] = weights
    srcs = {n: corpus.sources[n] for n in sc.sources}

    def build(rank: int, world: int, workers: int, sync, persistent: bool = False):
        extra = {"persistent_workers": True} if persistent and workers > 0 else {}
        # sparse_snapshots: prefetch_factor is refused without workers
        extra.update({k: v for k, v in kw.items() if workers or k != "prefetch_factor"})
        if sc.chat:
            template = ChatTemplate(roles={"user": "<|user|>", "assistant": "<|assistant|>"}, end="<|end|>",
                                    bos="<|bos|>")
            return sft(srcs, tokenizer=corpus.tokenizer, template=template, seq_len=sc.seq_len,
                       batch_size=sc.batch_size, buffer_size=sc.buffer_size, epochs=sc.epochs, num_workers=workers,
                       rank=rank, world_size=world, rank_sync=sync, seed=sc.seed % 7, **extra)
        return pretrain(srcs, tokenizer=corpus.tokenizer, bos="<|bos|>", seq_len=sc.seq_len,
                        batch_size=sc.batch_size, packing=sc.packing, buffer_size=sc.buffer_size, epochs=sc.epochs,
                        num_workers=workers, rank=rank, world_size=world, rank_sync=sync, seed=sc.seed % 7,
                        cache=corpus.cache, cache_strict=corpus.cache is not None, **extra)
    return build


class _Prefetched:
    """A loader read through a DevicePrefetcher: iterates it; its state and stats are the prefetcher's
    (as of the last batch handed to the loop), never the loader's, which describe the last batch the
    prefetch thread fetched, up to ``depth`` ahead (and are read while that thread may be mid-fetch)."""

    def __init__(self, loader):
        from tokenloom.pipes.loader.prefetch import DevicePrefetcher

        self.loader, self.pre = loader, DevicePrefetcher(loader, device="cpu", depth=2)

    def __iter__(self):
        return iter(self.pre)

    def state_dict(self):
        return self.pre.state_dict()

    def stats(self):
        return self.pre.stats()


def run_scenario(sc: Scenario, root: str, *, limit: float = LIMIT) -> Dict[str, int]:
    """Run ``sc``; raises AssertionError (the oracle's findings) or whatever the loader raised, and
    `TimeoutError` when it runs past ``limit`` seconds (an epoch that never ends)."""
    deadline = time.monotonic() + limit
    from tokenloom.pipes.loader.rank_sync import ThreadSync

    from .oracle import _roundtrip
    from .test_elastic import run_ranks

    corpus = make_corpus(root, sc.sources, row=sc.seq_len + 1, seed=sc.seed, chat=sc.chat)
    rounds = 0

    dropped = frozenset()
    if sc.composed:
        seqs, _ = corpus.sequences("eos" in sc.loader)
        if sc.epochs is None or len(sc.sources) > 1 and not sc.mix_defaults:
            # Where source a's branch is endless (an endless stream, or several sources: the mixer ends
            # the passes), a filter that drops every document a shard holds of it never returns: the
            # graph the user composed reads for ever inside one next() (seed 14538: four documents of a
            # on four ranks, each shorter than the filter's 8 tokens). A limit of composing a filter, in
            # the README; these scenarios filter below a's shortest document: the node runs, drops none.
            shortest = min(len(seqs[d]) for d, s in enumerate(corpus.doc_source) if s == "a")
            sc.composed = min(sc.composed, shortest)
        dropped = frozenset(d for d, s in enumerate(corpus.doc_source) if s == "a" and len(seqs[d]) < sc.composed)

    def new_oracle():
        return Oracle(corpus, epochs=sc.epochs, mode=sc.packing, cycling=sc.loader.get("cycle_exhausted", True),
                      end_label=BOS if sc.loader.get("predict_bos") else IGNORE, eos="eos" in sc.loader,
                      names=list(sc.sources), dropped=dropped)
    oracle = new_oracle()
    began: collections.Counter = collections.Counter()  # documents begun as inputs in earlier rounds' oracles
    reported: Optional[List[Dict[str, Any]]] = None  # the last hop's loader.stats(), per rank
    states: Optional[List[Dict[str, str]]] = None
    prev: Optional[FuzzHop] = None
    weights = None
    batches_seen = 0
    for h, hop in enumerate(sc.hops):
        if hop.weights is not None:
            weights = hop.weights
        build = composed_builder(sc, corpus) if sc.composed else _builder(sc, corpus, weights)
        sync = ThreadSync(hop.world) if hop.world > 1 else None
        loaders = []
        for r in range(hop.world):
            loader = build(r, hop.world, hop.workers, sync, hop.persistent)
            if states is not None:
                allow = hop.weights is not None
                if hop.as_dict and (prev.world, prev.workers) == (hop.world, hop.workers):
                    loader.load_state_dict(states[r], allow_weight_change=allow)
                else:
                    order = list(states)
                    random.Random(sc.seed * 31 + h * 7 + r).shuffle(order)
                    loader.load_state_dict(order, allow_weight_change=allow)
            loaders.append(_Prefetched(loader) if hop.prefetcher else loader)
        where = f"hop {h} ({hop})"
        if hop.save == 0:
            saved = [loader.state_dict() for loader in loaders]
            runs_ended = False
        else:
            record = hop.save == "last"
            steps = hop.save if isinstance(hop.save, int) else None
            runs = run_ranks(loaders, sync or ThreadSync(1), steps=steps, record=record, deadline=deadline)
            n = len(runs[0].batches)
            for k in range(n):
                for r, run in enumerate(runs):
                    oracle.feed(run.batches[k], f"{where} rank {r} step {k}", (h, r, k % max(hop.workers, 1)),
                                hop.workers)
            batches_seen += n
            saved = [run.states[n] if record else run.final for run in runs]
            reported = [run.stats[n] if record else run.stats[-1] for run in runs]
            runs_ended = runs[0].ended and not record  # "last": saved before the end was seen
            if runs_ended and h < len(sc.hops) - 1:
                oracle.finish(complete=sc.complete())  # the round ended: the next hop runs the next
                began.update(oracle.began)
                oracle = new_oracle()
                rounds += 1
        states = [_roundtrip(s, hop.roundtrip) for s in saved]
        prev = hop
        for loader in loaders:
            del loader
        del loaders
    if reported is not None and not sc.chat and not sc.composed:
        # The statistics are cumulative over the run (carried through resumes): the documents every
        # oracle of the run saw begin, all rounds together.
        docs = {n: sum(r["sources"][n]["documents"] for r in reported) for n in sc.sources}
        oracle.check_documents(docs, "end: loader.stats()", began + oracle.began)
    oracle.finish(complete=runs_ended and sc.complete())
    return {"batches": batches_seen, "rounds": rounds + 1, "tokens": oracle.delivered}


@contextlib.contextmanager
def _readahead(sc: Scenario):
    """Read-ahead as the scenario says, for its run (loader workers fork with it)."""
    if not sc.readahead:
        yield
        return
    from tokenloom.pipes.sources import readahead, unit_readahead

    saved = {k: os.environ.get(k) for k in (readahead.ENV, readahead.ENV_BYTES)}
    part = unit_readahead.PART_BYTES
    os.environ[readahead.ENV], os.environ[readahead.ENV_BYTES] = "all", sc.readahead
    unit_readahead.PART_BYTES = sc.part_bytes
    try:
        yield
    finally:
        unit_readahead.PART_BYTES = part
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def check_seed(seed: int, limit: float = LIMIT) -> Dict[str, int]:
    sc = draw(seed)
    root = tempfile.mkdtemp(prefix=f"oracle-fuzz-{seed}-")
    try:
        with _readahead(sc):
            return run_scenario(sc, root, limit=limit)
    except BaseException as e:
        raise AssertionError(f"scenario {sc}\nreproduce: python -m tests.oracle_fuzz --seed {seed}\n"
                             f"{type(e).__name__}: {e}") from e
    finally:
        shutil.rmtree(root, ignore_errors=True)


def category(sc: Scenario) -> str:
    elastic = any((a.world, a.workers) != (b.world, b.workers) for a, b in zip(sc.hops, sc.hops[1:]))
    return (f"{'sft' if sc.chat else sc.packing}/{'elastic' if elastic else 'same'}/"
            f"{'endless' if sc.epochs is None else f'epochs={sc.epochs}'}{'/many' if sc.many else ''}")


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seed", type=int, help="run this one scenario, printed")
    ap.add_argument("--start", type=int, default=10_000, help="first seed of a batch run")
    ap.add_argument("--n", type=int, help="scenarios to run")
    ap.add_argument("--minutes", type=float, help="run scenarios until this much time has passed")
    ap.add_argument("--limit", type=float, default=LIMIT, help="seconds a scenario may take before it fails as a hang")
    ap.add_argument("--many", action="store_true", help="only the seeds whose scenario has many sources (8-64): "
                                                        "--n counts those")
    args = ap.parse_args(argv)
    import warnings

    warnings.filterwarnings("ignore")
    if args.seed is not None:
        print(draw(args.seed))
        print(check_seed(args.seed, args.limit))
        return 0
    deadline = time.monotonic() + 60 * (args.minutes or 1e9)
    count = args.n if args.n is not None else (1 << 62 if args.minutes else 50)
    failures, per = [], {}
    seed = args.start
    t0 = time.monotonic()
    ran = 0
    while ran < count and time.monotonic() < deadline:
        sc = draw(seed)
        if args.many and not sc.many:
            seed += 1
            continue
        ran += 1
        cat = category(sc)
        try:
            check_seed(seed, args.limit)
            per[cat] = per.get(cat, 0) + 1
        except AssertionError as e:
            failures.append(seed)
            print(f"FAIL {e}\n", flush=True)
        except Exception:
            failures.append(seed)
            print(f"FAIL seed {seed}: {sc}\n{traceback.format_exc()}", flush=True)
        seed += 1
    print(f"{ran} scenarios (seeds {args.start}..{seed - 1}) in {time.monotonic() - t0:.0f}s, "
          f"{len(failures)} failed: {failures[:20]}")
    for cat in sorted(per):
        print(f"  {cat}: {per[cat]} passed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
