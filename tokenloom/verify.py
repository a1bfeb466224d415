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
   ``tokenloom run --resume``);
6. with ``elastic``, states saved on W ranks x N workers resumed on W' x N' (ranks as threads of
   this process): every token of the epoch exactly once, counted as the loop receives them
   (tokenloom/verify_elastic.py; needs a finite stream that delivers every document a fixed number
   of times).

The report names, for the first difference of each failing check, the step, the batch key, the row
and the position in it, the segment it falls in (its first tokens, decoded with ``decode``), the
sources whose delivered tokens (``stats()``) differ by then, and what usually causes it.

    from tokenloom.verify import verify

    report = verify(lambda: pretrain("data/*.parquet", tokenizer="tokenizer.json", num_workers=2),
                    steps=60)
    print(report)          # one line per check, and the first difference of each that failed
    assert report.ok

    # another topology: build takes the topology's keywords, the stream is finite
    report = verify(lambda **topology: pretrain({"web": "web/*.parquet", "code": "code/*.parquet"},
                                                 tokenizer="tokenizer.json", epochs=1, cycle_exhausted=False,
                                                 **topology),
                    steps=10**9, elastic=[((1, 2), (2, 1))])
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from .testing import items_equal, torch_roundtrip
from .verify_elastic import Topology, check_elastic, source_counts

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
    where: str = ""  # a failed check: where it first differed; one that held: what it counted, if anything

    def __str__(self) -> str:
        return f"{'ok  ' if self.ok else 'FAIL'} {self.name}" + (f": {self.where}" if self.where else "")


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


#: ``tick(batches done, tokens done, batches expected or None)``, after each batch of a check.
Tick = Callable[[int, int, Optional[int]], None]


def _tokens_in(batch: Any) -> int:
    """The tokens of a packed batch (``segment_ids > 0``), for a progress display; 0 for another."""
    seg = batch.get("segment_ids") if isinstance(batch, dict) else None
    return int((seg > 0).sum()) if isinstance(seg, torch.Tensor) else 0


def _take(it: Iterator[Any], n: int, loader: Any = None, sources: Optional[List[Dict[str, Tuple[int, int]]]] = None,
          tick: Optional[Tick] = None, total: Optional[int] = None) -> List[Any]:
    """The next ``n`` batches of ``it`` (fewer if it ends); with ``sources``, the tokens per source of
    ``loader.stats()`` after each of them are appended to it."""
    out, tokens = [], 0
    for batch in it:
        out.append(batch)
        if sources is not None:
            sources.append(_source_tokens(loader))
        if tick is not None:
            tokens += _tokens_in(batch)
            tick(len(out), tokens, total)
        if len(out) >= n:
            break
    return out


def _source_tokens(loader: Any) -> Dict[str, Tuple[int, int]]:
    """Per source, the tokens delivered and the passes finished so far, from ``loader.stats()``
    (empty when it has no sources)."""
    return source_counts(loader.stats() if hasattr(loader, "stats") else {})


def first_difference(want: Any, got: Any, decode: Optional[Callable[[List[int]], str]] = None) -> str:
    """Where two batches first differ: the key, then the row and the position of a tensor, and for a
    packed batch the segment (document, or chunk of one) the uninterrupted run had there."""
    if isinstance(want, dict) and isinstance(got, dict):
        if want.keys() != got.keys():
            return f"keys {sorted(got)} instead of {sorted(want)}"
        for key in want:
            if not items_equal(want[key], got[key]):
                where = f"{key!r}: {first_difference(want[key], got[key])}"
                return where + _segment(want, want[key], got[key], decode)
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


def _segment(batch: Dict[str, Any], want: Any, got: Any, decode: Optional[Callable[[List[int]], str]]) -> str:
    """``"; in the uninterrupted run's segment ..."``: the segment of ``batch`` at the first position
    where ``want`` and ``got`` differ (a 2-d tensor of the batch's shape), or "" when there is none."""
    seg, inp = batch.get("segment_ids"), batch.get("input_ids")
    if not (isinstance(want, torch.Tensor) and isinstance(seg, torch.Tensor) and isinstance(inp, torch.Tensor)
            and want.shape == got.shape == seg.shape == inp.shape and want.dim() == 2):
        return ""
    row, pos = (int(i) for i in (want != got).nonzero()[0])
    s = int(seg[row, pos])
    if s == 0:
        return "; the uninterrupted run had padding there"
    at = (seg[row] == s).nonzero().flatten()
    tokens = inp[row, at].tolist()
    text = ""
    if decode is not None:
        try:
            text = f", beginning {decode(tokens[:16])!r}"
        except Exception:  # noqa: BLE001 - ids the decoder does not know are still shown as ids
            text = ""
    return (f"; in the uninterrupted run's segment {s} of row {row} (positions {int(at[0])}-{int(at[-1])}, "
            f"a document or a chunk of one{text}; ids {tokens[:8]})")


