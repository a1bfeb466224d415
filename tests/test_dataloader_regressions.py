"""Known failures of StatefulDataLoader, as regression tests against `pretrain(...)`.

- meta-pytorch/data#1437: a state saved after a finished ``for`` loop, loaded into a
  fresh loader, gave an empty (dropped) epoch. Ours must give the next epoch.
- huggingface/datasets#7447: with ``persistent_workers=True``, resuming mid-epoch
  shortened every following epoch to the batches that were left when it stopped.
- A second resume in the same epoch (resume at k1, save at k2, resume again) must
  stay aligned with the uninterrupted run.
- ``iter(loader)`` before ``load_state_dict``: the loaded state must take effect for
  the next iterator; an iterator created before the load must not silently restart
  from the beginning of the data.

Every comparison is against an uninterrupted loader built with the same arguments,
bit for bit (`tests/resume.py`'s ``items_equal``).
"""

from __future__ import annotations

import pytest

from tokenloom.recipes import pretrain

from .conftest import synthetic_texts, write_corpus
from .resume import items_equal, torch_roundtrip


@pytest.fixture(scope="module")
def small_glob(tmp_path_factory):
    """400 documents in 2 files: one epoch is ~20-40 batches, so whole epochs are cheap."""
    root = tmp_path_factory.mktemp("regress")
    write_corpus(str(root), synthetic_texts(400, seed=5), files=2, row_group_size=32)
    return str(root / "*.parquet")


def _builder(glob, tok_path, **kw):
    args = dict(tokenizer=tok_path, seq_len=63, batch_size=4, buffer_size=24, seed=9)
    args.update(kw)
    return lambda: pretrain(glob, **args)


def _assert_same(want, got, what):
    assert len(got) == len(want), f"{what}: {len(got)} batches, the uninterrupted run has {len(want)}"
    for j, (w, g) in enumerate(zip(want, got)):
        assert items_equal(w, g), f"{what}: batch {j} differs from the uninterrupted run"


def _take(it, n):
    return [next(it) for _ in range(n)]


@pytest.mark.parametrize("num_workers,persistent", [(0, False), (2, False), (2, True)])
def test_state_after_finished_epoch_resumes_into_the_next_epoch(small_glob, tok_path, num_workers, persistent):
    """meta-pytorch/data#1437: save after the `for` loop ran out; the resumed loader's next
    `for` loop is the uninterrupted loader's next epoch (non-empty, not a repeat)."""
    kw = dict(epochs=1, num_workers=num_workers)
    if persistent:
        kw["persistent_workers"] = True
    build = _builder(small_glob, tok_path, **kw)
    loader = build()
    epoch1 = list(loader)
    state = torch_roundtrip(loader.state_dict())
    epoch2 = list(loader)
    epoch3 = list(loader)
    assert epoch1 and epoch2, "the corpus must give non-empty epochs"
    assert not items_equal(epoch1[0], epoch2[0]), "the next epoch must be reshuffled, not a repeat"

    resumed = build()
    resumed.load_state_dict(state)
    _assert_same(epoch2, list(resumed), "first epoch after resuming at the epoch boundary")
    _assert_same(epoch3, list(resumed), "second epoch after resuming at the epoch boundary")


def test_resumed_epoch_with_persistent_workers_is_not_shortened(small_glob, tok_path):
    """huggingface/datasets#7447: persistent workers, epochs=1, resume mid-epoch: the rest of
    that epoch has exactly the remaining batches, and the following epochs are complete."""
    build = _builder(small_glob, tok_path, epochs=1, num_workers=2, persistent_workers=True)
    ref = build()
    epochs = [list(ref) for _ in range(3)]
    n = len(epochs[0])
    assert n >= 8, f"the corpus gives only {n} batches per epoch"
    k = n // 2 + 1  # odd or even, a point inside the epoch where one worker is a batch ahead

    loader = build()
    it = iter(loader)
    head = _take(it, k)
    _assert_same(epochs[0][:k], head, "before saving")
    state = torch_roundtrip(loader.state_dict())
    del it, loader

    resumed = build()
    resumed.load_state_dict(state)
    _assert_same(epochs[0][k:], list(resumed), f"rest of the epoch resumed at batch {k}")
    _assert_same(epochs[1], list(resumed), "the epoch after the resumed one")
    _assert_same(epochs[2], list(resumed), "the second epoch after the resumed one")


@pytest.mark.parametrize("num_workers,snapshot", [(0, None), (2, 1), (2, 3)])
def test_second_resume_in_the_same_epoch_stays_aligned(small_glob, tok_path, num_workers, snapshot):
    """Resume at k1, run to k2, save again, resume again: still the uninterrupted batches."""
    kw = dict(epochs=1, num_workers=num_workers)
    if snapshot is not None:
        kw["snapshot_every_n_steps"] = snapshot
    build = _builder(small_glob, tok_path, **kw)
    ref = list(build())
    n = len(ref)
    assert n >= 10, f"the corpus gives only {n} batches per epoch"
    k1, k2 = n // 4 + 1, n // 2 + 2

    first = build()
    it = iter(first)
    _take(it, k1)
    state1 = torch_roundtrip(first.state_dict())
    del it, first

    second = build()
    second.load_state_dict(state1)
    it = iter(second)
    _assert_same(ref[k1:k2], _take(it, k2 - k1), f"after the first resume at batch {k1}")
    state2 = torch_roundtrip(second.state_dict())
    del it, second

    third = build()
    third.load_state_dict(state2)
    _assert_same(ref[k2:], list(third), f"after the second resume at batch {k2}")


def _state_after(build, k):
    """The state of a fresh loader after ``k`` batches, through torch.save/torch.load."""
    loader = build()
    it = iter(loader)
    _take(it, k)
    return torch_roundtrip(loader.state_dict())


@pytest.mark.parametrize("num_workers", [0, 2])
def test_load_state_takes_effect_for_the_next_iterator(small_glob, tok_path, num_workers):
    """`iter(loader)` called before `load_state_dict` (e.g. by a framework that peeks):
    an iterator created *after* the load resumes exactly."""
    build = _builder(small_glob, tok_path, num_workers=num_workers)
    ref = _take(iter(build()), 12)
    k = 5
    state = _state_after(build, k)

    resumed = build()
    early = iter(resumed)  # created before the load
    resumed.load_state_dict(state)
    _assert_same(ref[k:], _take(iter(resumed), len(ref) - k), f"new iterator after loading the state at {k}")
    del early


@pytest.mark.parametrize("num_workers", [0, 2])
def test_iterator_created_before_load_does_not_silently_restart(small_glob, tok_path, num_workers):
    """An iterator created before `load_state_dict` and used after it must either continue
    from the loaded state or raise an error that names `load_state_dict`; yielding the
    first batch of the data again (a silent restart) is the failure."""
    build = _builder(small_glob, tok_path, num_workers=num_workers)
    ref = _take(iter(build()), 12)
    k = 5
    state = _state_after(build, k)

    resumed = build()
    early = iter(resumed)
    resumed.load_state_dict(state)
    try:
        got = next(early)
    except (RuntimeError, ValueError) as e:
        assert "load_state_dict" in str(e), f"the error does not say what happened: {e}"
        return
    assert not items_equal(got, ref[0]), "the iterator silently restarted from the first batch"
    assert items_equal(got, ref[k]), f"the iterator yielded neither an error nor batch {k}"
