"""quiet_wakeup: the calling thread waits as SCHED_BATCH inside the block, and gets its own policy back."""

from __future__ import annotations

import os
import threading

import pytest

from tokenloom.pipes.loader.wakeup import quiet_wakeup

linux_only = pytest.mark.skipif(not hasattr(os, "SCHED_BATCH"), reason="scheduling policies are Linux's")


def in_thread(fn):
    out: list = []
    t = threading.Thread(target=lambda: out.append(fn()))
    t.start()
    t.join()
    return out[0]


@linux_only
def test_batch_inside_the_block_and_normal_after():
    def run():
        with quiet_wakeup():
            inside = os.sched_getscheduler(0)
        return inside, os.sched_getscheduler(0)

    assert in_thread(run) == (os.SCHED_BATCH, os.SCHED_OTHER)
    assert os.sched_getscheduler(0) == os.SCHED_OTHER  # only the calling thread changed


@linux_only
def test_a_policy_the_user_chose_is_left_alone():
    def run():
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        with quiet_wakeup():
            inside = os.sched_getscheduler(0)
        return inside, os.sched_getscheduler(0)

    assert in_thread(run) == (os.SCHED_IDLE, os.SCHED_IDLE)


@linux_only
def test_the_nice_value_is_kept():
    def run():
        os.nice(3)
        before = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        with quiet_wakeup():
            inside = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        return before, inside, os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    before, inside, after = in_thread(run)
    assert before == inside == after
