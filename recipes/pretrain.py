"""`pretrain(...)`: text sources in, packed fixed-shape token batches out, exactly resumable.

Graph per shard (one per rank and loader worker)::

    per source:  ShardUnits -> Read{Parquet,Jsonl,Text} -> Tokenize
    Mix (several sources, by weight) -> FlatPack | BestFitPack -> Batch -> WithStats

Everything that must be checked once (files exist, the text column exists, the
tokenizer loads, weights are valid, every shard gets rows) is checked here, in
the calling process, so a bad input fails before any worker starts. Rank and
world size are read from `torch.distributed` here and nowhere else.
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Sequence, Union

import torch

from tokenloom.pipes.batch import Batch, collate_rows
from tokenloom.pipes.loader import ShardContext, TokenLoomLoader
from tokenloom.pipes.mix import STOPS, STRATEGIES, UNITS, Mix
from tokenloom.pipes.pack_bestfit import BestFitPack
from tokenloom.pipes.pack_flat import FlatPack
from tokenloom.pipes.pack_stats import PACK_STAT_KEYS
from tokenloom.pipes.rank_sync import RankSync, gloo_sync_from_dist
from tokenloom.pipes.readers import SourcePlan, plan_source
from tokenloom.pipes.schedule import StepClock, Weights, normalize_schedule
from tokenloom.pipes.shard import ShardUnits, check_shardable
from tokenloom.pipes.sources import SourceSpec
from tokenloom.pipes.stats import WithStats
from tokenloom.pipes.tokenize import Tokenize
from tokenloom.pipes.tokenizer import Encoder, load_encoder, resolve_special

PACKINGS = ("flat", "bestfit", "bestfit-crop")
SOURCE_STAT_KEYS = ("tokens", "documents", "epochs")


def dist_rank_world(rank: Optional[int], world_size: Optional[int]) -> tuple:
    """Rank and world size: as given, else from an initialized torch.distributed, else (0, 1)."""
    if rank is None or world_size is None:
        dist = torch.distributed
        if dist.is_available() and dist.is_initialized():
            rank = dist.get_rank() if rank is None else rank
            world_size = dist.get_world_size() if world_size is None else world_size
        else:
            rank = 0 if rank is None else rank
            world_size = 1 if world_size is None else world_size
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"{rank=} must be in [0, {world_size=})")
    return int(rank), int(world_size)


def stat_keys(names: Sequence[str]) -> List[str]:
    return list(PACK_STAT_KEYS) + [f"source/{n}/{k}" for n in names for k in SOURCE_STAT_KEYS]


@dataclass
class PretrainStatsView:
    """Shapes the loader's summed counters: packing figures at the top level, and per
    source tokens, documents, epochs, the target share at the current step, and the
    observed token share."""

    names: List[str]
    schedule: list

    def __call__(self, flat: Dict[str, int], step: int) -> Dict[str, Any]:
        out: Dict[str, Any] = {k: flat[k] for k in PACK_STAT_KEYS}
        era = max(i for i, (s, _) in enumerate(self.schedule) if s <= step)
        total = sum(flat[f"source/{n}/tokens"] for n in self.names)
        out["sources"] = {
            n: {
                "tokens": flat[f"source/{n}/tokens"],
                "documents": flat[f"source/{n}/documents"],
                "epochs": flat[f"source/{n}/epochs"],
                "target": self.schedule[era][1][n],
                "share": flat[f"source/{n}/tokens"] / total if total else 0.0,
            }
            for n in self.names
        }
        return out


@dataclass
class PretrainGraph:
    """The picklable factory a worker calls to build its shard's graph."""

    plans: List[SourcePlan]
    encoder: Encoder
    bos: Optional[int]
    eos: Optional[int]
    seq_len: int
    batch_size: int
    packing: str
    buffer_size: int
    seed: int
    epochs: Optional[int]
    pad_id: int
    weights: Optional[Weights]
    mix: str
    weights_unit: str
    stop: str
    cycle_exhausted: bool
    pattern: Optional[Sequence[str]]
    burst: int

    def __call__(self, ctx: ShardContext):
        first_epoch = ctx.round * self.epochs if self.epochs is not None else 0
        single = len(self.plans) == 1
        branches = {}
        for plan in self.plans:
            # With several sources the mixer decides when to stop, so branches are endless.
            node = ShardUnits(plan.units.rows, shard=ctx.shard, num_shards=ctx.num_shards, seed=self.seed,
                              epochs=self.epochs if single else None, first_epoch=first_epoch,
                              what=f"source {plan.name!r}")
            node = plan.reader(node, seed=self.seed)
            branches[plan.name] = Tokenize(node, self.encoder, bos=self.bos, eos=self.eos)
        clock = StepClock(ctx.worker, ctx.num_workers)
        if single:
            mixed, mixer = branches[self.plans[0].name], None
        else:
            mixer = mixed = Mix(branches, weights=self.weights, strategy=self.mix, unit=self.weights_unit,
                                stop=self.stop, cycle_exhausted=self.cycle_exhausted, passes=self.epochs or 1,
                                first_epoch=first_epoch,
                                pattern=self.pattern, burst=self.burst, seed=self.seed, shard=ctx.shard, clock=clock)
        if self.packing == "flat":
            packer = FlatPack(mixed, seq_len=self.seq_len, pad_id=self.pad_id)
        else:
            packer = BestFitPack(mixed, seq_len=self.seq_len, buffer_size=self.buffer_size, pad_id=self.pad_id,
                                 mode="crop" if self.packing == "bestfit-crop" else "bestfit")
        names = [p.name for p in self.plans]
        batch = Batch(packer, batch_size=self.batch_size, seq_len=self.seq_len, pad_id=self.pad_id,
                      sources=names, clock=clock)

        def counters() -> List[int]:
            pack = packer.stats()
            delivered = batch.counts()
            passes = mixer.source_stats() if mixer is not None else None
            out = [pack[k] for k in PACK_STAT_KEYS]
            for n in names:
                tokens, docs = delivered.get(n, (0, 0))
                epochs = passes[n]["epochs"] if passes is not None else 0
                out += [tokens, docs, epochs]
            return out

        return WithStats(batch, counters=counters, keys=stat_keys(names), worker=ctx.worker)


