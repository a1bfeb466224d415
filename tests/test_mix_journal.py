"""The mixer's states taken for later (pipes/mix_journal.py, pipes/state_later.py): every state a
`Mix.state_later` handle gives is, byte for byte once written out, the state `state_dict` gave at
the same point, for every strategy and stop rule, with pieces, finite branches, a weights schedule
that changes eras, restores, and `state_dict` calls in between; and the best-fit packer's rows and
states are the same whether its parent offers `state_later` or not, and it resumes at every step
through the shared resume helper (tokenloom.testing.check_node_resume)."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

from tokenloom.pipes.base import Node
from tokenloom.pipes.items import TokenDoc
from tokenloom.pipes.mix import Mix
from tokenloom.pipes.pack.bestfit import BestFitPack
from tokenloom.pipes.pieces import Pieces
from tokenloom.pipes.schedule import StepClock
from tokenloom.pipes.state_later import Later, later_of, read_later
from tokenloom.testing import check_node_resume


class Synthetic(Node[TokenDoc]):
    """Documents of seeded lengths (1 to ``longest`` tokens); epoch ``k // per_epoch``; ends after
    ``total`` documents when given (a finite branch)."""

    STATE_KEYS = ("k",)

    def __init__(self, name, seed, *, longest=300, per_epoch=7, total=None):
        super().__init__()
        self.name, self.per_epoch, self.total = name, per_epoch, total
        self.lens = np.random.default_rng(seed).integers(1, longest + 1, 512).tolist()
        self.ids = np.arange(longest, dtype=np.int32)
        self.k = 0

    def reset(self, initial_state=None):
        self.k = 0 if initial_state is None else int(initial_state["k"])

    def next(self):
        k = self.k
        if self.total is not None and k >= self.total:
            raise StopIteration
        self.k = k + 1
        return TokenDoc(self.ids[:self.lens[k % 512]], self.name, None, k // self.per_epoch, 0, k, 0, False)

    def get_state(self):
        return {"k": self.k}


NAMES = ("a", "b", "c", "d", "e")
CASES = [
    dict(strategy="interleave"),
    dict(strategy="interleave", unit="documents", pieces=40),
    dict(strategy="interleave", pieces=16, weights={"a": 5, "b": 1, "c": 1, "d": 1, "e": 0}),
    dict(strategy="random", seed=4, pieces=50),
    dict(strategy="random", unit="documents"),
    dict(strategy="round_robin", pieces=30),
    dict(strategy="alternating", pattern=["a", "c", "c", "e"], burst=2, pieces=30),
    dict(strategy="interleave", stop="first_exhausted", passes=3, pieces=25),
    dict(strategy="interleave", stop="all_exhausted", passes=2, cycle_exhausted=False, pieces=25),
    dict(strategy="round_robin", stop="all_exhausted", passes=2, cycle_exhausted=True),
    dict(strategy="sequential", stop="all_exhausted", passes=2, cycle_exhausted=False, pieces=60),
    dict(strategy="interleave", finite=True, pieces=20),
    dict(strategy="interleave", schedule=True, pieces=20),
    dict(strategy="random", schedule=True, seed=9),
]


def build(case):
    case = dict(case)
    pieces, finite, schedule = case.pop("pieces", None), case.pop("finite", False), case.pop("schedule", False)
    kids = {}
    for i, name in enumerate(NAMES):
        src = Synthetic(name, i, total=40 + 13 * i if finite else None)
        kids[name] = Pieces(src, piece=pieces) if pieces else src
    clock = None
    if schedule:
        clock = StepClock()
        case["weights"] = [(0, {n: 1.0 for n in NAMES}), (3, {"a": 4, "b": 1, "c": 0, "d": 1, "e": 1}),
                           (7, {n: 1.0 + i for i, n in enumerate(NAMES)})]
        case["clock"] = clock
    return Mix(kids, **case), clock


def text(state):
    return json.dumps(state, default=lambda a: a.tolist())


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items() if k != "weights"))
def test_every_state_taken_for_later_is_the_state_of_its_time(case):
    rng = random.Random(7)
    mix, clock = build(case)  # takes states for later, and now and then its state_dict
    twin, twin_clock = build(case)  # the same picks; its state_dict at every step is the reference
    mix.reset(None)
    twin.reset(None)
    taken = []
    full = 0
    for step in range(1200):
        if clock is not None and step % 9 == 8:
            clock.batches += 1
            twin_clock.batches += 1
        if step == 60:  # a restore mid-way: the next take is a full state
            saved = twin.state_dict()
            mix.reset(saved)
            twin.reset(saved)
            if clock is not None:
                clock.load(twin_clock.state())
        try:
            got, want = mix.next(), twin.next()
        except StopIteration:
            with pytest.raises(StopIteration):
                twin.next()
            break
        assert got.source == want.source and len(got.ids) == len(want.ids)
        if rng.random() < 0.2:
            mix.state_dict()  # takes the stale branches' states itself: the journal must not miss them
        if rng.random() < 0.7:
            later = mix.state_later()
            assert isinstance(later, Later)
            full += later.k == 0  # a journal's base: a full state
            taken.append((later, text(twin.state_dict())))
    assert len(taken) > 40
    assert full >= 2, "a restore (and a new era) starts a new journal"
    order = list(range(len(taken)))
    rng.shuffle(order)  # read in any order, not only oldest first as the packer reads
    for i in order[: len(order) // 2] + sorted(order[len(order) // 2:]):
        later, want = taken[i]
        assert text(later.state()) == want, f"take {i}"
        assert later.state() is later.state()


def test_a_node_without_state_later_is_taken_at_once():
    src = Synthetic("a", 0)
    src.reset(None)
    take = later_of(src)
    assert take == src.state_dict
    src.next()
    got = take()
    assert read_later(got) == {"k": 1} and read_later(got) is got


@pytest.mark.parametrize("pieces", [None, 60])
def test_the_packer_gives_the_same_rows_and_states_with_or_without_its_parent_taking_for_later(pieces, monkeypatch):
    def run(plain):
        mix, _ = build(dict(strategy="interleave", pieces=pieces))
        if plain:  # the parent's state taken in full at every checkpoint, as before state_later
            monkeypatch.setattr(mix, "state_later", None, raising=False)
        packer = BestFitPack(mix, seq_len=63, buffer_size=12)
        packer.reset(None)
        out = []
        for i in range(600):
            row = packer.next()
            out.append(row.tokens.tobytes() + row.seg_lens.tobytes())
            if i % 3 == 0:
                out.append(text(packer.state_dict()).encode())
        return out

    assert run(plain=False) == run(plain=True)


@pytest.mark.parametrize("buffer_size,sources,finite", [(1, 20, False), (3, 5, True)])
def test_the_packer_over_a_journaled_mixer_resumes_at_every_step(buffer_size, sources, finite):
    """The resume helper over the graph the recipes build with several sources (more of them than
    `Mix.JOURNAL_MIN`, so journals start over mid-run), at the smallest buffer, and over finite branches
    whose stream must end."""
    def build():
        kids = {f"s{i}": Pieces(Synthetic(f"s{i}", i, longest=200, total=12 if finite else None), piece=33)
                for i in range(sources)}
        return BestFitPack(Mix(kids, weights={k: 1.0 for k in kids}), seq_len=31, buffer_size=buffer_size)

    steps = check_node_resume(build, max_steps=250)
    if finite:
        assert 20 < steps < 250, "the finite stream must end"
    else:
        assert steps == 250
