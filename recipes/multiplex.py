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

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from tokenloom.pipes.check_args import check_loader_keywords
from tokenloom.pipes.sources.examples import BatchExamples, ReadList, Take, default_collate
from tokenloom.pipes.loader.bridge import ShardContext, TokenLoomLoader
from tokenloom.pipes.mix import Mix
from tokenloom.pipes.shard import ShardUnits, check_shardable
from tokenloom.pipes.stats import WithStats

from .packed import dist_rank_world
from .setting import FREE, TOPOLOGY, check_fields, config_of, hints_of, setting, settings_fields
from .settings import at_least, boolean, one_of

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


@dataclass(frozen=True)
class MultiplexSpec:
    """Every setting of `multiplex` (module docstring), each a `setting` (recipes/setting.py) with its
    doc, its check and how a resume treats it. The in-memory datasets are recorded by name and size."""

    datasets: Any = setting(doc="[(name, examples), ...]", record="datasets", hint="pass the same datasets, "
                            "in the same order (positions count examples of each)", cli=None, no_cli="in memory")
    batch_size: int = setting(32, doc="examples per batch", check=at_least(1), hint="pass the same batch_size",
                              cli=None, no_cli="in memory")
    shuffle: bool = setting(True, doc="shuffle each dataset per epoch; weighted choices are random", check=boolean,
                            record="shuffle", hint="pass the same shuffle and shuffle_seed", cli=None,
                            no_cli="in memory")
    num_workers: int = setting(0, doc="loader worker processes", check=at_least(0), resume=TOPOLOGY, cli=None,
                               no_cli="in memory")
    pin_memory: bool = setting(False, doc="pin batches' tensors", resume=FREE, why="where batches live",
                               cli=None, no_cli="in memory")
    prefetch_factor: Optional[int] = setting(None, doc="batches each worker keeps ready", resume=FREE,
                                             why="how far workers run ahead", cli=None, no_cli="in memory")
    persistent_workers: bool = setting(False, doc="keep workers between epochs", resume=FREE,
                                       why="how workers live", cli=None, no_cli="in memory")
    drop_last: bool = setting(False, doc="drop a last batch smaller than batch_size", check=boolean,
                              hint="pass the same drop_last", cli=None, no_cli="in memory")
    sampling_strategy: str = setting("proportional", doc="how datasets are chosen", check=one_of(SAMPLING),
                                     record="sampling", hint="pass the same sampling_strategy", cli=None,
                                     no_cli="in memory")
    sampling_weights: Optional[Sequence[float]] = setting(
        None, doc="sampling_strategy='weighted': one weight per dataset", record="weights",
        hint="pass the same sampling weights", cli=None, no_cli="in memory")
    collate_fn: Optional[Callable[[List[Any]], Any]] = setting(
        None, doc="turns a list of examples into a batch (default: union of keys, see the module docstring)",
        resume=FREE, why="it shapes each batch, not which examples it holds", cli=None, no_cli="in memory")
    shuffle_seed: int = setting(42, doc="seed of the shuffles and random choices", check=at_least(0),
                                record="shuffle", cli=None, no_cli="in memory")
    pattern: Optional[Sequence[str]] = setting(None, doc="sampling_strategy='alternating': names in turn order",
                                               record="epoch_length", cli=None, no_cli="in memory")
    burst: int = setting(1, doc="sampling_strategy='alternating': examples a dataset gives per turn",
                         check=at_least(1), record="epoch_length", cli=None, no_cli="in memory")
    epoch_length: str = setting("sum", doc="what one pass over the loader is (module docstring)",
                                check=one_of(EPOCH_LENGTHS), record="epoch_length",
                                hint="pass the same epoch_length, steps, cycle_shorter, pattern and burst", cli=None,
                                no_cli="in memory")
    steps: Optional[int] = setting(None, doc="epoch_length='steps': batches in an epoch",
                                   check=at_least(1, "set by epoch_length"), record="epoch_length", cli=None,
                                   no_cli="in memory")
    cycle_shorter: Optional[bool] = setting(None, doc="shorter datasets restart within an epoch (default: by "
                                                      "strategy)", record="epoch_length", cli=None, no_cli="in memory")
    rank: Optional[int] = setting(None, doc="data rank (default: torch.distributed's, else 0)", resume=TOPOLOGY,
                                  cli=None, no_cli="in memory")
    world_size: Optional[int] = setting(None, doc="data ranks (default: torch.distributed's, else 1)",
                                        resume=TOPOLOGY, cli=None, no_cli="in memory")

    def validate(self) -> "MultiplexSpec":
        spec = dataclasses.replace(self, **check_fields(self))
        names = [str(n) for n, _ in spec.datasets]
        if not names:
            raise ValueError("datasets is empty: pass [(name, examples), ...]")
        if len(set(names)) != len(names):
            raise ValueError(f"dataset names must be unique, got {names}")
        for n, d in spec.datasets:
            if len(d) == 0:
                raise ValueError(f"dataset {n!r} is empty")
        if spec.epoch_length == "steps" and spec.steps is None:
            raise ValueError(f"epoch_length='steps' needs steps >= 1 (got steps={spec.steps})")
        if spec.sampling_weights is not None and spec.sampling_strategy != "weighted":
            raise ValueError(f"sampling_weights= needs sampling_strategy='weighted' (got {spec.sampling_strategy!r})")
        if spec.sampling_strategy == "weighted" and (spec.sampling_weights is None
                                                     or len(spec.sampling_weights) != len(names)):
            raise ValueError(f"sampling_strategy='weighted' needs one weight per dataset ({len(names)}), "
                             f"got sampling_weights={spec.sampling_weights}")
        return dataclasses.replace(spec, datasets=[(str(n), d) for n, d in spec.datasets])

    def weights(self) -> Tuple[Optional[Dict[str, float]], str]:
        """The mixer's weights and strategy."""
        sizes = {n: float(len(d)) for n, d in self.datasets}
        if self.sampling_strategy == "proportional":
            weights: Optional[Dict[str, float]] = sizes
        elif self.sampling_strategy == "uniform":
            weights = dict.fromkeys(sizes, 1.0)
        elif self.sampling_strategy == "weighted":
            weights = dict(zip(sizes, self.sampling_weights))
        else:
            return None, self.sampling_strategy
        return weights, "random" if self.shuffle else "interleave"

    def ending(self) -> Tuple[str, bool, Optional[int]]:
        """(the mixer's stop rule, whether shorter datasets cycle, examples in an epoch or None)."""
        cycle = self.cycle_shorter
        if cycle is None:
            cycle = self.sampling_strategy in ("uniform", "weighted", "round_robin", "alternating")
        total = sum(len(d) for _, d in self.datasets)
        limit: Optional[int] = None
        if self.epoch_length == "sum":
            stop, limit = ("never", total) if cycle else ("all_exhausted", None)
        elif self.epoch_length == "max":
            stop = "all_exhausted"
        elif self.epoch_length == "min":
            stop = "first_exhausted"
        else:
            stop, limit = "never", self.steps * self.batch_size
        if self.sampling_strategy == "sequential":
            stop, cycle = ("first_exhausted" if self.epoch_length == "min" else "all_exhausted"), False
            limit = limit if self.epoch_length == "steps" else None
        return stop, bool(cycle), limit


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
    """Build the multiplexed loader (see the module docstring and `MultiplexSpec` for every setting)."""
    check_loader_keywords(multiplex, loader_kwargs, also=TokenLoomLoader.USER_KEYWORDS)
    spec = MultiplexSpec(**{k: v for k, v in locals().items() if k in SETTINGS}).validate()
    rank, world_size = dist_rank_world(spec.rank, spec.world_size)
    spec = dataclasses.replace(spec, rank=rank, world_size=world_size)
    names = [n for n, _ in spec.datasets]
    sizes = {n: len(d) for n, d in spec.datasets}
    num_shards = world_size * max(spec.num_workers, 1)
    for n in names:
        check_shardable(sizes[n], num_shards, f"dataset {n!r}")
    weights, strategy = spec.weights()
    stop, cycle, limit = spec.ending()
    graph = MultiplexGraph(spec.datasets, weights, strategy, stop, cycle, limit, spec.batch_size, spec.collate_fn,
                           spec.drop_last, spec.shuffle, spec.shuffle_seed, spec.pattern, spec.burst)
    # Mix validates the weights and pattern; build one graph now so errors surface here.
    graph(ShardContext(0, 1, 0, 0))
    shares = {n: 1 / len(names) for n in names}
    if weights is not None:
        shares = {n: w / sum(weights.values()) for n, w in weights.items()}
    config = config_of((spec,), {
        "datasets": [[n, sizes[n]] for n in names], "sampling": spec.sampling_strategy, "weights": shares,
        "epoch_length": f"{spec.epoch_length} steps={spec.steps} cycle={cycle} pattern={spec.pattern} "
                        f"burst={spec.burst}",
        "shuffle": f"{spec.shuffle} seed={spec.shuffle_seed}"})
    if spec.prefetch_factor is not None:
        loader_kwargs["prefetch_factor"] = spec.prefetch_factor
    return TokenLoomLoader(graph, config=config, rank=rank, world_size=world_size, num_workers=spec.num_workers,
                           settings=spec, config_hints=hints_of(spec), stats_keys=[*names, "dropped_examples"],
                           stats_view=MultiplexStatsView(names, shares), pin_memory=spec.pin_memory,
                           persistent_workers=spec.persistent_workers, **loader_kwargs)


#: multiplex's keywords that are settings; the rest go to the DataLoader.
SETTINGS = frozenset(name for name, _ in settings_fields(MultiplexSpec))


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
