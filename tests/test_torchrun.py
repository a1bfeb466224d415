"""Ranks under torchrun (gloo on CPU), and the loader itself in torch.distributed.checkpoint.

The end-to-end test launches tests/dist_job.py twice with ``torch.distributed.run``:
a run over one finite epoch that saves a model and the loader itself with DCP at
step k, then a resume from that checkpoint. Checked: the rank sync that `pretrain`
creates from torch.distributed keeps both ranks at the same number of batches, the
ranks' documents are disjoint and together complete, the checkpoint holds one loader
entry per rank (DCP de-duplicates nothing of it), a checkpoint whose entries were
stitched from both ranks is refused, and each rank's resumed batches are bit for bit
the first run's batches after step k.

The elastic test (tests/dcp_elastic_job.py) saves on 2 ranks and resumes on 1 and on 3
through `read_loader_states`: every document of the epoch exactly once. One-process DCP
tests are in test_dcp.py.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import warnings
from collections import Counter

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import BytesStorageMetadata

from tokenloom.pipes import load_encoder
from tokenloom.pipes.loader.checkpoint import read_loader_states
from tokenloom.pipes.loader.bridge import KEY_PREFIX, decode_state
from tokenloom.recipes import pretrain

from .conftest import synthetic_texts, write_corpus
from .resume import items_equal

JOB = os.path.join(os.path.dirname(__file__), "dist_job.py")
ELASTIC_JOB = os.path.join(os.path.dirname(__file__), "dcp_elastic_job.py")
SAVE_STEP = 5


# --- two ranks under torchrun --------------------------------------------------------

def _torchrun(*args, timeout=120, job=JOB, nproc=2):
    """Launch ``job`` (dist_job.py) on ``nproc`` ranks; kill the whole process group if it hangs."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONHASHSEED="0")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", job, *args]
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
    assert set(infos) == set(range(nproc)), f"expected a summary from each of {nproc} ranks, got:\n{out}"
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

    # the checkpoint: one loader entry per rank (a str each: DCP de-duplicated none), one copy of the model
    meta = FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata
    assert sorted(k for k in meta if KEY_PREFIX in k) == [f"dataloader.{KEY_PREFIX}0", f"dataloader.{KEY_PREFIX}1"]
    assert all(isinstance(meta[f"dataloader.{KEY_PREFIX}{r}"], BytesStorageMetadata) for r in (0, 1))
    assert {"model.weight", "model.bias"} <= set(meta)
    # each rank's DCP entry is the state it also saved with torch.save
    entries = read_loader_states(str(ckpt))
    for r in (0, 1):
        assert entries[r] == torch.load(out / f"plain_rank{r}.pt", weights_only=True), \
            f"rank {r}: the DCP loader entry differs from the torch.save'd state"
        assert decode_state(entries[r])["tokenloom"]["config"]["rank"] == r

    # a checkpoint whose entries were stitched from both ranks (each rank's envelope around the
    # other rank's positions), as DCP's de-duplication used to mix them: refused on both ranks
    stitched = {}
    for r in (0, 1):
        body = json.loads(entries[r][f"{KEY_PREFIX}{r}"])
        body["loader"] = json.loads(entries[1 - r][f"{KEY_PREFIX}{1 - r}"])["loader"]
        stitched[f"{KEY_PREFIX}{r}"] = json.dumps(body)
    with warnings.catch_warnings():  # "assuming the intent is to ... in a single process": it is
        warnings.filterwarnings("ignore", message=".*single process.*")
        dcp.save({"dataloader": stitched}, checkpoint_id=str(tmp_path / "stitched"), no_dist=True)

    # resume: each rank continues exactly where the uninterrupted run went on after the save
    resumed = _torchrun("resume", *common, str(tmp_path / "stitched"))
    for r in (0, 1):
        assert resumed[r]["stitched_refused"] and "digest" in resumed[r]["stitched_refused"], (
            f"rank {r} accepted a loader state stitched from two ranks: {resumed[r]['stitched_refused']!r}")
        rest = torch.load(out / f"resume_rank{r}.pt", weights_only=True)
        want = batches[r][SAVE_STEP:]
        assert len(rest) == len(want), f"rank {r}: resumed {len(rest)} batches, expected {len(want)}"
        for j, (w, g) in enumerate(zip(want, rest)):
            assert items_equal(w, g), f"rank {r}: resumed batch {SAVE_STEP + j} differs from the uninterrupted run"
        saved = torch.load(out / f"model_rank{r}.pt", weights_only=True)
        got = torch.load(out / f"model_resumed_rank{r}.pt", weights_only=True)
        assert items_equal(saved, got), f"rank {r}: the model did not come back from DCP"
    assert resumed[0]["batches"] == resumed[1]["batches"] == n - SAVE_STEP


