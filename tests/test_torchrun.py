"""Two ranks under torchrun (gloo on CPU), and the loader state in torch.distributed.checkpoint.

The end-to-end test launches tests/dist_job.py twice with ``torch.distributed.run``:
a run over one finite epoch that saves a model and each rank's loader state with
DCP at step k, then a resume from that checkpoint. Checked: the rank sync that
`pretrain` creates from torch.distributed keeps both ranks at the same number of
batches, the ranks' documents are disjoint and together complete, the checkpoint
holds one loader entry per rank and nothing but tensors (nothing DCP would unpickle),
and each rank's resumed batches are bit for bit the first run's batches after step k.

The unit tests cover the JSON tensor encoding of pipes/checkpoint.py.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from tokenloom.pipes import load_encoder
from tokenloom.pipes.checkpoint import KEY_PREFIX, DCPLoaderState, state_from_tensor, state_to_tensor
from tokenloom.pipes.loader import decode_state
from tokenloom.recipes import pretrain

from .conftest import synthetic_texts, write_corpus
from .resume import assert_plain, items_equal

JOB = os.path.join(os.path.dirname(__file__), "dist_job.py")
SAVE_STEP = 5


# --- the encoding ------------------------------------------------------------------

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



def _single_process(fn, *args, **kw):
    with warnings.catch_warnings():  # "assuming the intent is to ... in a single process": it is
        warnings.filterwarnings("ignore", message=".*single process.*")
        return fn(*args, **kw)


def test_dcp_loader_state_in_one_process(corpus, tok_path, tmp_path):
    """DCPLoaderState through dcp.save/dcp.load without torch.distributed: exact resume, the
    model beside it, and a clear error for a rank the checkpoint has no state for."""
    glob, _ = corpus
    build = lambda: pretrain(glob, tokenizer=tok_path, seq_len=63, batch_size=2, buffer_size=40, seed=3)
    loader = build()
    it = iter(loader)
    for _ in range(4):
        next(it)
    model = torch.nn.Linear(3, 2)
    ckpt = str(tmp_path / "ckpt")
    _single_process(dcp.save, {"model": model.state_dict(), "dl": DCPLoaderState(loader)}, checkpoint_id=ckpt,
                    no_dist=True)
    want = [next(it) for _ in range(3)]

    resumed = build()
    fresh = torch.nn.Linear(3, 2)
    state = {"model": fresh.state_dict(), "dl": DCPLoaderState(resumed, checkpoint_id=ckpt)}
    _single_process(dcp.load, state, checkpoint_id=ckpt, no_dist=True)
    fresh.load_state_dict(state["model"])
    assert items_equal(fresh.state_dict(), model.state_dict())
    rit = iter(resumed)
    for j, w in enumerate(want):
        assert items_equal(w, next(rit)), f"batch {4 + j} after the DCP round trip differs"

    with pytest.raises(ValueError, match=r"has none loader state for rank 1 .*loader entries present: \['dl.tokenloom_rank_0'\]"):
        DCPLoaderState(build(), rank=1, checkpoint_id=ckpt)


# --- two ranks under torchrun --------------------------------------------------------

def _torchrun(*args, timeout=120, job=JOB):
    """Launch ``job`` (dist_job.py) on 2 ranks; kill the whole process group if it hangs."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONHASHSEED="0")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", job, *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"torchrun {args[0]} did not finish in {timeout}s (a rank hangs?):\n{err[-3000:]}")
    assert proc.returncode == 0, f"torchrun {args[0]} failed ({proc.returncode}):\n{err[-4000:]}"
    infos = {}
    decoder, at = json.JSONDecoder(), out.find("{")
    while at >= 0:  # the ranks share one pipe: their lines may run together
        info, end = decoder.raw_decode(out, at)
        infos[info["rank"]] = info
        at = out.find("{", end)
    assert set(infos) == {0, 1}, f"expected a summary from each rank, got:\n{out}"
    return infos


