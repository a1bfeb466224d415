"""The elastic check of `tokenloom.verify`: a state saved on W ranks x N workers and loaded on W' x N'
delivers every token of the epoch exactly once, counted as a training loop receives the batches.

Ranks run as threads of this process, kept in step by a `ThreadSync` as torch.distributed keeps real
ranks: every rank takes the same number of steps, and one whose data ran out gets padding batches.
The old ranks run the whole epoch uninterrupted, and what they deliver is the reference; every rank's
state at step ``k`` is the checkpoint. Each new rank loads the list of all of them (shuffled, as a
checkpoint gathered from many ranks comes) and runs to the epoch's end. What the old ranks delivered
in their first ``k`` steps plus all the new ranks delivered must equal the reference as a multiset of
token ids.

What `Tally` counts, from each batch as the loop gets it:

- every input where ``segment_ids > 0``;
- each row's last token, which the row holds only as its last label: counted when that label is a
  token, that is neither -100 nor the end label (the label after a document's last input, learned
  from the labels at document ends inside rows: the BOS id or -100);
- where labels are masked (sft: -100 on inputs that are not trained, seen inside segments), a row-end
  label of -100 may hide a token. Those slots are counted as unknown, and the two multisets may differ
  by at most them (the report says how many there were).

With a BOS, its count is the number of documents started, so the document boundaries are checked
with the tokens.

The check holds for a stream that delivers every document a fixed number of times whatever the
topology: a finite one (``epochs``) with one source, or several with ``cycle_exhausted=False``, packed
``flat`` or ``bestfit`` (``bestfit-crop`` discards tokens where rows happen to fall, so what it keeps
depends on the topology).
"""

from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

import numpy as np

from .testing import torch_roundtrip

__all__ = ["RankRun", "Tally", "Topology", "check_elastic", "run_ranks", "source_counts"]

#: ``(world_size, num_workers)``.
Topology = Tuple[int, int]
IGNORE = -100


@dataclass
class RankRun:
    """What one simulated rank's loop received: its batches, the state saved after ``save_at`` of them
    (None when no save was asked for), and its ``stats()`` at the end."""

    batches: List[Any]
    saved: Any
    stats: Dict[str, Any]


