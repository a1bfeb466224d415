"""Preemption: a 2-worker job killed with SIGKILL at random batches resumes exactly.

tests/preempt_job.py logs a digest of every batch, saves its state atomically every
few batches and prints a line per batch. The test kills the job's whole process
group (the main process and its loader workers, as a preempted node loses them)
after a seeded random number of lines, restarts it from the last saved state, and
repeats for several kill points in one chain. Every batch any launch logged must
be the uninterrupted run's batch at that step, and the batches kept (those up to
each save point, then the next launch's) must be the uninterrupted run exactly.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading

import pytest
import torch

from .conftest import synthetic_texts, write_corpus
from .preempt_job import batch_digest, build

JOB = os.path.join(os.path.dirname(__file__), "preempt_job.py")
TOTAL = 48
SAVE_EVERY = 4
KILLS = 3
LAUNCH_TIMEOUT = 90


@pytest.fixture(scope="module")
def preempt_corpus(tmp_path_factory):
    """~30 batches per epoch, so the 48 steps cross an epoch boundary of the endless stream."""
    root = tmp_path_factory.mktemp("preempt")
    write_corpus(str(root), synthetic_texts(300, seed=21), files=3, row_group_size=16)
    return str(root / "*.parquet")


def _launch(glob, tok_path, state, log, kill_after=None):
    """Run the job; with ``kill_after``, SIGKILL its process group once it printed that many
    steps. Returns (printed step numbers, whether it was killed)."""
    env = dict(os.environ, PYTHONHASHSEED="0", OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, JOB, glob, tok_path, str(state), str(log), str(TOTAL), str(SAVE_EVERY)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    hung = threading.Event()

    def watchdog():
        hung.set()
        os.killpg(proc.pid, signal.SIGKILL)

    timer = threading.Timer(LAUNCH_TIMEOUT, watchdog)
    timer.start()
    steps, killed = [], False
    try:
        for line in proc.stdout:
            if line.startswith("step "):
                steps.append(int(line.split()[1]))
                if kill_after is not None and len(steps) == kill_after:
                    os.killpg(proc.pid, signal.SIGKILL)  # the job and its two loader workers
                    killed = True
                    break
        proc.wait()
    finally:
        timer.cancel()
    err = proc.stderr.read()
    proc.stdout.close()
    proc.stderr.close()
    assert not hung.is_set(), f"the job hung (killed after {LAUNCH_TIMEOUT}s):\n{err[-3000:]}"
    if not killed:
        assert proc.returncode == 0, f"the job failed ({proc.returncode}):\n{err[-4000:]}"
    else:
        assert proc.returncode == -signal.SIGKILL, proc.returncode
    return steps, killed


def _read_log(path):
    out = []
    with open(path) as f:
        for line in f:
            step, digest = line.split()
            out.append((int(step), digest))
    return out


def test_sigkill_at_random_batches_resumes_exactly(preempt_corpus, tok_path, tmp_path):
    glob = preempt_corpus
    it = iter(build(glob, tok_path))
    reference = [batch_digest(next(it)) for _ in range(TOTAL)]
    del it
    assert len(set(reference)) == TOTAL, "batches repeat; the check could not tell a repeat from a resume"

    state = tmp_path / "state.pt"
    kept = []  # digests of the batches the "training" keeps: up to each save, then the next launch's
    # one seeded kill point per stretch of 12 steps, so each launch makes progress and saves
    rng = random.Random(2024)
    stretch = TOTAL // (KILLS + 1)
    kill_at = [rng.randint(stretch * i + SAVE_EVERY + 2, stretch * (i + 1) + SAVE_EVERY) for i in range(KILLS)]
    launches = []
    for attempt in range(KILLS + 1):
        start = 0 if not state.exists() else int(torch.load(state, weights_only=True)["step"])
        assert start == len(kept), f"launch {attempt} resumes at step {start}, but {len(kept)} batches were kept"
        # kill once step kill_at[attempt] is printed; the job runs on a little until the signal lands
        kill_after = kill_at[attempt] - start if attempt < KILLS else None
        if kill_after is not None and kill_after < SAVE_EVERY + 2:
            # The last launch ran on past this kill point before its signal landed (a loaded
            # machine reads the job's output late): kill this one a little after its next save.
            kill_after = rng.randint(SAVE_EVERY + 2, 2 * SAVE_EVERY + 2)
        log = tmp_path / f"log{attempt}.txt"
        printed, killed = _launch(glob, tok_path, state, log, kill_after)
        logged = _read_log(log)
        assert [s for s, _ in logged][:len(printed)] == printed, "the log and stdout disagree"
        assert [s for s, _ in logged] == list(range(start + 1, start + 1 + len(logged))), \
            f"launch {attempt} logged steps {[s for s, _ in logged][:5]}..., expected from {start + 1}"
        for s, d in logged:
            assert d == reference[s - 1], f"launch {attempt} (resumed at step {start}): batch {s} differs " \
                                          "from the uninterrupted run"
        saved = int(torch.load(state, weights_only=True)["step"]) if state.exists() else 0
        if killed:
            assert saved % SAVE_EVERY == 0 and saved <= start + len(logged)
            kept += [d for s, d in logged if s <= saved]
        else:
            kept += [d for _, d in logged]
        launches.append((start, kill_after, len(logged), saved, killed))
    assert sum(k for *_, k in launches) == KILLS, f"expected {KILLS} kills, got launches {launches}"
    assert kept == reference, f"the kept batches differ from the uninterrupted run; launches: {launches}"
