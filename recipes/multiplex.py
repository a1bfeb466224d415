"""`multiplex(...)`: mix in-memory datasets (lists of dicts) into one exactly resumable loader.

A drop-in for ``create_multiplex_dataloader``: the same parameters (``batch_size``,
``shuffle``, ``num_workers``, ``pin_memory``, ``prefetch_factor``,
``persistent_workers``, ``drop_last``, ``sampling_strategy``, ``sampling_weights``,
``collate_fn``, ``shuffle_seed``), every example carrying ``dataset_name`` and
``dataset_idx``, plus the strategies and epoch-length policies of multi-loader
trainers, and a ``state_dict()`` that resumes exactly.

Graph per shard: per dataset ``ShardUnits -> ReadList`` (a seeded shuffle per
epoch; shards take disjoint ranges), ``Mix`` counting examples, ``Take`` for
fixed epoch lengths, ``BatchExamples``.

``sampling_strategy``: ``"proportional"`` (shares by dataset size), ``"uniform"``
(equal shares), ``"weighted"`` (``sampling_weights``), ``"round_robin"``,
``"alternating"`` (``pattern`` of names, ``burst``), ``"sequential"``. Weighted
choices are random (seeded) when ``shuffle=True``, an exact deterministic
interleave otherwise.

``epoch_length`` (one ``for batch in loader`` is an epoch; the next one reshuffles):
``"sum"`` (default: as many examples as all datasets hold; proportional,
sequential and non-cycling strategies then see every example exactly once,
weighted ones sample shorter datasets again), ``"max"`` (until every dataset was
seen once, cycling the shorter), ``"min"`` (until the first dataset runs out),
``"steps"`` (``steps`` batches). ``cycle_shorter`` overrides whether shorter
datasets restart within an epoch.

Datasets with different keys (``{"question", "answer"}`` next to ``{"text"}``) are
collated as ``create_multiplex_dataloader``'s default collate does: every key of any
example in the batch, ``None`` where an example lacks it. Such a column is a list
(with its ``None``), whatever its values: a tensor with holes would shift rows.
So its type depends on which datasets a batch drew from; pass ``collate_fn`` to get
tensors from datasets of different shapes.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from tokenloom.pipes.check_args import check_int, check_loader_keywords
from tokenloom.pipes.sources.examples import BatchExamples, ReadList, Take, default_collate
from tokenloom.pipes.loader.bridge import ShardContext, TokenLoomLoader
from tokenloom.pipes.mix import Mix
from tokenloom.pipes.shard import ShardUnits, check_shardable
from tokenloom.pipes.stats import WithStats

from .packed import dist_rank_world

SAMPLING = ("proportional", "uniform", "weighted", "round_robin", "alternating", "sequential")
EPOCH_LENGTHS = ("sum", "max", "min", "steps")


@dataclass
class MultiplexGraph:
    datasets: List[Tuple[str, Sequence[Any]]]
    weights: Optional[Dict[str, float]]
    strategy: str
    stop: str
    cycle: bool
    limit: Optional[int]  # examples in the epoch (all shards together), or None
    batch_size: int
    collate_fn: Optional[Callable]
    drop_last: bool
    shuffle: bool
    seed: int
    pattern: Optional[Sequence[str]]
    burst: int

    def __call__(self, ctx: ShardContext):
        names = [n for n, _ in self.datasets]
        branches = {}
        for idx, (name, items) in enumerate(self.datasets):
            node = ShardUnits([len(items)], shard=ctx.shard, num_shards=ctx.num_shards, seed=self.seed,
                              epochs=None, first_epoch=ctx.round, shuffle=False, what=f"dataset {name!r}")
            branches[name] = ReadList(node, items, source=name, index=idx, seed=self.seed, shuffle=self.shuffle)
        node = Mix(branches, weights=self.weights, strategy=self.strategy, unit="documents", stop=self.stop,
                   cycle_exhausted=self.cycle, first_epoch=ctx.round, pattern=self.pattern, burst=self.burst,
                   seed=self.seed + 7919 * ctx.round, shard=ctx.shard)
        if self.limit is not None:
            # This shard's share of the epoch's examples: the shares of all shards add up to the limit.
            g, s = ctx.shard, ctx.num_shards
            node = Take(node, self.limit * (g + 1) // s - self.limit * g // s)
        batch = BatchExamples(node, batch_size=self.batch_size, sources=names,
                              collate_fn=self.collate_fn or collate_examples, drop_last=self.drop_last)
        return WithStats(batch, counters=batch.counts, keys=[*names, "dropped_examples"], worker=ctx.worker)


def collate_examples(batch: List[Any]) -> Any:
    """`default_collate`, except that dicts with different keys give the union of the keys,
    ``None`` where an example lacks one, and such a column stays a list (see the module
    docstring)."""
    if not batch or not all(isinstance(b, Mapping) for b in batch):
        return default_collate(batch)
    keys = dict.fromkeys(k for b in batch for k in b)  # first-seen order: the first example's keys first
    if all(len(b) == len(keys) for b in batch):
        return default_collate(batch)
    return {k: default_collate([b[k] for b in batch]) if all(k in b for b in batch) else [b.get(k) for b in batch]
            for k in keys}


@dataclass
class MultiplexStatsView:
    names: List[str]
    targets: Dict[str, float]

    def __call__(self, flat: Dict[str, int], step: int) -> Dict[str, Any]:
        total = sum(flat[n] for n in self.names)
        return {
            "datasets": {n: {"examples": flat[n], "target": self.targets[n],
                             "share": flat[n] / total if total else 0.0} for n in self.names},
            "dropped_examples": flat["dropped_examples"],
        }


def multiplex(
    datasets: Sequence[Tuple[str, Sequence[Any]]],
    batch_size: int = 32,
    shuffle: bool = True,
    num_workers: int = 0,
    pin_memory: bool = False,
    prefetch_factor: Optional[int] = None,
    persistent_workers: bool = False,
    drop_last: bool = False,
    sampling_strategy: str = "proportional",
    sampling_weights: Optional[Sequence[float]] = None,
    collate_fn: Optional[Callable[[List[Any]], Any]] = None,
    shuffle_seed: int = 42,
    pattern: Optional[Sequence[str]] = None,
    burst: int = 1,
    epoch_length: str = "sum",
    steps: Optional[int] = None,
    cycle_shorter: Optional[bool] = None,
    rank: Optional[int] = None,
    world_size: Optional[int] = None,
    **loader_kwargs: Any,
) -> TokenLoomLoader:
    """Build the multiplexed loader (see the module docstring)."""
    check_loader_keywords(multiplex, loader_kwargs)
    batch_size = check_int("batch_size", batch_size, 1)
    num_workers = check_int("num_workers", num_workers, 0)
    shuffle_seed = check_int("shuffle_seed", shuffle_seed, 0)
    burst = check_int("burst", burst, 1)
    steps = check_int("steps", steps, 1, none_ok=True, none_means="set by epoch_length")
    datasets = [(str(n), d) for n, d in datasets]
    names = [n for n, _ in datasets]
    if not datasets:
        raise ValueError("datasets is empty: pass [(name, examples), ...]")
    if len(set(names)) != len(names):
        raise ValueError(f"dataset names must be unique, got {names}")
    for n, d in datasets:
        if len(d) == 0:
            raise ValueError(f"dataset {n!r} is empty")
    if sampling_strategy not in SAMPLING:
        raise ValueError(f"{sampling_strategy=} is not one of {SAMPLING}")
    if epoch_length not in EPOCH_LENGTHS:
        raise ValueError(f"{epoch_length=} is not one of {EPOCH_LENGTHS}")
    if epoch_length == "steps" and (steps is None or steps < 1):
        raise ValueError(f"epoch_length='steps' needs steps >= 1 (got {steps=})")
    if sampling_weights is not None and sampling_strategy != "weighted":
        raise ValueError(f"sampling_weights= needs sampling_strategy='weighted' (got {sampling_strategy!r})")
    sizes = {n: len(d) for n, d in datasets}
    weights: Optional[Dict[str, float]] = None
    strategy = sampling_strategy
    if sampling_strategy in ("proportional", "uniform", "weighted"):
        if sampling_strategy == "proportional":
            weights = {n: float(sizes[n]) for n in names}
        elif sampling_strategy == "uniform":
            weights = {n: 1.0 for n in names}
        else:
            if sampling_weights is None or len(sampling_weights) != len(names):
                raise ValueError(f"sampling_strategy='weighted' needs one weight per dataset ({len(names)}), "
                                 f"got {sampling_weights=}")
            weights = dict(zip(names, sampling_weights))
        strategy = "random" if shuffle else "interleave"
    if cycle_shorter is None:
        cycle_shorter = sampling_strategy in ("uniform", "weighted", "round_robin", "alternating")
    total = sum(sizes.values())
    limit: Optional[int] = None
    if epoch_length == "sum":
        stop, limit = ("never", total) if cycle_shorter else ("all_exhausted", None)
    elif epoch_length == "max":
        stop = "all_exhausted"
    elif epoch_length == "min":
        stop = "first_exhausted"
    else:
        stop, limit = "never", steps * batch_size
    if sampling_strategy == "sequential":
        stop, cycle_shorter = ("first_exhausted", False) if epoch_length == "min" else ("all_exhausted", False)
        limit = None if epoch_length != "steps" else limit
    rank, world_size = dist_rank_world(rank, world_size)
    num_shards = world_size * max(num_workers, 1)
    for n in names:
        check_shardable(sizes[n], num_shards, f"dataset {n!r}")
    graph = MultiplexGraph(datasets, weights, strategy, stop, bool(cycle_shorter), limit, batch_size, collate_fn,
                           drop_last, shuffle, shuffle_seed, pattern, burst)
    # Mix validates the weights and pattern; build one graph now so errors surface here.
    graph(ShardContext(0, 1, 0, 0))
    shares = {n: 1 / len(names) for n in names}
    if weights is not None:
        shares = {n: w / sum(weights.values()) for n, w in weights.items()}
    config = {
        "world_size": world_size, "rank": rank, "num_workers": num_workers, "batch_size": batch_size,
        "datasets": [[n, sizes[n]] for n in names], "sampling": sampling_strategy, "weights": shares,
        "epoch_length": f"{epoch_length} steps={steps} cycle={cycle_shorter} pattern={pattern} burst={burst}",
        "shuffle": f"{shuffle} seed={shuffle_seed}", "drop_last": drop_last,
    }
    if prefetch_factor is not None:
        loader_kwargs["prefetch_factor"] = prefetch_factor
    return TokenLoomLoader(graph, config=config, rank=rank, world_size=world_size, num_workers=num_workers,
                           stats_keys=[*names, "dropped_examples"], stats_view=MultiplexStatsView(names, shares),
                           pin_memory=pin_memory, persistent_workers=persistent_workers, **loader_kwargs)


def print_dataloader_stats(loader: TokenLoomLoader) -> None:
    """The multiplex seed's table: examples per dataset with target and observed share."""
    stats = loader.stats()
    rows = stats["datasets"]
    print("=" * 70)
    print("Multiplex DataLoader Statistics")
    print("=" * 70)
    print(f"Number of datasets: {len(rows)}")
    print(f"Examples delivered: {sum(r['examples'] for r in rows.values()):,}"
          f" (dropped by drop_last: {stats['dropped_examples']})")
    print(f"Sampling strategy: {loader.config['sampling']}")
    print("-" * 70)
    print(f"{'Dataset':<30}{'Examples':<15}{'Target %':<12}{'Observed %':<12}")
    print("-" * 70)
    for name, r in rows.items():
        print(f"{name:<30}{r['examples']:<15,}{100 * r['target']:<12.2f}{100 * r['share']:<12.2f}")
    print("=" * 70)
