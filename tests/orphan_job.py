"""A training process whose loader workers tests/test_worker_orphans.py orphans with SIGKILL.

usage: orphan_job.py GLOB TOKENIZER MODE

MODE ``stall``: `pretrain(..., num_workers=2)` iterated in the main thread; after 3
batches it prints ``ready`` and stops reading (sleeps), so the workers fill their
queue's pipe and block writing into it, as when the OOM killer took the training
process in issue 14. MODE ``stall-forkserver`` (or ``stall-spawn``): the same with
workers started that way.

MODE ``thread``: persistent workers started by a thread that then ends: a thread
calls ``iter()`` on a `DevicePrefetcher` over the loader, prints ``iter-done`` and
returns 2 s later, then the main thread prints ``thread-ended`` and keeps taking
batches, printing ``step <n>`` about every 50 ms, for as long as it lives. (The
kernel's parent-death signal fires when the forking *thread* exits; workers must not.)

MODE ``late``: no loader; a multiprocessing child (fork) waits until this process
is gone and only then calls `exit_with_parent` (the parent died before the call).
Prints ``child <pid>``, then sleeps.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
import threading
import time


def build(glob, tokenizer, persistent, context=None):
    from tokenloom.recipes import pretrain

    return pretrain(glob, tokenizer=tokenizer, seq_len=127, batch_size=4, buffer_size=32, num_workers=2, seed=5,
                    persistent_workers=persistent, multiprocessing_context=context)


def stall(glob, tokenizer, context=None):
    it = iter(build(glob, tokenizer, persistent=False, context=context))
    for _ in range(3):
        next(it)
    print("ready", flush=True)
    while True:
        time.sleep(60)


def thread(glob, tokenizer):
    from tokenloom.pipes.loader.prefetch import DevicePrefetcher

    prefetcher = DevicePrefetcher(build(glob, tokenizer, persistent=True), device="cpu")
    made = []

    def start():
        made.append(iter(prefetcher))
        print("iter-done", flush=True)
        time.sleep(2.0)  # the test finds the workers while their forking thread still runs

    starter = threading.Thread(target=start, name="iter-then-exit")
    starter.start()
    starter.join()
    it = made[0]
    print("thread-ended", flush=True)
    step = 0
    while True:
        next(it)
        step += 1
        print(f"step {step}", flush=True)
        time.sleep(0.05)


def _late_child(parent):
    from tokenloom.pipes.loader.worker_parent import exit_with_parent

    while os.getppid() == parent:
        time.sleep(0.01)
    exit_with_parent()
    time.sleep(60)


def late():
    child = multiprocessing.get_context("fork").Process(target=_late_child, args=(os.getpid(),))
    child.start()
    print(f"child {child.pid}", flush=True)
    while True:
        time.sleep(60)


def main():
    glob, tokenizer, mode = sys.argv[1:]
    if mode == "stall":
        stall(glob, tokenizer)
    elif mode.startswith("stall-"):  # stall-spawn, stall-forkserver: workers started that way
        stall(glob, tokenizer, mode.split("-", 1)[1])
    elif mode == "thread":
        thread(glob, tokenizer)
    elif mode == "late":
        late()
    else:
        raise SystemExit(f"{mode=} must be one of stall, stall-forkserver, stall-spawn, thread, late")


if __name__ == "__main__":
    main()
