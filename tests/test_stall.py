"""A worker that stops making progress is reported, never waited on for ever (issue 42; pipes/loader/stall.py).

A node of the user's blocks for good in one worker after a few documents; the training loop must get
a `RuntimeError` within the bound, naming the worker, the node and the call it is stuck in, with the
stacks, and the workers must be stopped.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import pytest

from tokenloom.pipes import (Batch, BestFitPack, Node, ReadParquet, ShardContext, ShardUnits, Tokenize,
                             TokenLoomLoader, list_parquet_units, load_encoder, resolve_files)
from tokenloom.pipes.loader.stall import check_stall_timeout, where
from tokenloom.pipes.roles import PASS


class StuckAfter(Node):
    """Passes documents through; in worker ``worker`` it waits for ever after ``after`` of them."""

    ROLE = PASS
    PARENT, SEEN = "parent", "seen"
    STATE_KEYS = (PARENT, SEEN)

    def __init__(self, parent, *, worker: int, after: int, this_worker: int):
        super().__init__(parent)
        self.parent, self.stuck = parent, this_worker == worker
        self.after, self.seen = after, 0

    def reset(self, initial_state=None):
        self.parent.reset(None if initial_state is None else initial_state[self.PARENT])
        self.seen = 0 if initial_state is None else initial_state[self.SEEN]

    def next(self):
        doc = next(self.parent)
        self.seen += 1
        if self.stuck and self.seen > self.after:
            wait_for_ever()
        return doc

    def get_state(self):
        return {self.PARENT: self.parent.state_dict(), self.SEEN: self.seen}


def wait_for_ever():
    while True:
        time.sleep(3600)


@dataclass
class StuckGraph:
    glob: str
    tokenizer: str
    worker: int = 1
    after: int = 40

    def __call__(self, ctx: ShardContext):
        units = list_parquet_units(resolve_files(self.glob), "text")
        node = ShardUnits(units.rows, shard=ctx.shard, num_shards=ctx.num_shards, seed=1, epochs=1,
                          first_epoch=ctx.round)
        node = ReadParquet(node, units, seed=1)
        node = Tokenize(node, load_encoder(self.tokenizer), bos=0)
        node = StuckAfter(node, worker=self.worker, after=self.after, this_worker=ctx.worker)
        node = BestFitPack(node, seq_len=127, buffer_size=8)
        return Batch(node, batch_size=2, seq_len=127)


@pytest.mark.timeout(90)
def test_a_worker_that_stops_delivering_is_named_with_its_node_and_call(corpus, tok_path):
    glob, _ = corpus
    loader = TokenLoomLoader(StuckGraph(glob, tok_path), config={}, num_workers=2, stall_timeout=3)
    got = 0
    t0 = time.monotonic()
    with pytest.raises(RuntimeError) as caught:
        for _ in loader:
            got += 1
    waited = time.monotonic() - t0
    message = str(caught.value)
    assert got > 0, "batches came before the worker stopped"
    assert waited < 30, f"reported after {waited:.0f} s, the bound is 3 s"
    assert "for 3.0 s (stall_timeout)" in message
    stuck = next(line for line in message.splitlines() if line.startswith("- worker 1"))
    assert "test_stall.py" in stuck and "wait_for_ever" in stuck, stuck  # the node, and the call it waits in
    assert "stall_timeout=" in message and "forkserver" in message  # what to do
    assert "--- worker 1" in message and "in next" in message  # the stacks
    pids = [int(line.split("pid ")[1].split(")")[0]) for line in message.splitlines()
            if line.startswith("- worker") and "pid " in line]
    assert len(pids) == 2
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.1)
    assert not any(_alive(p) for p in pids), "the workers are stopped after the report"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not yet reaped) is gone for our purpose
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[1].split()[0] != "Z"
    except OSError:
        return True


def test_a_loader_that_delivers_is_never_stopped_by_the_watch(corpus, tok_path):
    glob, _ = corpus
    loader = TokenLoomLoader(StuckGraph(glob, tok_path, after=10**9), config={}, num_workers=2, stall_timeout=3)
    assert len(list(loader)) > 50
    assert loader.stall_watch is not None and loader.timeout == 3


def test_the_bound_is_checked_and_can_be_switched_off(corpus, tok_path):
    glob, _ = corpus
    for bad in (0, -1, "5", True):
        with pytest.raises(ValueError, match="stall_timeout="):
            check_stall_timeout(bad)
    off = TokenLoomLoader(StuckGraph(glob, tok_path), config={}, num_workers=2, stall_timeout=None)
    assert off.stall_watch is None and off.timeout == 0
    theirs = TokenLoomLoader(StuckGraph(glob, tok_path), config={}, num_workers=2, timeout=7)
    assert theirs.timeout == 7 and theirs.stall_watch.bound == 7  # a user's own timeout is the bound


def test_where_reads_a_faulthandler_dump():
    dump = ('Thread 0x00007f01 (most recent call first):\n  File "/x/threading.py", line 320 in wait\n\n'
            'Current thread 0x00007f00 (most recent call first):\n'
            '  File "/a/site-packages/fastokens/__init__.py", line 9 in encode_batch_flat\n'
            '  File "/r/pipes/fastokens_engine.py", line 66 in encode_batch\n'
            '  File "/r/pipes/tokenize.py", line 110 in next\n'
            '  File "/v/site-packages/torchdata/nodes/base_node.py", line 80 in __next__\n')
    node, call = where(dump)
    assert node == "pipes/tokenize.py, line 110"
    assert call == "encode_batch_flat (fastokens/__init__.py, line 9)"
    assert where("") == ("unknown (no stack dumped)", "unknown")


def test_the_recipes_take_the_bound(corpus, tok_path):
    from tokenloom.recipes import pretrain

    glob, _ = corpus
    loader = pretrain(glob, tokenizer=tok_path, seq_len=63, batch_size=2, num_workers=2, epochs=1, stall_timeout=9)
    assert loader.stall_watch.bound == 9 and loader.timeout == 9
    assert pretrain(glob, tokenizer=tok_path, seq_len=63, batch_size=2, num_workers=2, stall_timeout=None).timeout == 0
    with pytest.raises(TypeError, match="did you mean stall_timeout="):
        pretrain(glob, tokenizer=tok_path, stall_timout=3)