def run_ranks(build: Callable[..., Any], topology: Topology, *, save_at: Optional[int] = None,
              states: Optional[Sequence[Any]] = None, seed: int = 0, timeout: float = 600) -> List[RankRun]:
    """Build ``world_size`` loaders with ``build(rank=, world_size=, num_workers=, rank_sync=)``, load
    ``states`` (the list of all old ranks' states) into each when given, and run every rank in its own
    thread to the end of the stream. A rank that raises releases the others and its error is raised;
    ranks still running after ``timeout`` seconds are a `TimeoutError` (an epoch that never ends)."""
    from tokenloom.pipes.loader.rank_sync import ThreadSync

    world_size, num_workers = topology
    sync = ThreadSync(world_size)
    loaders = []
    for r in range(world_size):
        loader = build(rank=r, world_size=world_size, num_workers=num_workers, rank_sync=sync)
        if states is not None:
            order = [torch_roundtrip(s) for s in states]
            random.Random(seed * 101 + r).shuffle(order)
            loader.load_state_dict(order)
        loaders.append(loader)
    # Workers fork here, from this thread, not from the rank threads.
    iterators = [iter(loader) for loader in loaders]
    out: Dict[int, RankRun] = {}
    errors: Dict[int, BaseException] = {}
    deadline = time.monotonic() + timeout

    def drive(r: int) -> None:
        loader, it = loaders[r], iterators[r]
        try:
            batches: List[Any] = []
            saved = torch_roundtrip(loader.state_dict()) if save_at == 0 else None
            for batch in it:
                batches.append(batch)
                if save_at is not None and len(batches) == save_at:
                    saved = torch_roundtrip(loader.state_dict())
                if time.monotonic() > deadline:
                    raise TimeoutError(f"rank {r} of {world_size} still took steps after {timeout:.0f} s "
                                       f"({len(batches)} steps): an epoch that never ends, or a very slow one")
            out[r] = RankRun(batches, saved, loader.stats())
        except BaseException as e:  # noqa: BLE001 - raised below, after the other ranks are released
            errors[r] = e
            sync.abort()

    threads = [threading.Thread(target=drive, args=(r,), daemon=True) for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(max(deadline - time.monotonic(), 0) + 5)
    if errors:
        first = min(errors, key=lambda r: isinstance(errors[r], threading.BrokenBarrierError))
        raise errors[first]
    if len(out) < world_size:
        raise TimeoutError(f"ranks {sorted(set(range(world_size)) - set(out))} of {world_size} gave no batch "
                           f"for the last of {timeout:.0f} s: a step that never returns")
    return [out[r] for r in range(world_size)]


@dataclass
class Tally:
    """Token ids a training loop received (module docstring): inputs at once, row-end labels kept
    until `counts` knows the end label and whether labels are masked."""

    inputs: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    row_ends: List[np.ndarray] = field(default_factory=list)
    end_labels: Set[int] = field(default_factory=set)
    masked: bool = False

    def add(self, batch: Dict[str, Any]) -> None:
        inp, lab = batch["input_ids"].cpu().numpy(), batch["labels"].cpu().numpy()
        seg = batch["segment_ids"].cpu().numpy()
        real = seg > 0
        self.inputs = _add_counts(self.inputs, inp[real])
        same = seg[:, 1:] == seg[:, :-1]
        ends = real[:, :-1] & ~same
        if ends.any():
            self.end_labels.update(int(v) for v in np.unique(lab[:, :-1][ends]))
        if not self.masked:
            self.masked = bool((lab[:, :-1][real[:, :-1] & same] == IGNORE).any())
        self.row_ends.append(lab[real[:, -1], -1])

    def counts(self, end_labels: Set[int], masked: bool) -> Tuple[np.ndarray, int]:
        """(count per token id, row-end slots whose token is unknown)."""
        last = np.concatenate(self.row_ends) if self.row_ends else np.zeros(0, np.int64)
        tokens = last[(last >= 0) & ~np.isin(last, sorted(end_labels))]
        unknown = int((last == IGNORE).sum()) if masked else 0
        return _add_counts(self.inputs.copy(), tokens), unknown


def _add_counts(counts: np.ndarray, ids: np.ndarray) -> np.ndarray:
    if ids.size == 0:
        return counts
    new = np.bincount(ids.ravel(), minlength=len(counts))
    if len(counts) < len(new):
        counts = np.concatenate([counts, np.zeros(len(new) - len(counts), np.int64)])
    counts[: len(new)] += new
    return counts


def _tally(runs: Sequence[Sequence[Any]]) -> Tally:
    t = Tally()
    for batches in runs:
        for b in batches:
            t.add(b)
    return t


def source_counts(stats: Dict[str, Any]) -> Dict[str, Tuple[int, int]]:
    """Per source in a loader's ``stats()``, the tokens delivered and the passes finished (empty for a
    loader whose statistics have no sources)."""
    return {name: (s["tokens"], int(s.get("epochs") or 0)) for name, s in (stats.get("sources") or {}).items()
            if isinstance(s, dict) and isinstance(s.get("tokens"), int)}


def _source_tokens(runs: Sequence[RankRun]) -> Dict[str, int]:
    """Tokens per source summed over the ranks' final ``stats()`` (an elastic resume carries the
    old ranks' totals, so the new ranks' sum covers the whole epoch)."""
    out: Dict[str, int] = {}
    for run in runs:
        for name, (tokens, _) in source_counts(run.stats).items():
            out[name] = out.get(name, 0) + tokens
    return out


def check_elastic(build: Callable[..., Any], old: Topology, new: Topology, *, at: float, seed: int = 0,
                  decode: Optional[Callable[[List[int]], str]] = None, timeout: float = 600) -> Tuple[bool, str]:
    """Run ``old`` uninterrupted to the epoch's end, save every rank at the step a fraction ``at`` of
    the way through it, resume the list of states on ``new`` and compare what was delivered (module
    docstring). Returns (held, what it found: the figures, or the first thing that differs)."""
    first = run_ranks(build, old, timeout=timeout)
    length = len(first[0].batches)
    if length < 2:
        return False, f"the old ranks' epoch is {length} step(s): too short to save in the middle of it"
    k = min(max(1, round(at * length)), length - 1)
    # The old ranks again, to step k, for the states; the loop received their first k batches.
    saving = run_ranks(build, old, save_at=k, timeout=timeout)
    after = run_ranks(build, new, states=[r.saved for r in saving], seed=seed, timeout=timeout)
    where = f"saved at step {k} of {length}"
    reference = _tally([r.batches for r in first])
    got = _tally([r.batches[:k] for r in saving] + [r.batches for r in after])
    ends = reference.end_labels | got.end_labels
    masked = reference.masked or got.masked
    want, want_unknown = reference.counts(ends, masked)
    have, have_unknown = got.counts(ends, masked)
    size = max(len(want), len(have))
    want, have = np.pad(want, (0, size - len(want))), np.pad(have, (0, size - len(have)))
    missing, extra = int(np.maximum(want - have, 0).sum()), int(np.maximum(have - want, 0).sum())
    total = int(want.sum())
    if missing <= have_unknown and extra <= want_unknown:
        note = f"{where}: all {total} tokens exactly once"
        if want_unknown or have_unknown:
            note += f" (give or take {max(want_unknown, have_unknown)} row-end tokens the loop sees only as untrained labels)"
        return True, note
    ids = np.nonzero(want != have)[0]
    worst = ids[np.argsort(-np.abs(want[ids] - have[ids]), kind="stable")][:5]
    shown = ", ".join(f"{int(i)}{_text(decode, int(i))}: {int(have[i])} instead of {int(want[i])}" for i in worst)
    message = (f"{where}: {missing} of the epoch's {total} tokens missing and {extra} delivered more often than "
               f"in the uninterrupted run; most different (token id: delivered): {shown}")
    ref_sources, new_sources = _source_tokens(first), _source_tokens(after)
    differ = [n for n in ref_sources if new_sources.get(n) != ref_sources[n]]
    if differ:
        message += "; by source (tokens at the end, stats()): " + ", ".join(
            f"{n!r} {new_sources.get(n)} instead of {ref_sources[n]}" for n in differ)
    elif ref_sources:
        message += ("; every source's tokens in stats() agree with the uninterrupted run: the loader counted as "
                    "delivered what the loop did not receive")
    return False, message


def _text(decode: Optional[Callable[[List[int]], str]], token: int) -> str:
    if decode is None:
        return ""
    try:
        return f" {decode([token])!r}"
    except Exception:  # noqa: BLE001 - an id the decoder does not know is shown without its text
        return ""
