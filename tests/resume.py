"""The shared resume helper: every node and every recipe goes through it (the checks are the public
`tokenloom.testing`, which users run on their own nodes; `run_in_fresh_process` is the tests' own).

Two checks, one idea: run a pipeline uninterrupted and record what it yields;
then, at chosen steps, build a *fresh* pipeline, load the state saved at that
step, and assert that what follows is identical to the uninterrupted run.
Failures name the step.

- `check_node_resume(build)`: a node, saved at **every** step. Each restore is
  compared over the next ``horizon`` items, and the restores at the first,
  middle and last steps over the whole remainder. States are checked to be
  plain data and round-tripped through ``torch.save``/``torch.load(weights_only=True)``.
- `check_loader_resume(build)`: a loader (recipe or hand-built), saved after
  each of ``steps`` batches, restored into a freshly built loader.
- `run_in_fresh_process(...)`: the same through a state file and a new Python.
"""

from __future__ import annotations

import os
import subprocess
import sys

from tokenloom.testing import (assert_plain, batches_equal, check_loader_resume, check_node_resume,  # noqa: F401
                               items_equal, torch_roundtrip)


def run_in_fresh_process(script: str, *args: str, timeout: float = 240) -> str:
    """Run ``python script args...`` in a new interpreter; return its stdout, fail with its stderr."""
    env = dict(os.environ)
    env.setdefault("PYTHONHASHSEED", "0")
    proc = subprocess.run([sys.executable, script, *args], capture_output=True, text=True, timeout=timeout, env=env)
    assert proc.returncode == 0, f"{script} {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr[-4000:]}"
    return proc.stdout
