"""What a loader's iterator does around the batches its workers make (`StatsIterator`): takes out the
statistics they carry, drops a worker's drop markers, refuses to go on once stale, and with a
``rank_sync`` keeps every rank stepping until all ranks ran out (padding batches; rank_sync.py).
And what runs first in each worker process (`WorkerInit`). It talks to its loader through the
loader's iterator API (`TokenLoomLoader.see`, ``round_over``, ``data_over``, ``padding_step``, ...).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional

from ..tokenizer_threads import single_thread_tokenizers
from ..compat.torchdata import snapshot_at_end, stop_workers
from .stall import TORCH_TIMEOUT, StallWatch
from .wire import DROP_KEY, STALE_KEY, STALE_MESSAGE
from .worker_gc import settle_worker_gc
from .worker_memory import settle_worker_arrow_pool, settle_worker_malloc

if TYPE_CHECKING:
    from .bridge import TokenLoomLoader


class StatsIterator:
    """Passes batches through, taking out the statistics they carry; with a
    ``rank_sync``, keeps every rank stepping until all ranks ran out (see rank_sync.py)."""

    def __init__(self, loader: "TokenLoomLoader", it: Iterator[Any], padding: bool = False):
        self._loader, self._it = loader, it
        self._local_done = padding  # this rank's data has ended: padding until every rank's has
        self._ended = False
        self._generation = loader.generation
        loader.wait_clock.new_iterator()

    def __iter__(self):
        return self

    def _next_kept(self):
        while True:
            try:
                batch = next(self._it)
            except StopIteration:
                # the state from here on (padding, or after the round) is the workers' last positions
                snapshot_at_end(self._it)
                raise
            except Exception as e:
                watch = self._loader.stall_watch
                if watch is not None and isinstance(e, RuntimeError) and TORCH_TIMEOUT in str(e):
                    report = watch.report(self._loader.num_workers, self._loader.timeout)  # while they live
                    self._stop_workers()
                    raise RuntimeError(report) from e
                self._stop_workers()
                raise
            if isinstance(batch, dict) and (STALE_KEY in batch or DROP_KEY in batch):
                if STALE_KEY in batch:
                    raise RuntimeError(STALE_MESSAGE)
                self._loader.see(batch, count=False)
                continue
            return batch

    def _end(self) -> None:
        self._ended = True
        self._loader.round_over()

    def _stop_workers(self) -> None:
        # The graph failed: stop the workers now. The traceback holds the iterator in a cycle, so
        # otherwise they (and their memory) would stay until a later gc pass, wherever the
        # training process then is (compat/torchdata.py's keep_for_shutdown keeps that shutdown whole).
        stop_workers(self._loader, self._it)

    def __next__(self):
        clock = self._loader.wait_clock
        entered = clock.enter()
        ahead = self._loader.fetch_ahead
        if ahead is None:
            batch = self._next()
        else:
            if not ahead.states:
                ahead.keep(self._loader.encoded_state())
            batch = self._next()
            ahead.keep(self._loader.encoded_state())
        clock.leave(entered)
        return batch

    def _next(self):
        loader = self._loader
        if self._generation != loader.generation:
            # The loader's position now belongs to the newer iterator; going on here would
            # share it (0 workers) or run a second stream beside it (workers), silently.
            raise RuntimeError("this iterator is stale: iter(loader) or loader.load_state_dict() was called after "
                               "it was made, and the loader's position now belongs to the newer iterator; "
                               "keep using the iterator returned by the latest iter(loader)")
        if self._ended:
            raise StopIteration
        if loader.rank_sync is None:
            try:
                return loader.see(self._next_kept())
            except StopIteration:
                self._end()
                raise
        batch = None
        if not self._local_done:
            try:
                batch = self._next_kept()
            except StopIteration:
                self._local_done = True
                loader.data_over()
        if not loader.rank_sync.any_true(batch is not None):
            self._end()
            raise StopIteration
        if batch is None:
            return loader.padding_step()
        return loader.see(batch)

    def __getattr__(self, name):  # state_dict(), _finished, ... of the underlying iterator
        return getattr(self._it, name)


def identity(x):
    """The DataLoader's collate_fn: batches are formed by the graph."""
    return x


class WorkerInit:
    """Runs in each worker process before the user's ``worker_init_fn``: exit with the training
    process (worker_parent.py), its stack dumped on request (``stall``, stall.py), flat memory
    (worker_memory.py: glibc's malloc, Arrow's pool), a collector that leaves the graph's many small
    states alone (worker_gc.py) and one tokenizing thread per worker (pipes/tokenizer_threads.py)."""

    def __init__(self, user: Optional[Callable[[int], None]], stall: Optional[StallWatch] = None):
        self.user, self.stall = user, stall

    def __call__(self, worker_id: int) -> None:
        from .worker_parent import exit_with_parent

        exit_with_parent()  # first: a SIGKILLed training process must not leave its workers behind
        if self.stall is not None:
            self.stall.arm(worker_id)
        settle_worker_malloc()
        settle_worker_arrow_pool()
        settle_worker_gc()
        single_thread_tokenizers()
        if self.user is not None:
            self.user(worker_id)
