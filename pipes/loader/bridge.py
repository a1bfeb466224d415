"""The bridge from a node graph to `torchdata`'s `StatefulDataLoader`.

Mental model: the user (or a recipe) gives a *factory*, a picklable function
``factory(ctx: ShardContext) -> BaseNode`` that builds the graph of one shard.
`NodeDataset` (node_dataset.py) is an `IterableDataset` that calls it inside each
loader worker (or in the main process with ``num_workers=0``), so only the factory's
small arguments cross the process boundary. The dataset exposes
``state_dict``/``load_state_dict``, which `StatefulDataLoader` collects per
worker with every snapshot.

`TokenLoomLoader` wraps that state in an envelope: a format version, the
configuration that must match on resume (world size, workers, seq_len, batch
size, fingerprints of sources and tokenizer, ...), the round, and the
statistics the training loop has seen. ``load_state_dict`` compares the
configuration first and raises `ValueError` naming the setting that changed
(StatefulDataLoader alone fails a worker-count change with a bare
``AssertionError``).

Rounds: a finite stream (``epochs=n``) ends; the next ``iter(loader)`` starts
round ``r + 1``, whose epochs are ``n*(r+1) ...`` with fresh shuffles, as a
training loop's ``for epoch in ...: for batch in loader`` expects. A state saved
after a round finished resumes into the next round (not into an empty one, and
not into a repeat). Breaking out of a loop and calling ``iter()`` again restarts
the current round; keep one iterator to continue a stream.
"""

from __future__ import annotations

import copy
import logging
import time
import warnings
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence

from torchdata.stateful_dataloader import StatefulDataLoader

from . import envelope
from .config_check import TOPOLOGY, check_config
from ..compat.mp_queue import direct_context
from .elastic_entry import new_weights_between_snapshots, point_of, read_old_states
from .elastic import CARRY, apply_carry, build_shard, plan_shards, trimmed, worker_trees
from .envelope import (KEY_PREFIX, STATE_FORMAT, STATE_VERSION, decode_state,  # noqa: F401 (re-exported)
                       STATE_VERSIONS_READ, decode_with_digest, digest_of, encode_state, lineage_of)
from .fetch_ahead import FetchAhead
from .iteration import StatsIterator, WorkerInit, identity
from .fork_guard import picklable, unsafe_pools
from .stall import DEFAULT_STALL_TIMEOUT, StallWatch, check_stall_timeout
from .tally import Tally
from .wait_clock import WaitClock
from .node_dataset import GraphFactory, NodeDataset, ShardContext  # noqa: F401 (re-exported)
from ..compat.accelerate import AcceleratePrepared
from ..compat.torchdata import (IteratorHook, batches_ready, current_iterator, keep_for_shutdown, keep_snapshots_flat,
                                nested_snapshot, steps_since_snapshot)
from ..sources.first_fetches import wait_before_fork
from .wire import STATS_KEY
from .wire_ring import make_rings, uses_fork
from .worker_start import WORKER_START
from .worker_gc import no_collection_while_forking

log = logging.getLogger("tokenloom")


