"""The entry of an elastic resume: the old ranks' states checked as one run saved at one step, and
what each old rank's state holds for the planner (elastic.py), from the states alone.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Mapping, Sequence, Set, Tuple

from ..compat.torchdata import steps_since_snapshot
from .advance import advance_in_child
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


def new_weights_between_snapshots(what: str, steps: int, setting: str) -> ValueError:
    """The error for a change of weights from a state taken ``steps`` batches after its last worker
    snapshot (``setting``: the snapshot interval, as text): those batches would be replayed under the new
    weights, other batches than the run gave, so the position reached would not be the one saved."""
    return ValueError(f"{what} was taken {steps} batches after its last worker snapshot ({setting}), and a "
                      "change of weights cannot replay them; change the weights from a state saved at a multiple of "
                      "snapshot_every_n_steps, or resume this one with the weights it was saved with")


def old_positions(states: Sequence[Mapping[str, Any]], factory: Callable[[Any], Any], reweighted: bool = False,
                  start: Any = None) -> List[Tuple[int, Dict[int, Any], Any]]:
    """Per old rank (``states``: decoded, in rank order), ``(rank, worker trees, elastic plan)``: what
    `old_shards.read_old_shards` reads their save points from. The states taken between worker snapshots
    (``snapshot_every_n_steps > 1``) have their workers' graphs (``factory``'s) advanced to their step, in
    a child started with ``start`` (advance.py); refused when ``reweighted`` (the loader's weights are not
    the ones saved), as the replay would run under the new weights."""
    held, jobs = [], {}
    for i, state in enumerate(states):
        meta, inner = state[META], state[LOADER]
        config = meta[CONFIG]
        held.append((int(config["rank"]), worker_trees(inner) if inner else {}, meta[ELASTIC]))  # {}: not started
        if inner and steps_since_snapshot(inner):
            if reweighted:
                raise new_weights_between_snapshots(f"rank {int(config['rank'])}'s state",
                                                    steps_since_snapshot(inner), "snapshot_every_n_steps > 1")
            jobs[i] = dict(inner=inner, rank=int(config["rank"]), world=int(config["world_size"]),
                           workers=int(config["num_workers"]), round_=int(meta[ROUND]), plan=meta[ELASTIC])
    if jobs:
        for i, trees in zip(jobs, advance_in_child(factory, ShardContext, list(jobs.values()), start)):
            held[i] = (held[i][0], trees, held[i][2])
    return held


def read_old_states(dataset: Any, states: Sequence[Mapping[str, Any]], round_: int, world: int,
                    workers: int, reweighted: bool = False, start: Any = None) -> List[OldShard]:
    """The old ranks' shards (``states``: decoded, in rank order) at their save points, read from the
    states alone for ``dataset``'s graph (`old_shards.read_old_shards`); ``reweighted``, ``start``: see
    `old_positions`."""
    return read_old_shards(dataset.factory, old_positions(states, dataset.factory, reweighted, start),
                           names=dataset.source_names(), round_=round_, world=world, workers=workers,
                           context=ShardContext)
