"""An elastic resume reads the old run's shards at their save points, from their states alone.

One graph is built for the old topology's layout (`_Template`: where the batcher's and the packer's
states sit in a worker's tree, each source's sharder settings and branch); per old shard only the
packer's save point is decoded and a sharder restored per source (`read_old_shards`), so the cost is
about the states' size, not a replay. What each old shard had left comes back as an `OldShard`.
"""

from __future__ import annotations

import copy
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from ..graph import BATCH, BRANCH, MIX, PACKER, READER, parents_of, role_of, walk
from ..pack.savepoint import NO_DOCS, SOURCE_FIELDS, SavePoint, unpack_docs
from ..shard import EpochPlans, ShardUnits, WorkSlice, unread_after
from ..compat.torchdata import worker_dataset_states
from .plan_format import CARRY, prefix_of

# --- reading old states -----------------------------------------------------------------

def worker_trees(loader_state: Mapping[str, Any]) -> Dict[int, Any]:
    """{worker: the NodeDataset state {"round", "node"}} from StatefulDataLoader's state."""
    return worker_dataset_states(loader_state)


def source_of(branch: Any, default: str) -> str:
    """The source a branch turns into tokens: its reader's (the first above it)."""
    return next((str(n.source) for n in walk(branch) if role_of(n) == READER), default)


def counters_of(nodes: Sequence[Any]) -> Dict[str, Any]:
    """The counters a new shard continues, read from live nodes by their roles: mixer, packer,
    batcher, readers, branches (`_Template` takes the zeros of the layout from a fresh graph)."""
    out: Dict[str, Any] = {"packer": dict(next(n for n in nodes if role_of(n) == PACKER).stats())}
    batch = next(n for n in nodes if role_of(n) == BATCH)
    out["batch"] = batch.counts()
    mix = next((n for n in nodes if role_of(n) == MIX), None)
    if mix is not None:
        state = mix.get_state_counters()
        out["mix"] = state
    out["skipped"] = {n.source: int(n.skipped) for n in nodes if role_of(n) == READER}
    for i, b in enumerate(n for n in nodes if role_of(n) == BRANCH):
        # the chat renderers' counts, the documents encoded from text (the rest came from a token cache)
        out.setdefault(b.COUNTERS, {})[source_of(b, str(i))] = b.counters()
    return out


class _Template:
    """What every old shard's graph shares, from one graph built for the old topology: where the
    batcher's and the packer's states sit in a worker's tree, each source's sharder settings and
    branch kind, and the counters of a shard that has not started (all zero)."""

    def __init__(self, factory: Callable[[Any], Any], context: Any):
        root = factory(context)
        root.reset(None)
        nodes = list(walk(root))
        self.zeros = counters_of(nodes)
        node, path, self.batch_path = root, [], None
        while role_of(node) != PACKER:
            if role_of(node) == BATCH:
                self.batch_path, self.counts_key = list(path), type(node).COUNTS
            key, parents = getattr(type(node), "PARENT", None), parents_of(node)
            if key is None or len(parents) != 1:
                raise ValueError(f"{type(factory).__name__} graphs cannot change topology on resume: no packer "
                                 f"below {type(node).__name__}")
            path.append(key)
            node = parents[0]
        if self.batch_path is None:
            raise ValueError(f"{type(factory).__name__} graphs cannot change topology on resume: no Batch node")
        self.packer_path, self.elastic_key, self.stats_key = path, node.ELASTIC, node.STATS
        point = SavePoint(node.parent)
        point.count()
        self.branches = dict(zip(point.names, point.branches))
        self.sharders = {}
        for name, reader in zip(point.names, point.readers):
            self.sharders[name] = next(n for n in walk(reader) if isinstance(n, ShardUnits))


def _follow(tree: Any, path: Sequence[str]) -> Any:
    for key in path:
        tree = tree[key]
    return tree


class OldShard:
    """One old shard at its save point, read from its state alone (nothing rebuilt or re-read):
    its counters, its documents in flight (rows of ``savepoint.DOC_FIELDS``, the source column an
    index into the planner's ``names``), and per source the reader's position as a restored
    sharder plus the rows of its current slice already read, the epoch of its next row, and what
    the mixer will count again of the packer's documents."""

    def __init__(self, counters: Dict[str, Any], docs: np.ndarray, sharders: Dict[str, ShardUnits],
                 done: Dict[str, int], reading: Dict[str, int], again: Dict[str, Tuple[int, int]]):
        self.counters, self.docs, self.sharders, self.done = counters, docs, sharders, done
        self.reading, self.again = reading, again

    def reading_epoch(self, source: str) -> int:
        """The epoch of the next row this shard would read of ``source``."""
        return self.reading[source]

    def handed_over_through(self, source: str) -> int:
        """The last epoch a previous elastic resume handed to this shard (-1: none)."""
        return self.sharders[source].handed_over_through()

    def unread(self, source: str, upto_epoch: int) -> List[WorkSlice]:
        """The rows of ``source`` this shard had not read, of epochs up to ``upto_epoch``."""
        return unread_after(self.sharders[source], None, self.done[source], upto_epoch)


