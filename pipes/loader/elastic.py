"""Elastic resume: continue a run on another world size or number of loader workers,
every document of the interrupted epoch delivered exactly once.

The mental model. Each epoch of a source is one global row range, split into
contiguous shards (shard.py); every node's state is a position. So what an old run
had left is computable from its states alone, and is computed from them alone:

1. Read every old shard's save point from its state (`read_old_shards`). A packer's
   state restores by replay (it nests the positions above it at its window's start),
   so each packer also records, with every state, the save point itself in positions
   and counters (pack/savepoint.py): the documents in flight (the packer's buffer with
   the tokens delivered of each, the flat packer's current document, those a tokenizer
   read but did not hand on), as ``(source, epoch, unit, pos, used)``; per source the
   reader's live position and the epoch of its next row; the mixer's totals and the
   counters. Nothing of an old shard is rebuilt, read or tokenized: one graph is built
   for the layout, and per old shard a sharder is restored per source (its position is
   a few ints; its unread slices come from one plan of all old shards per epoch,
   `EpochPlans`).
2. Per source, the epochs still open are those from the earliest any old shard is
   reading to the latest, or to the last one an earlier elastic resume handed over
   (``E_lo .. E_hi``). What is left of them is the documents
   in flight plus every row not yet read (the rest of each reader's slice and the
   slices its sharder has not emitted, `ShardUnits.unread`).
3. Split that over the new shards: documents in flight in turn (sorted by unit, so
   a reader loads each row group once), rows in contiguous pieces balanced to one
   row. A new shard's sharder emits its share first (its ``prefix``: one-row slices
   carrying ``used``, the tokens delivered before, and row ranges), then plans
   epochs ``E_hi + 1 ...`` for the new topology. A document delivered in part goes
   on from its ``used`` token as a continuing segment (no second BOS); a document
   cropped in ``bestfit-crop`` left the buffer, so what was cropped stays cropped.
   Only a new shard's own prefix is read, by its own readers, as it runs.
4. Counters continue from the old totals, split evenly over the new shards: the
   mixer's per-source tokens and documents (less what the documents in flight will
   count again), the packer's and batcher's statistics, the readers' skipped rows.
   So the mix converges on its target as if the run had kept its shape, and
   ``loader.stats()`` goes on from the old figures. Schedules continue from the
   loop's step (`StepClock.base`).

What is not kept: the order. Batches after an elastic resume are not those a run
started on the new topology would give (nor could they be). A same-topology resume
is unchanged and exact.

The trade-off: a resume that changes topology no longer replays anything, and every step
pays for it instead: a packer's state carries its save point (~0.35 KB per worker at the
default best-fit buffer, 0.8 KB with 1,000 documents in flight) and taking it costs ~0.1 ms
a step (~0.3 ms with 1,000 documents in flight: a few numpy calls over the buffer, one Python
step per document pulled since the last state, a zlib call), ~1% of a worker's batch at
T=2048. Measured (benchmarks/RESULTS.md, ``elastic``; 2 x 2 new ranks): from 2, 16, 64 old
shards an elastic resume costs 0.91x, 1.18x, 1.22x a same-topology one (replaying: 1.09x,
3.09x, 7.60x), from 256 1.67x (65.9x: 13.3 s of replay, ~52 ms per old shard). What grows
with the old run now is reading its states: every new rank decodes the whole list (JSON and
digest) and walks each old shard's save point, ~0.35 ms per old shard, so ~3 s and ~20 MB
of states per rank after a 1024 x 8 run, where the replay took 7-26 minutes.
The plan of a new rank's shards (its share of the documents in flight, five ints each,
and a few row ranges per source) is kept in the loader state until the next round, so a
later save on the new topology resumes exactly; worker states stay positions.
"""

from __future__ import annotations

import base64
import copy
import zlib
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from ..graph import BATCH, BRANCH, MIX, OTHER, PACKER, READER, parents_of, role_of, walk
from ..pack.savepoint import SOURCE_FIELDS, SavePoint, unpack_docs
from ..shard import EpochPlans, ShardUnits, WorkSlice, unread_after

_NO_DOCS = np.zeros((0, 6), np.int64)

#: Plan keys (plain data in the loader state).
ROUND, STEP, SOURCES, CARRY = "round", "step", "sources", "carry"
PREFIX, RESUME_EPOCH, DROPPED = "prefix", "resume_epoch", "dropped"


# --- reading old states -----------------------------------------------------------------

