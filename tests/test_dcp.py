"""The loader itself in torch.distributed.checkpoint, in one process (no torchrun).

``dcp.save({"model": ..., "dataloader": loader})`` / ``dcp.load(...)`` resume exactly; a
checkpoint holding two simulated ranks' entries (what a 2-rank save writes) restores each
rank; a state stitched from two ranks, or another rank's state, is refused;
`read_loader_states` reads every rank's entry back for an elastic resume and names what is
missing. The earlier `DCPLoaderState` (JSON tensor) still loads its checkpoints.
Two ranks under torchrun: test_torchrun.py.
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import BytesStorageMetadata

from tokenloom.pipes.loader.checkpoint import DCPLoaderState, read_loader_states, state_from_tensor, state_to_tensor
from tokenloom.pipes.loader.bridge import KEY_PREFIX, decode_state
from tokenloom.recipes import pretrain

from .resume import assert_plain, items_equal


def _single(fn, *args, **kw):
    with warnings.catch_warnings():  # "assuming the intent is to ... in a single process": it is
        warnings.filterwarnings("ignore", message=".*single process.*")
        return fn(*args, checkpoint_id=kw.pop("checkpoint_id"), no_dist=True, **kw)


def _builder(corpus, tok_path, **kw):
    glob, _ = corpus
    args = dict(tokenizer=tok_path, seq_len=63, batch_size=2, buffer_size=40, seed=3)
    return lambda **more: pretrain(glob, **{**args, **kw, **more})


def _advance(loader, n):
    it = iter(loader)
    for _ in range(n):
        next(it)
    return it


def _two_ranks(build, steps=4):
    """Two simulated ranks (rank=, world_size=2), ``steps`` batches in; their iterators."""
    loaders = [build(rank=r, world_size=2) for r in (0, 1)]
    return loaders, [_advance(lo, steps) for lo in loaders]


def _stitch(own: str, other: str, part: str = "loader") -> str:
    """``own``'s JSON with ``part`` taken from ``other`` (its digest left as it was)."""
    body = json.loads(own)
    body[part] = json.loads(other)[part]
    return json.dumps(body)


# --- the loader itself through dcp.save / dcp.load ------------------------------------

@pytest.mark.parametrize("num_workers", [0, 2])
def test_loader_itself_in_dcp_resumes_exactly(corpus, tok_path, tmp_path, num_workers):
    build = _builder(corpus, tok_path, num_workers=num_workers)
    loader = build()
    it = _advance(loader, 5)
    model = torch.nn.Linear(3, 2)
    ckpt = str(tmp_path / "ckpt")
    _single(dcp.save, {"model": model.state_dict(), "dataloader": loader}, checkpoint_id=ckpt)
    want = [next(it) for _ in range(4)]

    meta = FileSystemReader(ckpt).read_metadata().state_dict_metadata
    assert isinstance(meta[f"dataloader.{KEY_PREFIX}0"], BytesStorageMetadata), meta  # one str, whole
    assert not [k for k in meta if k.startswith(f"dataloader.{KEY_PREFIX}0.")], "the state was flattened into leaves"

    resumed, fresh = build(), torch.nn.Linear(3, 2)
    state = {"model": fresh.state_dict(), "dataloader": resumed}
    _single(dcp.load, state, checkpoint_id=ckpt)
    fresh.load_state_dict(state["model"])
    assert items_equal(fresh.state_dict(), model.state_dict())
    rit = iter(resumed)
    for j, w in enumerate(want):
        assert items_equal(w, next(rit)), f"batch {5 + j} after the DCP round trip differs ({num_workers=})"


def test_two_ranks_entries_in_one_checkpoint_each_resume_exactly(corpus, tok_path, tmp_path):
    """What a 2-rank ``dcp.save({"dataloader": loader})`` writes: one entry per rank. Each
    rank's fresh loader takes its own; a 1-rank loader is refused (world size) rather than
    silently taking rank 0's position."""
    build = _builder(corpus, tok_path)
    loaders, its = _two_ranks(build)
    ckpt = str(tmp_path / "ckpt")
    _single(dcp.save, {"dataloader": {**loaders[0].state_dict(), **loaders[1].state_dict()}}, checkpoint_id=ckpt)
    want = [[next(it) for _ in range(3)] for it in its]
    assert not items_equal(want[0][0], want[1][0]), "the two ranks must read different data"

    for r in (0, 1):
        resumed = build(rank=r, world_size=2)
        _single(dcp.load, {"dataloader": resumed}, checkpoint_id=ckpt)
        rit = iter(resumed)
        for j, w in enumerate(want[r]):
            assert items_equal(w, next(rit)), f"rank {r}: batch {4 + j} after DCP differs"

    with pytest.raises(ValueError, match="world_size"):
        _single(dcp.load, {"dataloader": build()}, checkpoint_id=ckpt)


# --- refused: stitched states, another rank's state -------------------------------------

