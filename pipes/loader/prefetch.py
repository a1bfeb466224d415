"""Fetch the next batches in a background thread, copy them to the GPU, and checkpoint what the loop has seen.

Algorithm: `DevicePrefetcher` wraps a loader (a `TokenLoomLoader`). A background
thread keeps up to ``depth`` batches (default 2) ready: it takes a free slot,
fetches the next batch from the loader, copies it to ``device`` on a side CUDA
stream (``non_blocking`` from pinned memory, so the copy overlaps the training
step running on the current stream), records an event, and queues it. When the
loop asks for a batch, the front of the queue is handed over after

- ``current_stream.wait_event(event)``: kernels the loop launches on its own
  stream start only after that batch's copies finished (the host does not wait);
- ``tensor.record_stream(current_stream)``: the caching allocator, which
  allocated the tensors on the side stream, does not give their memory to a
  later copy until the work the loop queued on them is done;

and its slot is freed, so the thread fetches the next one during the step.
Without CUDA (or with ``device="cpu"``) the same thread and queue run with no
copies and no streams, which is what the CPU tests check.

Why a thread: receiving a batch from a worker process (unpickling it, applying
the worker's state delta, rebuilding the loader snapshot) costs the training
thread CPU time every batch; in the thread it overlaps the step, and
the loop's ``next()`` only takes a ready batch (measured by `benchmarks/stall.py`). The
DataLoader's own pin-memory thread does part of this on a GPU machine; this
thread does all of it, on every machine. The loader is only touched by the
thread while an iteration runs; `state_dict` and `stats` read what the thread
recorded, so they never race with it.

State: the loader's own ``state_dict()`` describes the last batch it *fetched*,
up to ``depth`` batches ahead of the loop; restoring it would skip the queued
batches. So each queued batch carries the loader's state taken right after it
was fetched (and the loader's ``stats()`` then), and ``state_dict()`` returns the
one of the last batch *handed to the loop* (before the first hand-over: the
state before the first fetch; after the loop saw the end: the loader's end
state, which resumes into the next round, as the loader does).

The loop's ``next()`` only moves a ready batch and wakes the thread, and two
things keep it that short when every core is busy (as many workers as cores, steps
barely longer than the data time; measured by `benchmarks/stall.py`): the batch the
loop lets go of is destroyed in the thread (destroying a tensor releases the GIL,
which the busy thread then holds for up to a switch interval, `sys.getswitchinterval`),
and the thread's wake-up does not preempt the loop (`wakeup.py`).

Trade-off: one ``loader.state_dict()`` per batch (small plain data; copied
with ``num_workers=0``, where it could alias live node state) and ``depth`` + 1
batches of memory (on the device when copying; the +1 is the batch the loop
just let go of, destroyed during the next step). An exception in the loader
reaches the loop's ``next()`` with its original type and message.

Rounds follow the loader: a new ``iter()`` after a finished loop starts the next
round; breaking out and calling ``iter()`` again restarts the current one (if the
thread had already fetched the round's end, the round's start state is reloaded
so the loader does not move on to the next round behind the loop's back).
Under torchrun with a finite epoch, the loader's per-step rank agreement then
runs in the thread, on the loader's own gloo group (`rank_sync.py`).

At interpreter exit (a loop that stops after its last step and never closes the prefetcher),
every fetch thread still running is told to stop and waited for (`EXIT_WAIT_S`), in an
``atexit`` hook: the thread is a daemon, and a daemon thread that is inside torch code with the
GIL released when the interpreter finalizes is ended as it takes the GIL back, through C++ frames
that may not be unwound, so the process aborted (``terminate called without an active exception``,
exit status 134) after a run that had gone well.
"""

from __future__ import annotations

import copy
import pickle
import queue
import threading
import weakref
from typing import Any, Dict, Iterator, NamedTuple, Optional, Union

import torch

from ..process_hooks import at_exit
from .wait_clock import WaitClock
from .wakeup import quiet_wakeup


