"""Loader workers deliver the batches of a fresh process whatever the training process did with threads
before it built the loader (issue 42; pipes/loader/fork_guard.py).

Each case runs in a fresh interpreter (tests/fork_after_threads_job.py) with a time limit: the training
process first encodes with fastokens on its own (its encode pool then runs), or with `tokenizers`'
parallel batch, tiktoken's thread pool, torch's intra-op threads and pyarrow's reads, then reads one
epoch with 2 workers. Every case must give the digest of the run that used no threads first, and
where fastokens' pool runs the workers must be started clean (forkserver), not forked from it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tokenloom.pipes import fastokens_engine
from tokenloom.pipes.loader.fork_guard import unsafe_pools

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LIMIT_S = 150


def _run(case, corpus, tok_path):
    env = {k: v for k, v in os.environ.items() if k not in ("TOKENLOOM_ENGINE", *fastokens_engine.THREAD_VARIABLES)}
    out = subprocess.run([sys.executable, "-m", "tests.fork_after_threads_job", case, corpus, tok_path], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=LIMIT_S)
    assert out.returncode == 0, f"{case}: exit {out.returncode}\n{out.stderr[-3000:]}"
    return json.loads(out.stdout.strip().splitlines()[-1]), out.stderr


@pytest.fixture(scope="module")
def fresh(corpus, tok_path):
    return _run("none", corpus[0], tok_path)[0]


@pytest.mark.skipif(fastokens_engine.version() is None, reason="fastokens is not installed (the fast extra)")
@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="native threads are seen by name on Linux only")
def test_after_fastokens_ran_in_the_training_process_workers_start_clean(fresh, corpus, tok_path):
    got, log = _run("fastokens", corpus[0], tok_path)
    assert got["start_method"] == "forkserver", got
    assert "forkserver instead of fork" in log and "fastokens-" in log
    assert (got["digest"], got["batches"]) == (fresh["digest"], fresh["batches"])
    assert fresh["start_method"] == "fork" and fresh["batches"] > 10


def test_after_other_libraries_threads_the_batches_are_those_of_a_fresh_process(fresh, corpus, tok_path):
    """`tokenizers`' parallel batch, tiktoken's thread pool, torch's intra-op threads and pyarrow's reads,
    one after the other in one training process (each alone: ``python -m tests.fork_after_threads_job
    tokenizers ...``)."""
    got, _ = _run("others", corpus[0], tok_path)
    assert got == fresh  # forked as usual: these libraries' pools survive a fork or are not inherited


def test_the_pools_are_seen_by_their_threads_names():
    if fastokens_engine.version() is None or not os.path.isdir("/proc/self/task"):
        pytest.skip("needs fastokens and Linux")
    probe = ("import fastokens, sys; from tokenloom.pipes.loader.fork_guard import unsafe_pools; "
             "t = fastokens.Tokenizer.from_file(sys.argv[1]); print(unsafe_pools()); "
             "t.encode_batch(['word ' * 5000] * 8); print(unsafe_pools())")
    from tokenloom.pipes.tokenizer import demo_tokenizer_path

    out = subprocess.run([sys.executable, "-c", probe, demo_tokenizer_path()], capture_output=True, text=True,
                         timeout=60, env={k: v for k, v in os.environ.items()
                                          if k not in fastokens_engine.THREAD_VARIABLES})
    before, after = out.stdout.strip().splitlines()
    assert before == "[]" and "fastokens-0 (fastokens' encode pool)" in after
    assert unsafe_pools() == [] or all("fastokens-" in p for p in unsafe_pools())


_EXIT_DURING_BUILD = r"""
import atexit, sys, threading
from tokenloom.pipes import fastokens_engine as fe

def after():  # registered first, so it runs after the engine's own exit hook
    alive = [t.name for t in threading.enumerate() if t.name == "tokenloom-fastokens-build" and t.is_alive()]
    print("alive at exit:", alive, flush=True)

atexit.register(after)
fe.STAND_IN_S = 0.0
payload = open(sys.argv[1]).read()
fe.ready(payload)
fe.ready(payload)  # starts the background build; the interpreter exits while it runs
"""


@pytest.mark.skipif(fastokens_engine.version() is None, reason="fastokens is not installed (the fast extra)")
def test_a_process_that_exits_while_fastokens_builds_waits_for_the_build(tok_path):
    """A daemon build thread still in fastokens' native code when the interpreter finalizes is unwound
    there and the process aborts ("FATAL: exception not rethrown", seen at the end of num_workers=0 runs):
    the exit hook waits for it."""
    env = {k: v for k, v in os.environ.items() if k not in ("TOKENLOOM_ENGINE", *fastokens_engine.THREAD_VARIABLES)}
    out = subprocess.run([sys.executable, "-c", _EXIT_DURING_BUILD, tok_path], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=LIMIT_S)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "alive at exit: []" in out.stdout, out.stdout + out.stderr[-2000:]


def test_a_factory_with_a_rank_sync_can_still_start_workers_clean(corpus, tok_path):
    """Ranks kept in step by a `rank_sync` (threads' barrier, a process group: not picklable) still get
    a factory a worker started clean can take: the fork guard's way out is not closed to them. The
    sync stays with the loader; the worker's copy has none (workers never sync)."""
    import pickle

    from tokenloom.pipes.loader.fork_guard import picklable
    from tokenloom.pipes.loader.rank_sync import ThreadSync
    from tokenloom.recipes import pretrain
    sync = ThreadSync(2)
    loader = pretrain(corpus[0], tokenizer=tok_path, seq_len=64, batch_size=2, epochs=1, num_workers=1, rank=0,
                      world_size=2, rank_sync=sync)
    assert picklable(loader.dataset.factory)
    assert pickle.loads(pickle.dumps(loader.dataset.factory)).spec.run.rank_sync is None
    assert loader.dataset.factory.spec.run.rank_sync is sync and loader.rank_sync is sync
