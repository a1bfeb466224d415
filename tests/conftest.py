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


@pytest.fixture(scope="session")
def real_corpus(tmp_path_factory):
    """The standard library's sources and docstrings as two parquet sources."""
    root = tmp_path_factory.mktemp("stdlib")
    return build_demo_corpus(str(root), max_docs_per_source=500)


@pytest.fixture(scope="session")
def demo_corpus(tmp_path_factory):
    """The whole demo corpus (`build_demo_corpus`, as `tokenloom demo` reads it), built once per test
    process: its sources as `build_demo_corpus` returns them, and "root", the folder (a subprocess
    given it reuses the files). Read only: a test that changes files makes a corpus of its own."""
    root = tmp_path_factory.mktemp("demo_corpus")
    return {**build_demo_corpus(str(root)), "root": str(root)}
