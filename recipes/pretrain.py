"""`pretrain(...)`: parquet text in, packed fixed-shape token batches out, exactly resumable.

Graph per shard (one per rank and loader worker)::

    ShardUnits -> ReadParquet -> Tokenize -> FlatPack | BestFitPack -> Batch -> WithStats

Everything that must be checked once (files exist, the text column exists, the
tokenizer loads, every shard gets rows) is checked here, in the calling
process, so a bad input fails before any worker starts. Rank and world size are
read from `torch.distributed` here and nowhere else.
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass
from typing import Any, Dict, Mapping, Optional, Union

import torch

from tokenloom.pipes.batch import Batch, collate_rows
from tokenloom.pipes.loader import ShardContext, TokenLoomLoader
from tokenloom.pipes.pack_bestfit import BestFitPack
from tokenloom.pipes.pack_flat import FlatPack
from tokenloom.pipes.pack_stats import PACK_STAT_KEYS
from tokenloom.pipes.parquet import ReadParquet, UnitTable, list_parquet_units
from tokenloom.pipes.rank_sync import RankSync, gloo_sync_from_dist
from tokenloom.pipes.shard import ShardUnits, check_shardable
from tokenloom.pipes.sources import SourceSpec, fingerprint_files, resolve_files
from tokenloom.pipes.stats import WithStats
from tokenloom.pipes.tokenize import Tokenize
from tokenloom.pipes.tokenizer import Encoder, load_encoder, resolve_special

PACKINGS = ("flat", "bestfit", "bestfit-crop")


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


@dataclass
class PretrainGraph:
    """The picklable factory a worker calls to build its shard's graph."""

    units: UnitTable
    source: str
    encoder: Encoder
    bos: Optional[int]
    eos: Optional[int]
    seq_len: int
    batch_size: int
    packing: str
    buffer_size: int
    seed: int
    epochs: Optional[int]
    text_column: str
    pad_id: int

    def __call__(self, ctx: ShardContext):
        first_epoch = ctx.round * self.epochs if self.epochs is not None else 0
        node = ShardUnits(self.units.rows, shard=ctx.shard, num_shards=ctx.num_shards, seed=self.seed,
                          epochs=self.epochs, first_epoch=first_epoch, what=f"source {self.source!r}")
        node = ReadParquet(node, self.units, column=self.text_column, source=self.source, seed=self.seed)
        node = Tokenize(node, self.encoder, bos=self.bos, eos=self.eos)
        if self.packing == "flat":
            packer = FlatPack(node, seq_len=self.seq_len, pad_id=self.pad_id)
        else:
            packer = BestFitPack(node, seq_len=self.seq_len, buffer_size=self.buffer_size, pad_id=self.pad_id,
                                 mode="crop" if self.packing == "bestfit-crop" else "bestfit")
        node = Batch(packer, batch_size=self.batch_size, seq_len=self.seq_len, pad_id=self.pad_id)
        return WithStats(node, counters=packer.stats, keys=PACK_STAT_KEYS, worker=ctx.worker)


def pretrain(
    sources: Union[SourceSpec, Mapping[str, SourceSpec]],
    tokenizer: Any,
    seq_len: int = 2048,
    batch_size: int = 8,
    bos: Union[str, int, None] = None,
    weights: Optional[Mapping[str, float]] = None,
    packing: str = "bestfit",
    buffer_size: int = 1000,
    epochs: Optional[int] = None,
    num_workers: int = 0,
    seed: int = 0,
    rank: Optional[int] = None,
    world_size: Optional[int] = None,
    text_column: str = "text",
    eos: Union[str, int, None] = None,
    rank_sync: Optional[RankSync] = None,
    **loader_kwargs: Any,
) -> TokenLoomLoader:
    """Build a loader of packed pretraining batches (see the README for every parameter).

    Returns a `TokenLoomLoader` (a `StatefulDataLoader`): iterate it for batches,
    save ``loader.state_dict()`` with the model, and ``load_state_dict`` it into
    a loader built with the same arguments to continue with the exact next batch.
    """
    if seq_len < 1:
        raise ValueError(f"{seq_len=} must be >= 1")
    if batch_size < 1:
        raise ValueError(f"{batch_size=} must be >= 1")
    if packing not in PACKINGS:
        raise ValueError(f"{packing=} is not one of {PACKINGS}")
    if epochs is not None and epochs < 1:
        raise ValueError(f"{epochs=} must be None (cycle forever) or >= 1")
    rank, world_size = dist_rank_world(rank, world_size)

    named = dict(sources) if isinstance(sources, Mapping) else {"default": sources}
    if len(named) != 1 or weights is not None:
        raise NotImplementedError(
            "pretrain() mixes several sources once the Mix node lands; pass one source for now "
            f"(got {sorted(named)} with {weights=})"
        )
    (source, spec), = named.items()
    files = resolve_files(spec, "parquet")
    units = list_parquet_units(files, text_column)
    check_shardable(units.total_rows, world_size * max(num_workers, 1), f"source {source!r}")

    encoder = load_encoder(tokenizer)
    bos_id = resolve_special(encoder, bos, default_bos=True)
    eos_id = resolve_special(encoder, eos, default_bos=False)
    pad_id = bos_id if bos_id is not None else 0

    graph = PretrainGraph(units, source, encoder, bos_id, eos_id, seq_len, batch_size, packing, buffer_size, seed,
                          epochs, text_column, pad_id)
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
        "sources": {source: fingerprint_files(files)},
        "tokenizer": f"{encoder.fingerprint} bos={bos_id} eos={eos_id}",
    }
    if epochs is not None and world_size > 1 and rank_sync is None:
        rank_sync = gloo_sync_from_dist()
        if rank_sync is None:
            warnings.warn(f"{world_size=} with a finite epoch but torch.distributed is not initialized: ranks may "
                          "yield different numbers of batches; pass rank_sync= to keep them in step", stacklevel=2)
    padding = functools.partial(collate_rows, [], batch_size=batch_size, seq_len=seq_len, pad_id=pad_id)
    return TokenLoomLoader(graph, config=config, rank=rank, world_size=world_size, num_workers=num_workers,
                           stats_keys=PACK_STAT_KEYS, rank_sync=rank_sync, padding_batch=padding, **loader_kwargs)