def pretrain(
    sources: Union[SourceSpec, Mapping[str, SourceSpec]],
    tokenizer: Any,
    seq_len: int = 2048,
    batch_size: int = 8,
    bos: Union[str, int, None] = None,
    weights: Optional[Weights] = None,
    packing: str = "bestfit",
    buffer_size: int = 1000,
    epochs: Optional[int] = None,
    num_workers: int = 0,
    seed: int = 0,
    rank: Optional[int] = None,
    world_size: Optional[int] = None,
    text_column: str = "text",
    eos: Union[str, int, None] = None,
    mix: str = "interleave",
    weights_unit: str = "tokens",
    stop: Optional[str] = None,
    cycle_exhausted: bool = True,
    pattern: Optional[Sequence[str]] = None,
    burst: int = 1,
    text_mode: str = "file",
    rank_sync: Optional[RankSync] = None,
    **loader_kwargs: Any,
) -> TokenLoomLoader:
    """Build a loader of packed pretraining batches (see the README for every parameter).

    ``sources`` is one spec (path, glob, directory, URI, or a list of them) or
    ``{name: spec}``; with several names, ``weights`` (``{name: w}`` or a schedule
    ``[(step, {name: w}), ...]``) mixes them, counted in ``weights_unit``.
    Returns a `TokenLoomLoader` (a `StatefulDataLoader`): iterate it for batches,
    save ``loader.state_dict()`` with the model, and ``load_state_dict`` it into a
    loader built with the same arguments to continue with the exact next batch.
    """
    if seq_len < 1:
        raise ValueError(f"{seq_len=} must be >= 1")
    if batch_size < 1:
        raise ValueError(f"{batch_size=} must be >= 1")
    if packing not in PACKINGS:
        raise ValueError(f"{packing=} is not one of {PACKINGS}")
    if epochs is not None and epochs < 1:
        raise ValueError(f"{epochs=} must be None (cycle forever) or >= 1")
    for name, value, allowed in (("mix", mix, STRATEGIES), ("weights_unit", weights_unit, UNITS)):
        if value not in allowed:
            raise ValueError(f"{name}={value!r} is not one of {allowed}")
    if stop is None:
        stop = "never" if epochs is None else "all_exhausted"
    elif stop not in STOPS:
        raise ValueError(f"{stop=} is not one of {STOPS}")
    if epochs is None and stop != "never":
        raise ValueError(f"{stop=} needs epochs=n (how many passes make a source exhausted)")
    rank, world_size = dist_rank_world(rank, world_size)

    named = dict(sources) if isinstance(sources, Mapping) else {"default": sources}
    if not named:
        raise ValueError("sources is empty: give a path, glob, directory or URI, or {name: spec}")
    if weights is not None and len(named) == 1 and not isinstance(sources, Mapping):
        raise ValueError("weights= needs several named sources: pass sources={name: spec, ...}")
    names = list(named)
    schedule = normalize_schedule(weights, names)
    num_shards = world_size * max(num_workers, 1)
    plans = []
    for name, spec in named.items():
        plan = plan_source(name, spec, column=text_column, text_mode=text_mode)
        check_shardable(plan.total_rows, num_shards, f"source {name!r}")
        plans.append(plan)

    encoder = load_encoder(tokenizer)
    bos_id = resolve_special(encoder, bos, default_bos=True)
    eos_id = resolve_special(encoder, eos, default_bos=False)
    pad_id = bos_id if bos_id is not None else 0

    graph = PretrainGraph(plans, encoder, bos_id, eos_id, seq_len, batch_size, packing, buffer_size, seed, epochs,
                          pad_id, weights, mix, weights_unit, stop, cycle_exhausted, pattern, burst)
    config: Dict[str, Any] = {
        "world_size": world_size,
        "rank": rank,
        "num_workers": num_workers,
        "seq_len": seq_len,
        "batch_size": batch_size,
        "packing": packing,
        "buffer_size": buffer_size if packing != "flat" else None,
        "seed": seed,
        "epochs": epochs,
        "sources": {p.name: p.fingerprint for p in plans},
        "tokenizer": f"{encoder.fingerprint} bos={bos_id} eos={eos_id}",
        "mix": None if len(plans) == 1 else (f"{mix} unit={weights_unit} stop={stop} cycle={cycle_exhausted} "
                                             f"pattern={pattern} burst={burst}"),
        "weights": None if len(plans) == 1 else [[s, w] for s, w in schedule],
    }
    if epochs is not None and world_size > 1 and rank_sync is None:
        rank_sync = gloo_sync_from_dist()
        if rank_sync is None:
            warnings.warn(f"{world_size=} with a finite epoch but torch.distributed is not initialized: ranks may "
                          "yield different numbers of batches; pass rank_sync= to keep them in step", stacklevel=2)
    padding = functools.partial(collate_rows, [], batch_size=batch_size, seq_len=seq_len, pad_id=pad_id)
    return TokenLoomLoader(graph, config=config, rank=rank, world_size=world_size, num_workers=num_workers,
                           stats_keys=stat_keys(names), stats_view=PretrainStatsView(names, schedule),
                           rank_sync=rank_sync, padding_batch=padding, **loader_kwargs)
