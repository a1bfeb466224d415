"""States taken only at checkpoint steps (``snapshot_every_n_steps=N``), not with every batch.

With ``snapshot_every_n_steps=N`` torchdata asks a worker for its state only with the batches a
snapshot may need (those within ``workers x (prefetch_factor + 1) + 1`` batches before each N-th
step), so with many sources most batches cross without one (benchmarks/sources.py, ``--snapshot-every``).
What must hold:

- a state saved at any step resumes exactly on the same topology (between snapshots torchdata
  replays the batches since the last one);
- a state saved at an N-th step resumes elastically, every document of the epoch once (the oracle):
  the state patches a worker sends (pipes/state_delta.py) stay paired when most batches send none;
- a state saved between snapshots is refused by an elastic resume, naming the setting and the steps.

``prefetch_factor=1`` keeps the window of batches that carry a state short, so that most batches here
carry none (with torchdata's rule and 2 workers: 5 of every 16).
"""

from __future__ import annotations

import pytest

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