def _compare(name: str, want: Sequence[Any], got: Sequence[Any], first_step: int,
             want_sources: Optional[List[Dict[str, Tuple[int, int]]]] = None, got_sources: Optional[List[Dict[str, Tuple[int, int]]]] = None,
             decode: Optional[Callable[[List[int]], str]] = None) -> Check:
    for j, (w, g) in enumerate(zip(want, got)):
        if not items_equal(w, g):
            where = f"batch at step {first_step + j} differs: {first_difference(w, g, decode)}"
            if want_sources is not None and got_sources is not None and j < len(got_sources):
                w_src, g_src = want_sources[first_step + j], got_sources[j]
                differ = [n for n in w_src if g_src.get(n, (None,))[0] != w_src[n][0]]
                where += ("; sources whose tokens differ after that batch (stats()): " + ", ".join(
                    f"{n!r} {g_src.get(n, (None,))[0]} instead of {w_src[n][0]}" for n in differ)) if differ else (
                    "; every source delivered as many tokens as in the uninterrupted run by then (stats())")
            return Check(name, False, where)
    if len(got) != len(want):
        return Check(name, False, f"{len(got)} batches after step {first_step}, the uninterrupted run had {len(want)}")
    return Check(name, True)


def verify(build: Callable[..., Any], *, steps: int = 60, points: int = 3, seed: int = 0, chain: bool = True,
           progress: Optional[Callable[[str], None]] = None,
           fresh_process: Optional[Callable[[Any, int], List[Any]]] = None,
           elastic: Sequence[Tuple[Topology, Topology]] = (),
           decode: Optional[Callable[[List[int]], str]] = None, timeout: float = 600,
           tick: Optional[Tick] = None) -> Report:
    """Check that ``build()``'s loader resumes exactly (module docstring) and return the `Report`.

    Args:
        build: makes a fresh loader, the same one each call (a recipe call, or ``TokenLoomLoader(...)``);
            with ``elastic``, it also takes the keywords ``rank``, ``world_size``, ``num_workers`` and
            ``rank_sync`` (a recipe's, passed on: ``lambda **topology: pretrain(..., **topology)``).
        steps: batches of the reference run (>= 2; a finite stream may end before: ``10**9`` runs it whole).
        points: save points drawn with ``seed`` beside steps 0, 1, the last and, when a source finishes a
            pass within the reference, the step right after.
        chain: also resume a state saved right after a load.
        progress: called with a line as each check starts (e.g. ``print``).
        fresh_process: ``fresh_process(state, count)`` loads ``state`` into a loader built in a new
            process and returns its next ``count`` batches (``tokenloom verify`` runs ``tokenloom run
            --resume``); when given, the state saved at the middle save point is also resumed there.
        elastic: pairs ``((W, N), (W2, N2))`` of (world size, workers): states saved on the first topology,
            at a step drawn with ``seed``, resumed on the second; the stream must be finite and deliver each
            document a fixed number of times (one source, or ``cycle_exhausted=False``; not ``bestfit-crop``).
        decode: token ids -> text, to show the segment where a batch differs (``tokenizer.decode``).
        timeout: seconds an elastic run of ranks may take before it fails as a hang.
        tick: called after each batch of the reference, the second run and the resumes with the batches
            and tokens done in that check and the batches it expects (None: not known), for a progress bar
            (``tokenloom verify`` draws one per check)."""
    if steps < 2:
        raise ValueError(f"verify(steps={steps}): give at least 2 batches")
    say = progress or (lambda line: None)
    say(f"reference: {'the whole stream' if steps >= 10**9 else f'{steps} batches'}")
    loader = build()
    sources: List[Dict[str, Tuple[int, int]]] = [_source_tokens(loader)]
    reference = _take(iter(loader), steps, loader, sources, tick=tick, total=None if steps >= 10**9 else steps)
    del loader
    n = len(reference)
    report = Report(n)
    say("determinism: a second run")
    again = _take(iter(build()), n, tick=tick, total=n)
    report.checks.append(_compare("a second run gives the same batches", reference, again, 0, decode=decode))
    if not report.checks[-1].ok:
        return report  # nothing resumes exactly from a stream that is not the same twice
    rng = random.Random(seed)
    chosen = {0, min(1, n - 1), n - 1} | {rng.randrange(n) for _ in range(points)}
    passes = [sum(p for _, p in s.values()) for s in sources]
    after_pass = next((k for k in range(1, n) if passes[k] > passes[k - 1]), None)
    if after_pass is not None and after_pass < n - 1:
        chosen.add(after_pass)
    for k in sorted(chosen):
        label = f"resume at step {k}" + (" (right after a source finished a pass)" if k == after_pass else "")
        say(label)
        report.checks.append(_guarded(label, lambda: _resume_at(label, build, reference, sources, k, decode, tick)))
    middle = sorted(chosen)[len(chosen) // 2]
    if fresh_process is not None:
        say(f"resume at step {middle} in a fresh process")
        report.checks.append(_guarded(f"resume at step {middle} in a fresh process",
                                      lambda: _in_fresh_process(build, reference, middle, fresh_process, decode)))
    if chain:
        say(f"chained resume at step {middle}")
        report.checks.append(_guarded(f"resume of a state saved right after a load (step {middle})",
                                      lambda: _chained(build, reference, sources, middle, decode, tick)))
    for old, new in elastic:
        name = f"elastic: saved on {old[0]} rank(s) x {old[1]} worker(s), resumed on {new[0]} x {new[1]}"
        at = rng.uniform(0.2, 0.8)
        say(name)
        report.checks.append(_guarded(name, lambda: Check(name, *check_elastic(build, old, new, at=at, seed=seed,
                                                                               decode=decode, timeout=timeout))))
    return report


def _guarded(name: str, run: Callable[[], Check]) -> Check:
    """``run()``; an error while it saves, loads or iterates fails the check, naming the error (a
    state that does not restore can make a node raise rather than differ)."""
    try:
        return run()
    except Exception as e:  # noqa: BLE001 - reported, not hidden: the check fails with it
        return Check(name, False, f"raised {_error(e)}")


def _error(e: BaseException) -> str:
    """``Type: message``; an error re-raised from a loader worker by its last line, the worker's own
    error (torch's message is its whole traceback)."""
    text = str(e).strip()
    lines = [line for line in text.splitlines() if line.strip()]
    if len(lines) > 1 and lines[0].startswith("Caught "):
        return f"{lines[-1].strip()} (in a loader worker)"
    return f"{type(e).__name__}: {text}"


def _state_at(build: Callable[[], Any], k: int) -> Any:
    """The state of a fresh loader after ``k`` batches."""
    loader = build()
    it = iter(loader)
    if k:
        _take(it, k)
    return loader.state_dict()


def _resume_at(name: str, build: Callable[[], Any], reference: List[Any], sources: List[Dict[str, Tuple[int, int]]], k: int,
               decode: Optional[Callable[[List[int]], str]], tick: Optional[Tick] = None) -> Check:
    state = torch_roundtrip(_state_at(build, k))
    resumed = build()
    resumed.load_state_dict(state)
    return _rest(name, resumed, reference, sources, k, decode, tick)


def _rest(name: str, resumed: Any, reference: List[Any], sources: List[Dict[str, Tuple[int, int]]], k: int,
          decode: Optional[Callable[[List[int]], str]], tick: Optional[Tick] = None) -> Check:
    """Compare what ``resumed`` gives with the reference from step ``k``; an error names its step."""
    got: List[Any] = []
    got_sources: List[Dict[str, Tuple[int, int]]] = []
    tokens = 0
    try:
        for batch in iter(resumed):
            got.append(batch)
            got_sources.append(_source_tokens(resumed))
            if tick is not None:
                tokens += _tokens_in(batch)
                tick(len(got), tokens, len(reference) - k)
            if len(got) >= len(reference) - k:
                break
    except Exception as e:  # noqa: BLE001 - the step it failed at is what the user needs
        return Check(name, False, f"raised {_error(e)} at step {k + len(got)}")
    return _compare(name, reference[k:], got, k, sources[1:], got_sources, decode)


def _in_fresh_process(build: Callable[[], Any], reference: List[Any], k: int,
                      fresh_process: Callable[[Any, int], List[Any]],
                      decode: Optional[Callable[[List[int]], str]]) -> Check:
    got = fresh_process(_state_at(build, k), len(reference) - k)
    return _compare(f"resume at step {k} in a fresh process", reference[k:], got, k, decode=decode)


def _chained(build: Callable[[], Any], reference: List[Any], sources: List[Dict[str, Tuple[int, int]]], k: int,
             decode: Optional[Callable[[List[int]], str]], tick: Optional[Tick] = None) -> Check:
    first = torch_roundtrip(_state_at(build, k))
    middle = build()
    middle.load_state_dict(first)
    second = torch_roundtrip(middle.state_dict())  # saved right after the load, before any batch
    del middle
    last = build()
    last.load_state_dict(second)
    return _rest(f"resume of a state saved right after a load (step {k})", last, reference, sources, k, decode, tick)
