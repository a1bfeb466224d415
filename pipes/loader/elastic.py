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

The trade-off: a resume that changes topology replays nothing, and every step pays for it
instead: a packer's state carries its save point, and taking it costs a few numpy calls over
the buffer, one Python step per document pulled since the last state and a zlib call; both
grow with the documents in flight. An elastic resume's cost then stays close to a
same-topology resume's as the number of old shards grows, where replaying every old shard
grew with it. What grows with the old run is reading its states: every new rank decodes the
whole list (JSON and digest) and walks each old shard's save point, one walk per old shard.
Measured by benchmarks/elastic.py (benchmarks/RESULTS.md, ``elastic``; see docs/performance.md).
The plan of a new rank's shards (its share of the documents in flight, five ints each,
and a few row ranges per source) is kept in the loader state until the next round, so a
later save on the new topology resumes exactly; worker states stay positions.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence

import numpy as np

from ..graph import BATCH, BRANCH, MIX, OTHER, PACKER, READER, role_of, walk
from ..shard import ShardUnits, WorkSlice
from ..pack.savepoint import NO_DOCS
from .old_shards import OldShard, counters_of, read_old_shards, source_of, worker_trees  # noqa: F401 (re-exported)
from .plan_format import (CARRY, DROPPED, PREFIX, RESUME_EPOCH, ROUND, SOURCES, STEP,  # noqa: F401 (re-exported)
                          pack_slices, prefix_of, unpack_slices)


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
    docs = np.concatenate([o.docs for o in old]) if old else NO_DOCS
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
