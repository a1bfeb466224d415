"""Mix several tokenized sources into one stream, by weight or by pattern.

Strategies (which source gives the next document):

- ``"interleave"`` (default): deterministic weighted interleave. Pick the source
  furthest below its share, ``argmax_i(w_i * total - count_i)``, counting tokens
  (``unit="tokens"``) or documents. Shares are exact up to one document at every
  point of the stream: the lowest variance a mixture can have.
- ``"random"``: seeded weighted random. By documents, source ``i`` has probability
  ``w_i``; by tokens, ``w_i / mean_len_i`` with each source's mean document length
  estimated as it streams, so the expected token share is ``w_i``. Random numbers
  come in seeded blocks of 1024 per (seed, shard, block): the state is a counter.
- ``"round_robin"``: one document from each source in turn.
- ``"sequential"``: each source to its end, then the next (needs a stop rule).
- ``"alternating"``: a ``pattern`` of source names, ``burst`` documents per entry.

Stop rules, with each source's documents counted in passes (epochs) from
``first_epoch``; a source is *exhausted* once it has delivered ``passes`` passes,
or once its branch ends (raises ``StopIteration``: a finite branch, its passes done):

- ``"never"`` (default): sources cycle forever; a finite branch drops out when it
  ends, and the stream ends when every branch has;
- ``"first_exhausted"``: the stream ends when any source is exhausted;
- ``"all_exhausted"``: the stream ends when every source is; meanwhile exhausted
  sources keep cycling (``cycle_exhausted=True``, the weights hold) or drop out.

A child may hand out a long document in pieces (pieces.py): a piece counts its own tokens
and only the first counts as a document; once a piece is out, the document's next pieces
come before the stream ends, and even when its source can no longer be picked.

A child is an endless stream (the mixer decides when to stop, by the epoch each
document carries; the document that shows a source has finished its passes is not
emitted) or a finite one, which ends after its passes. What the mixer is not told it
learns from the graph it is given (pipes/graph.py): each branch's sharder (the
``SHARD`` role: ``first_epoch``, ``epochs``, ``shard``) gives the source's
``first_epoch`` and ``passes`` (its ``epochs``; 1 when endless) and the random
strategy's ``shard``; ``cycle_exhausted`` is True unless a branch is finite, which
cannot cycle (asking it to under ``"all_exhausted"`` is refused, naming the source).
So ``Mix(branches, weights=...)`` over finite sharders (``epochs=n``) delivers every
document of their ``n`` passes once, on any topology an elastic resume moves it to.
Weights may follow a schedule over training steps (see `schedule`). State: each child's state under its name, per-source token and
document counts, the pick counter, and the strategy's cursor.

Cost in the number of sources ``n``: a node's state changes only in ``reset`` and ``next``
(pipes/base.py), so the mixer keeps each child's last state and takes again only those of the
children it pulled since (a packer takes the mixer's state about once a row, so re-taking all
``n`` would cost ``n`` Python calls a row); its state shares the unchanged children's state
objects with the previous one (states are never modified in place). The interleave choice is
one numpy pass over ``n`` values per pick, with the sums it needs kept as the counts change.
A packer that keeps the mixer's state at every checkpoint takes it with `state_later`: a journal
of the sources pulled since the previous take (mix_journal.py), rebuilt into the state only when
read. Nodes that keep something per source (a packer's save point) ask `pulled_since` which
sources were pulled since they last looked. Measured by benchmarks/sources.py.
"""

from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from .base import Node
from .graph import sharders_of
from .items import TokenDoc
from .mix_journal import MixJournal
from .roles import MIX
from .schedule import StepClock, Weights, normalize_schedule
from .shard import rng_for
from .state_later import Later

STRATEGIES = ("interleave", "random", "round_robin", "sequential", "alternating")
STOPS = ("never", "first_exhausted", "all_exhausted")
UNITS = ("tokens", "documents")
MIX_TAG = 0x313
_BLOCK = 1024
#: Prior mean document length (tokens) for the random strategy before a source has been seen.
PRIOR_TOKENS = 256.0


