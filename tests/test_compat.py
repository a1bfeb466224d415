"""Other packages' internals are used in pipes/compat/ only, each with a fallback a test forces
(issue 36): torchdata's iterator hook and worker shutdown, tiktoken's core, Accelerate's question.
The flat snapshots' fallback is forced in tests/test_wire.py, the direct queue's in
tests/test_direct_queue.py."""

from __future__ import annotations

import gc
import io
import os
import pathlib
import tokenize

import numpy as np
import pytest
import torch

import tokenloom
from tokenloom.pipes.compat import tiktoken as tiktoken_compat
from tokenloom.pipes.compat import torchdata as torchdata_compat
from tokenloom.pipes.loader.bridge import decode_state
from tokenloom.recipes import pretrain

from .conftest import write_corpus
from .resume import items_equal, torch_roundtrip

ROOT = pathlib.Path(tokenloom.__file__).resolve().parent.parent
#: Private names of torch, torchdata, multiprocessing, tiktoken and Accelerate the library uses.
PRIVATE = {"_get_iterator", "_iterator", "_shutdown_workers", "_update_snapshot", "_IncrementalWorkerState",
           "incremental_state", "_StatefulMultiProcessingDataLoaderIter", "_core_bpe", "_send_bytes", "_wlock",
           "_is_accelerate_prepared", "_snapshot"}


def _private_uses(path: pathlib.Path):
    """``(line, name)`` where the code (not its docstrings or comments) names a private internal:
    an identifier, a string such as getattr's, or an import of ``multiprocessing.queues``."""
    tokens = list(tokenize.generate_tokens(io.StringIO(path.read_text()).readline))
    for i, tok in enumerate(tokens):
        if tok.type == tokenize.NAME and tok.string in PRIVATE:
            yield tok.start[0], tok.string
        elif tok.type == tokenize.STRING and tok.string.strip("\"'") in PRIVATE:
            yield tok.start[0], tok.string
        elif tok.type == tokenize.NAME and tok.string == "queues" and i >= 2 and tokens[i - 2].string == "multiprocessing":
            yield tok.start[0], "multiprocessing.queues"


def test_no_module_outside_compat_uses_another_packages_internals():
    found = [f"{path.relative_to(ROOT)}:{line}: {name}"
             for top in ("pipes", "recipes", "tokenloom") for path in sorted((ROOT / top).rglob("*.py"))
             if "compat" not in path.parts for line, name in _private_uses(path)]
    assert not found, found


def test_the_scan_finds_a_private_use(tmp_path):
    path = tmp_path / "m.py"
    path.write_text('"""Mentions _core_bpe in a docstring."""\nimport multiprocessing.queues as q\n'
                    'x = enc._core_bpe  # _wlock in a comment\ny = getattr(it, "_shutdown_workers", None)\n')
    assert [n for _, n in _private_uses(path)] == ["multiprocessing.queues", "_core_bpe", '"_shutdown_workers"']


# --- tiktoken ----------------------------------------------------------------------------------

class _PublicOnly:
    """A tiktoken Encoding as its public API shows it: no core."""

    def __init__(self, enc):
        self.encode_ordinary = enc.encode_ordinary


def test_tiktoken_fallback_gives_the_cores_ids_and_refuses_the_same_texts(tok_path):
    from tokenloom.pipes import tiktoken_bpe

    with open(tok_path, encoding="utf-8") as f:
        enc = tiktoken_bpe.encoding(f.read())
    fast, public = tiktoken_compat.ordinary_encoder(enc), tiktoken_compat.ordinary_encoder(_PublicOnly(enc))
    for text in ("def f(x):\n\treturn x  # ü 😀", "<|bos|> is text here", "", "a" * 5000):
        got = public(text)
        assert got.dtype == np.int32 and np.array_equal(got, fast(text)), text
    for encode in (fast, public):
        with pytest.raises(UnicodeEncodeError):
            encode("lone \ud800 surrogate")


# --- torchdata ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("compat"))
    write_corpus(root, [f"doc {i} " + "word " * (3 + i * 11 % 90) for i in range(240)], files=1, row_group_size=30)
    return root


def _run(corpus, tok_path, n, state=None, **kw):
    loader = pretrain(corpus, tokenizer=tok_path, seq_len=63, batch_size=2, buffer_size=16, seed=3, num_workers=2,
                      epochs=1, **kw)
    if state is not None:
        loader.load_state_dict(state)
    it = iter(loader)
    batches = [next(it) for _ in range(n)]
    return loader, it, batches


def _positions(state):
    """A loader state without torch's random base seed for worker processes (drawn per iterator,
    unused by tokenloom's graphs) and the digest over it."""
    inner = decode_state(state)
    inner["loader"]["_snapshot"]["_main_snapshot"].pop("_base_seed")
    return inner


