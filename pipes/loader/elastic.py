"""Elastic resume: continue a run on another world size or number of loader workers,
every document of the interrupted epoch delivered exactly once.

The mental model. Each epoch of a source is one global row range, split into
contiguous shards (shard.py); every node's state is a position. So what an old run
had left is computable from its states alone:

1. Rebuild every old shard's graph (its old rank, world size and worker count) and
   restore it. The restore re-reads a bounded window (the packer's and the
   tokenizer's, as any resume does), which puts the documents in flight back in
   memory: those in the packer's buffer with the tokens already delivered of each,
   the flat packer's current document, and those a tokenizer had read but not
   handed on.
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
4. Counters continue from the old totals, split evenly over the new shards: the
   mixer's per-source tokens and documents (less what the documents in flight will
   count again), the packer's and batcher's statistics, the readers' skipped rows.
   So the mix converges on its target as if the run had kept its shape, and
   ``loader.stats()`` goes on from the old figures. Schedules continue from the
   loop's step (`StepClock.base`).

What is not kept: the order. Batches after an elastic resume are not those a run
started on the new topology would give (nor could they be). A same-topology resume
is unchanged and exact.

Cost: step 1 replays each old shard's window once, in the process that loads the
state (about a cold start's first batch per old shard: measured in
benchmarks/RESULTS.md, ``elastic``). The plan of a new rank's shards (its share of
the documents in flight, five ints each, and a few row ranges per source) is kept
in the loader state until the next round, so a later save on the new topology
resumes exactly; worker states stay positions.
"""

from __future__ import annotations

import base64
import zlib
from typing import Any, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from ..shard import ShardUnits, WorkSlice

#: Plan keys (plain data in the loader state).
ROUND, STEP, SOURCES, CARRY = "round", "step", "sources", "carry"
PREFIX, RESUME_EPOCH, DROPPED = "prefix", "resume_epoch", "dropped"


# --- reading old states ----------------------------------------------------------------

def worker_trees(loader_state: Mapping[str, Any]) -> Dict[int, Any]:
    """{worker: the NodeDataset state {"round", "node"}} from StatefulDataLoader's state."""
    snapshot = loader_state.get("_snapshot")
    if snapshot is None:  # 0 workers: the main process's fetcher holds the dataset state
        return {0: _dataset_state(loader_state)}
    return {int(w["worker_id"]): _dataset_state(w) for w in snapshot["_worker_snapshots"].values()}


def _dataset_state(holder: Mapping[str, Any]) -> Any:
    fetcher = holder.get("fetcher_state") or {}
    return fetcher.get("dataset_iter_state") or holder.get("dataset_state")


def _nodes(node: Any) -> Iterator[Any]:
    """Every node of a graph, children before going up (Mix children, readers' sharders)."""
    yield node
    children = getattr(node, "children", None)
    if isinstance(children, list):
        for child in children:
            yield from _nodes(child)
        return
    parent = getattr(node, "parent", None)
    if parent is None and hasattr(node, "_cursor"):
        parent = node._cursor.parent
    if parent is not None and hasattr(parent, "reset"):
        yield from _nodes(parent)


def _kind(node: Any) -> str:
    name = type(node).__name__
    if name in ("BestFitPack", "FlatPack"):
        return "packer"
    if name in ("Tokenize", "RenderChat"):
        return "branch"
    if name == "Mix":
        return "mix"
    if name == "Batch":
        return "batch"
    if isinstance(node, ShardUnits):
        return "shard"
    if hasattr(node, "unread"):
        return "reader"
    return "other"


class _Pending:
    """A document in flight in an old shard: where it comes from, tokens delivered, and
    whether the mixer already counted it (it reached the packer)."""

    __slots__ = ("source", "epoch", "unit", "pos", "used", "length", "picked")

    def __init__(self, doc: Any, used: int, picked: bool):
        self.source, self.epoch, self.unit, self.pos = doc.source, doc.epoch, doc.unit, doc.pos
        self.used, self.length, self.picked = int(used), len(doc.ids), picked

    def key(self) -> tuple:
        return (self.epoch, self.unit, self.pos)


