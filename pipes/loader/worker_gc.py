"""A loader worker's garbage collector: what the worker inherited is frozen, and young objects are
collected less often, once per worker.

Why: a worker's graph keeps positions, not buffers, and a position is a small dict (pipes/base.py):
the mixer keeps each branch's last state, the best-fit packer keeps a state of its parent at every
replay checkpoint, and a worker takes its graph's state with every batch. With hundreds of sources
these are tens of thousands of small containers made and kept per second, and Python's cyclic
collector, which scans the young generations every ``threshold0`` net allocations and the older ones
every few of those, spends its time walking them: in one process, 256 sources went about a fifth
faster with the collector off, 20 sources a few percent (benchmarks/sources.py's corpus, figures in
docs/performance.md, "Many sources"). tokenloom makes no reference cycles of its own in the loop,
so collecting less often frees the same memory a little later.

While a loader forks its workers the training process does not collect (`no_collection_while_forking`):
a collection there could finalize an earlier loader's garbage iterator in the middle of a fork (the
pipes of one worker made, not yet closed), and a worker inherits the collector switched off, so the
garbage it inherited (earlier loaders the training process had not collected yet) is not collected in
it either, before the worker freezes it: collected there, an old iterator's ``__del__`` would try to
stop workers that are not the worker's children ("can only test a child process" on its stderr) and
send them exit messages. `settle_worker_gc` then switches the collector back on, as the training
process had it.

The settings: `gc.freeze` once the worker starts (what it inherited from the training process, the
tokenizer and torch included, is never scanned again; nor written to, so its pages stay shared with
the parent after the fork) and thresholds `THRESHOLDS`. They apply only inside loader worker
processes, which tokenloom owns; the training process (and ``num_workers=0``) keeps its own.
"""

from __future__ import annotations

import contextlib
import gc
from typing import Iterator

#: The collector's thresholds in a loader worker (Python's defaults: 700, 10, 10).
THRESHOLDS = (20_000, 50, 100)

#: Whether the training process's collector was on when its loader forked this worker (inherited).
_enabled_in_parent = True


@contextlib.contextmanager
def no_collection_while_forking() -> Iterator[None]:
    """Within the block (a loader forking its workers), the collector is off; after it, as it was."""
    global _enabled_in_parent
    was = _enabled_in_parent = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def settle_worker_gc() -> None:
    """Freeze what the worker inherited, set `THRESHOLDS` and switch the collector on where the training
    process had it on (module docstring); in a worker only."""
    gc.freeze()
    gc.set_threshold(*THRESHOLDS)
    if _enabled_in_parent:
        gc.enable()