@pytest.mark.parametrize("persistent", [False, True])
def test_without_torchdatas_iterator_hook_batches_states_and_stats_are_the_same(corpus, tok_path, monkeypatch,
                                                                                 persistent):
    assert torchdata_compat.iterator_hook_ok()  # the pinned torchdata
    ref, _, want = _run(corpus, tok_path, 8, persistent_workers=persistent)
    state = torch_roundtrip(ref.state_dict())
    _, _, after = _run(corpus, tok_path, 4, state=state, persistent_workers=persistent)
    monkeypatch.setattr(torchdata_compat, "iterator_hook_ok", lambda: False)
    loader, it, got = _run(corpus, tok_path, 8, persistent_workers=persistent)
    assert loader.ring_bytes is None  # batches through the pipe: no hook to make rings for new workers
    assert items_equal(got, want)
    assert loader.stats() == ref.stats()
    assert _positions(loader.state_dict()) == _positions(state)
    _, _, resumed = _run(corpus, tok_path, 4, state=state, persistent_workers=persistent)
    assert items_equal(resumed, after)
    # a second round on the same loader: persistent workers are reused or made again, either way
    rest = list(it)
    again = next(iter(loader))
    assert rest and isinstance(again["input_ids"], torch.Tensor)


def test_stop_workers_without_torchs_shutdown_leaves_them_to_the_collector():
    class Loader:
        _iterator = None

    class Bare:  # an iterator without _shutdown_workers
        pass

    loader, it = Loader(), Bare()
    loader._iterator = it
    torchdata_compat.stop_workers(loader, it)
    assert torchdata_compat.current_iterator(loader) is it  # nothing stopped, nothing forgotten


def _garbage_with(make_garbage):
    """The type names of what the collector finds unreachable together, once ``make_garbage()`` has
    dropped the last references (the objects are saved, not freed, then let go)."""
    gc.collect()
    make_garbage()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        gc.collect()
        names = [type(o).__name__ for o in gc.garbage]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
    gc.collect()
    return names


def test_an_iterator_left_to_the_collector_shuts_its_workers_down_with_its_queues_intact(corpus, tok_path):
    """A loader and its iterator in a reference cycle (as a trainer's objects hold them) are freed by
    the collector. Its queues and worker processes must not be in that batch: the collector would
    finalize them in any order, closing their pipes before the iterator's __del__ uses them (a stale
    descriptor closed twice: EBADF at another loader's fork, issue 46's notes)."""
    kept = torchdata_compat.kept_for_shutdown()
    pids = []

    def drop():
        loader, it, _ = _run(corpus, tok_path, 3)
        pids.extend(w.pid for w in loader._iterator._workers)
        assert torchdata_compat.kept_for_shutdown() == kept + 1
        holder = {"loader": loader, "it": it}
        holder["self"] = holder  # reachable only through this cycle once dropped

    garbage = _garbage_with(drop)
    assert "_StatefulMultiProcessingDataLoaderIter" in garbage  # the cycle was the collector's to free
    assert not {"DirectQueue", "Queue", "Connection", "ForkProcess", "Popen"} & set(garbage), garbage
    assert torchdata_compat.kept_for_shutdown() == kept  # let go once the iterator went
    for pid in pids:  # the workers got their exit message and were joined
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_an_iterator_without_the_parts_of_torchs_shutdown_is_left_to_the_collector():
    class Bare:  # another torchdata's iterator: nothing to keep
        pass

    class Slotted:  # the parts, but no weak references: nothing could let go of them
        __slots__ = ("_workers", "_index_queues", "_shutdown_workers")

    kept = torchdata_compat.kept_for_shutdown()
    it = Bare()
    assert torchdata_compat.keep_for_shutdown(it) is it
    slotted = Slotted()
    slotted._workers, slotted._index_queues, slotted._shutdown_workers = [], [], lambda: None
    assert torchdata_compat.keep_for_shutdown(slotted) is slotted
    assert torchdata_compat.kept_for_shutdown() == kept


# --- Accelerate --------------------------------------------------------------------------------

def test_the_loader_answers_accelerates_question_and_takes_its_device(corpus, tok_path, monkeypatch):
    from tokenloom.pipes.compat import accelerate as accelerate_compat

    loader = pretrain(corpus, tokenizer=tok_path, seq_len=63, batch_size=2)
    assert loader.batch_device is None
    monkeypatch.setattr(accelerate_compat, "accelerator_device", lambda: torch.device("meta"))
    assert loader._is_accelerate_prepared is True
    assert loader.batch_device == torch.device("meta")
    loader._is_accelerate_prepared = False  # what Accelerate sets on loaders it prepared: ignored
    monkeypatch.setattr(accelerate_compat, "accelerator_device", lambda: None)  # CPU, or not Accelerate
    assert loader._is_accelerate_prepared is True and loader.batch_device is None