class OldShard:
    """One old shard, restored: its counters as saved, its documents in flight, its readers."""

    def __init__(self, root: Any):
        self.root = root
        nodes = list(_nodes(root))
        self.mix = next((n for n in nodes if _kind(n) == "mix"), None)
        self.packer = next(n for n in nodes if _kind(n) == "packer")
        self.batch = next(n for n in nodes if _kind(n) == "batch")
        self.branches = [n for n in nodes if _kind(n) == "branch"]
        self.readers = {n.source: n for n in nodes if _kind(n) == "reader"}
        self.pending: List[_Pending] = [_Pending(d, used, True) for d, used in self.packer.in_flight()]
        for branch in self.branches:
            self.pending += [_Pending(d, d.used, False) for d in branch.in_flight()]
        # Counters after what is in flight: a restored packer stands at its replay window's start
        # (`base`), and the nodes above it (mixer, readers, tokenizers) count as they were there;
        # the replay brings them to the save point, where the buffered documents were counted.
        # Taken before, the mixer's totals missed the window and then lost the buffered documents
        # a second time (a source's carried tokens went negative: a division by zero at its next pick).
        self.counters = counters_of(nodes)

    def reading_epoch(self, source: str) -> int:
        """The epoch of the next row this shard would read of ``source``."""
        return self.readers[source].next_epoch()

    def handed_over_through(self, source: str) -> int:
        """The last epoch a previous elastic resume handed to this shard (-1: none)."""
        return self.readers[source].handed_over_through()


def counters_of(nodes: Sequence[Any]) -> Dict[str, Any]:
    """The counters a new shard continues: mixer, packer, batcher, readers, chat renderers."""
    out: Dict[str, Any] = {"packer": dict(next(n for n in nodes if _kind(n) == "packer").stats())}
    batch = next(n for n in nodes if _kind(n) == "batch")
    out["batch"] = batch.counts()
    mix = next((n for n in nodes if _kind(n) == "mix"), None)
    if mix is not None:
        state = mix.get_state_counters()
        out["mix"] = state
    out["skipped"] = {n.source: int(getattr(n, "skipped", 0)) for n in nodes if _kind(n) == "reader"}
    chats = [n for n in nodes if type(n).__name__ == "RenderChat"]
    if chats:
        out["chat"] = {getattr(c.parent, "source", str(i)): c.counts() for i, c in enumerate(chats)}
    encoders = [n for n in nodes if type(n).__name__ == "Tokenize"]
    if encoders:  # documents encoded from text (the rest came from a token cache)
        out["encoded"] = {getattr(t.parent, "source", str(i)): t.encoded for i, t in enumerate(encoders)}
    return out


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


def _pieces(slices: List[WorkSlice], lo: int, hi: int) -> List[WorkSlice]:
    """Rows ``[lo, hi)`` of the concatenation of ``slices``."""
    out, at = [], 0
    for s in slices:
        n = s.hi - s.lo
        a, b = max(lo, at), min(hi, at + n)
        if a < b:
            out.append(s._replace(lo=s.lo + a - at, hi=s.lo + b - at))
        at += n
        if at >= hi:
            break
    return out


