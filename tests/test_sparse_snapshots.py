"""States taken only at checkpoint steps (``snapshot_every_n_steps=N``), not with every batch.

With ``snapshot_every_n_steps=N`` torchdata asks a worker for its state only with the batches a
snapshot may need (those within ``workers x (prefetch_factor + 1) + 1`` batches before each N-th
step), so with many sources most batches cross without one (benchmarks/sources.py, ``--snapshot-every``).
What must hold:

- a state saved at any step resumes exactly on the same topology (between snapshots torchdata
  replays the batches since the last one);
- a state saved at an N-th step resumes elastically, every document of the epoch once (the oracle):
  the state patches a worker sends (pipes/state_delta.py) stay paired when most batches send none;
- a state saved between snapshots is refused by an elastic resume, naming the setting and the steps, and
  by a resume under new weights (the replay would run under them);
- a state saved after the data ended between two snapshots (a rank padding while the others finish)
  holds the workers' final positions and resumes elastically (the iterator snapshots at its end,
  `compat.torchdata.snapshot_at_end`; refused as before where torchdata lacks what it uses).

``prefetch_factor=1`` keeps the window of batches that carry a state short, so that most batches here
carry none (with torchdata's rule and 2 workers: 5 of every 16).
"""

from __future__ import annotations

import pytest
import torch

from tokenloom.recipes import pretrain

from .resume import check_loader_resume, torch_roundtrip

EVERY = 16
SPARSE = {"snapshot_every_n_steps": EVERY, "prefetch_factor": 1}


def test_a_state_between_snapshots_resumes_exactly_on_the_same_topology(corpus, tok_path):
    glob, _ = corpus

    def build():
        return pretrain(glob, tokenizer=tok_path, seq_len=63, batch_size=2, buffer_size=24, seed=5, num_workers=2,
                        **SPARSE)

    # before the first snapshot, at one, and between two
    check_loader_resume(build, steps=[5, EVERY, EVERY + 7], total=EVERY + 12)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_a_state_at_a_snapshot_step_resumes_elastically_each_document_once(tmp_path):
    from .oracle_fuzz import FuzzHop, Scenario, run_scenario

    # 24 sources of 3 documents, bestfit, one epoch, nothing cycled: the round holds every document once.
    sources = {f"m{i:02d}": ("parquet", 3) for i in range(24)}
    loader = {"predict_bos": True, "mix": "interleave", "weights": {name: 1.0 for name in sources},
              "stop": "all_exhausted", "cycle_exhausted": False, **SPARSE}
    sc = Scenario(47, sources, 16, 2, "bestfit", 8, 1, loader,
                  [FuzzHop(1, 2, save=EVERY), FuzzHop(1, 3, save="end", as_dict=False)])
    out = run_scenario(sc, str(tmp_path / "run"), limit=120)
    assert out["rounds"] == 1 and out["batches"] > EVERY + 4, f"the save was not mid-epoch: {out}"


def test_an_elastic_resume_refuses_a_state_between_snapshots_naming_the_setting(corpus, tok_path):
    glob, _ = corpus

    def build(workers):
        return pretrain(glob, tokenizer=tok_path, seq_len=63, batch_size=2, buffer_size=24, seed=5,
                        num_workers=workers, **SPARSE)

    loader = build(2)
    it = iter(loader)
    for _ in range(EVERY + 3):
        next(it)
    state = torch_roundtrip(loader.state_dict())
    del it, loader
    with pytest.raises(ValueError, match=r"3 batches after its last worker snapshot.*multiple of "
                                         r"snapshot_every_n_steps"):
        build(3).load_state_dict([state])


#: A fuzzer seed (tests/oracle_fuzz.py `sparse_snapshots`): 2 sources of 3-4 documents, 3 ranks x 1 worker with a
#: state every 8 steps, saved at step 8 while rank 0, whose data ended after its first batch, pads; then 1 rank.
#: Its last snapshot was at step 0: before `compat.torchdata.snapshot_at_end` the elastic resume refused it.
ENDED_BETWEEN = 10187


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_a_rank_whose_data_ended_between_snapshots_resumes_elastically():
    from .oracle_fuzz import check_seed, draw

    sc = draw(ENDED_BETWEEN)
    assert sc.loader.get("snapshot_every_n_steps") == 8 and sc.hops[0].world == 3, (
        f"seed {ENDED_BETWEEN} no longer draws this scenario: {sc}")
    check_seed(ENDED_BETWEEN)


def test_without_the_end_snapshot_a_state_after_the_data_is_refused_elastically(tmp_path, monkeypatch):
    """Where torchdata lacks what `snapshot_at_end` uses, nothing is done: the state taken after the data
    ended between two snapshots keeps its steps since the last one, and an elastic resume refuses it."""
    from tokenloom.pipes.compat import torchdata as compat

    from .oracle_fuzz import check_seed

    monkeypatch.setattr(compat, "end_snapshot_ok", lambda: False)
    with pytest.raises(AssertionError, match="after its last worker snapshot"):
        check_seed(ENDED_BETWEEN)


def test_new_weights_refuse_a_state_between_snapshots(tmp_path, tok_path):
    """A state saved between snapshots resumes by replaying the batches since the last one; under new
    weights those would be other batches, so the position reached would not be the one saved (the
    fuzzer's seed 10953 lost and repeated documents so). Refused, naming the steps and the setting; the
    same state under the weights it was saved with resumes exactly."""
    from .conftest import synthetic_texts, write_corpus

    for name, seed in (("a", 1), ("b", 2)):
        write_corpus(str(tmp_path / name), synthetic_texts(200, seed=seed, tag=name))

    def build(weights):
        return pretrain({"a": str(tmp_path / "a" / "*.parquet"), "b": str(tmp_path / "b" / "*.parquet")},
                        tokenizer=tok_path, weights=weights, seq_len=63, batch_size=2, seed=5, num_workers=2,
                        **SPARSE)

    loader = build({"a": 1, "b": 1})
    it = iter(loader)
    for _ in range(EVERY + 3):
        next(it)
    state = torch_roundtrip(loader.state_dict())
    want = next(it)
    del it, loader
    with pytest.raises(ValueError, match=r"3 batches after its last worker snapshot \(snapshot_every_n_steps=16\).*"
                                         r"saved at a multiple of snapshot_every_n_steps"):
        build({"a": 3, "b": 1}).load_state_dict(state, allow_weight_change=True)
    same = build({"a": 1, "b": 1})
    same.load_state_dict(state, allow_weight_change=True)
    got = next(iter(same))
    assert all(torch.equal(want[k], got[k]) for k in want if isinstance(want[k], torch.Tensor))
