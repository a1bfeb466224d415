"""The graph every worker of `pretrain` and `sft` builds for its shard (`PackedGraph`).

Per source: a sharder (`ShardUnits`) over the source's units, its reader, and a branch that
turns documents into tokens (`Tokenize`, or `RenderChat` for conversations); several sources
meet in a `Mix` (best-fit's in pieces of a row, pipes/pieces.py, so the shares hold early);
then the packer (flat, best-fit or crop) and the `Batch` node, under a `WithStats` that keeps
the counters ``loader.stats()`` reads. The factory is plain data, pickled to spawned workers;
a worker calls it with its `ShardContext`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from tokenloom.pipes.batch import Batch
from tokenloom.pipes.chat import RenderChat
from tokenloom.pipes.loader.bridge import ShardContext
from tokenloom.pipes.loader.elastic import STEP, build_shard
from tokenloom.pipes.mix import Mix
from tokenloom.pipes.pack.bestfit import BestFitPack
from tokenloom.pipes.pack.flat import FlatPack
from tokenloom.pipes.pack.savepoint import reader_states
from tokenloom.pipes.pack.stats import PACK_STAT_KEYS
from tokenloom.pipes.pieces import Pieces
from tokenloom.pipes.schedule import StepClock
from tokenloom.pipes.shard import ShardUnits
from tokenloom.pipes.sources.first_fetches import fetch_first_from
from tokenloom.pipes.sources.readers import SourcePlan
from tokenloom.pipes.stats import WithStats
from tokenloom.pipes.tokenize import Tokenize
from tokenloom.pipes.tokenizer import Encoder

from .settings import PackedSpec


#: Per source: delivered tokens and documents, passes, and rows its reader skipped (null text,
#: bad jsonl lines under on_error="skip"), counted when read.
SOURCE_STAT_KEYS = ("tokens", "documents", "epochs", "skipped")
#: pretrain, per source: documents encoded from text when read (the rest came from a token cache).
TOKENIZED = "tokenized"
#: Per source, read-ahead memory (readahead.py): bytes held now and the most held, summed over workers.
READAHEAD_STAT_KEYS = ("readahead_bytes", "readahead_peak_bytes")


def stat_keys(names: Sequence[str], chat: bool = False) -> List[str]:
    keys = list(PACK_STAT_KEYS) + [f"source/{n}/{k}" for n in names for k in SOURCE_STAT_KEYS + READAHEAD_STAT_KEYS]
    if chat:
        return keys + [f"conversations/{k}" for k in RenderChat.COUNT_KEYS]
    return keys + [f"source/{n}/{TOKENIZED}" for n in names]


@dataclass
class PackedGraph:
    """The picklable factory a worker calls to build its shard's graph.

    Args:
        spec: the recipe's validated settings (recipes/settings.py).
        plans: every source's plan, in order (its units, reader and fingerprint).
        encoder: the tokenizer.
        specials: the resolved ids ``{"bos", "eos", "pad", "end_label"}`` (BOS and EOS may be None;
            ``end_label`` is the label after a whole document's last token: the BOS id or -100).
    """

    spec: PackedSpec
    plans: List[SourcePlan]
    encoder: Encoder
    specials: Mapping[str, Optional[int]]

    def __getstate__(self) -> Dict[str, Any]:
        # A worker never syncs ranks (the loader in the training process does), and a `rank_sync`
        # (threads' barrier, a process group) cannot be pickled: left out, so that the factory still
        # reaches a worker started clean (forkserver, spawn; pipes/loader/fork_guard.py).
        state = dict(self.__dict__)
        run = self.spec.run
        if run.rank_sync is not None:
            state["spec"] = replace(self.spec, run=replace(run, rank_sync=None))
        return state

    def first_fetches(self) -> List[Any]:
        """The first fetches the build (and `fetch_first`) started in this process, one per remote source
        that has them (first_fetches.py's `FirstFetches`): the loader's fork waits for them."""
        found = (getattr(p.fetched()[0], "first", None) for p in self.plans)
        return [f for f in found if f is not None]

    def fetch_first(self, shards: Sequence[Tuple[ShardContext, Optional[Mapping[str, Any]]]]) -> int:
        """After a restore, before the workers start: fetch in this process the first units each shard
        reads of a remote source from the position its state (None: its start, or an elastic
        plan) restores, as the build did from the start (`fetch_first_from`): the workers then start
        with them, not two round trips later. ``shards``: ``(context, the graph's state)`` per worker.
        How many units were added."""
        if not any(getattr(getattr(p.fetched()[0], "first", None), "handles", None) for p in self.plans):
            return 0  # local files, or remote ones listed without keeping them open: nothing to fetch here
        upcoming: Dict[str, List[Any]] = {p.name: [] for p in self.plans}
        for ctx, state in shards:
            for reader, saved in reader_states(build_shard(self, ctx), state):
                sharder = reader.sharder  # the reader protocol (pipes/graph.py)
                if reader.source in upcoming and isinstance(sharder, ShardUnits):
                    sharder.reset(None if saved is None else saved[type(reader).PARENT])
                    upcoming[reader.source].append(sharder.ahead())
        return sum(fetch_first_from(*p.fetched(), upcoming[p.name]) for p in self.plans if upcoming[p.name])

    def __call__(self, ctx: ShardContext):
        spec, specials = self.spec, self.specials
        pack, mix, seed, epochs = spec.pack, spec.mix, spec.run.seed, spec.run.epochs
        chat = spec.text.template if spec.recipe == "sft" else None
        first_epoch = ctx.round * epochs if epochs is not None else 0
        single = len(self.plans) == 1
        branches = {}
        readers = {}
        shards: Dict[str, ShardUnits] = {}
        renderers: List[RenderChat] = []
        for plan in self.plans:
            # With several sources the mixer decides when to stop, so branches are endless.
            node = ShardUnits(plan.units.rows, shard=ctx.shard, num_shards=ctx.num_shards, seed=seed,
                              epochs=epochs if single else None, first_epoch=first_epoch,
                              what=f"source {plan.name!r}")  # an elastic plan: given by the loader (build_shard)
            shards[plan.name] = node
            node = readers[plan.name] = plan.reader(node, seed=seed)
            if chat is None:
                branches[plan.name] = Tokenize(node, self.encoder, bos=specials["bos"], eos=specials["eos"])
            else:
                branches[plan.name] = RenderChat(node, self.encoder, template=chat, max_tokens=pack.seq_len + 1,
                                                 long=spec.text.long_conversations)
                renderers.append(branches[plan.name])
        feeds: Mapping[str, Any] = branches
        if pack.packing == "bestfit" and not single and chat is None:
            # Long documents reach the mixer in pieces of `piece_rows` rows, so the shares hold early (pipes/pieces.py).
            feeds = {n: Pieces(b, piece=pack.piece_rows * (pack.seq_len + 1)) for n, b in branches.items()}
        clock = StepClock(ctx.worker, ctx.num_workers, base=ctx.elastic[STEP] if ctx.elastic else 0)
        if single:
            mixed, mixer = branches[self.plans[0].name], None
        else:
            mixer = mixed = Mix(feeds, weights=mix.weights, strategy=mix.mix, unit=mix.weights_unit,
                                stop=mix.stop, cycle_exhausted=mix.cycle_exhausted, passes=epochs or 1,
                                first_epoch=first_epoch,
                                pattern=mix.pattern, burst=mix.burst, seed=seed, shard=ctx.shard, clock=clock)
        if pack.packing == "flat":
            packer = FlatPack(mixed, seq_len=pack.seq_len, pad_id=specials["pad"])
        else:
            packer = BestFitPack(mixed, seq_len=pack.seq_len, buffer_size=pack.buffer_size, pad_id=specials["pad"],
                                 mode="crop" if pack.packing == "bestfit-crop" else "bestfit",
                                 buffer_tokens=pack.buffer_tokens, max_wait=pack.max_wait, min_fill=pack.min_fill)
        names = [p.name for p in self.plans]
        batch = Batch(packer, batch_size=pack.batch_size, seq_len=pack.seq_len, pad_id=specials["pad"],
                      sources=names, clock=clock, end_label=specials["end_label"])

        source_readers = [readers[n] for n in names]
        source_branches = [branches[n] for n in names]
        aheads = [getattr(r, "readahead_stats", None) for r in source_readers]
        # Per source: tokens, documents, epochs, skipped, read-ahead held and peak bytes (stat_keys' order).
        per_source = np.zeros((len(names), 6), np.int64)
        encoded = np.zeros(len(names), np.int64)
        # A reader's skipped count and a branch's encoded count change only when the mixer pulls that
        # source; read-ahead moves by itself, but only where a reader has one (remote files).
        moved = mixer.pulled_since() if mixer is not None else None
        live_aheads: List[int] = []
        looked: List[bool] = [False]

        def counters() -> np.ndarray:
            # Once a batch: whole columns and the sources that moved, not a Python step per source.
            pack = packer.stats()
            tokens, docs = batch.count_columns()
            per_source[:, 0] = tokens
            per_source[:, 1] = docs
            # passes completed: the mixer's count or, for one source (no mixer), the epoch its sharder
            # is in (all of this round's epochs once its stream ended)
            per_source[:, 2] = mixer.passes_started() if mixer is not None else \
                [max(shards[n].next_epoch() - shards[n].first_epoch, 0) for n in names]
            for i in (range(len(names)) if moved is None else moved):
                per_source[i, 3] = getattr(source_readers[i], "skipped", 0)  # text readers never skip
                if not renderers:
                    encoded[i] = source_branches[i].encoded
            if moved is not None:
                moved.clear()
            if not looked[0]:  # every reader was reset with the graph: whether it reads ahead is known
                live_aheads[:] = [i for i, f in enumerate(aheads) if f is not None and f() is not None]
                looked[0] = True
            for i in live_aheads:
                got = aheads[i]()
                per_source[i, 4:6] = (got["held_bytes"], got["peak_bytes"]) if got else (0, 0)
            if renderers:
                per = [r.counts() for r in renderers]
                tail = [sum(c[k] for c in per) for k in RenderChat.COUNT_KEYS]
            else:
                tail = encoded
            return np.concatenate([[pack[k] for k in PACK_STAT_KEYS], per_source.ravel(), tail])

        return WithStats(batch, counters=counters, keys=stat_keys(names, bool(renderers)), worker=ctx.worker)