def plan_shards(old: List[OldShard], names: Sequence[str], *, new_shards: range, num_new: int, step: int,
                round_: int, last_epoch: Optional[int], schedule_shares: Sequence[float]) -> Dict[int, Dict[str, Any]]:
    """The plan of each new shard in ``new_shards`` (global indices of ``num_new``)."""
    plans: Dict[int, Dict[str, Any]] = {g: {ROUND: round_, STEP: step, SOURCES: {}, CARRY: {}} for g in new_shards}
    for name in names:
        reading = [o.reading_epoch(name) for o in old]
        pend = [p for o in old for p in o.pending if p.source == name]
        # An old shard that came from an elastic resume itself may still be reading the earliest
        # epoch of its handed-over work while later ones wait in its plan: they stay open too, or
        # they would be planned afresh and what the first topology delivered of them come again.
        top = max(reading + [p.epoch for p in pend] + [o.handed_over_through(name) for o in old])
        if last_epoch is not None:
            top = min(top, last_epoch)
        low = min(reading + [p.epoch for p in pend])
        per_shard: Dict[int, List[WorkSlice]] = {g: [] for g in new_shards}
        turn = 0
        for epoch in range(low, top + 1) if low <= top else ():
            docs = sorted((p for p in pend if p.epoch == epoch), key=_Pending.key)
            rows = [s for o in old for s in o.readers[name].unread(top) if s.epoch == epoch]
            total = sum(s.hi - s.lo for s in rows)
            for g in range(num_new):
                share = [WorkSlice(p.epoch, p.unit, p.pos, p.pos + 1, p.used)
                         for j, p in enumerate(docs) if (j + turn) % num_new == g]
                a = total * g // num_new
                share += _pieces(rows, a, a + _split(total, num_new, g))
                if g in per_shard:
                    per_shard[g] += _merge(share)
            turn = (turn + len(docs)) % num_new
        for g in new_shards:
            plans[g][SOURCES][name] = {PREFIX: pack_slices(per_shard[g]), RESUME_EPOCH: top + 1}
    carry = _carry(old, names, schedule_shares)
    for g in new_shards:
        plans[g][CARRY] = _share_of(carry, num_new, g)
    return plans


def _carry(old: List[OldShard], names: Sequence[str], shares: Sequence[float]) -> Dict[str, Any]:
    """The old shards' counters summed, less what the documents in flight will count again."""
    def total(path):
        out = 0
        for o in old:
            value = o.counters
            for p in path:
                value = value[p]
            out += int(value)
        return out

    del shares  # the mixer takes its shares from the schedule at the resumed step
    first = old[0].counters
    carry: Dict[str, Any] = {"packer": {k: total(("packer", k)) for k in first["packer"]},
                             "batch": {n: [total(("batch", n, 0)), total(("batch", n, 1))] for n in first["batch"]},
                             "skipped": {n: total(("skipped", n)) for n in first["skipped"]}}
    picked = [p for o in old for p in o.pending if p.picked]
    again_tokens = {n: sum(p.length - p.used for p in picked if p.source == n) for n in names}
    again_docs = {n: sum(1 for p in picked if p.source == n and p.used == 0) for n in names}
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
    for node in _nodes(root):
        kind = _kind(node)
        if kind == "packer":
            node.carry_stats(carry["packer"])
        elif kind == "batch":
            node.carry_counts(carry["batch"])
        elif kind == "mix" and "mix" in carry:
            node.carry_counters(carry["mix"])
        elif kind == "reader" and hasattr(node, "carry_skipped"):
            node.carry_skipped(carry["skipped"].get(node.source, 0))
        elif type(node).__name__ == "Tokenize" and "encoded" in carry:
            node.carry_encoded(carry["encoded"].get(getattr(node.parent, "source", ""), 0))
        elif type(node).__name__ == "RenderChat" and "chat" in carry:
            counts = carry["chat"].get(getattr(node.parent, "source", ""))
            if counts is not None:
                node.carry_counts(counts)


def pack_slices(slices: Sequence[WorkSlice]) -> str:
    """Slices as base64 of zlib'd little-endian int64 (epoch, unit, lo, hi, used) rows: a
    document in flight costs ~8 bytes of state instead of ~25 as JSON lists."""
    table = np.asarray([tuple(s) for s in slices], dtype="<i8").reshape(-1, len(WorkSlice._fields))
    return base64.b64encode(zlib.compress(table.tobytes(), 6)).decode("ascii")


def unpack_slices(text: str) -> List[WorkSlice]:
    raw = zlib.decompress(base64.b64decode(text.encode("ascii"), validate=True))
    table = np.frombuffer(raw, dtype="<i8").reshape(-1, len(WorkSlice._fields))
    return [WorkSlice(*row) for row in table.tolist()]


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