class TokenLoomLoader(AcceleratePrepared, IteratorHook, StatefulDataLoader):
    """A `StatefulDataLoader` over a `NodeDataset`, with a validated, versioned state.

    Batches are already formed by the graph (``batch_size=None`` underneath);
    ``config`` is the plain dict of settings a saved state must match, ``config_hints`` what to
    tell the user per setting when it differs and ``config_follows`` the settings derived from
    others (config_check.py); ``settings`` is what the loader was built from (a recipe's spec),
    for the commands that show it. ``stall_timeout``: with workers, the seconds without a batch after
    which the loop gets an error naming each worker's node and call, with their stacks (stall.py;
    None: wait for ever); a ``timeout=`` of the user's is the bound instead.
    """

    #: The state's layout (envelope.py, docs/state.md).
    META, LOADER, VERSION, FORMAT, CONFIG = envelope.META, envelope.LOADER, envelope.VERSION, envelope.FORMAT, \
        envelope.CONFIG
    ROUND, STATS, PADDING_BATCHES, STEPS, EARLIER = envelope.ROUND, envelope.STATS, envelope.PADDING_BATCHES, \
        envelope.STEPS, envelope.EARLIER
    PHASE, ELASTIC, ROUND_PADDING, LINEAGE = envelope.PHASE, envelope.ELASTIC, envelope.ROUND_PADDING, envelope.LINEAGE
    #: Where the current round stands (envelope.py).
    DATA, PADDING, OVER = envelope.DATA, envelope.PADDING, envelope.OVER
    #: Accelerate saves and loads this loader's own state_dict() with save_state/load_state, and
    #: keeps the loader as it is (compat/accelerate.py, tokenloom/integrations/accelerate.py).
    use_stateful_dataloader = True
    #: The loader's own keywords a recipe passes on from its caller (besides torch's DataLoader's).
    USER_KEYWORDS = ("stall_timeout",)
    def __init__(self, factory: GraphFactory, *, config: Mapping[str, Any], rank: int = 0, world_size: int = 1,
                 num_workers: int = 0, stats_keys: Sequence[str] = (), stats_min_keys: Sequence[str] = (),
                 stats_view: Optional[Callable[[Dict[str, int], int], Dict[str, Any]]] = None,
                 rank_sync: Optional[Any] = None, padding_batch: Optional[Callable[[], Any]] = None,
                 ring_bytes: Optional[int] = None, settings: Any = None,
                 config_hints: Optional[Mapping[str, str]] = None,
                 config_follows: Optional[Mapping[str, Any]] = None, config_absent: Optional[Mapping[str, Any]] = None,
                 stall_timeout: Optional[float] = DEFAULT_STALL_TIMEOUT, **loader_kwargs: Any):
        for bad in ("batch_size", "shuffle", "sampler", "batch_sampler", "collate_fn", "drop_last"):
            if bad in loader_kwargs:
                raise TypeError(f"{bad}= is decided by the node graph, not by the DataLoader; remove it")
        if num_workers < 0:
            raise ValueError(f"{num_workers=} must be >= 0")
        if loader_kwargs.get("in_order", True) is not True:
            # Batches would come in whichever order the workers finish them: no two runs alike,
            # and the saved position would not be the batch the loop last saw.
            raise ValueError(f"in_order={loader_kwargs['in_order']!r} is not supported: batches would arrive in the "
                             "order workers finish them, so runs differ and a resume is not exact; remove it "
                             "(tokenloom's workers keep batches ready, so a slow worker does not stall the loop)")
        if num_workers == 0:
            for opt in ("prefetch_factor", "persistent_workers"):
                if loader_kwargs.get(opt):
                    raise ValueError(f"{opt}= needs num_workers > 0 (got {num_workers=}); remove it or add workers")
                loader_kwargs.pop(opt, None)
        dataset = NodeDataset(factory, rank=rank, world_size=world_size, num_workers=num_workers)
        stall_timeout = check_stall_timeout(stall_timeout)
        #: Where workers dump their stacks when no batch comes in time (stall.py); None without workers.
        self.stall_watch: Optional[StallWatch] = None
        if num_workers > 0 and (stall_timeout is not None or loader_kwargs.get("timeout", 0) > 0):
            if not loader_kwargs.get("timeout", 0):
                loader_kwargs["timeout"] = stall_timeout
            self.stall_watch = StallWatch(float(loader_kwargs["timeout"]))
        # A start method of the user's is kept; tokenloom's default may move off fork (fork_guard.py).
        self._context_chosen = loader_kwargs.get("multiprocessing_context") is not None
        if num_workers > 0:
            loader_kwargs["worker_init_fn"] = WorkerInit(loader_kwargs.get("worker_init_fn"), self.stall_watch)
            # Same start method; its queues write a batch's small message without a feeder thread.
            loader_kwargs["multiprocessing_context"] = direct_context(loader_kwargs.get("multiprocessing_context"))
        with warnings.catch_warnings():
            # torchdata 0.11 calls a torch API that newer torch deprecates; not the user's concern.
            warnings.filterwarnings("ignore", message=".*set_vital.*")
            super().__init__(dataset, batch_size=None, num_workers=num_workers, collate_fn=identity,
                             **loader_kwargs)
        self.config = dict(config)
        self.settings = settings
        self.config_hints, self.config_follows = dict(config_hints or {}), dict(config_follows or {})
        self.config_absent = dict(config_absent or {})
        # The topology is part of every graph's configuration, a recipe's or one a user composed: a state
        # loaded on another one is refused naming it (torchdata alone fails with a bare AssertionError).
        for key, value in (("rank", rank), ("world_size", world_size), ("num_workers", num_workers)):
            self.config.setdefault(key, value)
        # Shared memory per worker for its batches (wire_ring.py); None: through the pipe only (also
        # where torchdata gives no hook for each new set of workers, compat/torchdata.py).
        self.ring_bytes = ring_bytes if num_workers > 0 and self.hooked() else None
        self.stats_keys = tuple(stats_keys)
        self.stats_view = stats_view
        self._tally = Tally(self.stats_keys, stats_min_keys)  # what the training loop saw (tally.py)
        self._steps = 0  # batches handed to the training loop in this round
        self._generation = 0  # bumped by iter() and load_state_dict(): older iterators refuse to continue
        self._phase = self.DATA
        # A state saved while this rank padded: the next iter() goes on padding (no workers
        # started) until every rank's data ended; its inner state is kept for state_dict().
        self._resume_padding = False
        self._padding_inner: Optional[Dict[str, Any]] = None
        if rank_sync is not None and padding_batch is None:
            raise ValueError("rank_sync= needs padding_batch= (what a rank yields after its data ran out)")
        self.rank_sync, self.padding_batch = rank_sync, padding_batch
        self._padding_batches = 0
        self._round_padding = 0  # padding batches of this round: the loop's step is _steps + this
        # The run's history: "" from the start; an elastic resume or a change of weights derives a
        # new one from what it continued, so states of different histories are not stitched together.
        self._lineage = ""
        # Set by iter() when a trainer's loop fetches batches ahead of its step (fetch_ahead.py).
        self._fetch_ahead: Optional[FetchAhead] = None
        self.wait_clock = WaitClock()  # how long the training loop waits in next() (wait_clock.py)
        self._rate_mark: Optional[tuple] = None  # (time, tokens delivered) at the last figures() call

    # --- iteration ---------------------------------------------------------------
    def __iter__(self) -> Iterator[Any]:
        """The round goes on from where the loop got to, by what the training loop saw:
        after a round ended (a ``StopIteration`` reached the loop) the next round; after a
        ``break`` or a peek, the current round from its start; after ``load_state_dict``,
        the loaded position. The same with and without persistent workers."""
        self._generation += 1
        self._fetch_ahead = FetchAhead.find()
        if self._resume_padding:
            self._resume_padding = False
            return StatsIterator(self, iter(()), padding=True)
        if self._phase == self.OVER:
            self.dataset.round += 1
            self._next_round()
        self._phase, self._padding_inner = self.DATA, None
        return StatsIterator(self, super().__iter__() if self.hooked() else self.start_iterator(super().__iter__))

    def start_iterator(self, make: Callable[[], Any]) -> Any:
        """``make()`` a new iterator (compat/torchdata.py's hook): its workers are forked in there, so
        their rings must exist first. Fresh rings for fresh workers, so the workers of an iterator
        still alive cannot write into the new ones."""
        self._guard_fork()
        if self.ring_bytes and uses_fork(self.multiprocessing_context):
            self.dataset.rings = make_rings(self.num_workers, self.ring_bytes)
        if self.num_workers > 0 and uses_fork(self.multiprocessing_context):
            # a clear error where a fork would leave the workers waiting for ever
            wait_before_fork(own=self.dataset.own_first_fetches())
            # torch's worker loop seeds numpy.random, which numpy 2 imports on first use: imported here
            # once, forked workers inherit it instead of each importing it (~10 ms a worker at start-up).
            import numpy.random  # noqa: F401
        self.dataset.armed = True
        try:
            if self.num_workers == 0:
                return keep_snapshots_flat(make())
            with WORKER_START, no_collection_while_forking():
                return keep_for_shutdown(keep_snapshots_flat(make()))
        finally:
            if self.num_workers > 0:
                self.dataset.armed = False  # its workers are forked: later forks are not tokenloom's

    def _guard_fork(self) -> None:
        """Start this iterator's workers with forkserver where a fork would copy a native thread pool
        of the training process that does not survive it (fork_guard.py); said once per loader."""
        if self.num_workers == 0 or self._context_chosen or not uses_fork(self.multiprocessing_context):
            return
        pools = unsafe_pools()
        if not pools:
            return
        if not picklable(self.dataset.factory):
            warnings.warn(f"the training process runs {', '.join(pools)}, which a forked loader worker may wait on "
                          "for ever, and the graph factory cannot be pickled for a worker started clean; workers are "
                          "forked anyway (stall_timeout reports a stuck one): make the factory picklable, or build "
                          "the loader before the training process uses that library", RuntimeWarning, stacklevel=3)
            return
        self.multiprocessing_context = direct_context("forkserver")
        log.warning("tokenloom: the training process runs %s, which a forked worker could wait on for ever: this "
                    "loader starts its workers with forkserver instead of fork (same batches; the first one waits "
                    "for the fork server to start). Build the loader before using that library to keep fork, or "
                    "pass multiprocessing_context= to choose.", ", ".join(pools))

    def see(self, batch: Any, count: bool = True) -> Any:
        if isinstance(batch, dict) and STATS_KEY in batch:
            counters = batch.pop(STATS_KEY)
            self._tally.see(counters.worker, counters.as_list())
        if count:
            batch = self.place_on_device(batch)
        if count:
            self._steps += 1
        return batch

    # --- what its iterator (iteration.py) tells it and asks -------------------------------------
    @property
    def generation(self) -> int:
        """Bumped by iter() and load_state_dict(): an iterator made before refuses to continue."""
        return self._generation

    @property
    def fetch_ahead(self) -> Optional[FetchAhead]:
        """Set when a trainer's loop fetches ahead of its step (fetch_ahead.py)."""
        return self._fetch_ahead

    def round_over(self) -> None:
        """The round reached the loop's end (a StopIteration): the next iter() starts the next round."""
        self._phase = self.OVER

    def data_over(self) -> None:
        """This rank's data ended; it pads until every rank's has (rank_sync)."""
        self._phase = self.PADDING

    def padding_step(self) -> Any:
        """A padding batch for the loop, counted."""
        self._padding_batches += 1
        self._round_padding += 1
        return self.place_on_device(self.padding_batch())

    def stats(self) -> Dict[str, Any]:
        """Cumulative counters over the batches this loader has handed to the training
        loop (summed over workers); checkpointed with the state. Recipes shape them
        (pretrain: packing figures plus per-source tokens, documents, epochs, target
        and share, passes and the round's progress); `tokenloom.pipes.stats.format_stats`
        prints them as a table. A view with ``takes_round = True`` also gets this round's
        counters (``current=``, for progress) and ``ended=`` (this rank's data ran out)."""
        now, totals = self._tally.current(), self._tally.totals()
        view = self.stats_view
        if view is None:
            out: Dict[str, Any] = totals
        elif getattr(view, "takes_round", False):
            out = view(totals, self._steps, current=dict(zip(self.stats_keys, now)), ended=self._phase != self.DATA)
        else:
            out = view(totals, self._steps)
        if self.rank_sync is not None:
            out["rank_padding_batches"] = self._padding_batches
        return out

    def figures(self, prefix: str = "data/") -> Dict[str, float]:
        """The figures a training run watches, flat, for a logger (TensorBoard's ``add_scalar`` per key,
        W&B's and Accelerate's ``log``, Lightning's ``log_dict`` take the dict as it is)::

            for step, batch in enumerate(loader):
                ...
                if step % 100 == 0:
                    wandb.log(loader.figures(), step=step)

        Keys (``prefix`` + ...): ``wait_ms``, ``wait_p99_ms`` (the time ``next()`` took, mean and p99
        over the last 100 steps), ``wait_share`` (of the loop's time, over the same steps: ~0 when the
        data keeps up, the loader's share of the time when it does not), ``wait_total_s``,
        ``first_batch_s`` (wait_clock.py); ``tokens_per_s`` (tokens delivered since the previous
        call, per second), ``padding``, ``discarded`` (shares of the rows' positions); per source
        ``share/<name>`` and ``target/<name>`` (delivered share of tokens, and the weight asked for);
        ``batches_ready`` (with workers: batches finished and not yet taken, at most ``num_workers *
        prefetch_factor``; near 0 while the loop waits means the workers are behind).
        Figures a recipe's statistics lack are left out."""
        out = {prefix + k: float(v) for k, v in self.wait_clock.figures().items()}
        it = current_iterator(self)
        ready = batches_ready(it) if it is not None and self.num_workers > 0 else None
        if ready is not None:
            out[prefix + "batches_ready"] = float(ready)
        stats = self.stats()
        delivered = stats.get("tokens_out")
        if isinstance(delivered, (int, float)):
            now = time.perf_counter()
            if self._rate_mark is not None and now > self._rate_mark[0]:
                out[prefix + "tokens_per_s"] = (delivered - self._rate_mark[1]) / (now - self._rate_mark[0])
            self._rate_mark = (now, delivered)
            positions = delivered + stats.get("padding", 0)
            for key in ("padding", "discarded"):
                if isinstance(stats.get(key), (int, float)) and positions:
                    out[prefix + key] = stats[key] / (positions + (stats["discarded"] if key == "discarded" else 0))
        for name, source in (stats.get("sources") or {}).items():
            for key in ("share", "target"):
                if isinstance(source, dict) and isinstance(source.get(key), (int, float)):
                    out[f"{prefix}{key}/{name}"] = float(source[key])
        return out

    def _next_round(self) -> None:
        self._tally.next_round()  # worker graphs restart their counters with every round
        self._steps = self._round_padding = 0
        self._phase, self._padding_inner = self.DATA, None
        if self.dataset.elastic is not None and int(self.dataset.elastic["round"]) < self.dataset.round:
            self.dataset.elastic = None  # an elastic resume's plan covers the round it happened in

    def worker_stats(self) -> Dict[str, List[int]]:
        """Per worker, the latest cumulative statistics vector seen by the training loop."""
        return copy.deepcopy(self._tally.per_worker)

    # --- state -------------------------------------------------------------------
    def state_dict(self) -> Dict[str, str]:
        """``{"tokenloom_rank_<rank>": <the state as JSON text>}``: one entry keyed by this
        loader's data rank, so the loader itself can go into ``torch.distributed.checkpoint``
        (see `encode_state`). `decode_state` gives the nested dict to look at.

        Iterated by a trainer's loop that fetches ahead of its step (Lightning's), the state is
        the one after the batch the step is on, not after the last batch fetched (fetch_ahead.py)."""
        if self._fetch_ahead is not None:
            return self._fetch_ahead.state(self.encoded_state)
        return self.encoded_state()

    def encoded_state(self) -> Dict[str, str]:
        return encode_state(self._state(), int(self.config.get("rank", 0)))

    def _state(self) -> Dict[str, Any]:
        state = {
            self.META: {
                self.FORMAT: STATE_FORMAT,
                self.VERSION: STATE_VERSION,
                self.CONFIG: dict(self.config),
                self.ROUND: int(self.dataset.round),
                self.STATS: copy.deepcopy(self._tally.per_worker),
                self.PADDING_BATCHES: self._padding_batches,
                self.ROUND_PADDING: self._round_padding,
                self.STEPS: self._steps,
                self.EARLIER: list(self._tally.earlier),
                self.PHASE: self._phase,
                self.LINEAGE: self._lineage,
            },
            self.LOADER: self._inner_state(),
        }
        meta = state[self.META]
        plan = self.dataset.elastic
        meta[self.ELASTIC] = plan if plan is None else trimmed(plan, state[self.LOADER], self.dataset.source_names())
        return state

    def _inner_state(self) -> Dict[str, Any]:
        if self._padding_inner is not None:
            return self._padding_inner
        if current_iterator(self) is None and self.next_iter_state is None:
            # Not started and nothing loaded: the start of the round. (StatefulDataLoader would
            # start the workers to ask them, which torch.distributed.checkpoint's load does
            # on a fresh loader: 130-290 ms with 2 workers, thrown away at the load.)
            return {}
        return nested_snapshot(super().state_dict())

    def _check_meta(self, meta: Mapping[str, Any], allow_weight_change: bool, topology: bool = True) -> None:
        if meta.get(self.FORMAT) != STATE_FORMAT or meta.get(self.VERSION) not in STATE_VERSIONS_READ:
            raise ValueError(
                f"loader state has format {meta.get(self.FORMAT)!r} version {meta.get(self.VERSION)!r}; this tokenloom "
                f"reads {STATE_FORMAT!r} versions {', '.join(map(str, STATE_VERSIONS_READ))}. Resume with the "
                "tokenloom version that saved it."
            )
        ignore = (("weights",) if allow_weight_change else ()) + (() if topology else TOPOLOGY)
        check_config(meta[self.CONFIG], self.config, ignore=ignore, hints=self.config_hints,
                     follows=self.config_follows, absent=self.config_absent)
        self._tally.check(meta[self.STATS], meta[self.EARLIER])

    def load_state_dict(self, state_dict: Any, *, allow_weight_change: bool = False) -> None:
        """Continue from ``state_dict``, what ``state_dict()`` returned (or its `decode_state`):
        the exact next batch. Or, for a run that changes shape, from the list of every old
        rank's state (any world size and ``num_workers``; see elastic.py): every document of
        the interrupted epoch exactly once."""
        if isinstance(state_dict, (list, tuple)):
            return self._load_elastic(list(state_dict), allow_weight_change)
        state_dict = decode_state(state_dict)
        meta = state_dict[self.META]
        self._generation += 1
        self._fetch_ahead = None
        self._check_meta(meta, allow_weight_change)
        inner = state_dict[self.LOADER]
        reweighted = allow_weight_change and meta[self.CONFIG].get("weights") != self.config.get("weights")
        if reweighted and meta[self.PHASE] == self.DATA and inner and steps_since_snapshot(inner):
            # torchdata would replay the batches since the snapshot under the new weights
            raise new_weights_between_snapshots("this state", steps_since_snapshot(inner),
                                                f"snapshot_every_n_steps={self.snapshot_every_n_steps}")
        self._tally.restore(meta[self.STATS], meta[self.EARLIER])
        self._padding_batches = int(meta[self.PADDING_BATCHES])
        self._round_padding = int(meta[self.ROUND_PADDING])
        self._steps = int(meta[self.STEPS])
        phase = meta[self.PHASE]
        if phase not in (self.DATA, self.PADDING, self.OVER):
            raise ValueError(f"loader state has {phase=}; expected one of {[self.DATA, self.PADDING, self.OVER]}")
        self._resume_padding, self._padding_inner = False, None
        self._lineage = str(meta[self.LINEAGE])
        if reweighted:
            # The loop's step (batches with data plus padding): the same on every rank, where the
            # batches with data alone differ at a finite epoch's end.
            self._lineage = lineage_of(self._lineage, "weights", self.config.get("weights"), meta[self.ROUND],
                                       int(meta[self.STEPS]) + int(meta[self.ROUND_PADDING]))
        self.dataset.elastic = meta[self.ELASTIC]
        if phase == self.OVER:
            # Saved after a round ran to its end: resume with the next round (meta-pytorch/data#1437).
            self.dataset.round = int(meta[self.ROUND]) + 1
            self._next_round()
            super().load_state_dict({})
        elif phase == self.PADDING:
            # This rank's data had ended but not every rank's: go on padding, in this round.
            self.dataset.round = int(meta[self.ROUND])
            self._phase, self._resume_padding, self._padding_inner = self.PADDING, True, inner
            super().load_state_dict({})
        else:
            self.dataset.round = int(meta[self.ROUND])
            self._phase = self.DATA
            super().load_state_dict(inner)
            self.dataset.fetch_first(worker_trees(inner) if inner else {})


    def _load_elastic(self, states: List[Any], allow_weight_change: bool) -> None:
        """Continue a run saved on another topology from every old rank's state (elastic.py)."""
        if not states:
            raise ValueError("load_state_dict([]): an elastic resume needs the state of every old rank; got none")
        factory = self.dataset.factory
        pairs = [decode_with_digest(s) for s in states]
        decoded = [d for d, _ in pairs]
        # The digests each state's check computed, for the new history's id (a nested state: computed here).
        digests = {id(d): digest if digest is not None else digest_of(d[self.META], d[self.LOADER]) for d, digest in pairs}
        metas = [d[self.META] for d in decoded]
        for meta in metas:
            self._check_meta(meta, allow_weight_change, topology=False)
        old_world, old_workers, round_, steps, phases = point_of(metas)
        rank, world = int(self.config["rank"]), int(self.config["world_size"])
        if (old_world, old_workers) == (world, self.num_workers):
            # The same topology: each rank's own state, exactly (bitwise) as a single dict.
            own = next(d for d in decoded if int(d[self.META][self.CONFIG]["rank"]) == rank)
            return self.load_state_dict(own, allow_weight_change=allow_weight_change)
        self.dataset.source_names()  # refuses a graph that cannot continue here, naming the node, before any change
        self._generation += 1
        self._fetch_ahead = None
        self._lineage = lineage_of(*[digests[id(d)]
                                     for d in sorted(decoded, key=lambda d: int(d[self.META][self.CONFIG]["rank"]))],
                                   world, self.num_workers, self.config.get("weights"))
        workers = max(self.num_workers, 1)
        self._tally.share_of([(m[self.STATS], m[self.EARLIER]) for m in metas], rank, world, phases == {self.OVER})
        self._steps, self._padding_batches = 0 if phases == {self.OVER} else steps, 0
        self._round_padding = 0
        self._resume_padding, self._padding_inner, self._phase = False, None, self.DATA
        if phases == {self.OVER}:
            self.dataset.round, self.dataset.elastic = round_ + 1, None
        else:
            ranked = sorted(decoded, key=lambda d: int(d[self.META][self.CONFIG]["rank"]))
            reweighted = allow_weight_change and any(m[self.CONFIG].get("weights") != self.config.get("weights")
                                                     for m in metas)
            old = read_old_states(self.dataset, ranked, round_, old_world, old_workers, reweighted,
                                  self.multiprocessing_context)
            epochs = self.config.get("epochs")
            plans = plan_shards(old, self.dataset.source_names(), new_shards=range(rank * workers, (rank + 1) * workers),
                                num_new=world * workers, step=steps, round_=round_,
                                last_epoch=None if epochs is None else (round_ + 1) * epochs - 1)
            self.dataset.round = round_
            self.dataset.elastic = {"round": round_, "shards": {str(g - rank * workers): p for g, p in plans.items()}}
            for w in range(workers):
                # What each new worker's counters start from, so stats() continues before its first batch.
                root = build_shard(factory, ShardContext(rank, world, w, self.num_workers, round_, plans[rank * workers + w]))
                root.reset(None)
                apply_carry(root, plans[rank * workers + w][CARRY])
                if self.stats_keys:  # a graph that reports statistics (WithStats at its root, as the recipes')
                    self._tally.see(w, [int(x) for x in root.counters()])
            self.dataset.fetch_first({})
        super().load_state_dict({})
