"""Shared fixtures: small real parquet corpora written by the tests, and the shipped tokenizer.

Nothing is downloaded: the synthetic corpus is generated from a fixed seed with a
heavy-tailed (Pareto) length distribution, and the real one is built from the
Python standard library's own files by `tokenloom.sample_data`.
"""

from __future__ import annotations

import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tokenloom.sample_data import build_demo_corpus, default_tokenizer_path

# The tokenizer cache (pipes/tokenizer_cache.py) of the tests lives in a directory of their own,
# not in the user's ~/.cache; the xdist workers and the subprocesses the tests start (torchrun jobs,
# fresh-process resumes) inherit it, so it is also shared by concurrent processes, as on a cluster.
if "TOKENLOOM_CACHE" not in os.environ:
    import tempfile as _tempfile

    os.environ["TOKENLOOM_CACHE"] = _tempfile.mkdtemp(prefix="tokenloom-test-cache-")

# fastokens spreads a batch over a thread pool of its own, started by its first batched call in a
# process. A training process in which that pool runs starts its loaders' workers with forkserver
# (pipes/loader/fork_guard.py), so one test encoding with fastokens in the pytest process (any
# num_workers=0 loader on the shipped tokenizer) would move every later test's workers off fork. The
# test processes never start the pool; tests/test_fork_safety.py starts it in fresh interpreters.
os.environ.setdefault("FASTOKENS_BPE_THREADS", "1")

WORDS = ("the of and to in is was for on that with as by at from it an be this which or are "
         "loader token batch shard worker epoch resume packing buffer parquet row group").split()


def synthetic_texts(n: int, seed: int = 0, tag: str = "d") -> list:
    """Documents 'd00042 w w w ...' with heavy-tailed word counts (a few are longer than a row)."""
    rng = np.random.default_rng(seed)
    lengths = (rng.pareto(1.3, n) * 25).astype(int) + 2
    return [f"{tag}{i:05d} " + " ".join(rng.choice(WORDS, k)) for i, k in enumerate(lengths)]


def write_corpus(root, texts, *, files: int = 3, row_group_size: int = 64, column: str = "text"):
    os.makedirs(root, exist_ok=True)
    per = -(-len(texts) // files)
    paths = []
    for f in range(files):
        p = os.path.join(root, f"part-{f:03d}.parquet")
        pq.write_table(pa.table({column: texts[f * per:(f + 1) * per]}), p, row_group_size=row_group_size)
        paths.append(p)
    return paths


@pytest.fixture(scope="session")
def tok_path() -> str:
    return default_tokenizer_path()


@pytest.fixture(scope="session")
def corpus(tmp_path_factory):
    """1500 synthetic documents in 3 files of 64-row row groups; returns (glob, texts)."""
    root = tmp_path_factory.mktemp("corpus")
    texts = synthetic_texts(1500)
    write_corpus(str(root), texts)
    return str(root / "*.parquet"), texts


def _built_once(tmp_path_factory, name, build):
    """``build(folder)``, once for the whole run: under xdist the test processes share the folder (in
    the run's temporary directory, above each process's own), the first builds it under a file lock
    and the others reuse it (``build`` must reuse what is there: `build_demo_corpus` does, from its
    manifest). Walking the standard library takes 5-10 s a build on a loaded 2-core machine."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return build(str(tmp_path_factory.mktemp(name)))
    from filelock import FileLock

    shared = tmp_path_factory.getbasetemp().parent / name
    with FileLock(str(shared) + ".lock"):
        return build(str(shared))


@pytest.fixture(scope="session")
def real_corpus(tmp_path_factory):
    """The standard library's sources and docstrings as two parquet sources. Read only."""
    return _built_once(tmp_path_factory, "stdlib", lambda root: build_demo_corpus(root, max_docs_per_source=500))


@pytest.fixture(scope="session")
def demo_corpus(tmp_path_factory):
    """The whole demo corpus (`build_demo_corpus`, as `tokenloom demo` reads it), built once per test
    process: its sources as `build_demo_corpus` returns them, and "root", the folder (a subprocess
    given it reuses the files). Read only: a test that changes files makes a corpus of its own."""
    return _built_once(tmp_path_factory, "demo_corpus", lambda root: {**build_demo_corpus(root), "root": root})


# --- the order the tests are handed out in -----------------------------------------------------------
# Under xdist (`make test`: 2 processes on a 2-core machine) the tests are handed out in collection
# order: the longest end-to-end runs go first, so that the short tests fill in around them and no
# process is left with a 30-second run at the end while the other one is idle. (Handed out two at a
# time, --maxschedchunk 2, the S3 modules' tests interleaved within a process and their module
# servers' credentials failed: ACCESS_DENIED in test_cache_remote, test_readahead and
# test_resume_first_fetches. The read-ahead tests stay in their modules' places for the same reason.) The order of everything else is unchanged. Longest first, from `--durations`
# (name prefixes: every parametrization of a test); a name no longer here only moves back in line.
LONGEST_FIRST = (
    "test_torchrun.py::test_dcp_elastic_resume_two_ranks_to_one_and_three",
    "test_torchrun.py::test_chained_elastic_dcp_resume_with_a_save_at_once",
    "test_torchrun.py::test_two_ranks_finite_epoch_and_dcp_resume",
    "test_integrations.py::test_torchtitan_adapter_resumes_through_dcp_and_elastically",
    "test_integrations.py::test_accelerate_save_state_load_state_resumes_exactly",
    "test_torchrun.py::test_two_ranks_resume_from_a_padding_step_and_the_last_step",
    "test_integrations.py::test_hf_trainer_resumes_from_its_own_checkpoint_exactly",
    "test_integrations.py::test_lightning_resumes_from_a_mid_epoch_checkpoint_exactly",
    "test_tokenizer_cache.py::test_concurrent_first_loads_agree_and_leave_a_whole_entry",
    "test_wire.py::test_workers_send_through_their_rings_when_forked",
    "test_worker_orphans.py::test_workers_exit_when_training_process_is_sigkilled",
    "test_wrapped.py::test_a_dataloader_recreated_around_the_dataset_yields_the_public_batches",
    "test_examples.py::",
    "test_preemption.py::test_sigkill_at_random_batches_resumes_exactly",
    "test_wire.py::test_the_loop_gets_the_same_tensors_with_and_without_workers",
    "test_elastic.py::test_elastic_resume_property",
    "test_small_buffers.py::test_the_demo_corpus_with_a_buffer_of_two_ends_its_epoch",
    "test_worker_setup.py::test_loaders_started_from_two_threads_at_once_fork_one_at_a_time",
    "test_worker_orphans.py::test_workers_outlive_the_thread_that_started_them",
    "test_wire.py::test_the_main_state_is_torchdatas_at_every_step",
    "test_tiktoken_bpe.py::test_loader_with_workers_delivers_the_same_batches_on_both_engines_and_resumes_across",
)


def pytest_collection_modifyitems(config, items):
    def rank(item):
        name = item.nodeid.rpartition("tests/")[2]
        return next((i for i, prefix in enumerate(LONGEST_FIRST) if name.startswith(prefix)), len(LONGEST_FIRST))

    items.sort(key=rank)  # stable: the rest keep their order