def read_old_shards(factory: Callable[[Any], Any], states: Sequence[Tuple[Any, Any]], *, names: Sequence[str],
                    round_: int, world: int, workers: int, context: Callable[..., Any]) -> List[OldShard]:
    """Every old shard (rank by rank, worker by worker) at its save point, from ``states``: per old
    rank, its rank, worker trees ({worker: {"round", "node"}}) and elastic plan (None: none). One graph
    is built for the layout (`_Template`); per old shard only its summary is decoded and a sharder
    restored per source, so the cost is ~the states' size, not a replay. ``names``: the graph's sources
    (`check_elastic`)."""
    index = {n: i for i, n in enumerate(names)}
    template = _Template(factory, context(0, world, 0, workers, round_, None))
    num_shards = world * max(workers, 1)
    plans = {n: EpochPlans(t.unit_rows, seed=t.seed, num_shards=num_shards, shuffle=t.shuffle)
             for n, t in template.sharders.items()}
    out = []
    for rank, trees, plan in states:
        for w in range(max(workers, 1)):
            shard_plan = plan["shards"][str(w)] if plan is not None and int(plan["round"]) == round_ else None
            node = (trees.get(w) or {}).get("node")
            out.append(_old_shard(template, names, index, node, rank * max(workers, 1) + w, num_shards, shard_plan,
                                  plans))
    return out


def _old_shard(t: _Template, names: Sequence[str], index: Mapping[str, int], node: Any, shard: int,
               num_shards: int, plan: Optional[Mapping[str, Any]], plans: Mapping[str, EpochPlans]) -> OldShard:
    sharders: Dict[str, ShardUnits] = {}
    for name in names:
        c = t.sharders[name]
        sharders[name] = ShardUnits(c.unit_rows, shard=shard, num_shards=num_shards, seed=c.seed, epochs=c.epochs,
                                    first_epoch=c.first_epoch, shuffle=c.shuffle, plans=plans[name],
                                    **prefix_of(plan, name))
    if node is None:  # saved before this shard started its round: its start, and the counters it started from
        for s in sharders.values():
            s.reset(None)
        counters = copy.deepcopy(plan[CARRY] if plan is not None else t.zeros)
        return OldShard(counters, NO_DOCS, sharders, dict.fromkeys(names, 0),
                        {n: s.next_epoch() for n, s in sharders.items()}, {n: (0, 0) for n in names})
    batch, packer = _follow(node, t.batch_path), _follow(node, t.packer_path)
    summary = packer[t.elastic_key]
    entries = summary[SavePoint.SOURCES]
    if set(entries) != set(names):
        raise ValueError(f"an old shard's save point describes sources {sorted(entries)}, this loader reads "
                         f"{sorted(names)}; was it saved by another pipeline?")
    local = list(entries)
    docs = unpack_docs(summary[SavePoint.DOCS])
    if len(docs):
        if docs[:, 0].min() < 0:
            raise ValueError("an old shard holds documents of no source this loader reads; was it saved by another "
                             "pipeline?")
        docs[:, 0] = np.asarray([index[n] for n in local], np.int64)[docs[:, 0]]
    again = summary[SavePoint.AGAIN]
    counters: Dict[str, Any] = {"packer": dict(packer[t.stats_key]),
                                "batch": {n: [int(x) for x in v] for n, v in batch[t.counts_key].items()},
                                "skipped": {}}
    if summary[SavePoint.MIX] is not None:
        tokens, documents, passes, exhausted, era_base = summary[SavePoint.MIX]
        counters["mix"] = {"tokens": list(tokens), "documents": list(documents), "passes": list(passes),
                           "exhausted": [bool(x) for x in exhausted], "era_base": list(era_base)}
    done, reading, carried = {}, {}, {}
    fields = len(SOURCE_FIELDS)
    for i, name in enumerate(local):
        e = entries[name]
        sharders[name].reset({ShardUnits.EPOCH: e[0], ShardUnits.INDEX: e[1], ShardUnits.PREFIX: e[2]})
        done[name], reading[name] = int(e[3]), int(e[4])
        counters["skipped"][name] = int(e[5])
        branch = t.branches.get(name)
        if branch is not None:
            counters.setdefault(branch.COUNTERS, {})[name] = branch.counters_from_ints(e[fields:])
        carried[name] = (int(again[2 * i]), int(again[2 * i + 1]))
    return OldShard(counters, docs, sharders, done, reading, carried)