@pytest.mark.slow
def test_dcp_elastic_resume_two_ranks_to_one_and_three(dist_corpus, tok_path, tmp_path):
    """2 ranks x 1 worker save the loader itself through DCP mid-epoch; the run resumes on
    1 rank x 2 workers and on 3 ranks x 0 workers, each new rank loading every old rank's
    entry (`read_loader_states`). Over the epoch, what the old ranks received before the
    save plus what the new ranks receive after is every document exactly once."""
    glob, texts = dist_corpus
    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    out.mkdir()
    enc = load_encoder(tok_path)
    longest = max(len(ids) for ids in enc.encode_batch(texts)) + 1  # + BOS
    assert longest <= 128, f"a document of {longest} tokens would be cut into chunks (rows hold 128)"
    every = sorted(t.split()[0] for t in texts)

    _torchrun("run", glob, tok_path, str(out), str(ckpt), str(SAVE_STEP), "1", job=ELASTIC_JOB)
    before = [d for r in (0, 1) for d in _doc_ids(torch.load(out / f"before_rank{r}.pt", weights_only=True), enc)]
    assert 0 < len(before) < len(every) // 2, f"the save must fall well inside the epoch: {len(before)} documents before"

    for world, workers in ((1, 2), (3, 0)):
        infos = _torchrun("resume", glob, tok_path, str(out), str(ckpt), str(SAVE_STEP), str(workers),
                          job=ELASTIC_JOB, nproc=world, timeout=180)
        assert all(infos[r]["old_ranks"] == 2 and infos[r]["world_size"] == world for r in range(world)), infos
        assert len({infos[r]["batches"] for r in range(world)}) == 1, f"ranks disagree on the epoch's end: {infos}"
        after = [d for r in range(world)
                 for d in _doc_ids(torch.load(out / f"after_w{world}_rank{r}.pt", weights_only=True), enc)]
        seen = Counter(before + after)
        twice = sorted(d for d, c in seen.items() if c > 1)
        missing = sorted(set(every) - set(seen))
        assert not twice and not missing and len(seen) == len(every), (
            f"2 ranks -> {world} x {workers} workers: {len(twice)} documents twice ({twice[:5]}), "
            f"{len(missing)} missing ({missing[:5]})")


PAD_JOB = os.path.join(os.path.dirname(__file__), "pad_resume_job.py")


# The same resumes run in one process on every `make test` (tests/test_round_edges.py's
# test_two_ranks_resume_while_padding_and_at_the_last_step, ranks as threads, 0 and 2 workers); torchrun's
# launch is test_two_ranks_finite_epoch_and_dcp_resume's: this launch is `make fuzz`'s.
@pytest.mark.slow
@pytest.mark.soak
def test_two_ranks_resume_from_a_padding_step_and_the_last_step(corpus, tok_path, tmp_path):
    """A state saved while one rank pads, and one saved at the epoch's last step, resume into
    the uninterrupted batches on both ranks: the rest of the epoch, then the next epoch. The three
    resumes run in one launch, each into a freshly built loader (a new process each: the test above)."""
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
    steps = (first_pad_step, n - 1, n)
    resumed = _torchrun("resume", glob, tok_path, str(out), "1", *map(str, steps), job=PAD_JOB)
    for step in steps:
        for r in (0, 1):
            rest, second = torch.load(out / f"resume{step}_rank{r}.pt", weights_only=False)
            want_rest, want_second = full[r][0][step:], full[r][1]
            assert resumed[r]["batches"][str(step)] == len(want_rest), (
                f"rank {r} resumed after step {step} of {n}: {len(rest)} batches, expected {len(want_rest)}")
            for j, (a, b) in enumerate(zip(rest, want_rest)):
                assert items_equal(a, b), f"rank {r} resumed after step {step}: batch {step + j} differs"
            assert len(second) == len(want_second) and all(items_equal(a, b) for a, b in zip(second, want_second)), (
                f"rank {r} resumed after step {step}: the next epoch differs")


ORACLE_JOB = os.path.join(os.path.dirname(__file__), "oracle_dcp_job.py")


# The same chain runs in one process on every `make test` (tests/test_oracle.py's
# test_chained_elastic_resume_with_a_save_at_once, ranks as threads), and DCP's elastic load under
# torchrun in test_dcp_elastic_resume_two_ranks_to_one_and_three: three launches here (10 interpreters,
# ~25 s) are `make fuzz`'s.
@pytest.mark.slow
@pytest.mark.soak
def test_chained_elastic_dcp_resume_with_a_save_at_once(tmp_path):
    """Issue 24's chain under real torchrun and DCP: 4 ranks save at step 3 of a 2-pass round; 2 ranks
    load every old entry and save again before a step; 1 rank loads those and runs the round out.
    Checked by the token-level oracle: every word of every document exactly twice."""
    from .oracle import BOS, Oracle, make_corpus

    corpus = make_corpus(str(tmp_path / "corpus"), {"a": ("parquet", 80)}, row=65, seed=3)
    config = json.dumps({"sources": corpus.sources, "tokenizer": corpus.tokenizer, "bos": "<|bos|>", "seq_len": 64,
                         "batch_size": 4, "packing": "flat", "epochs": 2, "num_workers": 0, "seed": 0})
    out = tmp_path / "out"
    out.mkdir()
    ckpt = [str(tmp_path / f"ckpt{i}") for i in range(2)]
    oracle = Oracle(corpus, epochs=2, mode="flat", end_label=BOS)
    for mode, nproc, ckpt_in, ckpt_out in (("run", 4, "-", ckpt[0]), ("relay", 2, ckpt[0], ckpt[1]),
                                           ("resume", 1, ckpt[1], "-")):
        infos = _torchrun(mode, config, str(out), ckpt_in, ckpt_out, "3", job=ORACLE_JOB, nproc=nproc, timeout=180)
        got = {r: torch.load(out / f"{mode}_rank{r}.pt", weights_only=True) for r in range(nproc)}
        assert len({len(b) for b in got.values()}) == 1, f"{mode}: ranks took different numbers of steps: {infos}"
        for k in range(len(got[0])):
            for r in range(nproc):
                oracle.feed(got[r][k], f"{mode} ({nproc} ranks) rank {r} step {k}", (mode, r))
    oracle.finish()