def worker_trees(loader_state: Mapping[str, Any]) -> Dict[int, Any]:
    """{worker: the NodeDataset state {"round", "node"}} from StatefulDataLoader's state."""
    snapshot = loader_state.get("_snapshot")
    if snapshot is None:  # 0 workers: the main process's fetcher holds the dataset state
        return {0: _dataset_state(loader_state)}
    return {int(w["worker_id"]): _dataset_state(w) for w in snapshot["_worker_snapshots"].values()}


def _dataset_state(holder: Mapping[str, Any]) -> Any:
    fetcher = holder.get("fetcher_state") or {}
    return fetcher.get("dataset_iter_state") or holder.get("dataset_state")


# --- the graph: can it continue on another topology? ------------------------------------------

def check_elastic(root: Any) -> List[str]:
    """The sources (readers' names, in the graph's order) of a graph that can continue on another
    topology; `ValueError` naming the node that cannot, and what it would need. Every node must have a
    role (pipes/graph.py) other than ``OTHER``: one that declares none may hold documents between
    calls, which a new topology would lose. One packer, a batcher above it, and readers of distinct
    names over `ShardUnits`."""
    nodes = list(walk(root))
    for node in nodes:
        if role_of(node) == OTHER:
            raise ValueError(
                f"{type(node).__name__} cannot continue on another topology (elastic resume): it declares no role, so "
                "it may hold documents between calls, which the new topology would lose. If it maps or filters items "
                "one at a time and holds none between calls, declare ROLE = PASS (tokenloom.pipes.roles) on its class; "
                "else resume with the world size and num_workers the states were saved with")
    packers = [n for n in nodes if role_of(n) == PACKER]
    if len(packers) != 1 or not any(role_of(n) == BATCH for n in nodes):
        raise ValueError(f"an elastic resume needs one packer and a Batch node above it; this graph has "
                         f"{len(packers)} packer(s) ({', '.join(type(n).__name__ for n in nodes)})")
    readers = [n for n in nodes if role_of(n) == READER]
    names = [str(r.source) for r in readers]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"an elastic resume tells sources apart by their readers' names; {len(readers)} readers share "
                         f"{twice}: give each reader its own source= name")
    for reader in readers:
        if not isinstance(reader.sharder, ShardUnits):
            raise ValueError(f"{type(reader).__name__} of source {reader.source!r} reads from "
                             f"{type(reader.sharder).__name__}, not ShardUnits: an elastic resume re-plans ShardUnits' work")
    return names


def continue_elastic(root: Any, plan: Mapping[str, Any]) -> None:
    """Give every sharder of a graph built for a new shard its part of ``plan`` (`ShardUnits.continue_plan`)."""
    for node in walk(root):
        if role_of(node) == READER:
            node.sharder.continue_plan(**prefix_of(plan, str(node.source)))