def _doc_ids(batches, enc):
    """The ids ('d00042') of the documents in these batches: one per segment that starts with BOS.

    Rows are rebuilt to their ``seq_len + 1`` tokens (``input_ids`` plus the last label),
    so a document ending a row is whole. The corpus has no document longer than a row,
    so no document is cut and every segment is a whole document.
    """
    ids = []
    for b in batches:
        for inp, lab, seg in zip(b["input_ids"], b["labels"], b["segment_ids"]):
            row = torch.cat([inp, lab[-1:]])
            tail = seg[-1:] if int(lab[-1]) != -100 else torch.zeros(1, dtype=seg.dtype)  # -100: padding
            seg = torch.cat([seg, tail])
            for s in seg.unique().tolist():
                if s == 0:
                    continue
                toks = row[seg == s]
                assert int(toks[0]) == 0, f"a segment does not start with BOS: {enc.decode(toks[:12].tolist())!r}"
                m = re.match(r"d\d{5}", enc.decode(toks[1:12].tolist()))
                assert m, f"a document does not start with its id: {enc.decode(toks[:12].tolist())!r}"
                ids.append(m.group(0))
    return ids


@pytest.fixture(scope="module")
def dist_corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("dist_corpus")
    # at most 40 words: every document fits a row (checked in the test), so none is cut into chunks
    texts = [" ".join(t.split()[:40]) for t in synthetic_texts(600, seed=1)]
    write_corpus(str(root), texts, files=3, row_group_size=32)
    return str(root / "*.parquet"), texts


def test_two_ranks_finite_epoch_and_dcp_resume(dist_corpus, tok_path, tmp_path):
    glob, texts = dist_corpus
    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    out.mkdir()
    common = (glob, tok_path, str(out), str(ckpt), str(SAVE_STEP), "1")

    run = _torchrun("run", *common)
    for r in (0, 1):
        assert run[r]["world_size"] == 2 and run[r]["loader_rank"] == r, run[r]
        assert run[r]["sync"] == "TorchDistSync", "pretrain must create the gloo rank sync for a finite epoch"
    batches = {r: torch.load(out / f"run_rank{r}.pt", weights_only=True) for r in (0, 1)}
    assert len(batches[0]) == len(batches[1]) == run[0]["batches"] == run[1]["batches"], \
        {r: len(batches[r]) for r in (0, 1)}
    n = len(batches[0])
    assert n > 2 * SAVE_STEP

    # one finite epoch: every document exactly once, each on one rank
    enc = load_encoder(tok_path)
    longest = max(len(ids) for ids in enc.encode_batch(texts)) + 1  # + BOS
    assert longest <= 128, f"a document of {longest} tokens would be cut into chunks (rows hold 128)"
    ids = {r: _doc_ids(batches[r], enc) for r in (0, 1)}
    for r in (0, 1):
        assert len(ids[r]) == len(set(ids[r])), f"rank {r} saw a document twice"
    assert not set(ids[0]) & set(ids[1]), f"ranks share documents: {sorted(set(ids[0]) & set(ids[1]))[:5]}"
    assert set(ids[0]) | set(ids[1]) == {t.split()[0] for t in texts}, "documents missing from the epoch"
    padding = [sum(int((b["labels"] != -100).sum()) == 0 for b in batches[r]) for r in (0, 1)]
    assert padding == [run[0]["padding_batches"], run[1]["padding_batches"]]
    assert sum(padding) > 0, "this corpus gives the ranks unequal raw counts; the shorter rank must have padded"

    # the checkpoint: one loader entry per rank, one copy of the replicated model, tensors only
    meta = FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata
    assert sorted(k for k in meta if KEY_PREFIX in k) == [f"dataloader.{KEY_PREFIX}0", f"dataloader.{KEY_PREFIX}1"]
    assert {"model.weight", "model.bias"} <= set(meta)
    not_tensors = sorted(k for k, v in meta.items() if not isinstance(v, TensorStorageMetadata))
    assert not not_tensors, f"entries DCP would unpickle on load: {not_tensors}"

    # each rank's DCP entry is the state it also saved with torch.save, read back without pickle
    class Capture:
        def __init__(self, rank):
            self.config, self.state = {"rank": rank}, None

        def load_state_dict(self, state):
            self.state = state

    for r in (0, 1):
        cap = Capture(r)
        _single_process(dcp.load, {"dataloader": DCPLoaderState(cap, checkpoint_id=str(ckpt))},
                        checkpoint_id=str(ckpt), no_dist=True)
        plain = torch.load(out / f"plain_rank{r}.pt", weights_only=True)
        assert cap.state == plain, f"rank {r}: the DCP loader state differs from the torch.save'd one"
        assert decode_state(cap.state)["tokenloom"]["config"]["rank"] == r

    # resume: each rank continues exactly where the uninterrupted run went on after the save
    resumed = _torchrun("resume", *common)
    for r in (0, 1):
        rest = torch.load(out / f"resume_rank{r}.pt", weights_only=True)
        want = batches[r][SAVE_STEP:]
        assert len(rest) == len(want), f"rank {r}: resumed {len(rest)} batches, expected {len(want)}"
        for j, (w, g) in enumerate(zip(want, rest)):
            assert items_equal(w, g), f"rank {r}: resumed batch {SAVE_STEP + j} differs from the uninterrupted run"
        saved = torch.load(out / f"model_rank{r}.pt", weights_only=True)
        got = torch.load(out / f"model_resumed_rank{r}.pt", weights_only=True)
        assert items_equal(saved, got), f"rank {r}: the model did not come back from DCP"
    assert resumed[0]["batches"] == resumed[1]["batches"] == n - SAVE_STEP


