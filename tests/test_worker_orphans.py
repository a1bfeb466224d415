"""Loader workers die with their training process, and only then (issue 14, item 7).

tests/orphan_job.py runs a real 2-worker `pretrain` loader in a subprocess. The tests
find its workers in /proc (below the job: its children, or the fork server's), SIGKILL
the job's main process alone, as the OOM killer does (not its process group), and
require every worker to be gone within ``DEADLINE_S``. Before the fix they stayed for
minutes, blocked writing batches into a pipe that nobody reads. One job starts its
persistent workers from a thread that then ends and keeps iterating: its workers must
live on (the kernel's parent-death signal would have killed them with that thread).
The last case is the race: a child whose parent died before it called
`exit_with_parent`.
"""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time

import pytest

from .conftest import synthetic_texts, write_corpus

JOB = os.path.join(os.path.dirname(__file__), "orphan_job.py")
DEADLINE_S = 15.0
STARTUP_S = 120.0
#: How long the job of the thread case must go on stepping after its forking thread ended:
#: several polls of the workers' watchdog (worker_parent.POLL_S).
ALIVE_S = 4.0


@pytest.fixture(scope="module")
def orphan_corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("orphans")
    write_corpus(str(root), synthetic_texts(300, seed=7), files=2, row_group_size=16)
    return str(root / "*.parquet")


def _stat(pid):
    """(parent pid, state, start time) of ``pid`` from /proc, or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return int(fields[1]), fields[0], int(fields[19])


def _workers_of(root):
    """{pid: start time} of the loader workers of ``root``: the live processes below it with no
    children of their own, but multiprocessing's resource tracker. Under fork (and spawn) they
    are its children; under forkserver, the fork server's."""
    procs = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            st = _stat(int(name))
            if st is not None and st[1] not in "ZX":
                procs[int(name)] = st
    below, frontier = set(), {root}
    while frontier:
        frontier = {pid for pid, st in procs.items() if st[0] in frontier}
        below |= frontier
    parents = {st[0] for st in procs.values()}
    out = {}
    for pid in below - parents:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"resource_tracker" in f.read():
                    continue
        except FileNotFoundError:
            continue
        out[pid] = procs[pid][2]
    return out


def _alive(procs):
    """The pids of ``procs`` ({pid: start time}) still running (not zombies, not reused)."""
    live = []
    for pid, start in procs.items():
        st = _stat(pid)
        if st is not None and st[1] not in "ZX" and st[2] == start:
            live.append(pid)
    return live


class _Job:
    """The job in its own session, so whatever a failed test leaves behind is killed at the end."""

    def __init__(self, *args):
        env = dict(os.environ, PYTHONHASHSEED="0", OMP_NUM_THREADS="1")
        self.proc = subprocess.Popen([sys.executable, JOB, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, env=env, start_new_session=True)
        self.lines: "queue.Queue[str]" = queue.Queue()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.put(line.strip())
        self.lines.put("<eof>")

    def wait_for(self, prefix, timeout=STARTUP_S):
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self.lines.get(timeout=max(deadline - time.monotonic(), 0.01))
            except queue.Empty:
                raise AssertionError(f"the job printed no {prefix!r} in {timeout}s") from None
            if line == "<eof>":
                raise AssertionError(f"the job ended ({self.proc.wait()}) before {prefix!r}:\n{self.stderr()}")
            if line.startswith(prefix):
                return line

    def latest(self, prefix):
        """The last line starting with ``prefix`` printed so far (waits for one if none is queued)."""
        last = None
        while True:
            try:
                line = self.lines.get_nowait()
            except queue.Empty:
                return last if last is not None else self.wait_for(prefix)
            if line.startswith(prefix):
                last = line
            elif line == "<eof>":
                self.lines.put(line)
                return last if last is not None else self.wait_for(prefix)

    def workers(self, n=2, timeout=30.0):
        deadline = time.monotonic() + timeout
        while True:
            found = _workers_of(self.proc.pid)
            if len(found) == n or time.monotonic() > deadline:
                assert len(found) == n, f"expected {n} loader workers below pid {self.proc.pid}, found {found}"
                return found
            time.sleep(0.05)

    def kill_main(self):
        """SIGKILL the training process only, as the OOM killer does; return the time of the kill."""
        os.kill(self.proc.pid, signal.SIGKILL)
        t = time.monotonic()
        assert self.proc.wait(timeout=10) == -signal.SIGKILL
        return t

    def stderr(self):
        """The end of the job's stderr, after killing what is left of it (orphans hold the pipe)."""
        self._kill_all()
        return self.proc.stderr.read()[-3000:]

    def _kill_all(self):
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # orphans keep the job's process group
        except ProcessLookupError:
            pass
        self.proc.wait()

    def close(self):
        self._kill_all()
        self.reader.join(timeout=10)
        self.proc.stdout.close()
        self.proc.stderr.close()


def _gone_after(procs, killed_at, what):
    """Poll until none of ``procs`` runs; fail after DEADLINE_S. Returns the seconds it took."""
    while True:
        live = _alive(procs)
        took = time.monotonic() - killed_at
        if not live:
            print(f"\n{what}: all gone {took:.2f}s after the training process was killed")
            return took
        assert took < DEADLINE_S, f"{what} {live} still running {took:.1f}s after their training process was " \
                                  "SIGKILLed; they must exit with it (worker_parent.py)"
        time.sleep(0.05)


@pytest.mark.slow
@pytest.mark.parametrize("start", ["fork", "forkserver"])  # Linux's default; Python 3.14's default
def test_workers_exit_when_training_process_is_sigkilled(orphan_corpus, tok_path, start, record_property):
    job = _Job(orphan_corpus, tok_path, "stall" if start == "fork" else f"stall-{start}")
    try:
        job.wait_for("ready")
        workers = job.workers()
        time.sleep(0.5)  # the training process reads nothing more: the workers fill their pipe
        assert sorted(_alive(workers)) == sorted(workers)
        took = _gone_after(workers, job.kill_main(), "loader workers")
        record_property("orphan_exit_s", round(took, 2))
    finally:
        job.close()


@pytest.mark.slow
def test_workers_outlive_the_thread_that_started_them(orphan_corpus, tok_path, record_property):
    job = _Job(orphan_corpus, tok_path, "thread")
    try:
        job.wait_for("iter-done")
        workers = job.workers()
        job.wait_for("thread-ended")
        first = int(job.latest("step ").split()[1])
        time.sleep(ALIVE_S)
        last = int(job.latest("step ").split()[1])
        assert sorted(_alive(workers)) == sorted(workers), \
            f"workers {sorted(set(workers) - set(_alive(workers)))} died while their training process was alive"
        assert job.proc.poll() is None, f"the job died ({job.proc.returncode}):\n{job.stderr()}"
        assert last >= first + 10, f"the job went from step {first} to {last} in {ALIVE_S}s; its workers stalled?"
        assert _workers_of(job.proc.pid) == workers, "the workers were replaced"
        took = _gone_after(workers, job.kill_main(), "persistent workers of a finished thread")
        record_property("orphan_exit_s", round(took, 2))
    finally:
        job.close()


@pytest.mark.slow
def test_a_worker_whose_parent_died_before_the_call_exits(tok_path):
    job = _Job("-", tok_path, "late")
    try:
        child = int(job.wait_for("child ").split()[1])
        st = _stat(child)
        assert st is not None and st[0] == job.proc.pid, f"child {child} of job {job.proc.pid}: {st}"
        _gone_after({child: st[2]}, job.kill_main(), "a child that called exit_with_parent after its parent died")
    finally:
        job.close()