def build_shard(factory: Callable[[Any], Any], ctx: Any) -> Any:
    """``factory(ctx)``, continued on the shard's elastic plan when it has one (``ctx.elastic``): how the
    loader builds every shard's graph, a recipe's or one composed by hand."""
    root = factory(ctx)
    if ctx.elastic is not None:
        continue_elastic(root, ctx.elastic)
    return root


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
        return OldShard(counters, _NO_DOCS, sharders, dict.fromkeys(names, 0),
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


# --- planning ------------------------------------------------------------------------------

def _split(total: int, parts: int, k: int) -> int:
    """Part ``k`` of ``total`` split into ``parts`` near-equal ints (they add up to ``total``)."""
    return total * (k + 1) // parts - total * k // parts


def _merge(slices: List[WorkSlice]) -> List[WorkSlice]:
    """Adjacent row ranges of one unit and epoch as one slice (documents not delivered in part)."""
    out: List[WorkSlice] = []
    for s in slices:
        last = out[-1] if out else None
        if last is not None and not last.used and not s.used and (last.epoch, last.unit, last.hi) == (s.epoch, s.unit, s.lo):
            out[-1] = last._replace(hi=s.hi)
        else:
            out.append(s)
    return out


def _pieces(slices: List[WorkSlice], starts: np.ndarray, lo: int, hi: int) -> List[WorkSlice]:
    """Rows ``[lo, hi)`` of the concatenation of ``slices`` (``starts``: the rows before each, and
    the total last)."""
    out = []
    first = max(int(np.searchsorted(starts, lo, "right")) - 1, 0)
    for k in range(first, len(slices)):
        at = int(starts[k])
        if at >= hi:
            break
        s = slices[k]
        a, b = max(lo, at), min(hi, at + s.hi - s.lo)
        if a < b:
            out.append(s._replace(lo=s.lo + a - at, hi=s.lo + b - at))
    return out


def plan_shards(old: List[OldShard], names: Sequence[str], *, new_shards: range, num_new: int, step: int,
                round_: int, last_epoch: Optional[int]) -> Dict[int, Dict[str, Any]]:
    """The plan of each new shard in ``new_shards`` (global indices of ``num_new``)."""
    plans: Dict[int, Dict[str, Any]] = {g: {ROUND: round_, STEP: step, SOURCES: {}, CARRY: {}} for g in new_shards}
    docs = np.concatenate([o.docs for o in old]) if old else _NO_DOCS
    for k, name in enumerate(names):
        reading = [o.reading_epoch(name) for o in old]
        pend = docs[docs[:, 0] == k]
        # An old shard that came from an elastic resume itself may still be reading the earliest
        # epoch of its handed-over work while later ones wait in its plan: they stay open too, or
        # they would be planned afresh and what the first topology delivered of them come again.
        top = max(reading + pend[:, 2].tolist() + [o.handed_over_through(name) for o in old])
        if last_epoch is not None:
            top = min(top, last_epoch)
        low = min(reading + pend[:, 2].tolist())
        by_epoch: Dict[int, List[WorkSlice]] = {}  # the old shards' unread rows, in their order, per epoch
        for o in old if low <= top else ():
            for s in o.unread(name, top):
                by_epoch.setdefault(s.epoch, []).append(s)
        per_shard: Dict[int, List[WorkSlice]] = {g: [] for g in new_shards}
        turn = 0
        for epoch in range(low, top + 1) if low <= top else ():
            now = pend[pend[:, 2] == epoch]
            now = now[np.lexsort((now[:, 4], now[:, 3]))]  # by (unit, pos): a reader loads each unit once
            rows = by_epoch.get(epoch, [])
            starts = np.zeros(len(rows) + 1, np.int64)
            np.cumsum([s.hi - s.lo for s in rows], out=starts[1:])
            total = int(starts[-1])
            for g in new_shards:
                mine = now[(g - turn) % num_new::num_new]
                share = [WorkSlice(epoch, u, p, p + 1, used) for u, p, used in mine[:, 3:6].tolist()]
                a = total * g // num_new
                share += _pieces(rows, starts, a, a + _split(total, num_new, g))
                per_shard[g] += _merge(share)
            turn = (turn + len(now)) % num_new
        for g in new_shards:
            plans[g][SOURCES][name] = {PREFIX: pack_slices(per_shard[g]), RESUME_EPOCH: top + 1}
    carry = _carry(old, names)
    for g in new_shards:
        plans[g][CARRY] = _share_of(carry, num_new, g)
    return plans


def _carry(old: List[OldShard], names: Sequence[str]) -> Dict[str, Any]:
    """The old shards' counters summed, less what the documents in flight will count again."""
    def total(path):
        out = 0
        for o in old:
            value = o.counters
            for p in path:
                value = value[p]
            out += int(value)
        return out

    first = old[0].counters
    carry: Dict[str, Any] = {"packer": {k: total(("packer", k)) for k in first["packer"]},
                             "batch": {n: [total(("batch", n, 0)), total(("batch", n, 1))] for n in first["batch"]},
                             "skipped": {n: total(("skipped", n)) for n in first["skipped"]}}
    again_tokens = {n: sum(o.again[n][0] for o in old) for n in names}
    again_docs = {n: sum(o.again[n][1] for o in old) for n in names}
    carry["packer"]["tokens_in"] -= sum(again_tokens.values())
    carry["packer"]["documents"] -= sum(again_docs.values())
    if "mix" in first:
        idx = {n: i for i, n in enumerate(names)}
        m = [o.counters["mix"] for o in old]
        carry["mix"] = {
            "tokens": [sum(x["tokens"][i] for x in m) - again_tokens[n] for n, i in idx.items()],
            "documents": [sum(x["documents"][i] for x in m) - again_docs[n] for n, i in idx.items()],
            "era_base": [sum(x["era_base"][i] for x in m) for i in range(len(names))],
            "passes": [min(x["passes"][i] for x in m) for i in range(len(names))],
            # Not carried: a new shard's prefix may still hold documents of a source every old shard
            # had exhausted (read to its end, not yet delivered); its mixer finds the source exhausted
            # again at the first document beyond the passes, which comes after the prefix.
            "exhausted": [False] * len(names),
        }
    if "chat" in first:
        carry["chat"] = {n: {k: total(("chat", n, k)) for k in first["chat"][n]} for n in first["chat"]}
    if "encoded" in first:  # the documents in flight are encoded again: real work, counted again
        carry["encoded"] = {n: total(("encoded", n)) for n in first["encoded"]}
    return carry


def _share_of(carry: Any, parts: int, k: int) -> Any:
    """Shard ``k``'s part of every int in ``carry`` (bools, floats and shares are kept)."""
    if isinstance(carry, dict):
        return {key: (value if key in ("exhausted", "passes") else _share_of(value, parts, k))
                for key, value in carry.items()}
    if isinstance(carry, list):
        return [_share_of(v, parts, k) for v in carry]
    if isinstance(carry, bool) or not isinstance(carry, int):
        return carry
    return _split(carry, parts, k)


# --- the new shard ---------------------------------------------------------------------------

def apply_carry(root: Any, carry: Mapping[str, Any]) -> None:
    """Give a freshly reset new shard the counters it continues (see `_carry`)."""
    for node in walk(root):
        role = role_of(node)
        if role == PACKER:
            node.carry_stats(carry["packer"])
        elif role == BATCH:
            node.carry_counts(carry["batch"])
        elif role == MIX and "mix" in carry:
            node.carry_counters(carry["mix"])
        elif role == READER:
            node.carry_skipped(carry["skipped"].get(node.source, 0))
        elif role == BRANCH and node.COUNTERS in carry:
            counters = carry[node.COUNTERS].get(source_of(node, ""))
            if counters is not None:
                node.carry(counters)


def pack_slices(slices: Sequence[WorkSlice]) -> str:
    """Slices as base64 of zlib'd little-endian int64 (epoch, unit, lo, hi, used) rows: a
    document in flight costs ~8 bytes of state instead of ~25 as JSON lists."""
    fields = len(WorkSlice._fields)
    table = np.array(list(zip(*slices)), dtype="<i8").T if slices else np.zeros((0, fields), "<i8")
    table = np.ascontiguousarray(table.reshape(-1, fields))
    return base64.b64encode(zlib.compress(table.tobytes(), 6)).decode("ascii")


def unpack_slices(text: str) -> List[WorkSlice]:
    raw = zlib.decompress(base64.b64decode(text.encode("ascii"), validate=True))
    table = np.frombuffer(raw, dtype="<i8").reshape(-1, len(WorkSlice._fields))
    return list(map(WorkSlice._make, table.tolist()))


def prefix_of(plan: Optional[Mapping[str, Any]], source: str) -> Dict[str, Any]:
    """`ShardUnits` arguments for a new shard's ``source``: its prefix, the epoch it plans
    from after it, and how many leading prefix slices a saved plan dropped (nothing
    without a plan)."""
    if plan is None:
        return {}
    entry = plan[SOURCES][source]
    return {"prefix": unpack_slices(entry[PREFIX]), "resume_epoch": int(entry[RESUME_EPOCH]),
            "prefix_offset": int(entry.get(DROPPED, 0))}


def _prefix_positions(tree: Any, source: Optional[str], out: Dict[str, int]) -> None:
    """The least prefix position of each source's sharder anywhere in a worker's state tree
    (its live position and every restore point: packer checkpoint, tokenizer batch, reader slice)."""
    if isinstance(tree, dict):
        if set(tree) == set(ShardUnits.STATE_KEYS):
            if source is not None:
                out[source] = min(out.get(source, 1 << 62), int(tree[ShardUnits.PREFIX]))
            return
        for key, value in tree.items():
            if key == "children" and isinstance(value, dict):  # Mix: one subtree per source
                for name, sub in value.items():
                    _prefix_positions(sub, name, out)
            else:
                _prefix_positions(value, source, out)
    elif isinstance(tree, list):
        for value in tree:
            _prefix_positions(value, source, out)


def trimmed(elastic: Dict[str, Any], inner: Mapping[str, Any], names: Sequence[str]) -> Dict[str, Any]:
    """The plan as saved: each prefix without the slices no position in the state can reach
    again (so the handed-over work stops costing state once it is used up)."""
    if not inner:
        return elastic
    trees = worker_trees(inner)
    shards = {}
    for w, plan in elastic["shards"].items():
        tree = trees.get(int(w)) or {}
        lowest: Dict[str, int] = {}
        _prefix_positions(tree.get("node"), names[0] if len(names) == 1 else None, lowest)
        sources = {}
        for name, entry in plan[SOURCES].items():
            dropped = int(entry.get(DROPPED, 0))
            keep = max(dropped, lowest.get(name, dropped))
            if keep > dropped and tree.get("round") == elastic["round"]:
                slices = unpack_slices(entry[PREFIX])[keep - dropped:]
                entry = {**entry, PREFIX: pack_slices(slices), DROPPED: keep}
            sources[name] = entry
        shards[w] = {**plan, SOURCES: sources}
    return {**elastic, "shards": shards}
