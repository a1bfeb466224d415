"""A pretrain-like graph composed by hand from tokenloom's public nodes, a user's filter and a
``torchdata.nodes.Mapper``, run by ``TokenLoomLoader`` (issue 35): what a user who outgrows the
recipes writes. The oracle's tests and its fuzzer (``composed`` scenarios) run it beside the recipes.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Dict, Optional, Tuple

from torchdata.nodes import Mapper

from tokenloom.pipes import (Batch, BestFitPack, FlatPack, Mix, Pieces, ReadJsonl, ReadParquet, ShardContext,
                             ShardUnits, Tokenize, TokenLoomLoader, collate_rows, list_jsonl_units,
                             list_parquet_units, load_encoder, resolve_files)

from .oracle import BOS, EOS, IGNORE
from .test_custom_node import LengthFilter

#: The oracle corpus kinds a composed graph reads (parquet, and JSON lines / arrays, plain or gzipped).
COMPOSABLE = ("parquet", "jsonl", "json_array", "jsonl_gz")


def _same(doc):
    return doc


@dataclass
class Composed:
    """Per source: sharder -> reader -> tokenizer -> (source ``a``: the filter) -> a Mapper -> (best-fit of
    several: pieces); several sources mixed (interleave, by weight); packed; batched."""

    sources: Dict[str, Tuple[str, str]]  # name -> (kind, path)
    tokenizer: str
    seq_len: int
    batch_size: int
    packing: str = "bestfit"
    buffer_size: int = 16
    epochs: Optional[int] = 1
    weights: Optional[Dict[str, float]] = None
    weights_unit: str = "tokens"
    stop: str = "all_exhausted"
    cycle_exhausted: bool = False
    eos: bool = False
    end_label: Optional[int] = BOS
    min_tokens: int = 0
    filter_cls: type = LengthFilter
    seed: int = 3
    #: As the README composes two sources: finite sharders (``epochs``) under ``Mix(branches, weights=...)`` with
    #: its defaults, which learns the rest from the graph; False: the sharders endless, the mixer told everything.
    mix_defaults: bool = False
    names: Tuple[str, ...] = field(init=False)

    def __post_init__(self):
        self.names = tuple(self.sources)

    def _reader(self, name: str, node):
        kind, path = self.sources[name]
        if kind == "parquet":
            units = list_parquet_units(resolve_files(path), "text")
            return ReadParquet(node(units), units, source=name, seed=self.seed)
        units = list_jsonl_units(resolve_files(path, "jsonl"))
        return ReadJsonl(node(units), units, source=name, seed=self.seed)

    def __call__(self, ctx: ShardContext):
        enc = load_encoder(self.tokenizer)
        single = len(self.names) == 1
        first = ctx.round * self.epochs if self.epochs is not None else 0
        feeds = {}
        for name in self.names:
            def sharder(units):
                return ShardUnits(units.rows, shard=ctx.shard, num_shards=ctx.num_shards, seed=self.seed,
                                  epochs=self.epochs if single or self.mix_defaults else None, first_epoch=first)
            node = Tokenize(self._reader(name, sharder), enc, bos=BOS, eos=EOS if self.eos else None)
            if name == "a" and self.min_tokens:
                node = self.filter_cls(node, self.min_tokens)
            node = Mapper(node, _same)
            if self.packing == "bestfit" and not single:
                node = Pieces(node, piece=self.seq_len + 1)
            feeds[name] = node
        if single:
            mixed = feeds[self.names[0]]
        elif self.mix_defaults:
            mixed = Mix(feeds, weights=self.weights or dict.fromkeys(self.names, 1))
        else:
            mixed = Mix(feeds, weights=self.weights or dict.fromkeys(self.names, 1), unit=self.weights_unit,
                        stop=self.stop, cycle_exhausted=self.cycle_exhausted, passes=self.epochs or 1,
                        first_epoch=first, seed=self.seed, shard=ctx.shard)
        if self.packing == "flat":
            packer = FlatPack(mixed, seq_len=self.seq_len)
        else:
            packer = BestFitPack(mixed, seq_len=self.seq_len, buffer_size=self.buffer_size,
                                 mode="crop" if self.packing == "bestfit-crop" else "bestfit")
        return Batch(packer, batch_size=self.batch_size, seq_len=self.seq_len, sources=list(self.names),
                     end_label=self.end_label)


def loader_builder(graph: Composed, snapshots: Optional[Dict[str, int]] = None):
    """``build(rank, world, workers, sync, persistent=False)``: the composed graph's loader, as the
    oracle's drivers call a recipe's. ``snapshots``: ``snapshot_every_n_steps`` and ``prefetch_factor``
    for the hops with workers."""
    padding = functools.partial(collate_rows, [], batch_size=graph.batch_size, seq_len=graph.seq_len, pad_id=0,
                                end_label=graph.end_label)

    def build(rank: int, world: int, workers: int, sync=None, persistent: bool = False):
        extra = {"persistent_workers": True} if persistent and workers > 0 else {}
        if workers and snapshots:
            extra.update(snapshots)
        return TokenLoomLoader(graph, config={"graph": repr(graph), "epochs": graph.epochs}, rank=rank,
                               world_size=world, num_workers=workers, rank_sync=sync, padding_batch=padding, **extra)
    return build


def composed_builder(sc: Any, corpus: Any):
    """The fuzzer's scenario ``sc`` as a composed graph (its packing, sizes, epochs, weights and end rules)."""
    loader = sc.loader
    weights = loader.get("weights") if isinstance(loader.get("weights"), dict) else None
    graph = Composed({n: (kind, corpus.sources[n]) for n, (kind, _) in sc.sources.items()}, corpus.tokenizer,
                     sc.seq_len, sc.batch_size, packing=sc.packing, buffer_size=sc.buffer_size, epochs=sc.epochs,
                     weights=weights, weights_unit=loader.get("weights_unit", "tokens"),
                     stop=loader.get("stop", "all_exhausted") if sc.epochs is not None else "never",
                     cycle_exhausted=loader.get("cycle_exhausted", True), eos="eos" in loader,
                     end_label=BOS if loader.get("predict_bos") else IGNORE, min_tokens=sc.composed,
                     seed=sc.seed % 7, mix_defaults=sc.mix_defaults)
    return loader_builder(graph, {k: loader[k] for k in SNAPSHOT_KEYS if k in loader})


#: The loader settings of a scenario whose workers take their state only around every N-th step.
SNAPSHOT_KEYS = ("snapshot_every_n_steps", "prefetch_factor")
