"""An old rank's worker positions at the step its state was saved, when that step fell between two
worker snapshots (``snapshot_every_n_steps=N``), for an elastic resume.

Why: with ``snapshot_every_n_steps=N`` a state saved at step ``s`` holds each worker's graph state at
the last snapshot step ``s - k`` and the count ``k`` of batches yielded since; a resume on the same
topology replays those ``k`` batches in its workers (torchdata). An elastic resume plans from every old
shard's save point (old_shards.py), so it needs each worker's state at step ``s`` itself.

How (`advance_trees`): the graph is a function of its state, so each old worker's graph is built in
this process (its old rank, worker, round and elastic plan), restored from its snapshot, and pulled for
the batches it gave after the snapshot; its state then is the state it would have sent with its batch
at step ``s``. Which worker gave which of the ``k`` batches follows torchdata's order: round robin from
the worker after the one that gave the snapshot step's batch, passing over workers whose data had
ended; a worker whose graph ends on a pull (StopIteration) drops out there, as torchdata drops it, and
its state after the end is the one kept (torchdata applies the state sent with the end before the next
batch). Workers that had ended at the snapshot are left as they were.

Where (`advance_in_child`): in one child process, started as the loader starts its workers
(fork_guard.py), so that the training process never runs a graph: its tokenizer would start native
thread pools there that later forks of workers must not copy.

Cost: the ``k`` batches (fewer than N) of each old rank, read, tokenized and packed again, one graph
per old worker alive while its rank is advanced, and the child's start; nothing when the state was
saved at a snapshot step. The states are those a state taken with every batch would hold
(tests/test_sparse_snapshots.py compares them).
"""

from __future__ import annotations

from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any, Callable, Dict, List, Mapping, Sequence

from ..compat.torchdata import last_yielded_worker, steps_since_snapshot, worker_trees_ended
from .elastic import apply_carry, build_shard
from .fork_guard import safe_context
from .node_dataset import NodeDataset
from .old_shards import worker_trees
from .plan_format import CARRY

ROUND, NODE = NodeDataset.ROUND, NodeDataset.NODE


def advance_trees(factory: Callable[[Any], Any], context: Callable[..., Any], inner: Mapping[str, Any], *,
                  rank: int, world: int, workers: int, round_: int, plan: Any) -> Dict[int, Any]:
    """``{worker: {"round", "node"}}`` of one old rank's StatefulDataLoader state ``inner`` at the step
    it was saved at (module docstring): its snapshot's trees when it was saved at a snapshot step.
    ``round_``: the rank's round then (a worker that sent no state yet starts it); ``plan``: the rank's
    elastic plan when the state was saved (its ``meta["elastic"]``, or None);
    ``context(rank, world, worker, workers, round, plan)`` makes a `ShardContext`."""
    trees = worker_trees(inner)
    k = steps_since_snapshot(inner)
    if not k or workers < 1:  # at a snapshot step, or no workers (no snapshots: nothing since)
        return trees
    ended = worker_trees_ended(inner)
    active = [not ended.get(w, False) for w in range(workers)]
    roots: Dict[int, Any] = {}

    def root(w: int) -> Any:
        if w not in roots:
            tree = trees.get(w) or {}
            at = int(tree.get(ROUND, round_))
            shard_plan = plan["shards"][str(w)] if plan is not None and int(plan["round"]) == at else None
            node = build_shard(factory, context(rank, world, w, workers, at, shard_plan))
            node.reset(tree.get(NODE))
            if tree.get(NODE) is None and shard_plan is not None:
                apply_carry(node, shard_plan[CARRY])
            roots[w] = node
        return roots[w]

    last = last_yielded_worker(inner)
    w = workers - 1 if last is None else last
    for step in range(k):
        while True:
            if not any(active):
                raise ValueError(f"rank {rank}'s state counts {k} batches after its last worker snapshot, but its "
                                 f"workers' data ended after {step}: the state does not belong to this pipeline "
                                 "or its data changed since it was saved")
            w = (w + 1) % workers
            if not active[w]:
                continue
            try:
                next(root(w))
                break
            except StopIteration:
                active[w] = False  # torchdata drops it and asks the next worker
    for w, node in roots.items():
        tree = trees.get(w) or {}
        trees[w] = {ROUND: int(tree.get(ROUND, round_)), NODE: node.state_dict()}
    return trees


def advance_in_child(factory: Callable[[Any], Any], context: Callable[..., Any], jobs: Sequence[Mapping[str, Any]],
                     start: Any = None) -> List[Dict[int, Any]]:
    """`advance_trees` of each job (its keyword arguments: ``inner``, ``rank``, ``world``, ``workers``,
    ``round_``, ``plan``), in order, in one child process started with ``start`` (a DataLoader's
    ``multiprocessing_context``; see the module docstring). The child's errors are raised here."""
    try:
        with ProcessPoolExecutor(1, mp_context=safe_context(start, factory)) as pool:
            return pool.submit(_advance_jobs, factory, context, list(jobs)).result()
    except BrokenProcessPool as e:
        raise RuntimeError(f"the process advancing the old workers' graphs to the step their state was saved at "
                           f"died ({e}); resume from a state saved at a multiple of snapshot_every_n_steps, or "
                           "look for what killed it (memory)") from e


def _advance_jobs(factory: Callable[[Any], Any], context: Callable[..., Any],
                  jobs: List[Mapping[str, Any]]) -> List[Dict[int, Any]]:
    return [advance_trees(factory, context, job["inner"], rank=job["rank"], world=job["world"],
                          workers=job["workers"], round_=job["round_"], plan=job["plan"]) for job in jobs]