PAD_JOB = os.path.join(os.path.dirname(__file__), "pad_resume_job.py")


@pytest.mark.slow
def test_two_ranks_resume_from_a_padding_step_and_the_last_step(corpus, tok_path, tmp_path):
    """A state saved while one rank pads, and one saved at the epoch's last step, resume into
    the uninterrupted batches on both ranks: the rest of the epoch, then the next epoch."""
    glob, _ = corpus  # heavy-tailed lengths: the ranks' batch counts differ
    out = tmp_path / "out"
    out.mkdir()
    run = _torchrun("run", glob, tok_path, str(out), "1", job=PAD_JOB)
    n = run[0]["batches"]
    assert run[1]["batches"] == n
    full = {r: torch.load(out / f"run_rank{r}.pt", weights_only=False) for r in (0, 1)}
    padding = {r: [k for k, b in enumerate(full[r][0]) if int((b["labels"] != -100).sum()) == 0] for r in (0, 1)}
    pad_rank = 0 if padding[0] else 1
    assert padding[pad_rank] and padding[pad_rank][0] < n - 1, f"one rank must pad for several steps: {padding}"
    first_pad_step = padding[pad_rank][0] + 1  # the state saved after the first padding batch
    for step in (first_pad_step, n - 1, n):
        resumed = _torchrun("resume", glob, tok_path, str(out), "1", str(step), job=PAD_JOB)
        for r in (0, 1):
            rest, second = torch.load(out / f"resume{step}_rank{r}.pt", weights_only=False)
            want_rest, want_second = full[r][0][step:], full[r][1]
            assert resumed[r]["batches"] == len(want_rest), (
                f"rank {r} resumed after step {step} of {n}: {len(rest)} batches, expected {len(want_rest)}")
            for j, (a, b) in enumerate(zip(rest, want_rest)):
                assert items_equal(a, b), f"rank {r} resumed after step {step}: batch {step + j} differs"
            assert len(second) == len(want_second) and all(items_equal(a, b) for a, b in zip(second, want_second)), (
                f"rank {r} resumed after step {step}: the next epoch differs")
