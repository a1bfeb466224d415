"""Mixture weights, fixed or changing at training steps, and the clock that tells steps.

``weights`` is ``{name: w}`` or a schedule ``[(step, {name: w}), ...]`` whose first
breakpoint is step 0 and whose steps increase. A *step* is the index of the batch
the training loop receives on this rank, counted from the start of the stream
(with ``N`` loader workers, worker ``w`` produces batches ``w, w+N, w+2N, ...``, so
each worker knows the step of every batch it builds).

The mixer picks documents before the packer's buffer, so a switch at step ``k``
takes effect in batches a buffer's worth later (the delay is bounded by the
packer's delay bound). `StepClock` is shared by the batcher, which advances and
checkpoints it, and the mixer, which records at which pick each breakpoint took
effect. A restore replays the mixer from an older position while the batcher is
already further on; the recorded picks make the replayed picks use the weights
they used the first time, so resuming between a switch and its effect is exact.
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

Weights = Union[Mapping[str, float], Sequence[Tuple[int, Mapping[str, float]]]]


def _check_one(weights: Mapping[str, float], names: Sequence[str], where: str) -> Dict[str, float]:
    if not isinstance(weights, Mapping):
        raise ValueError(f"{where} must be a dict {{name: weight}}, got {type(weights).__name__}")
    unknown = sorted(set(weights) - set(names))
    if unknown:
        raise ValueError(f"{where} name unknown sources {unknown}; the sources are {sorted(names)}")
    missing = sorted(set(names) - set(weights))
    if missing:
        raise ValueError(f"{where} miss sources {missing}; give every source a weight (0 to leave it out)")
    out = {}
    for name in names:
        w = weights[name]
        try:
            w = float(w)
        except (TypeError, ValueError):
            raise ValueError(f"{where}: weight for {name!r} is {w!r}, not a number") from None
        if math.isnan(w) or math.isinf(w) or w < 0:
            raise ValueError(f"{where}: weight for {name!r} is {w!r}; weights must be finite and >= 0")
        out[name] = w
    total = sum(out.values())
    if total <= 0:
        raise ValueError(f"{where}: all weights are zero ({dict(weights)}); at least one source needs a weight > 0")
    return {k: v / total for k, v in out.items()}


def normalize_schedule(weights: Optional[Weights], names: Sequence[str]) -> List[Tuple[int, Dict[str, float]]]:
    """Validate and normalise to ``[(step, {name: share}), ...]`` (shares sum to 1).
    ``None`` means equal weights."""
    if weights is None:
        return [(0, {n: 1.0 / len(names) for n in names})]
    if isinstance(weights, Mapping):
        return [(0, _check_one(weights, names, "weights"))]
    try:
        points = [(step, w) for step, w in weights]
    except (TypeError, ValueError):
        raise ValueError("weights must be {name: weight} or a list of (step, {name: weight}) breakpoints") from None
    if not points:
        raise ValueError("the weights schedule is empty; give at least (0, {name: weight})")
    out = []
    for i, (step, w) in enumerate(points):
        if not isinstance(step, int) or step < 0:
            raise ValueError(f"weights schedule entry {i}: {step=} must be an int >= 0")
        if i == 0 and step != 0:
            raise ValueError(f"weights schedule must start at step 0, it starts at {step=}")
        if i and step <= out[-1][0]:
            raise ValueError(f"weights schedule entry {i}: steps must increase ({out[-1][0]} then {step})")
        out.append((step, _check_one(w, names, f"weights at step {step}")))
    return out


class StepClock:
    """The batcher's step count, and the weights the mixer actually used from which pick on.

    Every change of weights (a schedule breakpoint reached, or a loader rebuilt with
    new weights and loaded with ``allow_weight_change=True``) is recorded as an *era*:
    ``(first pick, shares)``. Picks below ``picks`` are replays after a restore and
    use the recorded era; new picks use the schedule at the current step. The state
    is checkpointed by the batcher (see the module docstring)."""

    BATCHES = "batches"
    PICKS = "picks"
    ERAS = "eras"
    STATE_KEYS = (BATCHES, PICKS, ERAS)

    def __init__(self, worker: int = 0, num_workers: int = 1, base: int = 0):
        # base: the loop's step when this layout started (an elastic resume, see elastic.py)
        self.worker, self.num_workers, self.base = worker, max(num_workers, 1), base
        self.batches = 0  # batches this worker has completed
        self.picks = 0  # picks the mixer has made: the replay horizon
        self.eras: List[Tuple[int, List[float]]] = []
        self._due_step = -1  # the schedule lookup is cached per step: it runs once per document
        self._due: Any = None  # (breakpoint, schedule) the last era was checked against

    @property
    def step(self) -> int:
        """The step of the batch being built now."""
        return self.base + self.worker + self.num_workers * self.batches

    def era_for_pick(self, pick: int, schedule: List[Tuple[int, Dict[str, float]]], names: Sequence[str]) -> int:
        """The index of the era governing pick number ``pick``, recording a new era when a
        new pick finds the schedule's weights changed."""
        if pick >= self.picks:
            step = self.step
            if step != self._due_step or not self.eras:
                self._due_step = step
                due = max(i for i, (s, _) in enumerate(schedule) if s <= step)
                if self._due != (due, id(schedule)) or not self.eras:
                    # once a breakpoint, not once a step: a list per source
                    shares = [schedule[due][1][n] for n in names]
                    self._due = (due, id(schedule))
                    if not self.eras or self.eras[-1][1] != shares:
                        self.eras.append((pick, shares))
            self.picks = pick + 1
            return len(self.eras) - 1
        era = 0
        for k, (first, _) in enumerate(self.eras):
            if first <= pick:
                era = k
            else:
                break
        return era

    def state(self) -> Dict[str, Any]:
        return {self.BATCHES: self.batches, self.PICKS: self.picks,
                self.ERAS: [[first, list(shares)] for first, shares in self.eras]}

    def load(self, state: Optional[Dict[str, Any]]) -> None:
        self._due_step, self._due = -1, None
        if state is None:
            self.batches, self.picks, self.eras = 0, 0, []
            return
        if set(state) != set(self.STATE_KEYS):
            raise ValueError(f"step clock state has keys {sorted(state)}, expected {list(self.STATE_KEYS)}")
        self.batches = int(state[self.BATCHES])
        self.picks = int(state[self.PICKS])
        self.eras = [(int(first), [float(x) for x in shares]) for first, shares in state[self.ERAS]]
