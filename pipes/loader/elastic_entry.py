"""The entry of an elastic resume: the old ranks' states checked as one run saved at one step, and
what each old rank's state holds for the planner (elastic.py), from the states alone.
"""

from __future__ import annotations

from typing import Any, Dict, List, Mapping, Sequence, Set, Tuple

from ..compat.torchdata import steps_since_snapshot
from .envelope import CONFIG, ELASTIC, LINEAGE, LOADER, META, OVER, PHASE, ROUND, ROUND_PADDING, STEPS
from .node_dataset import ShardContext
from .old_shards import OldShard, read_old_shards, worker_trees


def point_of(metas: Sequence[Mapping[str, Any]]) -> Tuple[int, int, int, int, Set[str]]:
    """``(old world size, old num_workers, round, the loop's step, phases)`` of the old ranks' metas,
    which must be every rank of one run (one history) saved at one step; `ValueError` naming what
    differs otherwise. The step counts the batches with data plus padding batches (ranks pad in step
    on a finite epoch)."""
    first = metas[0][CONFIG]
    old_world, old_workers = int(first["world_size"]), int(first["num_workers"])
    ranks = sorted(int(m[CONFIG]["rank"]) for m in metas)
    twice = sorted({r for r in ranks if ranks.count(r) > 1})
    if twice:
        raise ValueError(f"the states hold rank(s) {twice} more than once; pass each old rank's state once")
    for m in metas:
        c = m[CONFIG]
        if (c["world_size"], c["num_workers"]) != (old_world, old_workers):
            raise ValueError(f"the states come from different runs: rank {c['rank']} was saved with world_size="
                             f"{c['world_size']}, num_workers={c['num_workers']}, rank {first['rank']} with "
                             f"world_size={old_world}, num_workers={old_workers}")
    histories: Dict[str, List[int]] = {}
    for m in metas:
        histories.setdefault(str(m[LINEAGE]), []).append(int(m[CONFIG]["rank"]))
    if len(histories) > 1:
        seen = "; ".join(f"rank(s) {sorted(r)} carry history {h or 'from the start'!r}" for h, r in histories.items())
        raise ValueError(f"the states come from different runs: {seen}. An elastic resume or a change of weights "
                         "starts a new history; pass the states every rank of one run saved at the same step")
    missing = sorted(set(range(old_world)) - set(ranks))
    if missing:
        raise ValueError(f"the states of rank(s) {missing} are missing: the old run had world_size={old_world}; "
                         "pass every old rank's state")
    where = {(int(m[ROUND]), int(m[STEPS]) + int(m[ROUND_PADDING])) for m in metas}
    phases = {m[PHASE] for m in metas}
    if len(where) != 1 or (OVER in phases and len(phases) > 1):
        seen = sorted((int(m[CONFIG]["rank"]), m[ROUND], m[STEPS] + m[ROUND_PADDING], m[PHASE]) for m in metas)
        raise ValueError("the states were saved at different points of the run (rank, round, step, phase): "
                         f"{seen}; pass the states every rank saved at the same step")
    (round_, steps), = where
    return old_world, old_workers, round_, steps, phases


def old_positions(states: Sequence[Mapping[str, Any]]) -> List[Tuple[int, Dict[int, Any], Any]]:
    """Per old rank (``states``: decoded, in rank order), ``(rank, worker trees, elastic plan)``: what
    `old_shards.read_old_shards` reads their save points from. A state taken between worker snapshots
    (``snapshot_every_n_steps > 1``) is refused: it does not hold every batch's position."""
    held = []
    for state in states:
        meta, inner = state[META], state[LOADER]
        if steps_since_snapshot(inner):
            raise ValueError(f"rank {int(meta[CONFIG]['rank'])}'s state was taken "
                             f"{steps_since_snapshot(inner)} batches after its last worker snapshot "
                             "(snapshot_every_n_steps > 1): an elastic resume needs the position of every batch; "
                             "save at a step that is a multiple of snapshot_every_n_steps, or pass "
                             "snapshot_every_n_steps=1 (the default)")
        # {}: saved before the round started
        held.append((int(meta[CONFIG]["rank"]), worker_trees(inner) if inner else {}, meta[ELASTIC]))
    return held


def read_old_states(dataset: Any, states: Sequence[Mapping[str, Any]], round_: int, world: int,
                    workers: int) -> List[OldShard]:
    """The old ranks' shards (``states``: decoded, in rank order) at their save points, read from the
    states alone for ``dataset``'s graph (`old_shards.read_old_shards`)."""
    return read_old_shards(dataset.factory, old_positions(states), names=dataset.source_names(), round_=round_,
                           world=world, workers=workers, context=ShardContext)
