"""Many named sources (issue 46): 1024 sources run and resume exactly; 128 resume elastically, each
document once.

The sources are tiny files of 1-3 documents each, one file a source (sources reading the same file
warn once per pair: with one file each, none do). benchmarks/sources.py measures the cost of many
sources (speed, memory, state); these tests pin what must hold whatever it costs.

- `test_1024_sources_resume_exactly`: ``pretrain`` over 1024 sources with equal weights, an endless
  stream; saved mid-stream (a few batches in, when some sources have been read and most have not),
  restored into a freshly built loader (the state through ``torch.save``), the next batches equal to
  the uninterrupted run's (tests/resume.py `check_loader_resume`), with 0 and 2 workers.
- `test_many_sources_elastic_resume_delivers_each_document_once`: 128 sources of the token-level
  oracle's corpus (tests/oracle.py: every word its own token id, so a token names its document and
  offset), one epoch, saved mid-epoch on 2 workers (or 2 ranks) and resumed on 3 workers (or 3
  ranks): the oracle checks that every document of every source was delivered exactly once, whole,
  across the save (nothing lost, nothing repeated). The ranks case runs with ``make fuzz`` (soak); the
  fuzzer's many-source seeds below change ranks in CI.
- `test_many_source_scenarios`: a few seeds of the fuzzer's many-source scenarios (tests/oracle_fuzz.py
  `many_sources`; ``make fuzz`` and ``python -m tests.oracle_fuzz --many`` run many more).
"""

from __future__ import annotations

import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tokenloom.recipes import pretrain

from .conftest import synthetic_texts
from .resume import check_loader_resume

# Sources share no file here, but a user's many sources may; the warning is not what these tests check.
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def tiny_sources(root: str, n: int, *, least: int = 1, seed: int = 46) -> dict:
    """``n`` sources ``s0000 ...``, each its own parquet file of ``least``-3 short synthetic documents
    (every shard needs a row of every source: ``least`` is the number of shards)."""
    os.makedirs(root, exist_ok=True)
    texts = synthetic_texts(3 * n, seed=seed)
    sources = {}
    for i in range(n):
        k = least + (i * 7 + seed) % (4 - least)  # least..3 documents, spread over the sources
        path = os.path.join(root, f"s{i:04d}.parquet")
        pq.write_table(pa.table({"text": [" ".join(t.split()[:60]) for t in texts[3 * i:3 * i + k]]}), path)
        sources[f"s{i:04d}"] = path
    return sources


@pytest.mark.parametrize("num_workers", [0, pytest.param(2, marks=pytest.mark.slow)])
def test_1024_sources_resume_exactly(tmp_path, tok_path, num_workers):
    sources = tiny_sources(str(tmp_path), 1024, least=max(num_workers, 1))
    weights = {name: 1.0 for name in sources}

    def build():
        return pretrain(sources, tokenizer=tok_path, weights=weights, seq_len=63, batch_size=2, buffer_size=32,
                        num_workers=num_workers, seed=3)

    reference = check_loader_resume(build, steps=[4], total=8)
    assert len(reference) == 8


#: Enough sources that a per-source cost or a lost branch shows, few enough for `make test`'s budget.
SOURCES_ELASTIC = 128


@pytest.mark.slow
@pytest.mark.parametrize("old,new", [((1, 2), (1, 3)), pytest.param((2, 1), (3, 1), marks=pytest.mark.soak)],
                         ids=["2-to-3-workers", "2-to-3-ranks"])
def test_many_sources_elastic_resume_delivers_each_document_once(tmp_path, old, new):
    from .oracle_fuzz import FuzzHop, Scenario, run_scenario

    # SOURCES_ELASTIC parquet sources of 3 documents each (every shard needs a row of every source), bestfit, one
    # epoch, nothing cycled: the oracle's round must hold every document exactly once. Saved after
    # 6 steps (mid-epoch: the run holds ~40 batches), resumed on the new topology to the epoch's end.
    sources = {f"m{i:03d}": ("parquet", 3) for i in range(SOURCES_ELASTIC)}
    loader = {"predict_bos": True, "mix": "interleave", "weights_unit": "tokens",
              "weights": {name: 1.0 for name in sources}, "stop": "all_exhausted", "cycle_exhausted": False}
    sc = Scenario(46, sources, 32, 4, "bestfit", 16, 1, loader,
                  [FuzzHop(*old, save=6), FuzzHop(*new, save="end", as_dict=False)])
    out = run_scenario(sc, str(tmp_path / "run"), limit=120)
    assert out["rounds"] == 1 and out["batches"] > 6, f"the save was not mid-epoch: {out}"


#: Seeds of the fuzzer whose scenario has many sources: 10156, 48 sources best-fit round-robin from 1 x 0
#: workers to 3 ranks x 1 and back; 10192, 12 sources of an endless stream from 2 workers to 3 ranks;
#: 10206, 64 sources cropped (bestfit-crop), one epoch, through JSON.
MANY_SEEDS = [10156, 10192, 10206]


@pytest.mark.slow
@pytest.mark.parametrize("seed", MANY_SEEDS)
def test_many_source_scenarios(seed):
    from .oracle_fuzz import check_seed, draw

    assert draw(seed).many >= 8, (f"seed {seed} no longer draws many sources: pick another "
                                  "(python -m tests.oracle_fuzz --many)")
    check_seed(seed)