@pytest.mark.parametrize("part", ["loader", "tokenloom"])
def test_state_stitched_from_two_ranks_is_refused_naming_the_digest(corpus, tok_path, tmp_path, part):
    build = _builder(corpus, tok_path)
    loaders, _ = _two_ranks(build)
    texts = [loaders[r].state_dict()[f"{KEY_PREFIX}{r}"] for r in (0, 1)]
    stitched = {f"{KEY_PREFIX}0": _stitch(texts[0], texts[1], part)}

    with pytest.raises(ValueError, match="does not match its digest.*stitched"):
        build(rank=0, world_size=2).load_state_dict(stitched)
    with pytest.raises(ValueError, match="digest"):
        decode_state(stitched)

    ckpt = str(tmp_path / "ckpt")  # the same through DCP, and through read_loader_states
    _single(dcp.save, {"dataloader": {**stitched, f"{KEY_PREFIX}1": texts[1]}}, checkpoint_id=ckpt)
    with pytest.raises(ValueError, match="digest"):
        _single(dcp.load, {"dataloader": build(rank=0, world_size=2)}, checkpoint_id=ckpt)
    with pytest.raises(ValueError, match=f"checkpoint '{ckpt}' entry 'dataloader.{KEY_PREFIX}0'.*digest"):
        read_loader_states(ckpt)


def test_another_ranks_state_is_refused(corpus, tok_path, tmp_path):
    build = _builder(corpus, tok_path)
    loaders, _ = _two_ranks(build)
    one = loaders[1].state_dict()
    with pytest.raises(ValueError, match=r"rank: saved with 1, this loader has 0"):
        build(rank=0, world_size=2).load_state_dict(one)
    relabelled = {f"{KEY_PREFIX}0": one[f"{KEY_PREFIX}1"]}  # rank 1's text under rank 0's key
    with pytest.raises(ValueError, match="holds the state of rank 1"):
        build(rank=0, world_size=2).load_state_dict(relabelled)

    ckpt = str(tmp_path / "ckpt")
    _single(dcp.save, {"dataloader": {**relabelled, **one}}, checkpoint_id=ckpt)
    with pytest.raises(ValueError, match="holds the state of rank 1"):
        _single(dcp.load, {"dataloader": build(rank=0, world_size=2)}, checkpoint_id=ckpt)


# --- read_loader_states -------------------------------------------------------------------

def test_read_loader_states_gives_every_rank_sorted(corpus, tok_path, tmp_path):
    build = _builder(corpus, tok_path)
    loaders, _ = _two_ranks(build)
    states = [lo.state_dict() for lo in loaders]
    ckpt = str(tmp_path / "ckpt")
    model = torch.nn.Linear(3, 2)
    # saved in reverse order, under another key, beside a model
    _single(dcp.save, {"model": model.state_dict(), "dl": {**states[1], **states[0]}}, checkpoint_id=ckpt)
    assert read_loader_states(ckpt, key="dl") == states
    assert read_loader_states(FileSystemReader(ckpt), key="dl") == states
    assert [decode_state(s)["tokenloom"]["config"]["rank"] for s in read_loader_states(ckpt, key="dl")] == [0, 1]
    with pytest.raises(ValueError, match=rf"no loader state under 'dataloader\.{KEY_PREFIX}<rank>'.*"
                                         rf"\['dl\.{KEY_PREFIX}0', 'dl\.{KEY_PREFIX}1'\].*pass key="):
        read_loader_states(ckpt)


class _NotAState:
    pass


def test_read_loader_states_names_the_checkpoint_and_what_is_missing(corpus, tok_path, tmp_path):
    build = _builder(corpus, tok_path)
    loaders, _ = _two_ranks(build)
    one = str(tmp_path / "only_rank1")
    _single(dcp.save, {"dataloader": loaders[1].state_dict()}, checkpoint_id=one)
    with pytest.raises(ValueError, match=rf"checkpoint '{one}' was saved with world_size=2 but holds loader states "
                                         rf"of ranks \[1\]: ranks \[0\] missing \(keys \['dataloader\.{KEY_PREFIX}0'\]\)"):
        read_loader_states(one)

    mixed = str(tmp_path / "mixed")  # rank 0 of a 1-rank run beside rank 1 of a 2-rank run
    _single(dcp.save, {"dataloader": {**build().state_dict(), **loaders[1].state_dict()}}, checkpoint_id=mixed)
    with pytest.raises(ValueError, match=r"different world sizes \(rank: world_size \{0: 1, 1: 2\}\)"):
        read_loader_states(mixed)

    nothing = str(tmp_path / "model_only")
    _single(dcp.save, {"model": torch.nn.Linear(3, 2).state_dict()}, checkpoint_id=nothing)
    with pytest.raises(ValueError, match=rf"checkpoint '{nothing}' holds no loader state.*'model.bias'"):
        read_loader_states(nothing)
    with pytest.raises(ValueError, match=rf"checkpoint '{tmp_path}/absent' has no DCP metadata"):
        read_loader_states(str(tmp_path / "absent"))

    pickled = str(tmp_path / "pickled")  # an object where the str should be: never unpickled
    _single(dcp.save, {"dataloader": {f"{KEY_PREFIX}0": _NotAState()}}, checkpoint_id=pickled)
    with pytest.raises(ValueError, match=rf"checkpoint '{pickled}': entry 'dataloader\.{KEY_PREFIX}0' is not the str"
                                         r".*weights_only=True"):
        read_loader_states(pickled)


