"""Resume checks for your own nodes and loaders, in your own tests: what tokenloom runs on every
node and recipe it ships (its tests go through these same functions).

A resumed run must be the uninterrupted run. Both checks run a pipeline once, uninterrupted, and
record what it yields; then, at chosen steps, build a *fresh* pipeline, load the state saved at that
step and compare what follows, bit for bit. A failure raises ``AssertionError`` naming the step and
the item (pytest shows it as a failed check).

- `check_node_resume(build)`: a node (``build()`` makes it from scratch), saved at **every** step up to
  ``max_steps``. Each restore is compared over the next ``horizon`` items, and the restores at the
  first, middle and last steps over the whole rest. Every state must be plain data (`assert_plain`),
  keep the same keys, and survive ``torch.save``/``torch.load(weights_only=True)``.
- `check_loader_resume(build, steps=[...])`: a loader (a recipe's, or ``TokenLoomLoader`` over your
  graph), saved after each of ``steps`` batches, restored into a freshly built loader.

Example, for a node written as the README's "Composing your own node" shows::

    from tokenloom.testing import check_loader_resume, check_node_resume

    def test_my_filter_resumes():
        n = check_node_resume(lambda: LengthFilter(Tokenize(reader(), encoder), min_tokens=5))
        assert n > 0  # the pipeline was not empty

    def test_my_graph_resumes_through_the_loader():
        check_loader_resume(lambda: TokenLoomLoader(MyGraph(), config={...}, num_workers=2),
                            steps=[0, 1, 7], total=20)
"""

from __future__ import annotations

import io
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence

import numpy as np
import torch

__all__ = ["assert_plain", "batches_equal", "check_loader_resume", "check_node_resume", "items_equal",
           "torch_roundtrip"]


def _check(ok: Any, message: str) -> None:
    """An ``assert`` that ``python -O`` keeps."""
    if not ok:
        raise AssertionError(message)


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
            _check(isinstance(k, str), f"{path} has a non-string key {k!r}")
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
        _check(_key_tree(state) == keys0, f"state keys changed at step {k}: {_key_tree(state)} vs {keys0}")
        restored = build()
        restored.reset(torch_roundtrip(state))
        want = items[k:] if k in full_steps else items[k:k + horizon]
        got = _take(restored, len(want)) if want else []
        for j, (w, g) in enumerate(zip(want, got)):
            _check(items_equal(w, g), f"restored at step {k}: item {k + j} differs from the uninterrupted run")
        _check(len(got) == len(want), f"restored at step {k}: got {len(got)} items, expected {len(want)}")
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
        _check(k <= n, f"step {k} is past the end of the stream ({n} batches)")
        loader = build()
        it = iter(loader)
        head = [next(it) for _ in range(k)]
        for j, (w, g) in enumerate(zip(reference, head)):
            _check(items_equal(w, g), f"before saving at step {k}: batch {j} differs (the pipeline is not deterministic)")
        state = loader.state_dict()
        assert_plain(state, f"loader state at step {k}")
        if roundtrip:
            state = torch_roundtrip(state)
        del it, loader
        resumed = build()
        resumed.load_state_dict(state)
        rest = _take(resumed, n - k if total is not None else None)
        for j, (w, g) in enumerate(zip(reference[k:], rest)):
            _check(items_equal(w, g), f"resumed at step {k}: batch {k + j} differs from the uninterrupted run")
        _check(len(rest) == n - k, f"resumed at step {k}: got {len(rest)} batches, expected {n - k}")
    return reference