class Mix(Node[TokenDoc]):
    """One stream from several tokenized sources, by the strategy and stop rule of the module docstring.

    Args:
        children: ``{name: node}``, each a stream of `TokenDoc`, endless or finite (the order is the mix's order).
        weights: ``{name: weight}`` or a schedule ``[(step, {name: weight}), ...]`` (needs ``clock``).
        strategy: ``"interleave"``, ``"random"``, ``"round_robin"``, ``"sequential"`` or ``"alternating"``.
        unit: count shares in ``"tokens"`` or ``"documents"``.
        stop: ``"never"``, ``"first_exhausted"`` or ``"all_exhausted"``; ``passes`` make a source exhausted.
        cycle_exhausted: under ``"all_exhausted"``, exhausted sources keep cycling (else they drop out);
            None: True unless a branch is finite.
        passes: the passes that exhaust a source; None: per source, its sharder's ``epochs`` (1: endless).
        first_epoch: the epoch the first pass of every source carries; None: per source, its sharder's.
        pattern, burst: ``"alternating"``'s source names and documents per entry.
        seed, shard: the random strategy's stream, derived from both; ``shard`` None: the first sharder's
            (0 without one).
        clock: the `StepClock` a weights schedule reads (shared with the batcher).

    State keys: ``CHILDREN`` (each child's state, by name), per source ``TOKENS`` and ``DOCUMENTS``
    counted, ``PASSES`` completed and ``EXHAUSTED``; ``PICKS`` (the random strategy's counter),
    ``CURSOR`` (round robin, sequential, alternating), ``ENDED``, the weights era (``ERA``,
    ``ERA_BASE``: counts when the current weights began) and ``MIDWAY`` (per source, a document
    handed out in part, in pieces).
    """

    ROLE = MIX
    CHILDREN = "children"
    TOKENS = "tokens"
    DOCUMENTS = "documents"
    PASSES = "passes"
    EXHAUSTED = "exhausted"
    PICKS = "picks"
    CURSOR = "cursor"
    ENDED = "ended"
    ERA = "era"
    ERA_BASE = "era_base"
    MIDWAY = "midway"  # per source: a document handed out in part, in pieces (pieces.py)
    STATE_KEYS = (CHILDREN, TOKENS, DOCUMENTS, PASSES, EXHAUSTED, PICKS, CURSOR, ENDED, ERA, ERA_BASE, MIDWAY)
    #: `state_later` starts a new journal after this many takes, or as many as there are sources if more.
    JOURNAL_MIN = 16

    def __init__(self, children: Mapping[str, Node[TokenDoc]], *, weights: Optional[Weights] = None,
                 strategy: str = "interleave", unit: str = "tokens", stop: str = "never",
                 cycle_exhausted: Optional[bool] = None, passes: Optional[int] = None,
                 first_epoch: Optional[int] = None, pattern: Optional[Sequence[str]] = None, burst: int = 1,
                 seed: int = 0, shard: Optional[int] = None, clock: Optional[StepClock] = None):
        super().__init__(*children.values())
        if not children:
            raise ValueError("Mix needs at least one source")
        for name, value, allowed in (("strategy", strategy, STRATEGIES), ("stop", stop, STOPS), ("unit", unit, UNITS)):
            if value not in allowed:
                raise ValueError(f"{name}={value!r} is not one of {allowed}")
        self.names = list(children)
        self.children = [children[n] for n in self.names]
        self.schedule = normalize_schedule(weights, self.names)
        if len(self.schedule) > 1 and clock is None:
            raise ValueError("a weights schedule needs a StepClock shared with the batcher (the recipes wire it)")
        if passes is not None and passes < 1:
            raise ValueError(f"{passes=} must be >= 1 (or None: each source's sharder's epochs)")
        sharders = [next(iter(sharders_of(c)), None) for c in self.children]
        finite = [s is not None and s.epochs is not None for s in sharders]
        if cycle_exhausted is None:
            cycle_exhausted = not any(finite)
        elif cycle_exhausted and stop == "all_exhausted" and any(finite):
            name = self.names[finite.index(True)]
            raise ValueError(f"Mix: source {name!r} reads a sharder with epochs={sharders[finite.index(True)].epochs}, "
                             "so its branch ends after its passes and cannot cycle, but cycle_exhausted=True under "
                             "stop='all_exhausted'; pass cycle_exhausted=False (or leave it out), or give that "
                             "source's ShardUnits epochs=None and the mixer passes=")
        if strategy == "sequential" and (stop == "never" and not all(finite)
                                         or cycle_exhausted and stop == "all_exhausted"):
            raise ValueError("strategy='sequential' moves on when a source is exhausted: pass stop='all_exhausted' "
                             "with cycle_exhausted=False, or stop='first_exhausted', or give every source's "
                             "ShardUnits epochs=n")
        if strategy == "alternating":
            if not pattern:
                raise ValueError("strategy='alternating' needs pattern=[source names ...]")
            bad = [p for p in pattern if p not in self.names]
            if bad:
                raise ValueError(f"pattern names unknown sources {bad}; the sources are {self.names}")
            self.pattern = [self.names.index(p) for p in pattern]
        else:
            self.pattern = []
        if burst < 1:
            raise ValueError(f"{burst=} must be >= 1")
        self.strategy, self.unit, self.stop, self.cycle_exhausted = strategy, unit, stop, cycle_exhausted
        # Per source: the epoch its first pass carries, and the passes that exhaust it.
        self.first_epochs = [first_epoch if first_epoch is not None else s.first_epoch if s is not None else 0
                             for s in sharders]
        self.passes = [passes if passes is not None else s.epochs if f else 1 for s, f in zip(sharders, finite)]
        if shard is None:
            shard = next((s.shard for s in sharders if s is not None), 0)
        self.burst, self.seed, self.shard = burst, seed, shard
        self.clock = clock
        self._cycling = stop == "all_exhausted" and cycle_exhausted
        self._block_id = -1
        self._block: Optional[np.ndarray] = None
        self._watchers: List[set] = []
        self._static_shares = [self.schedule[0][1][n] for n in self.names]
        self._choice_key: Any = None  # what the choice's cached arrays were made for (_choice_arrays)
        # state_later's journal (mix_journal.py), the sources pulled since its last take, and whether a change
        # touched every source since (the next take is then a full state)
        self._journal: Optional[MixJournal] = None
        self._journal_moved: set = set()
        self._journal_full = True
        self._fresh()

    def _fresh(self) -> None:
        n = len(self.names)
        self._tokens = [0] * n
        self._docs = [0] * n
        self._passes = [0] * n
        self._exhausted = [False] * n
        self._picks = 0
        self._cursor = 0
        self._ended = False
        self._era = -1
        self._era_base = [0] * n  # the counted unit at the start of the current era
        self._midway = [0] * n  # 1: a document handed out in part (as the state saves it)
        self._after_load()

    def _after_load(self) -> None:
        """Derive what the choice keeps beside the counters (they were just set or loaded)."""
        counts = self._tokens if self.unit == "tokens" else self._docs
        # per source: the counted unit since the current era began (the interleave's lag)
        self._lag = np.array(counts, np.int64) - np.array(self._era_base, np.int64)
        self._lag_total = int(self._lag.sum())  # kept as the lags change: a numpy call fewer a pick
        self._midway_at = {i for i, m in enumerate(self._midway) if m}
        self._exhausted_changes = getattr(self, "_exhausted_changes", 0) + 1
        self._forget_states()

    def _forget_states(self) -> None:
        """After a reset: no child state is known, and every watcher must look at every source."""
        self._kid_states: Dict[str, Any] = dict.fromkeys(self.names)  # the order the state lists them in
        self._stale = set(range(len(self.names)))  # children pulled since their state was last taken
        self._journal_full = True
        for seen in self._watchers:
            seen.update(range(len(self.names)))

    def reset(self, initial_state: Optional[Dict[str, Any]] = None) -> None:
        if initial_state is None:
            self._fresh()
            for c in self.children:
                c.reset(None)
            return
        kids = initial_state[self.CHILDREN]
        if sorted(kids) != sorted(self.names):
            raise ValueError(f"Mix: saved state has sources {sorted(kids)}, this mixer has {sorted(self.names)}")
        for name, c in zip(self.names, self.children):
            c.reset(kids[name])
        self._tokens = [int(x) for x in initial_state[self.TOKENS]]
        self._docs = [int(x) for x in initial_state[self.DOCUMENTS]]
        self._passes = [int(x) for x in initial_state[self.PASSES]]
        self._exhausted = [bool(x) for x in initial_state[self.EXHAUSTED]]
        self._picks = int(initial_state[self.PICKS])
        self._cursor = int(initial_state[self.CURSOR])
        self._ended = bool(initial_state[self.ENDED])
        self._era = int(initial_state[self.ERA])
        self._era_base = [int(x) for x in initial_state[self.ERA_BASE]]
        self._midway = [1 if x else 0 for x in initial_state[self.MIDWAY]]
        self._after_load()

    # --- who moved -------------------------------------------------------------------
    def pulled_since(self) -> set:
        """A set this mixer adds a source's index to whenever it pulls that source's child (or
        resets): the caller empties it when it has looked. Filled with every index at first."""
        seen = set(range(len(self.names)))
        self._watchers.append(seen)
        return seen

    def _pulled(self, i: int) -> None:
        self._stale.add(i)
        self._journal_moved.add(i)
        for seen in self._watchers:
            seen.add(i)

    # --- choosing a source ---------------------------------------------------------
    def _shares(self) -> List[float]:
        if self.clock is None:
            return self._static_shares
        era = self.clock.era_for_pick(self._picks, self.schedule, self.names)
        if era != self._era:
            # Shares are kept from the start of each era, so a change of weights does not
            # set off a burst to repay the previous era's mixture.
            self._era = era
            self._era_base = list(self._tokens if self.unit == "tokens" else self._docs)
            self._lag[:] = 0
            self._lag_total = 0
            self._journal_full = True  # every source's era base changed
        return self.clock.eras[era][1]

    def _choice_arrays(self, shares: Optional[List[float]]) -> Tuple[np.ndarray, np.ndarray, float, frozenset]:
        """For the current shares and exhausted sources: which sources can be picked (a mask), their
        shares over the mass of those (the interleave's ratio), that mass, and the sources that
        cannot be picked. Made again only when the shares or an exhausted flag change."""
        key = (shares, self._exhausted_changes)
        if self._choice_key is None or self._choice_key[0] is not shares or self._choice_key[1] != key[1]:
            n = len(self.names)
            if shares is None:
                usable = [self._participates(i) and self._eligible(i) for i in range(n)]
            else:
                usable = [shares[i] > 0 and self._eligible(i) for i in range(n)]
            mass = 0.0
            for i in range(n):  # in order, as a running sum: the float the choice always divided by
                if usable[i]:
                    mass += shares[i] if shares is not None else 0.0
            mask = np.array(usable, bool)
            ratio = np.array(shares, np.float64) / mass if shares is not None and mass else np.zeros(n)
            blocked = frozenset(i for i in range(n) if not usable[i])
            self._choice_key = key
            self._choice = (mask, ratio, mass, blocked)
        return self._choice

    def _uniform(self) -> float:
        block, i = divmod(self._picks, _BLOCK)
        if block != self._block_id:
            self._block = rng_for(self.seed, MIX_TAG, self.shard, block).random(_BLOCK)
            self._block_id = block
        return float(self._block[i])

    def _participates(self, i: int) -> bool:
        """Can source i be picked at all? (Not if it has no weight now, or is not in the pattern.)
        Only those count for "all exhausted", or a never-picked source would keep the stream open."""
        if self.strategy in ("interleave", "random"):
            return self._shares()[i] > 0
        if self.strategy == "alternating":
            return i in self.pattern
        return True

    def _eligible(self, i: int) -> bool:
        return not self._exhausted[i] or self._cycling

    def _choose(self, shares: Optional[List[float]] = None) -> int:
        """The next source's index (-1: none can be picked). ``shares``: `_shares` for this pick,
        when the caller has them already."""
        n = len(self.names)
        if self.strategy == "interleave":
            # The most under-served source since the era began: argmax(share / mass * total - lag), ties
            # to the first; shares renormalised over the sources that can still be picked. One numpy
            # pass: the same float operations, in the same order, as a loop over the sources.
            mask, ratio, mass, blocked = self._choice_arrays(self._shares() if shares is None else shares)
            if mass == 0:
                return -1
            lag = self._lag
            if not blocked:  # every source usable: the same values, two numpy calls fewer a pick
                return int((ratio * float(self._lag_total) - lag).argmax())
            total = float(lag[mask].sum())  # an exact int sum, as the running float sum of ints was
            return int(np.where(mask, ratio * total - lag, -np.inf).argmax())
        if self.strategy == "random":
            if shares is None:
                shares = self._shares()
            mask, _, _, _ = self._choice_arrays(shares)
            active = np.flatnonzero(mask)
            if not len(active):
                return -1
            shares = np.array(shares, np.float64)[active]
            if self.unit == "tokens":
                tokens = np.array(self._tokens, np.float64)[active]
                docs = np.array(self._docs, np.float64)[active]
                rates = shares / ((tokens + PRIOR_TOKENS) / (docs + 1))
            else:
                rates = shares
            acc = np.cumsum(rates)  # sequential, as a running sum is
            u = self._uniform() * float(acc[-1])
            k = int(np.searchsorted(acc, u, side="right"))  # the first running sum above u
            return int(active[min(k, len(active) - 1)])
        if self.strategy == "round_robin":
            for k in range(n):
                i = (self._cursor + k) % n
                if self._eligible(i):
                    self._cursor = i + 1
                    return i
            return -1
        if self.strategy == "sequential":
            while self._cursor < n and not self._eligible(self._cursor):
                self._cursor += 1
            return self._cursor if self._cursor < n else -1
        # alternating: pattern entry (cursor // burst) % len(pattern), skipping exhausted sources
        for _ in range(len(self.pattern) * self.burst):
            i = self.pattern[(self._cursor // self.burst) % len(self.pattern)]
            self._cursor += 1
            if self._eligible(i):
                return i
        return -1

    # --- the node ------------------------------------------------------------------
    def _set_midway(self, i: int, more: Any) -> None:
        self._midway[i] = 1 if more else 0
        if more:
            self._midway_at.add(i)
        else:
            self._midway_at.discard(i)

    def _exhaust(self, i: int) -> None:
        self._exhausted[i] = True
        self._exhausted_changes += 1

    def _go_on(self, i: int) -> TokenDoc:
        """The next piece of the document source ``i`` handed out in part."""
        self._pulled(i)
        doc = self.children[i].next()
        self._set_midway(i, getattr(doc, "more", False))
        n = len(doc.ids) - doc.used
        self._tokens[i] += n
        if self.unit == "tokens":
            self._lag[i] += n
            self._lag_total += n
        return doc

    def next(self) -> TokenDoc:
        shares = None  # this pick's shares, once looked up (the first choice below uses them)
        if self._midway_at:
            # A document handed out in part is finished even when its source can no longer be
            # picked (a weight gone to 0, the stream stopped): its packer slot waits for the rest.
            if self._ended:
                return self._go_on(min(self._midway_at))
            shares = self._shares() if self.strategy in ("interleave", "random") else None
            stuck = self._midway_at & self._choice_arrays(shares)[3]
            if stuck:
                return self._go_on(min(stuck))
        while not self._ended:
            i = self._choose(shares)
            shares = None  # a retry is another pick, or the same after a source dropped out
            if i < 0:
                self._ended = True
                break
            self._pulled(i)
            try:
                doc = self.children[i].next()
            except StopIteration:
                if self._branch_ended(i):
                    break
                continue
            self._picks += 1
            passes = doc.epoch - self.first_epochs[i]
            if passes > self._passes[i]:
                self._passes[i] = passes
            if self.stop != "never" and passes >= self.passes[i]:
                # This document opens a pass beyond the limit: the source is exhausted.
                self._exhaust(i)
                if self.stop == "first_exhausted" or all(
                        self._exhausted[j] or not self._participates(j) for j in range(len(self.names))):
                    self._ended = True
                    break
                if not self.cycle_exhausted:
                    continue  # it belongs to the next pass; the source drops out
            # used > 0: delivered in part before an elastic resume, and counted then
            used = getattr(doc, "used", 0)
            if self.unit == "tokens" or isinstance(doc, TokenDoc):
                self._tokens[i] += len(doc.ids) - used
            self._docs[i] += used == 0
            lag = (len(doc.ids) - used) if self.unit == "tokens" else int(used == 0)
            self._lag[i] += lag
            self._lag_total += lag
            self._set_midway(i, getattr(doc, "more", False))  # a piece: its document goes on (pieces.py)
            return doc
        if self._midway_at:
            return self._go_on(min(self._midway_at))
        raise StopIteration

    def _branch_ended(self, i: int) -> bool:
        """Source ``i``'s branch has ended (a finite one, its passes done): it is exhausted and drops out.
        Whether the stream ends with it."""
        if self._cycling:
            raise ValueError(f"Mix: the branch of source {self.names[i]!r} ended (StopIteration) under "
                             "stop='all_exhausted' with cycle_exhausted=True, which cycles an exhausted source: a "
                             "finite branch cannot. Pass cycle_exhausted=False, or make the branch endless")
        self._exhaust(i)
        if self.stop == "first_exhausted":
            self._ended = True
        return self._ended

    def get_state(self) -> Dict[str, Any]:
        kids = self._kid_states
        if self._stale:
            names, children = self.names, self.children
            for i in self._stale:
                kids[names[i]] = children[i].state_dict()
            self._stale.clear()
        return {
            self.CHILDREN: dict(kids),  # in the mixer's order: the keys were made in it (_forget_states)
            self.TOKENS: list(self._tokens), self.DOCUMENTS: list(self._docs), self.PASSES: list(self._passes),
            self.EXHAUSTED: list(self._exhausted), self.PICKS: self._picks, self.CURSOR: self._cursor,
            self.ENDED: self._ended, self.ERA: self._era, self.ERA_BASE: list(self._era_base),
            self.MIDWAY: list(self._midway),
        }

    def state_later(self) -> Later:
        """This mixer's state as it stands now, to be read later (pipes/state_later.py; a packer's
        checkpoints): the sources pulled since the previous take, added to a journal of changes to a
        full state (mix_journal.py), so a take costs what was pulled, not the number of sources. A
        full state after a change that touched every source, and every ``max(JOURNAL_MIN, sources)``
        takes. Its ``state()`` equals, value for value, what `state_dict` gives now."""
        journal = self._journal
        if journal is None or self._journal_full or len(journal.entries) >= max(self.JOURNAL_MIN, len(self.names)):
            self._journal_moved.clear()
            self._journal_full = False
            lists = (self.TOKENS, self.DOCUMENTS, self.PASSES, self.EXHAUSTED, self.MIDWAY)  # the counters' order
            self._journal = journal = MixJournal(self.state_dict(), self.CHILDREN, lists,
                                                 (self.PICKS, self.CURSOR, self.ENDED, self.ERA))
            return journal.first()
        kids, names, children, stale = self._kid_states, self.names, self.children, self._stale
        changes = []
        for i in self._journal_moved:
            name = names[i]
            if i in stale:  # as get_state takes it, and keeps it for the next get_state
                kids[name] = children[i].state_dict()
                stale.discard(i)
            changes.append((i, name, kids[name], (self._tokens[i], self._docs[i], self._passes[i],
                                                  self._exhausted[i], self._midway[i])))
        self._journal_moved.clear()
        return journal.add((self._picks, self._cursor, self._ended, self._era), changes)

    def get_state_counters(self) -> Dict[str, Any]:
        """The counters an elastic resume carries over (elastic.py), per source in order."""
        return {"tokens": list(self._tokens), "documents": list(self._docs), "passes": list(self._passes),
                "exhausted": list(self._exhausted), "era_base": list(self._era_base)}

    def carry_counters(self, carry: Mapping[str, Any]) -> None:
        """Continue from an elastic resume's share of the old shards' counters: the shares of
        the current era are counted from ``era_base`` as before the resume."""
        self._tokens = [int(x) for x in carry["tokens"]]
        self._docs = [int(x) for x in carry["documents"]]
        self._passes = [int(x) for x in carry["passes"]]
        self._exhausted = [bool(x) for x in carry["exhausted"]]
        self._era_base = [int(x) for x in carry["era_base"]]
        self._after_load()
        if self.clock is not None:
            step = self.clock.step
            due = max(i for i, (s, _) in enumerate(self.schedule) if s <= step)
            self.clock.eras = [(0, [self.schedule[due][1][n] for n in self.names])]
            self._era = 0

    def passes_started(self) -> List[int]:
        """Per source in the mixer's order: the passes started (``source_stats``'s ``epochs``)."""
        return list(self._passes)

    def source_stats(self) -> Dict[str, Dict[str, int]]:
        """Per source: tokens and documents handed downstream, and passes started."""
        return {n: {"tokens": self._tokens[i], "documents": self._docs[i], "epochs": self._passes[i]}
                for i, n in enumerate(self.names)}

    def targets(self) -> Dict[str, float]:
        """The shares in force for the latest pick."""
        if self.clock is None or not self.clock.eras:
            return dict(self.schedule[0][1])
        return dict(zip(self.names, self.clock.eras[-1][1]))