class _Queued(NamedTuple):
    batch: Any
    state: Dict[str, Any]
    stats: Optional[Dict[str, int]]
    event: Any  # torch.cuda.Event, or None on the pass-through path


class _End(NamedTuple):
    state: Dict[str, Any]
    stats: Optional[Dict[str, int]]


class _Failed(NamedTuple):
    error: BaseException


def _map_tensors(obj: Any, fn) -> Any:
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, dict):
        return {k: _map_tensors(v, fn) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        out = [_map_tensors(v, fn) for v in obj]
        return type(obj)(*out) if hasattr(obj, "_fields") else type(obj)(out)
    return obj


def _each_tensor(obj: Any):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _each_tensor(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _each_tensor(v)


class DevicePrefetcher:
    """Iterate ``loader`` with ``depth`` batches fetched (and copied to ``device``) ahead, in a thread.

    ``device=None`` picks ``"cuda"`` when available, else ``"cpu"`` (no copies).
    Build the loader with ``pin_memory=True`` so the copies are asynchronous;
    unpinned tensors are pinned here first (a host copy per batch).

    Args:
        loader: the loader to iterate (a `TokenLoomLoader`: ``__iter__``, ``state_dict``,
            ``load_state_dict`` and, optionally, ``stats`` and ``num_workers``).
        device: where batches are copied (``"cuda"``, ``"cuda:1"``, a `torch.device`, or ``"cpu"``
            for no copies); None: ``"cuda"`` when available, else ``"cpu"``. A CUDA device without
            CUDA is refused.
        depth: batches fetched (and copied) ahead of the loop, >= 1; ``depth`` + 1 batches are
            held at most (the +1: the batch the loop just let go of).
    """

    def __init__(self, loader: Any, device: Union[str, torch.device, None] = None, depth: int = 2):
        if depth < 1:
            raise ValueError(f"{depth=} must be >= 1 (the number of batches fetched ahead)")
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device={str(self.device)!r} but CUDA is not available; pass device='cpu' "
                             "(or None) to run without copies")
        self.loader, self.depth = loader, depth
        self._stream = torch.cuda.Stream(device=self.device) if self.device.type == "cuda" else None
        # Only the in-process (num_workers=0) state aliases live node objects.
        self._copy_state = getattr(loader, "num_workers", 0) == 0
        self._generation = 0
        self._fetcher: Optional[_Fetcher] = None
        self._start_state: Optional[Dict[str, Any]] = None
        self._loader_done = self._consumer_done = False
        self._handed_state: Optional[Dict[str, Any]] = None
        self._handed_stats: Optional[Dict[str, int]] = None
        self.wait_clock = WaitClock()  # the loop's waits on this prefetcher (the loader's time its thread)

    # --- iteration ---------------------------------------------------------------
    def __iter__(self) -> Iterator[Any]:
        self._stop_fetcher()
        if self._loader_done and not self._consumer_done:
            # The loop broke out after the thread fetched the round's end: restart this round,
            # as the bare loader would, instead of letting it move on to the next.
            self.loader.load_state_dict(self._start_state)
        self._generation += 1
        # iter() in this thread: the DataLoader installs its worker-failure signal handler here.
        source = iter(self.loader)
        self._start_state = self._loader_state()  # before the first fetch of this iteration
        self._handed_state, self._handed_stats = self._start_state, self._loader_stats()
        self._loader_done = self._consumer_done = False
        self._fetcher = _Fetcher(self, source)
        self._fetcher.start()
        self.wait_clock.new_iterator()
        return _PrefetchIter(self, self._fetcher, self._generation)

    def close(self) -> None:
        """Stop the background thread now and let go of the loader's iterator (a dropped iterator
        also stops it, within one `_Fetcher.POLL_S` poll of the thread waiting for a slot)."""
        self._stop_fetcher()

    def _stop_fetcher(self) -> None:
        if self._fetcher is not None:
            self._fetcher.halt()
            self._fetcher = None

    def _loader_state(self) -> Dict[str, Any]:
        state = self.loader.state_dict()
        # A pickle round trip is the cheapest deep copy of plain data (0.05 ms for a
        # 6 KB state vs 0.36 ms for copy.deepcopy).
        return pickle.loads(pickle.dumps(state, pickle.HIGHEST_PROTOCOL)) if self._copy_state else state

    def _loader_stats(self) -> Optional[Dict[str, int]]:
        stats = getattr(self.loader, "stats", None)
        return stats() if stats is not None else None

    def _to_device(self, batch: Any) -> _Queued:
        if self._stream is None:
            return _Queued(batch, self._loader_state(), self._loader_stats(), None)
        with torch.cuda.device(self.device), torch.cuda.stream(self._stream):
            moved = _map_tensors(batch, lambda t: (t if t.is_pinned() else t.pin_memory())
                                 .to(self.device, non_blocking=True))
            event = torch.cuda.Event()
            event.record(self._stream)
        return _Queued(moved, self._loader_state(), self._loader_stats(), event)

    def _hand_over(self, item: _Queued) -> Any:
        if item.event is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(item.event)
            for t in _each_tensor(item.batch):
                if t.is_cuda:
                    t.record_stream(current)
        self._handed_state, self._handed_stats = item.state, item.stats
        return item.batch

    # --- state -------------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        """The loader state after the last batch handed to the loop (what a resume continues from)."""
        if self._handed_state is None:
            return self._loader_state()
        return self._handed_state

    def load_state_dict(self, state: Dict[str, Any], **kwargs: Any) -> None:
        """Load into the loader (same checks, same ``kwargs``) and drop the queued batches."""
        self._stop_fetcher()
        self.loader.load_state_dict(state, **kwargs)
        self._generation += 1
        self._loader_done = self._consumer_done = False
        self._handed_state, self._handed_stats = state, None

    def figures(self, prefix: str = "data/") -> Dict[str, float]:
        """The loader's figures (`TokenLoomLoader.figures`), with the waits the training loop had on
        this prefetcher: the loader's own are those of the prefetch thread, which is always waiting."""
        figures = getattr(self.loader, "figures", None)
        out = dict(figures(prefix)) if figures is not None else {}
        out.update({prefix + k: float(v) for k, v in self.wait_clock.figures().items()})
        return out

    def stats(self) -> Dict[str, int]:
        """The loader's counters as of the last batch handed to the loop."""
        if self._handed_stats is None:
            return self.loader.stats()
        return copy.deepcopy(self._handed_stats)


#: Seconds the exit hook waits for each fetch thread still running to finish the fetch in progress.
EXIT_WAIT_S = 10.0

_running: "weakref.WeakSet[_Fetcher]" = weakref.WeakSet()  # fetch threads started and not yet ended


def _stop_fetchers_at_exit() -> None:
    """Stop every fetch thread still running, before the interpreter finalizes (module docstring)."""
    fetchers = list(_running)
    for f in fetchers:
        f.stopping.set()
    for f in fetchers:
        if f.is_alive():
            f.join(EXIT_WAIT_S)


class _Fetcher(threading.Thread):
    """Fetches into ``ready`` while a slot is free; always ends with an `_End` or a `_Failed`."""

    #: How often a thread waiting for a free slot checks whether it was told to stop.
    POLL_S = 0.05

    def __init__(self, owner: DevicePrefetcher, source: Iterator[Any]):
        super().__init__(name="tokenloom-prefetch", daemon=True)
        self.owner, self.source = owner, source
        # One token per free slot. A C-level queue, not a threading.Semaphore: freeing a slot is
        # then a single call in the training thread, with no Python-level Condition to run.
        self.slots: "queue.SimpleQueue[None]" = queue.SimpleQueue()
        for _ in range(owner.depth):
            self.slots.put(None)
        # Batches the loop was handed, dropped here rather than in the training thread (see free_slot).
        self.retired: "list[Any]" = []
        self.ready: "queue.SimpleQueue[Any]" = queue.SimpleQueue()
        self.stopping = threading.Event()
        at_exit("prefetch", _stop_fetchers_at_exit)  # registered by the first prefetcher, not at import
        _running.add(self)

    def run(self) -> None:
        owner = self.owner
        try:
            while True:
                if not self._wait_for_slot():
                    return
                self.retired.clear()
                try:
                    batch = next(self.source)
                except StopIteration:
                    owner._loader_done = True
                    self.ready.put(_End(owner._loader_state(), owner._loader_stats()))
                    return
                self.ready.put(owner._to_device(batch))
        except BaseException as e:  # noqa: BLE001 - handed to the loop's next(), which re-raises it
            self.ready.put(_Failed(e))
        finally:
            # owner -> fetcher -> owner is a cycle: without this, a dropped prefetcher (its loader and
            # worker processes) lives until the cyclic gc, and workers forked meanwhile inherit it.
            self.source = self.owner = None
            self.retired.clear()

    def take(self) -> Any:
        while True:
            try:
                return self.ready.get(timeout=1.0)
            except queue.Empty:
                if not self.is_alive() and self.ready.empty():
                    raise RuntimeError("the prefetch thread stopped without a batch or an error; "
                                       "iterate the prefetcher again") from None

    def _wait_for_slot(self) -> bool:
        """Block until the loop frees a slot (True) or the thread is told to stop (False)."""
        try:
            self.slots.get_nowait()  # a slot is free (the loop is waiting for data): no wake-up to tame
        except queue.Empty:
            # The loop frees a slot in next(): woken then, this thread must not take the loop's CPU.
            with quiet_wakeup():
                while True:
                    try:
                        self.slots.get(timeout=self.POLL_S)
                        break
                    except queue.Empty:
                        if self.stopping.is_set():
                            return False
        return not self.stopping.is_set()

    def free_slot(self, handed: Any) -> None:
        """Let the thread fetch the next batch, and have it destroy ``handed`` (the loop's previous batch).

        The loop drops its previous batch when it takes the next one, in the training thread.
        Destroying a tensor releases the GIL there (PyTorch does so around every tensor's
        destructor), and a thread that is busy receiving a batch takes it for up to a switch
        interval (`sys.getswitchinterval`), so the loop waits for it (measured by
        `benchmarks/stall.py`). Holding one reference here moves the last drop, and its waits,
        to this thread, which clears the list before each fetch.
        """
        self.retired.append(handed)
        self.slots.put(None)

    def halt(self) -> None:
        """Stop after the fetch in progress (if any) and wait for the thread."""
        self.stopping.set()
        if self is not threading.current_thread():
            self.join()


class _PrefetchIter:
    def __init__(self, owner: DevicePrefetcher, fetcher: _Fetcher, generation: int):
        self.owner, self.fetcher, self.generation = owner, fetcher, generation
        self._ended = False
        self._handed: Any = None  # the batch the loop holds, retired to the thread at the next step

    def __iter__(self) -> "_PrefetchIter":
        return self

    def __next__(self) -> Any:
        owner = self.owner
        if owner._generation != self.generation:
            raise RuntimeError("this prefetch iterator is stale: iter() or load_state_dict() was called on the "
                               "prefetcher since; iterate the prefetcher again")
        if self._ended:
            raise StopIteration
        entered = owner.wait_clock.enter()
        item = self.fetcher.take()
        if isinstance(item, _Failed):
            self._ended = True
            raise item.error
        if isinstance(item, _End):
            self._ended = owner._consumer_done = True
            owner._handed_state, owner._handed_stats = item.state, item.stats
            raise StopIteration
        batch = owner._hand_over(item)
        self.fetcher.free_slot(self._handed)  # the thread fetches the next batch during this step
        self._handed = batch
        owner.wait_clock.leave(entered)
        return batch

    def __del__(self) -> None:
        # A loop that drops its iterator must not leave the thread holding the loader.
        if self.owner._generation == self.generation:
            self.fetcher.stopping.set()
