"""Prove the resume on your own setup: `verify` runs your loader (a recipe's, or ``TokenLoomLoader``
over your graph) the way a training job that is interrupted runs it, and says whether every resume
gives the batches of the uninterrupted run, bit for bit, or where the first one differs.

The checks, on the loader ``build()`` makes (a fresh one each time, as a new process would):

1. the reference: ``steps`` batches of an uninterrupted run (fewer if the stream ends first);
2. determinism: a second run gives the same first batches (else nothing can resume exactly);
3. resume at save points: step 0, step 1, the last step, and ``points`` more drawn with ``seed``;
   at each, a loader runs to the step, saves (``state_dict``, through ``torch.save``/``torch.load``),
   and a fresh loader loads the state and must give the rest of the reference;
4. a chained resume: a state saved right after a load (before any batch) resumes again, exactly;
5. with ``fresh_process``, a state resumed in a new process (``tokenloom verify`` does it with
   ``tokenloom run --resume``).

The report names, for the first difference of each failing check, the step, the batch key, the row
and the position in it, and what usually causes it. Same topology only: a resume on another number
of workers or ranks is checked by the project's oracle (tests/oracle.py), not here.

    from tokenloom.verify import verify

    report = verify(lambda: pretrain("data/*.parquet", tokenizer="tokenizer.json", num_workers=2),
                    steps=60)
    print(report)          # one line per check, and the first difference of each that failed
    assert report.ok
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, List, Optional, Sequence

import torch

from .testing import items_equal, torch_roundtrip

__all__ = ["Check", "Report", "verify"]

#: What usually makes a resume differ, as the report words it.
CAUSES = ("a node whose state misses something it changes (a counter, a buffer, a random generator), or "
          "a step that is not deterministic (an unseeded random, the order of a set or of files); "
          "tokenloom.testing.check_node_resume on each node of yours finds which")


@dataclass
class Check:
    """One check: its name, whether it held, and where it first did not."""

    name: str
    ok: bool
    where: str = ""

    def __str__(self) -> str:
        return f"{'ok  ' if self.ok else 'FAIL'} {self.name}" + ("" if self.ok else f": {self.where}")


@dataclass
class Report:
    """Every check `verify` ran; ``ok`` when all held."""

    batches: int
    checks: List[Check] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)

    def __str__(self) -> str:
        head = (f"tokenloom verify: {len(self.checks)} checks over {self.batches} batches: "
                + ("every resume gives the uninterrupted run's batches" if self.ok else
                   f"{sum(not c.ok for c in self.checks)} failed"))
        tail = [] if self.ok else [f"usual causes: {CAUSES}"]
        return "\n".join([head] + [str(c) for c in self.checks] + tail)


def _take(it: Iterator[Any], n: int) -> List[Any]:
    out = []
    for batch in it:
        out.append(batch)
        if len(out) >= n:
            break
    return out


def first_difference(want: Any, got: Any) -> str:
    """Where two batches first differ: the key, then the row and the position of a tensor."""
    if isinstance(want, dict) and isinstance(got, dict):
        if want.keys() != got.keys():
            return f"keys {sorted(got)} instead of {sorted(want)}"
        for key in want:
            if not items_equal(want[key], got[key]):
                return f"{key!r}: {first_difference(want[key], got[key])}"
        return "equal"
    if isinstance(want, torch.Tensor) and isinstance(got, torch.Tensor):
        if want.shape != got.shape or want.dtype != got.dtype:
            return f"shape {tuple(got.shape)} {got.dtype} instead of {tuple(want.shape)} {want.dtype}"
        at = (want != got).nonzero()
        if len(at) == 0:
            return "equal"
        index = tuple(int(i) for i in at[0])
        row = f"row {index[0]}" + (f", position {index[1]}" if len(index) > 1 else "")
        return f"{row}: {got[index].item()} instead of {want[index].item()}"
    return f"{got!r:.80} instead of {want!r:.80}"


def _compare(name: str, want: Sequence[Any], got: Sequence[Any], first_step: int) -> Check:
    for j, (w, g) in enumerate(zip(want, got)):
        if not items_equal(w, g):
            return Check(name, False, f"batch at step {first_step + j} differs: {first_difference(w, g)}")
    if len(got) != len(want):
        return Check(name, False, f"{len(got)} batches after step {first_step}, the uninterrupted run had {len(want)}")
    return Check(name, True)


def verify(build: Callable[[], Any], *, steps: int = 60, points: int = 3, seed: int = 0, chain: bool = True,
           progress: Optional[Callable[[str], None]] = None,
           fresh_process: Optional[Callable[[Any, int], List[Any]]] = None) -> Report:
    """Check that ``build()``'s loader resumes exactly (module docstring) and return the `Report`.

    Args:
        build: makes a fresh loader, the same one each call (a recipe call, or ``TokenLoomLoader(...)``).
        steps: batches of the reference run (>= 2; a finite stream may end before).
        points: save points drawn with ``seed`` beside steps 0, 1 and the last.
        chain: also resume a state saved right after a load.
        progress: called with a line as each check starts (e.g. ``print``).
        fresh_process: ``fresh_process(state, count)`` loads ``state`` into a loader built in a new
            process and returns its next ``count`` batches (``tokenloom verify`` runs ``tokenloom run
            --resume``); when given, the state saved at the middle save point is also resumed there."""
    if steps < 2:
        raise ValueError(f"verify(steps={steps}): give at least 2 batches")
    say = progress or (lambda line: None)
    say(f"reference: {steps} batches")
    reference = _take(iter(build()), steps)
    n = len(reference)
    report = Report(n)
    say("determinism: a second run")
    again = _take(iter(build()), n)
    report.checks.append(_compare("a second run gives the same batches", reference, again, 0))
    if not report.checks[-1].ok:
        return report  # nothing resumes exactly from a stream that is not the same twice
    rng = random.Random(seed)
    chosen = sorted({0, min(1, n - 1), n - 1} | {rng.randrange(n) for _ in range(points)})
    for k in chosen:
        say(f"resume at step {k}")
        report.checks.append(_guarded(f"resume at step {k}", lambda: _resume_at(build, reference, k)))
    if fresh_process is not None:
        k = chosen[len(chosen) // 2]
        say(f"resume at step {k} in a fresh process")
        report.checks.append(_guarded(f"resume at step {k} in a fresh process",
                                      lambda: _in_fresh_process(build, reference, k, fresh_process)))
    if chain:
        k = chosen[len(chosen) // 2]
        say(f"chained resume at step {k}")
        report.checks.append(_guarded(f"resume of a state saved right after a load (step {k})",
                                      lambda: _chained(build, reference, k)))
    return report


def _guarded(name: str, run: Callable[[], Check]) -> Check:
    """``run()``; an error while it saves, loads or iterates fails the check, naming the error (a
    state that does not restore can make a node raise rather than differ)."""
    try:
        return run()
    except Exception as e:  # noqa: BLE001 - reported, not hidden: the check fails with it
        return Check(name, False, f"raised {type(e).__name__}: {e}")


def _state_at(build: Callable[[], Any], k: int) -> Any:
    """The state of a fresh loader after ``k`` batches."""
    loader = build()
    it = iter(loader)
    if k:
        _take(it, k)
    return loader.state_dict()


def _resume_at(build: Callable[[], Any], reference: List[Any], k: int) -> Check:
    state = torch_roundtrip(_state_at(build, k))
    resumed = build()
    resumed.load_state_dict(state)
    return _rest(f"resume at step {k}", resumed, reference, k)


def _rest(name: str, resumed: Any, reference: List[Any], k: int) -> Check:
    """Compare what ``resumed`` gives with the reference from step ``k``; an error names its step."""
    got: List[Any] = []
    try:
        for batch in iter(resumed):
            got.append(batch)
            if len(got) >= len(reference) - k:
                break
    except Exception as e:  # noqa: BLE001 - the step it failed at is what the user needs
        return Check(name, False, f"raised {type(e).__name__} at step {k + len(got)}: {e}")
    return _compare(name, reference[k:], got, k)


def _in_fresh_process(build: Callable[[], Any], reference: List[Any], k: int,
                      fresh_process: Callable[[Any, int], List[Any]]) -> Check:
    got = fresh_process(_state_at(build, k), len(reference) - k)
    return _compare(f"resume at step {k} in a fresh process", reference[k:], got, k)


def _chained(build: Callable[[], Any], reference: List[Any], k: int) -> Check:
    first = torch_roundtrip(_state_at(build, k))
    middle = build()
    middle.load_state_dict(first)
    second = torch_roundtrip(middle.state_dict())  # saved right after the load, before any batch
    del middle
    last = build()
    last.load_state_dict(second)
    return _rest(f"resume of a state saved right after a load (step {k})", last, reference, k)
