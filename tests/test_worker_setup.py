"""What tokenloom does once in each loader worker: glibc malloc settings, one tokenizing thread, then the
user's worker_init_fn."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

from tokenloom.recipes import pretrain


class RecordWorker:
    def __init__(self, folder):
        self.folder = folder

    def __call__(self, worker_id):
        with open(os.path.join(self.folder, f"worker-{worker_id}"), "w") as f:
            f.write(str(os.getpid()))
        with open(os.path.join(self.folder, f"env-{worker_id}"), "w") as f:
            f.write(os.environ.get("TOKENIZERS_PARALLELISM", "<unset>"))
        import gc

        with open(os.path.join(self.folder, f"gc-{worker_id}"), "w") as f:
            f.write(f"{list(gc.get_threshold())} {gc.get_freeze_count() > 0} {gc.isenabled()}")
        import pyarrow as pa

        with open(os.path.join(self.folder, f"pool-{worker_id}"), "w") as f:
            f.write(pa.default_memory_pool().backend_name)


def test_the_users_worker_init_fn_still_runs(corpus, tok_path, tmp_path):
    loader = pretrain(corpus[0], tokenizer=tok_path, seq_len=63, batch_size=2, buffer_size=16, num_workers=2,
                      worker_init_fn=RecordWorker(str(tmp_path)))
    next(iter(loader))
    pids = {open(tmp_path / f"worker-{w}").read() for w in (0, 1)}
    assert len(pids) == 2 and str(os.getpid()) not in pids


def test_workers_tokenize_on_one_thread_and_the_user_can_say_otherwise(corpus, tok_path, tmp_path, monkeypatch):
    monkeypatch.delenv("TOKENIZERS_PARALLELISM", raising=False)
    loader = pretrain(corpus[0], tokenizer=tok_path, seq_len=63, batch_size=2, buffer_size=16, num_workers=2,
                      worker_init_fn=RecordWorker(str(tmp_path)))
    next(iter(loader))
    # set before the user's worker_init_fn runs (so it can set it back), and only in the workers
    assert [open(tmp_path / f"env-{w}").read() for w in (0, 1)] == ["false", "false"]
    assert "TOKENIZERS_PARALLELISM" not in os.environ


def test_workers_collect_garbage_less_often_and_the_training_process_as_it_was(corpus, tok_path, tmp_path):
    """pipes/loader/worker_gc.py: in each worker what it inherited is frozen and the thresholds are raised;
    the training process keeps its own."""
    import gc

    from tokenloom.pipes.loader.worker_gc import THRESHOLDS

    before = gc.get_threshold()
    loader = pretrain(corpus[0], tokenizer=tok_path, seq_len=63, batch_size=2, buffer_size=16, num_workers=2,
                      worker_init_fn=RecordWorker(str(tmp_path)))
    next(iter(loader))
    assert [open(tmp_path / f"gc-{w}").read() for w in (0, 1)] == [f"{list(THRESHOLDS)} True True"] * 2
    assert gc.get_threshold() == before != THRESHOLDS and gc.isenabled()


def test_a_training_process_without_the_collector_gets_workers_without_it(corpus, tok_path, tmp_path):
    import gc

    gc.disable()
    try:
        loader = pretrain(corpus[0], tokenizer=tok_path, seq_len=63, batch_size=2, buffer_size=16, num_workers=2,
                          worker_init_fn=RecordWorker(str(tmp_path)))
        next(iter(loader))
        assert not gc.isenabled()
    finally:
        gc.enable()
    assert [open(tmp_path / f"gc-{w}").read().split()[-1] for w in (0, 1)] == ["False"] * 2


_at_fork = {"on": False, "enabled": [], "canary": None}


def _before_fork():
    if _at_fork["on"]:
        import gc

        _at_fork["enabled"].append(gc.isenabled())


def _in_child():
    if _at_fork["on"] and _at_fork["canary"] is not None:
        import gc

        # what the collector inherited is collected in the child only if it runs before the worker freezes it
        gc.unfreeze()
        gc.set_threshold(1, 1, 1)
        # a full collection where the collector is on: it runs once the objects that survived the younger
        # generations since the last one are a quarter of the oldest generation's
        _ = [[] for _ in range(len(gc.get_objects(2)) // 2)]


class _Canary:
    def __init__(self, path):
        self.path, self.pid, self.me = path, os.getpid(), self

    def __del__(self):
        if os.getpid() != self.pid:
            with open(self.path, "a") as f:
                f.write(f"{os.getpid()}\n")


def test_no_collection_while_the_workers_are_forked_nor_in_them_before_they_settle(corpus, tok_path, tmp_path):
    """pipes/loader/worker_gc.py: a collection in the training process during the forks could finalize an
    earlier loader's iterator mid-fork; one in a worker before it freezes what it inherited would run
    the __del__ of the training process's garbage there (an old iterator stopping workers that are not
    its children). A garbage object with a __del__, frozen in the training process so that it survives
    to the fork, is unfrozen in each child right after the fork, and allocations follow: no worker may
    collect it."""
    import gc

    if not _at_fork.get("registered"):
        os.register_at_fork(before=_before_fork, after_in_child=_in_child)
        _at_fork["registered"] = True
    _at_fork["enabled"].clear()
    canary = str(tmp_path / "collected-in")
    loader = pretrain(corpus[0], tokenizer=tok_path, seq_len=63, batch_size=2, buffer_size=16, num_workers=2)
    _Canary(canary)  # garbage at once: a cycle, left to the collector
    gc.freeze()
    _at_fork.update(on=True, canary=canary)
    try:
        next(iter(loader))
    finally:
        _at_fork["on"] = False
        gc.unfreeze()
        gc.collect()
    assert not os.path.exists(canary), open(canary).read()
    assert _at_fork["enabled"] == [False, False]  # the training process did not collect during the forks
    assert not os.path.exists(canary), open(canary).read()


def test_workers_take_arrows_buffers_from_jemalloc_and_the_training_process_keeps_its_pool(corpus, tok_path,
                                                                                           tmp_path, monkeypatch):
    """pipes/loader/worker_memory.py: mimalloc, pyarrow's default, kept far more freed memory than it held
    in a worker reopening row groups for many sources."""
    import pyarrow as pa

    from tokenloom.pipes.loader.worker_memory import ARROW_POOL

    monkeypatch.delenv("ARROW_DEFAULT_MEMORY_POOL", raising=False)
    before = pa.default_memory_pool().backend_name
    loader = pretrain(corpus[0], tokenizer=tok_path, seq_len=63, batch_size=2, buffer_size=16, num_workers=2,
                      worker_init_fn=RecordWorker(str(tmp_path)))
    next(iter(loader))
    assert ARROW_POOL == "jemalloc"
    want = ARROW_POOL if _has_pool(pa, ARROW_POOL) else before
    assert [open(tmp_path / f"pool-{w}").read() for w in (0, 1)] == [want] * 2
    assert pa.default_memory_pool().backend_name == before


def _has_pool(pa, name):
    try:
        getattr(pa, f"{name}_memory_pool")()
    except (AttributeError, NotImplementedError):
        return False
    return True


@pytest.mark.parametrize("case", ["the user's pool", "a pool this pyarrow lacks"])
def test_the_arrow_pool_is_left_as_it_is_where_it_should_be(case):
    """A pool the user chose (``ARROW_DEFAULT_MEMORY_POOL``) is kept; a pyarrow built without `ARROW_POOL`
    keeps its default."""
    code = {
        "the user's pool": "import pyarrow as pa; from tokenloom.pipes.loader.worker_memory import "
                           "settle_worker_arrow_pool as s; print(s(), pa.default_memory_pool().backend_name)",
        "a pool this pyarrow lacks": "import pyarrow as pa; import tokenloom.pipes.loader.worker_memory as m; "
                                     "d = pa.default_memory_pool().backend_name; m.ARROW_POOL = 'nonesuch'; "
                                     "print(m.settle_worker_arrow_pool() == d, "
                                     "pa.default_memory_pool().backend_name == d)",
    }[case]
    env = dict(os.environ)
    env.pop("ARROW_DEFAULT_MEMORY_POOL", None)
    if case == "the user's pool":
        env["ARROW_DEFAULT_MEMORY_POOL"] = "system"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env).stdout
    assert out.split() == {"the user's pool": ["system", "system"], "a pool this pyarrow lacks": ["True", "True"]}[case]


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc only")
def test_malloc_settings_apply_on_glibc():
    code = "from tokenloom.pipes.loader.worker_memory import settle_worker_malloc; print(settle_worker_malloc())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "True"


def test_workers_keep_about_a_million_tokens_ready_unless_told(corpus, tok_path):
    from tokenloom.recipes.packed import default_prefetch_factor

    assert default_prefetch_factor(8, 2048) == 64  # 16k tokens a batch
    assert default_prefetch_factor(32, 4096) == 8  # 131k tokens: at least 8 batches
    assert default_prefetch_factor(2, 63) == 64  # tiny batches: at most 64
    assert default_prefetch_factor(4, 16383) == 16
    kw = dict(tokenizer=tok_path, seq_len=63, batch_size=2, buffer_size=16, num_workers=2)
    assert pretrain(corpus[0], **kw).prefetch_factor == 64
    assert pretrain(corpus[0], prefetch_factor=3, **kw).prefetch_factor == 3


def test_reading_parquet_does_not_import_pandas(corpus, tok_path):
    """pyarrow imports pandas on its first pa.array() call: 0.15-0.2 s of every worker's first batch."""
    import subprocess
    import sys

    code = ("import sys; from tokenloom.recipes import pretrain; "
            f"next(iter(pretrain({corpus[0]!r}, tokenizer={tok_path!r}, seq_len=63, batch_size=2, buffer_size=4))); "
            "print('pandas' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "False"


@pytest.mark.slow
@pytest.mark.parametrize("times", [3, pytest.param(12, marks=pytest.mark.soak)])
def test_loaders_started_from_two_threads_at_once_fork_one_at_a_time(demo_corpus, times):
    """Issue 34: on a GPU machine's Python (3.12, filelock auditing forks) two ranks simulated as threads
    failed with 'os.fork is unsafe while filelock is changing descriptor ownership': each started its
    workers while the other was inside its fork. Loader starts in one process now take turns.
    3 rounds of both ranks starting at once in `make test`; 12 under `make fuzz` (-m soak)."""
    pytest.importorskip("filelock._core._fork")
    job = os.path.join(os.path.dirname(__file__), "fork_race_job.py")
    proc = subprocess.run([sys.executable, job, str(times), demo_corpus["root"]], capture_output=True, text=True,
                          timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "[]", proc.stdout[-2000:]