# --- the earlier JSON tensor wrapper, kept for its checkpoints -------------------------------

def test_dcp_loader_state_checkpoints_still_load(corpus, tok_path, tmp_path):
    """DCPLoaderState saves (with a DeprecationWarning), its checkpoints load through it
    and through read_loader_states; a checkpoint of the loader itself is not its kind."""
    build = _builder(corpus, tok_path)
    loader = build()
    it = _advance(loader, 4)
    ckpt = str(tmp_path / "ckpt")
    with pytest.warns(DeprecationWarning, match="put the loader itself"):
        _single(dcp.save, {"dl": DCPLoaderState(loader)}, checkpoint_id=ckpt)
    want = [next(it) for _ in range(3)]

    resumed = build()
    _single(dcp.load, {"dl": DCPLoaderState(resumed, checkpoint_id=ckpt)}, checkpoint_id=ckpt)
    rit = iter(resumed)
    for j, w in enumerate(want):
        assert items_equal(w, next(rit)), f"batch {4 + j} after the DCPLoaderState round trip differs"

    (old,) = read_loader_states(ckpt, key="dl")
    elastic = build()
    elastic.load_state_dict(old)
    eit = iter(elastic)
    assert all(items_equal(w, next(eit)) for w in want), "read_loader_states of a DCPLoaderState entry differs"

    with pytest.raises(ValueError, match=r"has none loader state for rank 1 .*present: \['dl\.tokenloom_rank_0'\]"):
        DCPLoaderState(build(), rank=1, checkpoint_id=ckpt)
    itself = str(tmp_path / "itself")
    _single(dcp.save, {"dl": loader}, checkpoint_id=itself)
    with pytest.raises(ValueError, match="saved from the loader itself.*put the loader itself in the dict"):
        DCPLoaderState(build(), checkpoint_id=itself)


# --- DCPLoaderState's encoding: JSON in a uint8 tensor ---------------------------------------

def test_state_tensor_roundtrip_keeps_ints_and_types():
    state = {"big": 2**63 - 1, "neg": -(2**63), "huge": 2**80 + 1, "f": 0.1, "b": True, "n": None,
             "s": "héllo \u2603 \"quoted\"", "l": [1, [2, {"x": 3}]], "d": {"0": [0, 1]}}
    t = state_to_tensor(state)
    assert t.dtype == torch.uint8 and t.dim() == 1
    back = state_from_tensor(t)
    assert back == state
    assert type(back["big"]) is int and type(back["b"]) is bool and type(back["f"]) is float


@pytest.mark.parametrize("bad,where", [
    ({"t": (1, 2)}, "['t'] is a tuple"),
    ({"x": {1: 2}}, "key 1"),
    ({"f": float("nan")}, "NaN"),
    ({"a": [torch.tensor(1)]}, "['a'][0] is a Tensor"),
    ({"b": b"raw"}, "is a bytes"),
])
def test_state_to_tensor_refuses_what_json_would_change(bad, where):
    with pytest.raises(TypeError) as e:
        state_to_tensor(bad)
    assert where in str(e.value)


def test_state_from_tensor_refuses_corrupt_tensors():
    with pytest.raises(ValueError, match="1-D uint8"):
        state_from_tensor(torch.zeros(3, dtype=torch.int64))
    with pytest.raises(ValueError, match="not UTF-8 JSON"):
        state_from_tensor(torch.tensor(list(b'{"a": 1'), dtype=torch.uint8))
    with pytest.raises(ValueError, match="NaN"):
        state_from_tensor(torch.tensor(list(b'{"a": NaN}'), dtype=torch.uint8))


@pytest.mark.parametrize("num_workers", [0, 2])
def test_real_loader_state_survives_json_and_weights_only_load(corpus, tok_path, tmp_path, num_workers):
    glob, _ = corpus
    build = lambda: pretrain(glob, tokenizer=tok_path, seq_len=63, batch_size=2, buffer_size=40, seed=3,
                             num_workers=num_workers)
    loader = build()
    it = iter(loader)
    for _ in range(6):
        next(it)
    state = loader.state_dict()
    assert_plain(state)
    encoded = state_to_tensor(state)
    assert state_from_tensor(encoded) == state
    torch.save(state, tmp_path / "state.pt")
    nxt = [next(it) for _ in range(3)]  # what the uninterrupted loader gives after the save
    loaded = torch.load(tmp_path / "state.pt", weights_only=True)
    assert loaded == state_from_tensor(encoded)
    for how, source in (("torch.load(weights_only=True)", loaded), ("JSON tensor", state_from_tensor(encoded))):
        resumed = build()
        resumed.load_state_dict(source)
        rit = iter(resumed)
        for j, want in enumerate(nxt):
            assert items_equal(want, next(rit)), f"resumed through {how}: batch {6 + j} differs"
