"""The shared resume helper: every node and every recipe goes through it.

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

import io
import os
import subprocess
import sys
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence

import numpy as np
import torch

PLAIN_SCALARS = (int, float, str, bool, type(None))


def assert_plain(state: Any, path: str = "state") -> None:
    """States must be plain data: ints, floats, strings, bools, None, lists/tuples and str-keyed dicts."""
    if isinstance(state, PLAIN_SCALARS):
        return
    if isinstance(state, (list, tuple)):
        for i, v in enumerate(state):
            assert_plain(v, f"{path}[{i}]")
        return
    if isinstance(state, dict):
        for k, v in state.items():
            assert isinstance(k, str), f"{path} has a non-string key {k!r}"
            assert_plain(v, f"{path}[{k!r}]")
        return
    raise AssertionError(f"{path} is a {type(state).__name__}, not plain data: {state!r:.200}")


def torch_roundtrip(state: Any) -> Any:
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def items_equal(a: Any, b: Any) -> bool:
    """Deep equality that understands numpy arrays and tensors (bitwise, dtype included)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                and a.shape == b.shape and torch.equal(a, b))
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return (isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and a.dtype == b.dtype
                and a.shape == b.shape and bool(np.array_equal(a, b)))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(items_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(items_equal(x, y) for x, y in zip(a, b))
    return a == b


def _take(it: Iterable, n: Optional[int]) -> List[Any]:
    out = []
    for x in it:
        out.append(x)
        if n is not None and len(out) >= n:
            break
    return out


def check_node_resume(build: Callable[[], Any], *, max_steps: int = 300, horizon: int = 4,
                      full_at: Sequence[str] = ("first", "middle", "last")) -> int:
    """Save ``build()``'s state at every step (up to ``max_steps``) and check each restore.

    Returns the number of steps checked (so a caller can assert the pipeline was not empty).
    """
    node = build()
    node.reset(None)
    items: List[Any] = []
    states: List[Dict[str, Any]] = [node.state_dict()]
    for _ in range(max_steps):
        try:
            items.append(next(node))
        except StopIteration:
            break
        states.append(node.state_dict())
    keys0 = _key_tree(states[0])
    n = len(items)
    full = {"first": 0, "middle": n // 2, "last": n}
    full_steps = {full[f] for f in full_at}
    for k, state in enumerate(states):
        assert_plain(state, f"state at step {k}")
        assert _key_tree(state) == keys0, f"state keys changed at step {k}: {_key_tree(state)} vs {keys0}"
        restored = build()
        restored.reset(torch_roundtrip(state))
        want = items[k:] if k in full_steps else items[k:k + horizon]
        got = _take(restored, len(want)) if want else []
        for j, (w, g) in enumerate(zip(want, got)):
            assert items_equal(w, g), f"restored at step {k}: item {k + j} differs from the uninterrupted run"
        assert len(got) == len(want), f"restored at step {k}: got {len(got)} items, expected {len(want)}"
        if k in full_steps and n < max_steps:
            # the uninterrupted run ended here; so must the restored one
            try:
                extra = next(restored)
            except StopIteration:
                pass
            else:
                raise AssertionError(f"restored at step {k}: yields an extra item after the end: {extra!r:.100}")
    return n


def _key_tree(state: Any) -> Any:
    if isinstance(state, dict):
        return {k: _key_tree(v) for k, v in state.items() if isinstance(v, dict)} | {"": tuple(sorted(state))}
    return None


def batches_equal(a: Dict[str, torch.Tensor], b: Dict[str, torch.Tensor]) -> bool:
    return items_equal(a, b)


def check_loader_resume(build: Callable[[], Any], *, steps: Sequence[int], total: Optional[int] = None,
                        reference: Optional[List[Any]] = None, roundtrip: bool = True) -> List[Any]:
    """For each k in ``steps``: run a fresh loader k batches, save, restore into another fresh
    loader, and compare what follows with an uninterrupted run (``total`` batches, or to the end).

    Returns the uninterrupted reference batches.
    """
    if reference is None:
        reference = _take(build(), total)
    n = len(reference)
    for k in steps:
        assert k <= n, f"step {k} is past the end of the stream ({n} batches)"
        loader = build()
        it = iter(loader)
        head = [next(it) for _ in range(k)]
        for j, (w, g) in enumerate(zip(reference, head)):
            assert items_equal(w, g), f"before saving at step {k}: batch {j} differs (the pipeline is not deterministic)"
        state = loader.state_dict()
        assert_plain(state, f"loader state at step {k}")
        if roundtrip:
            state = torch_roundtrip(state)
        del it, loader
        resumed = build()
        resumed.load_state_dict(state)
        rest = _take(resumed, n - k if total is not None else None)
        for j, (w, g) in enumerate(zip(reference[k:], rest)):
            assert items_equal(w, g), f"resumed at step {k}: batch {k + j} differs from the uninterrupted run"
        assert len(rest) == n - k, f"resumed at step {k}: got {len(rest)} batches, expected {n - k}"
    return reference


def run_in_fresh_process(script: str, *args: str, timeout: float = 240) -> str:
    """Run ``python script args...`` in a new interpreter; return its stdout, fail with its stderr."""
    env = dict(os.environ)
    env.setdefault("PYTHONHASHSEED", "0")
    proc = subprocess.run([sys.executable, script, *args], capture_output=True, text=True, timeout=timeout, env=env)
    assert proc.returncode == 0, f"{script} {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr[-4000:]}"
    return proc.stdout
