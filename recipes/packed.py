"""What `pretrain` and `sft` share: the checks, the sources' listing, the loader around the graph.

Graph per shard (one per rank and loader worker; packed_graph.py builds it)::

    per source:  ShardUnits -> Read{Parquet,Jsonl,Text} -> Tokenize | RenderChat
    Mix (several sources, by weight) -> FlatPack | BestFitPack -> Batch -> WithStats

Everything that must be checked once (files exist, the column exists, the
tokenizer loads, weights are valid, every shard gets rows) is checked in
`packed_loader`, in the calling process, so a bad input fails before any worker
starts. Rank and world size are read from `torch.distributed` there and nowhere
else.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import warnings
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import torch

from tokenloom.pipes.batch import IGNORE_INDEX, collate_rows
from tokenloom.pipes.check_args import per_source
from tokenloom.pipes.loader.bridge import TokenLoomLoader
from tokenloom.pipes.loader.rank_sync import RankSync, gloo_sync_from_dist
from tokenloom.pipes.loader.wire_ring import uses_fork
from tokenloom.pipes.sources.cache import attach_cache, close_cache_reads, start_cache_reads
from tokenloom.pipes.sources.readers import SourcePlan, named_sources, plan_source
from tokenloom.pipes.schedule import normalize_schedule
from tokenloom.pipes.shard import check_shardable
from tokenloom.pipes.sources.files import shared_filesystems
from tokenloom.pipes.sources.first_fetches import close_listing, start_first_fetches

from .packed_graph import PackedGraph, stat_keys
from .packed_stats import PackedStatsView
from .settings import PackedSpec, config_of
from tokenloom.pipes.tokenizer import Encoder, load_encoder, resolve_special

#: Tokens each loader worker keeps ready by default, as whole batches between the bounds below.
PREFETCH_TOKENS = 1 << 20
PREFETCH_BATCHES = (8, 64)


def default_prefetch_factor(batch_size: int, seq_len: int) -> int:
    """Batches each worker keeps ready: about `PREFETCH_TOKENS` tokens, `PREFETCH_BATCHES` bounds.

    The StatefulDataLoader takes batches from the workers in turn, so a worker that
    is ahead stops once its ready batches fill, and the loader runs at the pace of
    whichever worker is behind. Workers fall behind in turns: a best-fit buffer's
    tokens swing as long documents come and go, and a worker refilling it tokenizes
    far more than it hands out for a while, so a deeper queue keeps both workers busy
    (measured in docs/performance.md). Cost: host memory, about 20 bytes per token of
    a batch as it travels, held by the worker or by the training process until the
    batch is used. Pass ``prefetch_factor=`` to choose.
    """
    lo, hi = PREFETCH_BATCHES
    return max(lo, min(hi, -(-PREFETCH_TOKENS // (batch_size * (seq_len + 1)))))


def ring_bytes(batch_size: int, seq_len: int, prefetch_factor: int) -> int:
    """Shared memory per worker for its ready batches (pipes/loader/wire_ring.py): a batch is
    five (B, T) arrays of 4 bytes a token on the way, plus small ones; room for
    ``prefetch_factor`` + 2 batches (one being written, one at the ring's wrap)."""
    return (prefetch_factor + 2) * (20 * batch_size * seq_len + 4096)


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


def describe_template(template: Any) -> str:
    """A description that is the same in every process (a callable's repr holds an address)."""
    if hasattr(template, "resolve"):  # ChatTemplate, JinjaTemplate (its repr holds a hash of the source)
        return repr(template)
    return f"{getattr(template, '__module__', '?')}.{getattr(template, '__qualname__', type(template).__name__)}"


def _manifests(manifest: Union[str, Mapping[str, str], None], names: List[str]) -> Dict[str, str]:
    """``manifest=`` as {source name: index path}: a path for a single source, or a dict."""
    if manifest is None:
        return {}
    if isinstance(manifest, Mapping):
        unknown = sorted(set(manifest) - set(names))
        if unknown:
            raise ValueError(f"manifest= names unknown sources {unknown}; the sources are {names}")
        return dict(manifest)
    if len(names) != 1:
        raise ValueError(f"{manifest=} with several sources {names}: pass {{name: index path}} for the sources "
                         "that have an index elsewhere")
    return {names[0]: manifest}


def _warn_shared_files(plans: Sequence[Any]) -> None:
    """Warn when two sources read the same file the same way: its documents come once per source,
    so the mix is not the one the weights say (a same file read as another column is fine)."""
    seen: Dict[Any, str] = {}
    shared: Dict[Tuple[str, str], List[str]] = {}
    for plan in plans:
        for f in plan.files:
            key = (f.uri or f.path, plan.column, plan.text_mode)
            other = seen.setdefault(key, plan.name)
            if other != plan.name:
                shared.setdefault((other, plan.name), []).append(f.uri or f.path)
    for (a, b), paths in shared.items():
        warnings.warn(f"sources {a!r} and {b!r} both read {len(paths)} file(s), e.g. {paths[0]!r}: their documents "
                      f"come once per source, twice in every pass; give each file one source (weights= sets how "
                      f"often a source is drawn)", stacklevel=4)


def _is_remote(spec: Any) -> bool:
    """Whether a source spec names files on a remote store (a URI such as ``s3://...``)."""
    if isinstance(spec, (str, os.PathLike)):
        return "://" in os.fspath(spec)
    return isinstance(spec, (list, tuple)) and any(_is_remote(s) for s in spec)


def _plan_sources(named: Mapping[str, Any], tokenizer: Any, *, columns: Mapping[str, str], modes: Mapping[str, str],
                  manifests: Mapping[str, str], require_type: type, engine: Optional[str] = None,
                  retry: Any = None) -> Tuple[List[SourcePlan], Encoder]:
    """Every source's plan, in order, and the encoder. With a remote source the sources are listed at
    once (a thread each) while this thread loads the tokenizer: each source's listing and footers are
    round trips to the store (one after the other, several per source without this; see
    docs/performance.md). Errors come as one after the other would raise them: the first failing source
    in order, then the tokenizer. Local sources are listed in turn, from the page cache."""

    def plan(name: str) -> SourcePlan:
        return plan_source(name, named[name], column=columns[name], text_mode=modes[name],
                           require_type=require_type, manifest=manifests.get(name), retry=retry)

    if not any(_is_remote(spec) for spec in named.values()):
        plans = [plan(name) for name in named]
        return plans, load_encoder(tokenizer, engine)
    with shared_filesystems(named.values()), \
            ThreadPoolExecutor(len(named), thread_name_prefix="tokenloom-plan") as pool:
        futures = [pool.submit(plan, name) for name in named]
        try:
            encoder, error = load_encoder(tokenizer, engine), None
        except Exception as e:  # noqa: BLE001 - raised after the sources' errors
            encoder, error = None, e
        plans = [f.result() for f in futures]
    if error is not None:
        raise error
    return plans, encoder


def _start_first_fetches(plans: Sequence[SourcePlan], rank: int, num_workers: int, num_shards: int, seed: int,
                         epochs: Optional[int]) -> None:
    """Fetch the first units (row groups, jsonl line ranges; a token cache's row groups) this rank's
    workers will read of each remote source listed with its files open, in the background from now on
    (`start_first_fetches`, first_fetches.py): they come with the workers' memory instead of two round
    trips after each worker starts, and this process lets go of them once it has forked the workers.
    The sharders as `PackedGraph` makes them."""
    workers = max(num_workers, 1)
    for plan in plans:
        units, column = plan.fetched()  # a token cache's files, for a plan that reads one
        if units is not plan.units:
            close_listing(plan.units)  # it reads no text
        start_first_fetches(units, column, shards=[rank * workers + w for w in range(workers)],
                            num_shards=num_shards, seed=seed, epochs=epochs if len(plans) == 1 else None,
                            forks=num_workers or None)


def _resolve_specials(spec: PackedSpec, encoder: Encoder) -> Dict[str, Optional[int]]:
    """The special tokens' ids: BOS, EOS, padding, and the label after a whole document's last token."""
    text, chat = spec.text, spec.recipe == "sft"
    bos_id = resolve_special(encoder, None if chat else text.bos, default_bos=not chat)
    eos = None if chat else text.eos
    eos_id = resolve_special(encoder, eos, default_bos=False)
    if eos_id is not None and eos_id == bos_id:
        raise ValueError(f"eos={eos!r} is the BOS (id {bos_id}): every document would be followed by two of them "
                         "(its EOS, then the next document's BOS); leave eos= out (the BOS already marks where a "
                         "document ends and the next begins), or pass bos= and eos= two different tokens")
    pad_id = encoder.token_id(text.pad) if text.pad is not None else bos_id if bos_id is not None else 0
    predict_bos = False if chat else text.predict_bos
    end_label = bos_id if predict_bos else IGNORE_INDEX
    if end_label is None:
        raise ValueError("predict_bos=True needs a BOS token to predict; pass bos= or predict_bos=False")
    return {"bos": bos_id, "eos": eos_id, "pad": pad_id, "end_label": end_label}


def _resolved_config(spec: PackedSpec, plans: Sequence[SourcePlan], encoder: Encoder, specials: Mapping[str, Any],
                     schedule: list, texts: Mapping[str, str], rank: int, world_size: int) -> Dict[str, Any]:
    """The recorded values the spec's settings cannot give alone (`config_of`)."""
    names = [p.name for p in plans]
    mix = spec.mix
    chat = spec.text.template if spec.recipe == "sft" else None
    return {
        "world_size": world_size,
        "rank": rank,
        "sources": {p.name: p.fingerprint for p in plans},
        "source_order": names,
        # one entry for every source, or {name: entry} where they differ (a change names the source)
        "text": texts[names[0]] if len(set(texts.values())) == 1 else dict(texts),
        "tokenizer": f"{encoder.fingerprint} bos={specials['bos']} eos={specials['eos']}",
        "chat": None if chat is None else f"{describe_template(chat)} long={spec.text.long_conversations}",
        "mix": None if len(plans) == 1 else (f"{mix.mix} unit={mix.weights_unit} stop={mix.stop} "
                                             f"cycle={mix.cycle_exhausted} pattern={mix.pattern} burst={mix.burst}"),
        "weights": None if len(plans) == 1 else [[s, w] for s, w in schedule],
        "predict_bos": False if chat is not None else spec.text.predict_bos,
        "pad": specials["pad"],
        # recorded only where it changes an order (a row group read in windows): a state saved before the
        # setting, or with another budget that reads every row group whole, loads
        "read_budget": spec.data.read_budget if any(p.windowed for p in plans) else None,
    }


def packed_loader(spec: PackedSpec, loader_kwargs: Mapping[str, Any]) -> TokenLoomLoader:
    """The shared body of `pretrain` and `sft`: the spec checked, the sources listed, the loader around
    the graph. sft's ``spec.text.template`` is the template it chose and checked."""
    spec = spec.validate()
    data, text, mix, run = spec.data, spec.text, spec.mix, spec.run
    sft = spec.recipe == "sft"
    cache = None if sft else text.cache
    rank, world_size = dist_rank_world(run.rank, run.world_size)
    spec = dataclasses.replace(spec, run=dataclasses.replace(run, rank=rank, world_size=world_size))
    named = named_sources(data.sources)
    if mix.weights is not None and len(named) == 1 and not isinstance(data.sources, Mapping):
        raise ValueError("weights= needs several named sources: pass sources={name: spec, ...}")
    names = list(named)
    schedule = normalize_schedule(mix.weights, names)
    manifests = _manifests(data.manifest, names)
    num_shards = world_size * max(run.num_workers, 1)
    columns = per_source("messages_field" if sft else "text_column", text.text_column, names)
    modes = per_source("text_mode", "file" if sft else text.text_mode, names, what="a text mode")
    cache_reads = start_cache_reads(cache, names) if cache is not None else {}  # beside the sources' listing
    try:  # the cache's reads open its files: closed if the build fails before it matches them
        plans, encoder = _plan_sources(named, data.tokenizer, columns=columns, modes=modes, manifests=manifests,
                                       require_type=list if sft else str, engine=data.engine, retry=data.retry)
        for plan in plans:
            check_shardable(plan.total_rows, num_shards, f"source {plan.name!r}")
        # the budget is per worker, shared by the sources (row_windows.py)
        plans = [p.with_window_bytes(None if data.read_budget is None else max(1, data.read_budget // len(plans)))
                 for p in plans]
        if cache is None:  # a token cache reads no text
            _start_first_fetches(plans, rank, run.num_workers, num_shards, run.seed, run.epochs)
        _warn_shared_files(plans)
        specials = _resolve_specials(spec, encoder)
    except BaseException:
        close_cache_reads(cache_reads)
        raise
    if cache is not None:
        # Same units, same positions: the configuration (what a resume must match) does not change.
        plans = attach_cache(plans, cache, encoder, strict=text.cache_strict, reads=cache_reads)
        _start_first_fetches(plans, rank, run.num_workers, num_shards, run.seed, run.epochs)
    elif not sft and text.cache_strict:
        raise ValueError("cache_strict=True needs cache= (the directory `tokenloom tokenize --out` wrote)")

    graph = PackedGraph(spec=spec, plans=plans, encoder=encoder, specials=specials)
    texts = {n: f"column={columns[n]} mode={modes[n]}" for n in names}
    config = config_of(spec, _resolved_config(spec, plans, encoder, specials, schedule, texts, rank, world_size))
    rank_sync = run.rank_sync
    if run.epochs is not None and world_size > 1 and rank_sync is None:
        rank_sync = gloo_sync_from_dist()
        if rank_sync is None:
            warnings.warn(f"{world_size=} with a finite epoch but torch.distributed is not initialized: ranks may "
                          "yield different numbers of batches; pass rank_sync= to keep them in step", stacklevel=3)
    return _loader(spec, graph, config, schedule, rank, world_size, rank_sync, loader_kwargs)


def _loader(spec: PackedSpec, graph: PackedGraph, config: Dict[str, Any], schedule: list, rank: int,
            world_size: int, rank_sync: Optional[RankSync], loader_kwargs: Mapping[str, Any]) -> TokenLoomLoader:
    """The `TokenLoomLoader` around a built graph: prefetch depth, shared-memory ring, statistics view."""
    pack, run, mix = spec.pack, spec.run, spec.mix
    names, specials, num_workers = [p.name for p in graph.plans], graph.specials, run.num_workers
    padding = functools.partial(collate_rows, [], batch_size=pack.batch_size, seq_len=pack.seq_len,
                                pad_id=specials["pad"], end_label=specials["end_label"])
    loader_kwargs = dict(loader_kwargs)
    ring = None
    cache = None if spec.recipe == "sft" else spec.text.cache
    if num_workers > 0 and cache is None and uses_fork(loader_kwargs.get("multiprocessing_context")):
        graph.encoder.prepare()  # built once here, shared by the forked workers (copy on write); a cache needs none
    if num_workers > 0:
        loader_kwargs.setdefault("prefetch_factor", default_prefetch_factor(pack.batch_size, pack.seq_len))
        ring = ring_bytes(pack.batch_size, pack.seq_len, loader_kwargs["prefetch_factor"] or 2)
    view = PackedStatsView(
        names, schedule,
        rows={p.name: PackedStatsView.rank_rows(p.total_rows, rank, world_size, num_workers) for p in graph.plans},
        epochs=run.epochs, stop=mix.stop, cycle_exhausted=mix.cycle_exhausted,
        active=PackedStatsView.pickable(names, schedule, mix.mix, mix.pattern))
    return TokenLoomLoader(graph, config=config, rank=rank, world_size=world_size, num_workers=num_workers,
                           ring_bytes=ring, settings=spec, config_hints=spec.hints(), config_follows=spec.follows(),
                           config_absent=spec.absent(),
                           stats_keys=stat_keys(names, spec.recipe == "sft"), stats_view=view,
                           stats_min_keys=[f"source/{n}/epochs" for n in names],
                           rank_sync=rank_sync, padding_batch=padding, **loader_kwargs)
